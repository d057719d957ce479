"""The warm server (agent.warm.server) with a small preloaded module in place of the trainer: a forked
rank gets the request's argv, environment and cwd, its exit reaches the runner as a parent would
see it, and it never outlives its runner."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from agent.confinement.job_user import RunAs
from agent.warm.client import WarmProcess, python_module
from agent.warm.servers import WarmServer, WarmServers
from agent.warm.sockets import socket_folder
from tests.support.waiting import wait_for

RANK_MODULE = textwrap.dedent("""
    import json, os, sys, time
    if __name__ == "__main__":
        out, code, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
        with open(out, "w") as f:
            json.dump({"argv": sys.argv[1:], "env": os.environ.get("RANK_VAR"), "cwd": os.getcwd(),
                       "pid": os.getpid()}, f)
        time.sleep(seconds)
        sys.exit(code)
""")


# A rank that, told to stop, takes its time (a final checkpoint) and exits 4, as the trainer does.
STOPPING_MODULE = textwrap.dedent("""
    import signal, sys, time
    if __name__ == "__main__":
        stop = []
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
        open(sys.argv[1], "w").close()
        while not stop:
            time.sleep(0.02)
        time.sleep(0.5)
        sys.exit(4)
""")


@pytest.fixture
def warm(tmp_path, monkeypatch):
    (tmp_path / "warm_rank_module.py").write_text(RANK_MODULE)
    (tmp_path / "warm_stopping_module.py").write_text(STOPPING_MODULE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    server = WarmServer(tmp_path / "warm.sock", ["warm_rank_module", "warm_stopping_module"], tmp_path / "warm.log")
    server.ensure_running()
    wait_for(server.socket_path.exists, 30, "the warm server to listen")
    yield server
    server.stop()


def test_a_warm_rank_runs_the_request_and_its_exit_code_comes_back(warm, tmp_path, monkeypatch):
    out, workdir = tmp_path / "out.json", tmp_path / "cwd"
    workdir.mkdir()
    monkeypatch.setenv("RANK_VAR", "r7")
    monkeypatch.chdir(workdir)
    rank = WarmProcess(str(warm.socket_path), [*python_module(sys.executable, "warm_rank_module"), str(out), "7", "0"])
    assert rank.wait() == 7
    seen = json.loads(out.read_text())
    assert seen == {"argv": [str(out), "7", "0"], "env": "r7", "cwd": str(workdir), "pid": rank.pid}


def test_a_killed_warm_rank_reports_the_signal(warm, tmp_path):
    argv = [*python_module(sys.executable, "warm_rank_module"), str(tmp_path / "o"), "0", "60"]
    rank = WarmProcess(str(warm.socket_path), argv)
    rank.kill()
    assert rank.wait() == -signal.SIGKILL


def test_a_sigterm_to_the_whole_tree_leaves_a_warm_rank_its_graceful_stop(warm, tmp_path):
    """Slurm's preemption signals every process of the allocation: the server and the keeper ignore
    it, so the rank lives to act on it (the trainer saves its step and exits 4) instead of dying of
    their parent-death signal."""
    ready = tmp_path / "ready"
    rank = WarmProcess(str(warm.socket_path), [*python_module(sys.executable, "warm_stopping_module"), str(ready)])
    wait_for(ready.exists, 30, "the rank to take SIGTERM")
    keeper = int(Path(f"/proc/{rank.pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    for pid in (warm.pid, keeper, rank.pid):
        os.kill(pid, signal.SIGTERM)
    assert rank.wait() == 4
    assert warm.pid is not None  # the server serves on


def test_a_module_the_server_did_not_load_is_refused(warm, tmp_path):
    with pytest.raises(ConnectionError):  # the runner then starts a fresh interpreter
        WarmProcess(str(warm.socket_path), python_module(sys.executable, "json.tool"))


RUNNER = """
import sys, time
from agent.warm.client import WarmProcess
from tests.support.waiting import wait_for
rank = WarmProcess(sys.argv[1], [sys.executable, "-P", "-m", "warm_rank_module", sys.argv[2], "0", "60"])
print(rank.pid, flush=True)
time.sleep(60)
"""


def test_a_warm_rank_dies_with_its_runner(warm, tmp_path):
    runner = subprocess.Popen([sys.executable, "-c", RUNNER, str(warm.socket_path), str(tmp_path / "o")],
                              stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        pid = int(runner.stdout.readline())
        assert os.path.exists(f"/proc/{pid}")
    finally:
        runner.kill()
        runner.wait()
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 10, "the orphaned rank to be killed")


PEER_SCRIPT = """
import os, sys
from agent.warm.client import WarmProcess
os.setgid(65534)
os.setuid(65534)  # nobody, from here on: the server sees it in SO_PEERCRED
WarmProcess(sys.argv[1], sys.argv[2:])
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="a caller of another user")
def test_a_caller_of_another_user_is_not_served(tmp_path, monkeypatch):
    """The socket is its user's alone (0600, in a folder of its own); were it opened to others,
    the server would still serve no caller but its own user."""
    (tmp_path / "warm_rank_module.py").write_text(RANK_MODULE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    opened = Path(tempfile.mkdtemp(prefix="ett-warm-"))
    server = WarmServer(opened / "w" / "warm.sock", ["warm_rank_module"], tmp_path / "warm.log")
    try:
        server.ensure_running()
        wait_for(server.socket_path.exists, 30, "the warm server to listen")
        for path, mode in ((opened, 0o755), (server.socket_path.parent, 0o755), (server.socket_path, 0o666)):
            path.chmod(mode)
        argv = [*python_module(sys.executable, "warm_rank_module"), str(tmp_path / "o"), "0", "0"]
        done = subprocess.run([sys.executable, "-c", PEER_SCRIPT, str(server.socket_path), *argv],
                              capture_output=True, text=True, timeout=60)
        # Refused as soon as accepted: the caller's send or its wait for the pid finds the socket closed.
        assert done.returncode != 0 and re.search(r"(ConnectionError|BrokenPipeError|ConnectionResetError)", done.stderr)
        assert "request refused: a caller of uid 65534" in (tmp_path / "warm.log").read_text()
        assert not (tmp_path / "o").exists()
    finally:
        server.stop()
        shutil.rmtree(opened, ignore_errors=True)


SCRIPT = textwrap.dedent("""
    import json, os, sys
    preloaded = "warm_preloaded" in sys.modules  # before this script imports anything
    import warm_preloaded
    with open(sys.argv[1], "w") as f:
        json.dump({"argv": sys.argv, "preloaded": preloaded, "imports_from": warm_preloaded.PID != os.getpid(),
                   "path0": sys.path[0], "name": __name__}, f)
    sys.exit(int(sys.argv[2]))
""")


def test_a_jobs_script_is_forked_with_its_warm_imports_loaded_as_python_would_run_it(tmp_path, monkeypatch):
    """A job's own `python SCRIPT` (warm_imports): the server imported them once; the script runs as
    `__main__` with its argv and its folder first on the path; another interpreter is refused."""
    (tmp_path / "warm_preloaded.py").write_text("import os\nPID = os.getpid()\n")
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "train.py").write_text(SCRIPT)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    server = WarmServers(tmp_path / "data", ["unused"]).for_user(RunAs(), ["warm_preloaded"])
    server.ensure_running()
    try:
        wait_for(server.socket_path.exists, 30, "the script server to listen")
        out = tmp_path / "out.json"
        rank = WarmProcess(str(server.socket_path), [sys.executable, str(scripts / "train.py"), str(out), "5"])
        assert rank.wait() == 5
        seen = json.loads(out.read_text())
        assert seen == {"argv": [str(scripts / "train.py"), str(out), "5"], "preloaded": True, "imports_from": True,
                        "path0": str(scripts), "name": "__main__"}
        other_python = shutil.which("python3.11", path="/usr/bin")
        if other_python and os.path.realpath(other_python) != os.path.realpath(sys.executable):
            with pytest.raises(ConnectionError):  # not its interpreter: the runner starts one fresh
                WarmProcess(str(server.socket_path), [other_python, str(scripts / "train.py"), str(out), "0"])
    finally:
        server.stop()



