"""Nothing of a job's uid outlives its owner's last attempt on the node, and what lives on for the
owner (its warm server) is closed to the owner's own jobs (#48): each test an attack a job makes,
with real processes (an agent started as root, torchrun, the owner's own uid). After each the agent
lives, and another owner's job on the same node succeeds. One service and one agent serve the
module, as one node serves its owners' jobs in turn; its uids are the module's own, so that the
suite's other agents (the same uids, on the same machine) neither keep nor take these files."""

import json
import os
import random
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from agent.confinement.become import MODULE as BECOME
from agent.confinement.job_user import JobUser, RunAs
from agent.confinement.uid_files import message_queues, remove_files_of
from agent.confinement.uid_ipc import objects_of, remove_ipc_of
from agent.confinement.uid_keys import KEY_USERS, clear_keys_of
from agent.warm.servers import WarmServer, socket_path
from service.models import Owner
from tests.support.cluster import Cluster, cluster
from tests.support.hostile import run, the_agent_lives_and_another_owners_job_succeeds
from tests.support.job_user import job_python, open_folder
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="needs an agent started as root")]

UID_BASE = 1_600_000_000 + random.randrange(100_000) * 100
HEAD = """
import ctypes, json, os, socket, subprocess, sys, time
CKPT = os.environ["ETT_CHECKPOINT_DIR"]
def said(name, what):
    with open(os.path.join(CKPT, name), "w") as f:
        json.dump(what, f)
"""
# What is not a process: files in /dev/shm, /tmp (one in a tree of its own) and /var/tmp, and a System V
# shared memory segment, semaphore set and message queue (IPC_PRIVATE, IPC_CREAT).
LEAVE = HEAD + """
tag = sys.argv[1]
for folder in ("/dev/shm", "/tmp", "/var/tmp"):
    with open(os.path.join(folder, tag), "wb") as f:
        f.write(b"x" * 65536)
os.makedirs(f"/tmp/{tag}-tree/a/b")
open(f"/tmp/{tag}-tree/a/b/file", "w").close()
libc = ctypes.CDLL(None, use_errno=True)
said("ipc.json", {"shm": libc.shmget(0, 1 << 20, 0o1000 | 0o600), "sem": libc.semget(0, 1, 0o1000 | 0o600),
                  "msg": libc.msgget(0, 0o1000 | 0o600)})
"""
# What the first review found outliving the uid: a file in /run/lock, a POSIX message queue (the node
# mounts none at /dev/mqueue), a key in its user keyring and one in its user session keyring.
LEAVE_MORE = HEAD + """
tag = sys.argv[1]
open(f"/run/lock/{tag}", "w").write("still here")
libc, rt = ctypes.CDLL(None, use_errno=True), ctypes.CDLL("librt.so.1", use_errno=True)
key = b"k" * 4000
said("made.json", {"mq": rt.mq_open(f"/{tag}".encode(), os.O_CREAT | os.O_RDWR, 0o600, None),
                   "keys": [libc.syscall(248, b"user", tag.encode(), key, len(key), ctypes.c_int(ring))
                            for ring in (-4, -5)]})  # add_key(2) into @u and @us
"""
# The agent's placer socket, asked again and again to move this rank where it may not go.
FLOOD = HEAD + """
refused = 0
for _ in range(int(sys.argv[2])):
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(sys.argv[1])
        s.sendall(json.dumps({"cgroup": "/"}).encode())
        refused += s.recv(4096).startswith(b"refused")
said("refused.json", refused)
"""
# Another process of the rank's uid reads a process's memory (/proc/PID/mem), as a debugger would.
READ_MEMORY = """
import errno, sys
pid = sys.argv[1]
try:
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        start = int(next(line for line in open(f"/proc/{pid}/maps") if "rw-p" in line).split("-")[0], 16)
        mem.seek(start)
        print("read" if len(mem.read(8)) == 8 else "nothing")
except OSError as exc:
    print(errno.errorcode.get(exc.errno, str(exc.errno)))
"""
# A warm-forked rank: its warm server and keeper above it, and itself, read by another process of its uid.
WARM = HEAD + """
libc = ctypes.CDLL(None, use_errno=True)
keeper = os.getppid()
server = int(open(f"/proc/{keeper}/stat").read().rsplit(")", 1)[1].split()[1])
def read(pid):
    return subprocess.run([sys.executable, sys.argv[1], str(pid)], capture_output=True, text=True).stdout.strip()
said("memory.json", {"server_cmdline": open(f"/proc/{server}/cmdline", "rb").read().decode(errors="replace"),
                     "server": read(server), "keeper": read(keeper), "rank": read(os.getpid()),
                     "rank_dumpable": libc.prctl(3, 0, 0, 0, 0)})  # PR_GET_DUMPABLE
"""
# A process of the owner's uid, there before its warm servers start, that attaches to each as it starts:
# opens its /proc/PID/mem (to read and write) and PTRACE_SEIZEs it, again and again, from its fork (a
# child of the process that starts it, argv[1]) until the test says stop (SIGTERM). A hold it got is
# kept: read through once the server is closed to it (a fresh open refused). Then it says what it got.
ATTACH = """
import ctypes, json, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
PTRACE_SEIZE, PTRACE_INTERRUPT, PTRACE_DETACH, WALL = 0x4206, 0x4207, 17, 0x40000000
parent, stop = sys.argv[1], []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
servers, held, traced, kept, looks = set(), {}, set(), set(), 0
def children():
    found = []
    for task in os.listdir(f"/proc/{parent}/task"):
        try:
            found += open(f"/proc/{parent}/task/{task}/children").read().split()
        except OSError:
            pass
    return found
def opens(pid, flags):
    try:
        return os.open(f"/proc/{pid}/mem", flags)
    except OSError:
        return None
before = set(children())  # the suite's own warm server (tests/support/warm.py) is none of this test's starts
print("watching", flush=True)
while not stop:
    for pid in children():
        if pid in before:
            continue
        try:  # a fork not yet exec'd has its parent's; what the server execs names it
            if b"agent.warm.server" not in open(f"/proc/{pid}/cmdline", "rb").read():
                continue
        except OSError:
            continue
        servers.add(pid)
        looks += 1
        if pid not in held and (fd := opens(pid, os.O_RDWR)) is not None:
            try:
                held[pid] = (fd, int(open(f"/proc/{pid}/maps").readline().split("-")[0], 16))
            except (OSError, ValueError):
                held[pid] = (fd, None)
        if pid not in traced and libc.ptrace(PTRACE_SEIZE, int(pid), 0, 0) == 0:
            traced.add(pid)
            libc.ptrace(PTRACE_INTERRUPT, int(pid), 0, 0)
            try:
                os.waitpid(int(pid), WALL)
            except ChildProcessError:
                pass
            libc.ptrace(PTRACE_DETACH, int(pid), 0, 0)
        if pid in held and pid not in kept and held[pid][1] is not None:
            again = opens(pid, os.O_RDONLY)
            if again is not None:
                os.close(again)  # still open to all: the hold proves nothing yet
                continue
            try:
                if len(os.pread(held[pid][0], 8, held[pid][1])) == 8:
                    kept.add(pid)
            except OSError:
                pass
print(json.dumps({"servers": len(servers), "looks": looks, "mem": len(held), "ptrace": len(traced),
                  "kept": len(kept)}), flush=True)
"""
BYSTANDER = "import os; open(os.path.join(os.environ['ETT_CHECKPOINT_DIR'], 'ran'), 'w').close()\n"
SCRIPTS = {"leave.py": LEAVE, "leave_more.py": LEAVE_MORE,
           "flood.py": FLOOD, "read_memory.py": READ_MEMORY, "warm.py": WARM,
           "attach.py": ATTACH, "bystander.py": BYSTANDER}


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[Cluster, Path]]:
    """The service and one agent started as root, its owners' uids the module's; the scripts in a
    folder every user may read."""
    with open_folder("ett-leftovers-") as root:
        python = job_python(root / "job-python")
        scripts = root / "scripts"
        scripts.mkdir()
        for name, text in SCRIPTS.items():
            (scripts / name).write_text(text)
        try:
            with cluster(root) as c:
                c.start_agent("node-a", slots=1, job_python=python, job_uid_base=str(UID_BASE))
                yield c, python
        finally:  # whatever a failed test left of the module's uids
            for number in range(1, 4):
                remove_files_of(UID_BASE + number, set(), set(), time.time_ns())
                remove_ipc_of(UID_BASE + number)
                clear_keys_of(UID_BASE + number, UID_BASE + number)




