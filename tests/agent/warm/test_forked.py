"""A server of a job's imports forked from its user's base server (agent.warm.forked): a child of that server
that imports only what it does not hold (torch never again), serves a script's ranks, goes stale with an edit
of what the base holds, is forked again when killed and ends with the agent; a fresh interpreter where no base
listens or the base refuses. Real servers; the base's imports are a probe (it imports torch) in place of
SCRIPT_BASE_IMPORTS."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import agent.warm.servers as servers_module
from agent.confinement.job_user import RunAs
from agent.confinement.uid_sweep import parent_pid
from agent.warm.client import WarmProcess
from agent.warm.servers import WarmServer, WarmServers
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[3]
BASE, LEARNED = ["warm_base_probe"], ["warm_base_probe", "warm_learned_probe"]
# Each probe says which process imported it; the base's marks torch with the process that imported it.
BASE_PROBE = textwrap.dedent("""
    import os
    import torch
    torch.warm_probe_loaded_in = os.getpid()
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "imported"), "a") as f:
        f.write(f"warm_base_probe {os.getpid()}\\n")
    VALUE = "one"
""")
LEARNED_PROBE = textwrap.dedent("""
    import os
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "imported"), "a") as f:
        f.write(f"warm_learned_probe {os.getpid()}\\n")
""")
# A job's script: what it held before its first line, where torch was imported, its keeper's parent (the
# server that forked it); then a pause (a rank that runs on).
SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    held = sorted(name for name in ("torch", "warm_base_probe", "warm_learned_probe") if name in sys.modules)
    torch_from = getattr(sys.modules.get("torch"), "warm_probe_loaded_in", None)
    import warm_base_probe
    with open(f"/proc/{os.getppid()}/stat") as stat:
        server = int(stat.read().rsplit(")", 1)[1].split()[1])
    with open(sys.argv[1] + ".part", "w") as f:  # whole or absent: the test reads it once it exists
        json.dump({"held": held, "torch_from": torch_from, "value": warm_base_probe.VALUE, "server": server}, f)
    os.replace(sys.argv[1] + ".part", sys.argv[1])
    time.sleep(float(sys.argv[2]))
""")
# The agent, a process the test kills: it starts both servers and says their pids once they listen.
AGENT = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    import agent.warm.servers as servers_module
    from agent.confinement.job_user import RunAs
    servers_module.SCRIPT_BASE_IMPORTS = {base!r}
    servers = servers_module.WarmServers(Path({data!r}), ["unused"])
    pids = []
    for imports in ({base!r}, {learned!r}):
        server = servers.for_user(RunAs(), imports)
        server.ensure_running()
        deadline = time.monotonic() + 60
        while not server.listening and time.monotonic() < deadline:
            time.sleep(0.05)
        pids.append(server.pid)
    print(json.dumps(pids), flush=True)
    time.sleep(600)
