"""A warm server never forks stale code (agent.warm.fresh): a job's module edited between two
launches runs its new version, the server is replaced when the job's environment or interpreter
changed, and a module beside a script never gives way to one the server holds. Real servers,
forking a job's own script as its rank runners would ask them."""

import json
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from agent.confinement.job_user import RunAs
from agent.warm.client import WarmProcess, start_process
from agent.warm.server import STALE_EXIT
from agent.warm.servers import WarmServer, WarmServers
from tests.support.waiting import wait_for

# A job's script: the VALUE of the module it names, whether the server had it loaded, and then a
# pause (a rank that runs on) when asked.
SCRIPT = textwrap.dedent("""
    import json, sys, time
    out, module = sys.argv[1], sys.argv[2]
    warm = module in sys.modules  # before this script imports anything
    value = __import__(module).VALUE
    with open(out, "w") as f:
        json.dump({"value": value, "warm": warm, "python": sys.executable}, f)
    time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0)
""")


@pytest.fixture
def servers(tmp_path):
    servers = WarmServers(tmp_path / "data", ["unused"])
    yield servers
    servers.stop()


def folder(path: Path, **modules: str) -> Path:
    """A folder with the job's script and `modules` (name: VALUE)."""
    path.mkdir()
    (path / "train.py").write_text(SCRIPT)
    for name, value in modules.items():
        (path / f"{name}.py").write_text(f"VALUE = {value!r}\n")
    return path


def listening(servers: WarmServers, imports: list[str], run_as: RunAs = RunAs()) -> WarmServer:
    server = servers.for_user(run_as, imports)
    server.ensure_running()
    wait_for(server.socket_path.exists, 30, "the warm server to listen", explain=lambda: server.log_path.read_text())
    return server


def launch(server: WarmServer, script: Path, module: str, python: str = sys.executable) -> dict:
    """A rank as its runner starts it: forked by the server when it serves it, else a fresh interpreter."""
    out = script.parent / "out.json"
    out.unlink(missing_ok=True)
    assert start_process([python, str(script), str(out), module], str(server.socket_path)).wait() == 0
    return json.loads(out.read_text())


def edit(module: Path, value: str) -> None:
    """New content of the same size, and a later mtime (whatever the file system's clock grain)."""
    before = module.stat()
    module.write_text(f"VALUE = {value!r}\n")
    assert module.stat().st_size == before.st_size
    os.utime(module, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))


def test_a_job_module_edited_between_two_launches_runs_its_new_version(servers, tmp_path, monkeypatch):
    """The job's folder is on the path (as an editable install would put it), so the server holds
    its module: the launch after the edit is refused warm and runs the new version cold, and the
    agent starts a fresh server at once, which serves the next launch the new version warm."""
    job = folder(tmp_path / "job", jobmod="one")
    monkeypatch.setenv("PYTHONPATH", str(job))
    server = listening(servers, ["jobmod"])
    assert launch(server, job / "train.py", "jobmod") == {"value": "one", "warm": True, "python": sys.executable}

    edit(job / "jobmod.py", "two")
    assert launch(server, job / "train.py", "jobmod") == {"value": "two", "warm": False, "python": sys.executable}
    wait_for(lambda: server.pid is None, 30, "the stale server to exit")
    assert server._proc.returncode == STALE_EXIT
    assert f"{job / 'jobmod.py'} changed since this server imported it" in server.log_path.read_text()

    servers.ensure_running()  # the agent's next look: no pause before a stale server's successor
    assert server.pid is not None
    again = listening(servers, ["jobmod"])
    assert again is server
    assert launch(server, job / "train.py", "jobmod") == {"value": "two", "warm": True, "python": sys.executable}


def test_a_stale_server_outlives_what_it_forked_and_forks_nothing_more(servers, tmp_path, monkeypatch):
    """An edit while a launch's ranks are being forked: the rank already forked runs on (the server's
    exit would take it along), the next is refused, and the server exits once the first has ended."""
    job = folder(tmp_path / "job", jobmod="one")
    monkeypatch.setenv("PYTHONPATH", str(job))
    server = listening(servers, ["jobmod"])
    out = job / "out.json"
    running = WarmProcess(str(server.socket_path), [sys.executable, str(job / "train.py"), str(out), "jobmod", "600"])
    wait_for(out.exists, 30, "the first rank to start")

    edit(job / "jobmod.py", "two")
    with pytest.raises(OSError):  # refused, or no longer listening: its runner would start a fresh interpreter
        WarmProcess(str(server.socket_path), [sys.executable, str(job / "train.py"), str(out), "jobmod"])
    wait_for(lambda: not server.socket_path.exists(), 30, "the stale server to stop listening")
    assert server.pid is not None and os.path.exists(f"/proc/{running.pid}")

    running.kill()
    assert running.wait() == -signal.SIGKILL
    wait_for(lambda: server.pid is None, 30, "the stale server to exit once its rank ended")
    assert server._proc.returncode == STALE_EXIT