def said(c: Cluster, owner: str, job_id: str, name: str):
    return json.loads((c.root / "checkpoints" / owner / job_id / name).read_text())


def uid_of(c: Cluster, owner: str) -> int:
    with c.service.context.sessions() as session:
        return UID_BASE + session.scalars(select(Owner.id).where(Owner.name == owner)).one()




def test_files_and_ipc_objects_of_the_jobs_uid_go_with_its_last_attempt(node):
    c, python = node
    tag = f"ett-leftover-{os.getpid()}-{random.randrange(10**6)}"
    other = UID_BASE + 99  # no owner's: another uid's files and segment, where the job leaves its own
    others = [Path(f"/dev/shm/{tag}-other"), Path(f"/tmp/{tag}-other"), Path(f"/var/tmp/{tag}-other")]
    segment = int(subprocess.run(["ipcmk", "-M", "4096"], user=other, group=other, extra_groups=[],
                                 capture_output=True, text=True, check=True).stdout.split()[-1])
    try:
        for path in others:
            path.write_text("another uid's")
            os.chown(path, other, other)
        job_id = run(c, c.user, python, "leave.py", tag)
        assert c.wait_job(job_id, timeout=120)["state"] == "succeeded", c.logs()
        alice, made = uid_of(c, "alice"), said(c, "alice", job_id, "ipc.json")
        assert min(made.values()) >= 0, made
        theirs = [Path(f"/dev/shm/{tag}"), Path(f"/tmp/{tag}"), Path(f"/var/tmp/{tag}"), Path(f"/tmp/{tag}-tree")]

        def gone() -> bool:
            return not any(p.exists() for p in theirs) and objects_of(alice) == []
        wait_for(gone, 30, "alice's files and IPC objects removed",
                 explain=lambda: f"{[p for p in theirs if p.exists()]} {objects_of(alice)} {c.logs()}")
        assert [p.read_text() for p in others] == ["another uid's"] * 3
        assert ("shm", segment) in objects_of(other)
    finally:
        for path in others:
            path.unlink(missing_ok=True)
        subprocess.run(["ipcrm", "-m", str(segment)], capture_output=True, check=False)
    the_agent_lives_and_another_owners_job_succeeds(c, python)


