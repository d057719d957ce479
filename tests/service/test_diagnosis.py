"""The diagnosis table (service/jobs/diagnosis.py): each kind from lines a real failure prints,
the specific before the general, an operator's pattern before the built-in ones, and the restart
loop's rule. The whole path, with real ranks, is tests/e2e/test_diagnosis.py."""

from types import SimpleNamespace

import pytest

from service.jobs.diagnosis import Diagnosis, compile_patterns, read_lines, restart_loop

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