def test_a_data_folder_too_deep_for_a_socket_gets_a_short_folder_of_the_agents_own(tmp_path, monkeypatch):
    """A warm socket under a deep --data-dir would be past sun_path's 107 bytes, where no server can
    bind (warm start was then off, silently): the agent's sockets go to a short folder of its own,
    named after its data folder, where a server listens and forks; one that is not the agent's
    alone (anyone may write in it) is refused, never used."""
    (tmp_path / "warm_rank_module.py").write_text(RANK_MODULE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    data = tmp_path / ("d" * 100)
    data.mkdir()
    folder = socket_folder(data)
    assert not folder.is_relative_to(tmp_path) and socket_folder(data) == folder
    server = WarmServers(data, ["warm_rank_module"], sockets=folder).for_user(RunAs())
    assert len(os.fsencode((data / "warm" / str(os.geteuid()) / "warm.sock").resolve())) > 107
    try:
        server.ensure_running()
        wait_for(server.socket_path.exists, 30, "the warm server to listen", explain=server.log_path.read_text)
        assert server.socket_path.parent.parent == folder and server.usable
        rank = WarmProcess(str(server.socket_path),
                           [*python_module(sys.executable, "warm_rank_module"), str(tmp_path / "o"), "3", "0"])
        assert rank.wait() == 3
    finally:
        server.stop()
    folder.chmod(0o777)
    try:
        with pytest.raises(OSError, match="not a folder of this agent's own"):
            socket_folder(data)
    finally:
        shutil.rmtree(folder)
