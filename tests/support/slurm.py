"""A real Slurm cluster on this machine for the tests marked `slurm`: Debian's munged, slurmctld
and two slurmd daemons (`slurmd -N n1`, `-N n2`), each node on its own port, in a temporary
folder; everything stopped at the end.

Two partitions share the nodes: `batch` (the default) and `urgent`, whose jobs preempt batch
jobs (PreemptMode=CANCEL), so a test can preempt a job the way a busy cluster does.
"""

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.postgres import free_port
from tests.support.waiting import wait_for

DAEMONS = ("munged", "slurmctld", "slurmd")
NODES = ("n1", "n2")
KILL_WAIT_SECONDS = 20  # SIGTERM to SIGKILL at a time limit, a preemption, a cancel: the ranks' grace


def slurm_conf(root: Path, ctld_port: int, node_ports: dict[str, int]) -> str:
    nodes = "\n".join(f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs=2 "
                      "RealMemory=2000 State=UNKNOWN" for name, port in node_ports.items())  # fmt: skip
    return f"""ClusterName=ett-test
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
AuthType=auth/munge
AuthInfo=socket={root / 'munge' / 'munge.sock'}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root / 'state'}
SlurmdSpoolDir={root / 'spool'}/%n
SlurmctldPidFile={root / 'slurmctld.pid'}
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root / 'log' / 'slurmctld.log'}
SlurmdLogFile={root / 'log'}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait={KILL_WAIT_SECONDS}
MinJobAge=300
{nodes}
PartitionName=batch Nodes={','.join(node_ports)} Default=YES MaxTime=INFINITE PriorityTier=1 State=UP
PartitionName=urgent Nodes={','.join(node_ports)} MaxTime=INFINITE PriorityTier=2 State=UP
"""


@dataclass
class SlurmCluster:
    root: Path
    conf: Path

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to use this cluster's commands."""
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *argv: str) -> str:
        done = subprocess.run(argv, env=os.environ | self.env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, f"{argv}: {done.stderr}"
        return done.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` of a job Slurm still remembers, as a dict."""
        out = self.run("scontrol", "show", "job", "-o", job_id)
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def logs(self) -> dict[Path, str]:
        return {p: p.read_text(errors="replace") for p in (self.root / "log").glob("*.log")}


def _start(argv: list[str], env: dict[str, str]) -> None:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{argv[0]} did not start: {done.stderr or done.stdout}"


@contextlib.contextmanager
def slurm_cluster(root: Path) -> Iterator[SlurmCluster]:
    """munged, slurmctld and a slurmd for each of NODES, up until the block ends."""
    missing = [d for d in DAEMONS if shutil.which(d, path=os.environ.get("PATH", "") + ":/usr/sbin") is None]
    if missing:
        pytest.skip(f"no {', '.join(missing)}: Debian's slurm-wlm and munge (.ci/run installs them)")
    if os.geteuid() != 0:
        pytest.skip("slurmd runs jobs as their users, so it runs as root: run the Slurm tests as root")
    for sub in ("munge", "state", "log", *(f"spool/{n}" for n in NODES)):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "munge").chmod(0o711)  # the socket's folder: every user's processes reach munged
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, free_port(), {name: free_port() for name in NODES}))
    env = os.environ | {"SLURM_CONF": str(conf), "PATH": os.environ.get("PATH", "") + ":/usr/sbin"}
    munge = root / "munge"
    try:
        _start(["munged", "--force", f"--key-file={key}", f"--socket={munge / 'munge.sock'}",
                f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
                f"--seed-file={munge / 'munged.seed'}"], env)  # fmt: skip
        _start(["slurmctld", "-f", str(conf), "-i"], env)  # -i: no state from an earlier run
        for name in NODES:
            _start(["slurmd", "-f", str(conf), "-N", name], env)
        cluster = SlurmCluster(root, conf)
        idle = lambda: cluster.run("sinfo", "--noheader", "--format=%t", "--partition=batch").split() == ["idle"]  # noqa: E731
        wait_for(idle, 60, "both Slurm nodes to be idle", interval=0.5)
        yield cluster
    finally:
        _stop_everything(root, env)


def _stop_everything(root: Path, env: dict[str, str]) -> None:
    """Cancels every job and waits for their steps to go (each gets SIGTERM, then SIGKILL after
    KillWait), then stops the daemons; a daemon that does not stop in 10 s is killed."""
    with contextlib.suppress(Exception):
        subprocess.run(["scancel", "--user=root"], env=env, capture_output=True, timeout=10)
        left = lambda: subprocess.run(["squeue", "--noheader"], env=env, capture_output=True, text=True,  # noqa: E731
                                      timeout=10).stdout.strip() == ""  # fmt: skip
        wait_for(left, KILL_WAIT_SECONDS + 10, "Slurm's jobs to end", interval=0.5)
    pidfiles = [*(root / f"slurmd-{name}.pid" for name in NODES), root / "slurmctld.pid", root / "munge" / "munged.pid"]
    pids = [pid for pid in map(_pid_in, pidfiles) if pid is not None]
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: not any(_alive(pid) for pid in pids), 10, "the Slurm daemons to stop", interval=0.2)
    for pid in filter(_alive, pids):
        os.kill(pid, signal.SIGKILL)


def _pid_in(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