def test_an_edit_under_a_running_rank_has_a_successor_listening_before_the_next_launch(servers, tmp_path,
                                                                                     monkeypatch):
    """A module edited while an attempt's rank runs (a developer's save, an upgrade): the idle server
    sees it by itself and says so, and the agent's next look starts its successor on the same socket
    at once, while the old one waits for its rank. The restart after it then forks the new code warm,
    with no wait for imports (the demo's restarts took 14-42 s when they waited)."""
    job = folder(tmp_path / "job", jobmod="one")
    monkeypatch.setenv("PYTHONPATH", str(job))
    server = listening(servers, ["jobmod"])
    first = server.pid
    out = job / "out.json"
    running = WarmProcess(str(server.socket_path), [sys.executable, str(job / "train.py"), str(out), "jobmod", "600"])
    wait_for(out.exists, 30, "the first rank to start")

    edit(job / "jobmod.py", "two")  # no request comes: the server finds it while idle
    wait_for(lambda: (servers.ensure_running(), server.pid not in (None, first))[1], 30,
             "the agent to start the stale server's successor", explain=lambda: server.log_path.read_text())
    assert os.path.exists(f"/proc/{running.pid}") and first in servers.pids()  # retired, not killed
    wait_for(server.socket_path.exists, 30, "the successor to listen", explain=lambda: server.log_path.read_text())
    assert launch(server, job / "train.py", "jobmod") == {"value": "two", "warm": True, "python": sys.executable}
    assert f"stale ({job / 'jobmod.py'} changed since this server imported it)" in server.log_path.read_text()

    running.kill()
    assert running.wait() == -signal.SIGKILL
    wait_for(lambda: (servers.ensure_running(), first not in servers.pids())[1], 30,
             "the retired server to exit once its rank ended")
    assert server.pid is not None and server.socket_path.exists()


def test_a_changed_environment_gets_a_fresh_server(servers, tmp_path, monkeypatch):
    """A variable read while the server imported (by the job's module here) took effect there: with
    another value the agent stops that server and starts one with the job's environment."""
    lib = folder(tmp_path / "lib")
    (lib / "warm_probe.py").write_text("import os\nVALUE = os.environ.get('WARM_PROBE')\n")
    job = folder(tmp_path / "job")
    monkeypatch.setenv("PYTHONPATH", str(lib))
    monkeypatch.setenv("WARM_PROBE", "one")
    first = listening(servers, ["warm_probe"])
    pid = first.pid
    assert launch(first, job / "train.py", "warm_probe") == {"value": "one", "warm": True, "python": sys.executable}

    monkeypatch.setenv("WARM_PROBE", "two")
    second = listening(servers, ["warm_probe"])
    assert second is not first and first.pid is None and not os.path.exists(f"/proc/{pid}")
    assert launch(second, job / "train.py", "warm_probe") == {"value": "two", "warm": True, "python": sys.executable}
    assert servers.for_user(RunAs(), ["warm_probe"]) is second  # the same environment: the same server


def test_another_interpreter_gets_a_fresh_server(servers, tmp_path, monkeypatch):
    """The job's interpreter, by another path (a venv's python3.11 beside its python), gets a server
    of its own: the old one is stopped, the new one forks the script with that interpreter."""
    here = Path(sys.executable)
    other = next((str(here.with_name(name)) for name in (f"python{sys.version_info[0]}.{sys.version_info[1]}",
                                                         f"python{sys.version_info[0]}", "python")
                  if name != here.name and here.with_name(name).exists()), None)
    if other is None:
        pytest.skip(f"no other name for {here} beside it")
    job = folder(tmp_path / "job", jobmod="one")
    monkeypatch.setenv("PYTHONPATH", str(job))
    first = listening(servers, ["jobmod"])
    second = listening(servers, ["jobmod"], RunAs(python=other))
    assert second is not first and first.pid is None
    assert launch(second, job / "train.py", "jobmod", other) == {"value": "one", "warm": True, "python": other}


def test_a_module_beside_the_script_is_imported_in_place_of_one_the_server_holds(servers, tmp_path, monkeypatch):
    """`python SCRIPT` puts the script's folder first on the path: a module there named like one the
    server holds from elsewhere is the one a fresh interpreter imports, so that script starts cold;
    the server serves on, and forks a script whose folder holds no such module."""
    lib = folder(tmp_path / "lib", warm_shadowed="held")
    job = folder(tmp_path / "job", warm_shadowed="beside")
    other = folder(tmp_path / "other")
    monkeypatch.setenv("PYTHONPATH", str(lib))
    server = listening(servers, ["warm_shadowed"])
    assert launch(server, job / "train.py", "warm_shadowed") == {"value": "beside", "warm": False,
                                                                   "python": sys.executable}
    assert f"{job / 'warm_shadowed.py'}, beside the script, stands in for" in server.log_path.read_text()
    assert server.pid is not None and server.socket_path.exists()
    assert launch(server, other / "train.py", "warm_shadowed") == {"value": "held", "warm": True,
                                                                     "python": sys.executable}