""")


@pytest.fixture
def lib(tmp_path, monkeypatch) -> Path:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "warm_base_probe.py").write_text(BASE_PROBE)
    (lib / "warm_learned_probe.py").write_text(LEARNED_PROBE)
    (lib / "train.py").write_text(SCRIPT)
    monkeypatch.setenv("PYTHONPATH", str(lib))
    monkeypatch.setattr(servers_module, "SCRIPT_BASE_IMPORTS", BASE)
    return lib


@pytest.fixture
def servers(tmp_path):
    servers = WarmServers(tmp_path / "data", ["unused"])
    yield servers
    servers.stop()


def listening(servers: WarmServers, imports: list[str]) -> WarmServer:
    server = servers.for_user(RunAs(), imports)
    server.ensure_running()
    wait_for(lambda: server.listening, 60, f"the server of {imports} to listen", explain=server.log_path.read_text)
    return server


def imported(lib: Path) -> list[tuple[str, int]]:
    return [(name, int(pid)) for name, pid in (line.split() for line in (lib / "imported").read_text().splitlines())]


def launch(server: WarmServer, lib: Path, seconds: float = 0) -> tuple[WarmProcess, dict]:
    """A rank of the script as its runner asks for it, once it has said what it holds."""
    out = lib / "out.json"
    out.unlink(missing_ok=True)
    rank = WarmProcess(str(server.socket_path), [sys.executable, str(lib / "train.py"), str(out), str(seconds)])
    wait_for(out.exists, 30, "the rank to start", explain=server.log_path.read_text)
    return rank, json.loads(out.read_text())


def alive(pid: int) -> bool:
    return parent_pid(pid) is not None


def test_a_learned_server_is_forked_from_the_base_server_and_imports_only_what_it_lacks(servers, lib, monkeypatch):
    base = listening(servers, BASE)
    learned = listening(servers, LEARNED)
    assert parent_pid(learned.pid) == base.pid
    # The base's probe (and torch with it) imported once, by the base; the learned one by the forked server.
    assert imported(lib) == [("warm_base_probe", base.pid), ("warm_learned_probe", learned.pid)]
    rank, seen = launch(learned, lib)
    assert rank.wait() == 0
    assert seen == {"held": ["torch", "warm_base_probe", "warm_learned_probe"], "torch_from": base.pid, "value": "one",
                    "server": learned.pid}  # fmt: skip

    # A running group forked from it: neither it nor its base is stopped to make room (it would end with its base).
    monkeypatch.setattr(WarmServers, "MAX_SERVERS", 1)
    servers.for_user(RunAs(), ["warm_other"], busy=frozenset({learned.socket_path}))
    assert learned.listening and base.listening
    # None: the least recently used go first, but never the base of a kept forked server.
    servers.for_user(RunAs(), ["warm_other_too"])
    assert learned.pid is None and base.listening


def test_an_edit_of_a_base_module_makes_the_forked_server_stale_too_and_both_end_after_their_rank(servers, lib):
    """The forked server holds what its base holds, with the base's fingerprint: an edit of the base's probe
    makes both stale. The base, which waits for its children before it exits, exits once the forked one has,
    after the rank it forked: neither outlives what it forked, nor stays for ever."""
    base, learned = listening(servers, BASE), listening(servers, LEARNED)
    first_base, first_learned = base.pid, learned.pid
    rank, _ = launch(learned, lib, 600)
    probe = lib / "warm_base_probe.py"
    before = probe.stat()
    probe.write_text(BASE_PROBE.replace('"one"', '"two"'))
    os.utime(probe, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    wait_for(lambda: (servers.ensure_running(), base.pid not in (None, first_base)
                      and learned.pid not in (None, first_learned))[1], 60, "both stale servers' successors to start",
             explain=lambda: learned.log_path.read_text())  # fmt: skip
    assert f"stale ({probe} changed since this server imported it)" in learned.log_path.read_text()
    assert {first_base, first_learned} <= servers.pids() and alive(rank.pid)  # retired, not killed
    rank.kill()
    assert rank.wait() == -signal.SIGKILL
    wait_for(lambda: (servers.ensure_running(), not {first_base, first_learned} & servers.pids())[1], 30,
             "the retired servers to exit once their rank ended")
    assert not alive(first_learned) and not alive(first_base)
    listening(servers, LEARNED)
    rank, seen = launch(learned, lib)
    assert rank.wait() == 0 and seen["value"] == "two" and seen["server"] == learned.pid


def test_a_killed_forked_server_is_forked_again(servers, lib, monkeypatch):
    monkeypatch.setattr(servers_module, "RESTART_PAUSE_SECONDS", 0.0)
    base, learned = listening(servers, BASE), listening(servers, LEARNED)
    first = learned.pid
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: (servers.ensure_running(), learned.listening and learned.pid != first)[1], 60,
             "the killed server's successor to listen", explain=lambda: learned.log_path.read_text())
    assert parent_pid(learned.pid) == base.pid and first not in servers.pids()
    rank, seen = launch(learned, lib)
    assert rank.wait() == 0 and seen["server"] == learned.pid


def test_a_fresh_interpreter_starts_it_where_no_base_listens_or_the_base_refuses(servers, lib):
    learned = listening(servers, LEARNED)  # no base server
    assert parent_pid(learned.pid) == os.getpid()  # the agent's child: it imported everything itself
    assert imported(lib) == [("warm_base_probe", learned.pid), ("warm_learned_probe", learned.pid)]
    base = listening(servers, BASE)
    forged = [*LEARNED, "a" * 200]  # no module name (agent.warm.learned.checked_names): the base forks nothing
    fresh = listening(servers, forged)
    assert parent_pid(fresh.pid) == os.getpid()
    assert "no server forked" in base.log_path.read_text() and base.listening


def test_a_forked_server_ends_with_the_agent(tmp_path, lib):
    """Agent -> base server -> forked server, each by its parent-death signal."""
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT.format(base=BASE, learned=LEARNED, data=str(tmp_path / "data"))],
        env={**os.environ, "PYTHONPATH": f"{lib}:{REPO}"}, stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert agent.stdout is not None
        base, learned = pids = json.loads(agent.stdout.readline())
        assert parent_pid(base) == agent.pid and parent_pid(learned) == base
    finally:
        agent.kill()
        agent.wait()
    wait_for(lambda: not any(alive(pid) for pid in pids), 30, "the servers to end with the agent")
