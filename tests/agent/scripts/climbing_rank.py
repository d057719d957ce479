"""A rank that tries to outlive its attempt, as a hostile job would (stdlib only: it also runs with an
empty environment).

    python climbing_rank.py OUT_DIR [--stay | --daemon]

It writes its pid into the cgroup.procs of its owner's cgroup, its warm server's, each other
attempt of its owner and the hierarchy's root, and asks the agent's placer (if its environment
names one) to move it into its owner's cgroup and into its own attempt; what the kernel and the
agent answered goes to OUT_DIR/rank-R.json. Then, with --stay, it sleeps until it is killed;
else rank 0 double-forks a child that leaves its session and execs itself with an empty
environment (--daemon: the same tries, written to OUT_DIR/daemon.json, then a sleep), and exits 0
once the child has written.
"""

import errno
import json
import os
import socket
import sys
import time
from pathlib import Path


def v2_mount() -> Path:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, _, after = line.partition(" - ")
        if after.split(" ", 1)[0] == "cgroup2":
            return Path(before.split()[4])
    raise SystemExit("no cgroup v2")


def own_cgroup() -> str:
    return next(line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::"))


def move(cgroup: Path) -> str:
    try:
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc))
    return "moved"


def ask_placer(placer: str, cgroup: Path) -> str:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.settimeout(10)
            conn.connect(placer)
            conn.sendall(json.dumps({"cgroup": str(cgroup)}).encode())
            return conn.recv(4096).decode()
    except OSError as exc:
        return f"error: {exc}"


def tries() -> dict:
    mount = v2_mount()
    here = mount / own_cgroup().lstrip("/")
    owner = here.parent
    answers = {"cgroup": str(here), "owner": move(owner), "warm": move(owner / "warm"), "root": move(mount)}
    others = [p for p in owner.iterdir() if p.is_dir() and p not in (here, owner / "warm")]
    answers["other_attempts"] = {p.name: move(p) for p in others}
    placer = os.environ.get("ETT_CGROUP_PLACER")
    if placer:
        answers["placer_owner"] = ask_placer(placer, owner)
        answers["placer_own_attempt"] = ask_placer(placer, here)
    answers["after"] = str(mount / own_cgroup().lstrip("/"))
    parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    return answers | {"pid": os.getpid(), "uid": os.getuid(), "warm_forked": b"agent.warm.server" in parent}


def write(path: Path, data: dict) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(data))
    path.with_suffix(".tmp").rename(path)


def main() -> None:
    out = Path(sys.argv[1])
    if "--daemon" in sys.argv:
        write(out / "daemon.json", tries())
        time.sleep(600)
        return
    rank = os.environ.get("RANK", "0")
    write(out / f"rank-{rank}.json", tries())
    if rank == "0" and "--stay" not in sys.argv:
        child = os.fork()
        if child == 0:
            os.setsid()
            if os.fork() == 0:
                os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), str(out), "--daemon"], {})
            os._exit(0)
        os.waitpid(child, 0)
        deadline = time.monotonic() + 60
        while not (out / "daemon.json").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    if "--stay" in sys.argv:
        time.sleep(600)


if __name__ == "__main__":
    main()