def key_bytes(uid: int) -> int:
    """The bytes of keys the kernel charges to `uid` (0: none)."""
    for line in KEY_USERS.read_text().splitlines():
        if line.split(":")[0].strip() == str(uid):
            return int(line.split()[-1].split("/")[0])
    return 0


def queues() -> list[str]:
    folder = message_queues()
    try:
        return os.listdir(folder)
    finally:
        if isinstance(folder, int):
            os.close(folder)


def test_a_lock_file_a_message_queue_and_keys_of_the_jobs_uid_go_with_its_last_attempt(node):
    c, python = node
    tag = f"ett-leftover-{os.getpid()}-{random.randrange(10**6)}"
    job_id = run(c, c.user, python, "leave_more.py", tag)
    assert c.wait_job(job_id, timeout=120)["state"] == "succeeded", c.logs()
    made = said(c, "alice", job_id, "made.json")
    assert made["mq"] >= 0 and min(made["keys"]) > 0, made
    lock = Path(f"/run/lock/{tag}")
    wait_for(lambda: not lock.exists() and tag not in queues() and key_bytes(uid_of(c, "alice")) < 100, 30,
             "alice's lock file, queue and keys gone",
             explain=lambda: f"{lock.exists()} {tag in queues()} {key_bytes(uid_of(c, 'alice'))} {c.logs()[-2000:]}")
    the_agent_lives_and_another_owners_job_succeeds(c, python)


def test_a_flood_of_refused_requests_at_the_placer_is_counted_not_logged_each(node):
    c, python = node
    placer = c.root / "node-a" / "warm" / "place.sock"
    if not placer.exists():
        pytest.skip("no cgroup v2 placer on this machine")
    log = c.root / "node-a.log"
    before = log.stat().st_size
    job_id = run(c, c.user, python, "flood.py", str(placer), "3000")
    assert c.wait_job(job_id, timeout=180)["state"] == "succeeded", c.logs()
    refused = said(c, "alice", job_id, "refused.json")
    alice = uid_of(c, "alice")
    assert refused == 3000

    def accounted() -> tuple[int, int] | None:
        text = log.read_bytes()[before:].decode(errors="replace")
        logged = len(re.findall(rf"\(uid {alice}\) not moved into", text))
        held = sum(int(n) for n in re.findall(rf"placement: (\d+) more like it for uid {alice} ", text))
        return (logged, held) if logged + held == refused else None
    # Each refusal is in root's log, in full or in a count said once its interval is over.
    logged, held = wait_for(accounted, 60, "every refusal logged or counted", interval=0.5,
                            explain=lambda: log.read_bytes()[before:][-3000:].decode(errors="replace"))
    grown = log.stat().st_size - before
    print(f"3000 refusals: {logged} logged in full, {held} counted; the agent's log grew by {grown} bytes")
    assert logged <= 20 and grown < 50_000, (logged, grown)
    the_agent_lives_and_another_owners_job_succeeds(c, python)


