"""The diagnosis table (service/failures/diagnosis.py): each kind from lines a real failure prints,
the specific before the general, an operator's pattern before the built-in ones, and the restart
loop's rule; torchrun's and torch.distributed's prefixes seen through, and a line the job made
hostile read in linear time. The whole path, with real ranks, is tests/e2e/test_diagnosis.py."""

from types import SimpleNamespace

import pytest

from service.failures.diagnosis import Diagnosis, compile_patterns, conclude, read_lines, restart_loop
from service.failures.failure_text import LINE_CHARS, RANK_PREFIX, TAIL_LINES, failure_key, last_lines

TRACEBACK = ["Traceback (most recent call last):", '  File "train.py", line 3, in <module>']


@pytest.mark.parametrize(("last", "kind", "summary"), [
    ("ValueError: bad batch", "exception", "ValueError: bad batch"),
    ("ModuleNotFoundError: No module named 'flash_attn'", "import_error", "ModuleNotFoundError: No module named 'flash_attn'"),
    ("MemoryError", "out_of_memory", "MemoryError"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "cuda_out_of_memory", None),
    ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error: Timed out", "collective_timeout",
     None),
    ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE) ran for 600000 ms",
     "collective_timeout", None),
    ("RuntimeError: CUDA error: an illegal memory access was encountered", "hardware_error", None),
    ("OSError: [Errno 28] No space left on device", "disk_full", None),
    ("torch.distributed.DistBackendError: [1] is setting up NCCL communicator and timed out", "collective_timeout", None),
])  # fmt: skip
def test_each_kind_is_read_from_the_ranks_last_lines(last, kind, summary):
    found = read_lines([*TRACEBACK, last], compile_patterns())
    assert found == Diagnosis(kind, summary or last)


def test_nothing_recognised_is_no_diagnosis_and_an_operators_pattern_comes_first():
    assert read_lines(["step 12 loss 2.3", "bye"], compile_patterns()) is None
    patterns = compile_patterns([("data_loader", r"DataLoader worker \(pid \d+\) is killed")])
    line = "RuntimeError: DataLoader worker (pid 4242) is killed by signal: Killed."
    assert read_lines([*TRACEBACK, line], patterns) == Diagnosis("data_loader", line)


def attempt(diagnosis, summary="ValueError: bad batch", resume_from=None):
    return SimpleNamespace(diagnosis=diagnosis, summary=summary, resume_from=resume_from)


def test_a_restart_loop_is_the_same_failure_from_the_same_checkpoint_limit_times_in_a_row():
    same = [attempt("exception") for _ in range(3)]
    assert "the same failure 3 times in a row" in restart_loop(same, None, 3)
    assert restart_loop(same[:2], None, 3) is None  # not yet
    assert restart_loop(same, "/ckpt/step-00000020", 3) is None  # a newer checkpoint: progress was made
    moved = [attempt("exception", resume_from=f"/ckpt/step-{i}") for i in range(3)]
    assert restart_loop(moved, "/ckpt/step-2", 3) is None  # each got further
    other = [attempt("exception"), attempt("exception", "KeyError: 'x'"), attempt("exception")]
    assert restart_loop(other, None, 3) is None


def test_a_restart_loop_is_the_same_failure_whatever_its_numbers_pids_durations_and_addresses():
    summaries = ["RuntimeError: DataLoader worker (pid 4242) exited after 12.5 s at 0x7f3a9c001e40 (10.0.0.7:29500)",
                 "RuntimeError: DataLoader worker (pid 17) exited after 3 s at 0x55d1c2a0 (10.0.0.9:41873)",
                 "RuntimeError: DataLoader worker (pid 90311) exited after 0.25 s at 0x7ffe01 (127.0.0.1:20004)"]
    assert "the same failure 3 times in a row" in restart_loop([attempt("exception", s) for s in summaries], None, 3)
    assert len({failure_key(s) for s in summaries}) == 1
    other = [*summaries[:2], "RuntimeError: DataLoader worker (pid 5) is killed by signal: Killed."]
    assert restart_loop([attempt("exception", s) for s in other], None, 3) is None  # a failure of another kind


