# Two commands for a newcomer: `make demo` (set up, run the demo) and `make test` (set up, run the tests).
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: setup bytecode demo service test clean

$(BIN)/ett: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# Pinned first: the pre-staged CPU build; an unpinned torch would pull several GB of CUDA wheels.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[postgres,test,huggingface,lightning,accelerate]'
	touch $@

setup: $(BIN)/ett

# Our modules compiled once: where PYTHONDONTWRITEBYTECODE is set (these machines set it), every
# process compiled them again, about 0.5 s of CPU for each that imports the trainer (BENCHMARKS.md, 2026-11-29).
bytecode: setup
	$(BIN)/python -m compileall -q agent ett ett_cli service trainer tests migrations > /dev/null

demo: setup bytecode
	$(BIN)/ett demo

service: setup
	$(BIN)/ett service migrate
	$(BIN)/ett service

# Two workers, a test file each at a time (--dist loadfile: a file's shared runs and servers start
# once): most tests wait on processes. Three took as long in all (each test 1.5x longer: the 2
# cores are the limit; BENCHMARKS.md, "Eleventh session"). The slowest tests are listed at the end.
test: setup bytecode
	$(BIN)/pytest -q -n 2 --dist loadfile --durations=15

clean:
	rm -rf $(VENV) data .pytest_cache .hypothesis
