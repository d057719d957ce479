# Two commands for a newcomer: `make demo` (set up, run the demo) and `make test` (set up, run the tests).
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: setup demo service test clean

$(BIN)/ett: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# Pinned first: the pre-staged CPU build; an unpinned torch would pull several GB of CUDA wheels.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[postgres,test,huggingface]'
	touch $@

setup: $(BIN)/ett

demo: setup
	$(BIN)/ett demo

service: setup
	$(BIN)/ett service migrate
	$(BIN)/ett service

test: setup
	$(BIN)/pytest -q

clean:
	rm -rf $(VENV) data .pytest_cache .hypothesis