def test_the_warm_server_and_its_keepers_are_closed_to_the_owners_own_ranks(node):
    c, python = node
    # The owner's warm server started by a first job and listening (a launch waits at most 30 s for
    # its imports, then starts fresh): the job after it is forked from it.
    first = run(c, c.user, python, "bystander.py", warm_imports=["json"])
    assert c.wait_job(first, timeout=240)["state"] == "succeeded", c.logs()
    folder = c.root / "node-a" / "warm" / str(uid_of(c, "alice"))
    wait_for(lambda: list(folder.glob("w-*.sock")), 240, "alice's warm server to listen", interval=0.5)
    job_id = run(c, c.user, python, "warm.py", str(c.root / "scripts" / "read_memory.py"), warm_imports=["json"])
    assert c.wait_job(job_id, timeout=240)["state"] == "succeeded", c.logs()
    seen = said(c, "alice", job_id, "memory.json")
    # os.walk, not rglob: the agent removes an ended attempt's spool folders meanwhile, which rglob raises on.
    warm_logs = "\n".join(Path(d, f).read_text(errors="replace")[-2000:] for d, _, files in os.walk(c.root / "node-a")
                          for f in files if f.startswith("warm-") and f.endswith(".log"))  # fmt: skip
    assert "agent.warm.server" in seen["server_cmdline"], (seen, warm_logs, c.logs())  # forked warm
    assert seen["rank"] == "read" and seen["rank_dumpable"] == 1, seen  # its user may debug its own rank
    assert seen["server"] in ("EACCES", "EPERM") and seen["keeper"] in ("EACCES", "EPERM"), seen
    the_agent_lives_and_another_owners_job_succeeds(c, python)


ATTACHED_STARTS = 20


def test_no_process_of_the_owner_attaches_to_its_warm_server_while_it_starts(node):
    """The server is exec'd as root and becomes the owner before it runs a line of the owner's
    (agent.confinement.become): from its fork until it listens, a process of the owner's uid that tries all along,
    start after start, never opens its /proc/PID/mem nor ptraces it. Exec'd as the owner, as it was, it was open
    to them until its first line: that process got into 20 of 20 starts, and read the server through its hold
    once the server had closed itself."""
    c, python = node
    uid = UID_BASE + 3  # no owner's: the module's cleanup covers it
    run_as = RunAs(str(python), JobUser(f"ett-{uid}", uid, uid, str(c.root / "attach-home"), owners_alone=True))
    run_as.make_own(run_as.user.home)
    attacker = subprocess.Popen([str(python), str(c.root / "scripts" / "attach.py"), str(os.getpid())], user=uid,
                                group=uid, extra_groups=[], stdout=subprocess.PIPE, text=True, cwd="/")
    started = []
    try:
        assert attacker.stdout.readline().strip() == "watching"
        for number in range(ATTACHED_STARTS):
            server = WarmServer(socket_path(c.root / "attach", uid), ["json"], c.root / "attach.log", run_as)
            server.ensure_running()
            try:
                wait_for(lambda: server.listening, 60, "the warm server to listen",
                         explain=lambda: (c.root / "attach.log").read_text()[-3000:])
                started.append(Path(f"/proc/{server.pid}/cmdline").read_bytes().split(b"\0"))
                time.sleep(0.2)  # for a hold it got to be read through
            finally:
                server.stop()
    finally:
        attacker.terminate()
        out, _ = attacker.communicate(timeout=30)
    got = json.loads(out)
    print(f"{ATTACHED_STARTS} starts, {got['looks']} tries: the owner's process opened the memory of {got['mem']}, "
          f"ptraced {got['ptrace']}, read one through a hold kept after it closed {got['kept']}")
    assert got["servers"] == ATTACHED_STARTS and got["looks"] > ATTACHED_STARTS, got  # it saw every start
    assert (got["mem"], got["ptrace"], got["kept"]) == (0, 0, 0), got
    assert all(argv[4] == os.fsencode(BECOME) and argv[5] == str(uid).encode() for argv in started), started
