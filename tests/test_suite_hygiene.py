"""The suite itself: a test's leftover processes are ended when it ends (tests/conftest.py), as a
test that fails or times out before its own clean-up would leave them (the first two tests, run in
this order: one file runs on one worker, in order); each worker hands out master ports of its own;
a test over the per-test budget says why."""

import ast
import os
import subprocess
from pathlib import Path

from tests.support.processes import TEST_MARK_ENV, pids_with_env

left: dict[str, int] = {}


def test_a_test_that_leaves_a_process_running():
    # A new session and process group, as torchrun's ranks or an agent have: a kill of the test's
    # group would not reach it.
    sleeper = subprocess.Popen(["sleep", "600"], start_new_session=True)
    left["pid"], left["mark"] = sleeper.pid, os.environ[TEST_MARK_ENV]


def test_the_next_test_finds_it_gone():
    # By its mark, not its pid: a pid is soon another process's on a busy machine.
    assert pids_with_env(TEST_MARK_ENV, left["mark"]) == [], f"process {left['pid']} of the previous test still runs"
    assert os.environ[TEST_MARK_ENV] != left["mark"]  # each test has a mark of its own


def test_each_worker_hands_out_master_ports_of_its_own():
    # Both workers once shared worker 0's range (inherited from the controller): two jobs of the
    # suite got one port at once and a torchrun failed its rendezvous with EADDRINUSE.
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    assert os.environ["ETT_MASTER_PORT_FIRST"] == str(20000 + 1000 * worker)


def test_a_test_over_its_budget_says_why():
    # tests/conftest.py names every test over BUDGET_SECONDS that has no `over_budget(reason)`.
    bare = []
    for path in Path(__file__).parent.rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "pytest.mark.over_budget":
                args = node.args
                if len(args) != 1 or not isinstance(args[0], ast.Constant) or not str(args[0].value).strip():
                    bare.append(f"{path}:{node.lineno}")
    assert bare == []