TORCH_TRACEBACK = ["Traceback (most recent call last):", '  File "/work/train.py", line 41, in <module>',
                   "    raise ValueError('bad batch')", "ValueError: bad batch"]  # fmt: skip


@pytest.mark.parametrize("prefix", ["[rank0]: ", "[rank0]:", "[default0]:", "[default3]:[rank11]: ", "[trainer2]:"])
def test_torchrun_and_torch_distributeds_line_prefixes_are_seen_through(prefix):
    # After init_process_group, torch.distributed prints a rank's traceback as `[rank0]: ...`;
    # torchrun's --tee puts `[default0]:` before each line; c10's log lines come after, `[W...]`.
    lines = [prefix + line for line in TORCH_TRACEBACK]
    lines.append(prefix + "[W1115 10:24:11.960449418 ProcessGroupNCCL.cpp:1250] Warning: WARNING: process group "
                          "has NOT been destroyed before we destruct ProcessGroupNCCL.")  # fmt: skip
    assert read_lines(lines, compile_patterns()) == Diagnosis("exception", "ValueError: bad batch")
    timeout = (f"{prefix}[E1115 10:34:11.960449418 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective "
               "operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.")
    found = read_lines([*lines, timeout], compile_patterns())
    assert found.kind == "collective_timeout" and found.summary.startswith("[Rank 0] Watchdog caught")
    log = "\n".join(lines) + "\n"
    assert conclude("exit", "rank 0 exit code 1", 1, log) == Diagnosis("exception", "ValueError: bad batch")


def test_a_prefix_is_taken_only_where_torch_puts_one():
    for line in ("[Rank 1] Watchdog caught collective operation timeout", "[Errno 28] No space left on device",
                 "[rank]: x", "[INFO]: ValueError: x", "  File \"t.py\", line 3"):
        assert RANK_PREFIX.match(line).end() == 0, line


# Lines a job can print: the first three the old patterns matched in quadratic time (minutes at 256 Ki
# characters: many starts of `NCCL.*[Tt]imed? ?out`, a class name the exception pattern split every
# way); the others lead the module path, the prefixes and failure_key's hex words to backtrack if they can.
HOSTILE_LINES = {
    "nccl": "NCCL " * (50 << 10),
    "gloo": "gloo " * (50 << 10),
    "error_words": "A" + "Error" * (50 << 10) + "!",
    "dotted": "a." * (125 << 10) + "!",
    "prefix_digits": "[rank0]:[W" + "1" * (250 << 10),
    "hex": "0xa1" * (63 << 10) + "g",
}


@pytest.mark.timeout(20)  # the old patterns took minutes on the first three
@pytest.mark.parametrize("name", HOSTILE_LINES)
def test_a_250_ki_character_line_is_read_in_linear_time_and_bounded(name):
    line = HOSTILE_LINES[name]
    assert len(line) >= 250 << 10
    # The patterns are linear on the whole line, bound or no bound...
    for _, pattern in compile_patterns():
        pattern.search(line)
    RANK_PREFIX.match(line)
    failure_key(line)
    # ... and diagnosis reads at most TAIL_LINES lines of LINE_CHARS characters of a log, the line
    # last and without a newline, after a traceback as torch.distributed prints it.
    log = "".join(f"[rank0]: {traceback_line}\n" for traceback_line in TORCH_TRACEBACK) + line
    assert [len(kept) for kept in last_lines(log)] == [len(f"[rank0]: {t}") for t in TORCH_TRACEBACK] + [LINE_CHARS]
    assert len(last_lines(("x" * 5000 + "\n") * 100)) == TAIL_LINES
    found = conclude("exit", "rank 0 exit code 1", 1, log)
    assert found.kind == "exception"  # the traceback's, or the line's own `AErrorError...` read as a class name
    assert found.summary == "ValueError: bad batch" or found.summary == line[:240]
