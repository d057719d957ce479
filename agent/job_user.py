"""Who a job's processes run as, and with which interpreter (docs/agent.md, "The job's user").

An agent started as root never runs a job as root: torchrun, the rank runners, the ranks and the
warm server run as an unprivileged user (ETT_AGENT_JOB_USER, default `nobody`); root only with
ETT_AGENT_ALLOW_ROOT_JOBS=true. An agent started as any other user runs jobs as itself. The
folders the agent makes for a job (its spool, its checkpoint folders) belong to that user.

The interpreter must be one that user can run, with ett installed (ETT_AGENT_JOB_PYTHON; default
the agent's own): an interpreter under root's home folder is not. The agent checks this once at
start, as that user, and refuses to start with a one-line reason rather than fail every launch.
"""

import errno
import grp
import os
import pwd
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_JOB_USER = "nobody"  # exists on every Debian and Red Hat machine
PREFLIGHT_TIMEOUT_SECONDS = 120.0
# Folders the agent makes above a job's own: the job's user passes through them but cannot list
# them (no job learns the others' ids). Set after mkdir, so the agent's umask cannot close them.
PASSABLE = 0o711
# Run as the job's user: each folder can be reached (it prints the first one it cannot enter), then
# the runner imports. The agent makes the job's own folders in there and gives them to the user.
CLOSED_FOLDER_EXIT = 10
PREFLIGHT_SCRIPT = (
    "import os, sys\n"
    "for folder in sys.argv[1:]:\n"
    "    parts = os.path.abspath(folder).split(os.sep)\n"
    "    for above in (os.sep.join(parts[:i]) for i in range(2, len(parts) + 1)):\n"
    "        if not os.access(above, os.X_OK):\n"
    f"            print(above); sys.exit({CLOSED_FOLDER_EXIT})\n"
    "import agent.rank_runner\n"
)


def make_passable(folder: Path) -> None:
    """Creates `folder` and each missing folder above it, every one of them PASSABLE."""
    for path in reversed([p for p in (folder, *folder.parents) if not p.exists()]):
        path.mkdir(exist_ok=True)
        path.chmod(PASSABLE)


def describe_folder(folder: str) -> str:
    """`/x (drwx------ root:root)`: what an operator needs to see why a user cannot enter it."""
    try:
        st = os.stat(folder)
    except OSError as exc:
        return f"{folder} ({exc.strerror})"
    return f"{folder} ({stat.filemode(st.st_mode)} {_name(pwd.getpwuid, st.st_uid)}:{_name(grp.getgrgid, st.st_gid)})"


def _name(lookup: Any, number: int) -> str:
    try:
        return lookup(number)[0]
    except KeyError:
        return str(number)


class JobUserError(ValueError):
    """A setting that names no usable job user; the message names the setting."""


@dataclass(frozen=True)
class JobUser:
    name: str
    uid: int
    gid: int
    home: str

    @classmethod
    def of(cls, entry: pwd.struct_passwd) -> "JobUser":
        return cls(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir)


def resolve_job_user(name: str | None, allow_root: bool) -> JobUser:
    """The user jobs run as, from the settings and who the agent is; JobUserError when not allowed."""
    euid = os.geteuid()
    if euid != 0:
        me = pwd.getpwuid(euid)
        if name not in (None, me.pw_name):
            raise JobUserError(f"ETT_AGENT_JOB_USER={name}: an agent that is not root runs jobs as itself "
                               f"({me.pw_name}); start it as root to run them as another user")
        return JobUser.of(me)
    name = name or DEFAULT_JOB_USER
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise JobUserError(f"ETT_AGENT_JOB_USER={name}: no such user on this machine") from None
    if entry.pw_uid == 0 and not allow_root:
        raise JobUserError(f"ETT_AGENT_JOB_USER={name} is root: every user's job would run as root on this node; "
                           "set ETT_AGENT_ALLOW_ROOT_JOBS=true to allow it")
    return JobUser.of(entry)


@dataclass(frozen=True)
class RunAs:
    """How the job's processes are started: which interpreter, as which user (None: as the agent)."""

    python: str = field(default_factory=lambda: sys.executable)
    user: JobUser | None = None

    @property
    def switches(self) -> bool:
        return self.user is not None and self.user.uid != os.geteuid()

    def popen(self) -> dict[str, Any]:
        """subprocess.Popen arguments that drop to the job's user (no supplementary groups kept)."""
        if not self.switches:
            return {}
        assert self.user is not None
        return {"user": self.user.uid, "group": self.user.gid, "extra_groups": []}

    def env(self) -> dict[str, str]:
        """What a login as the job's user would set; nothing when it is the agent's own user."""
        if not self.switches:
            return {}
        assert self.user is not None
        return {"USER": self.user.name, "LOGNAME": self.user.name, "HOME": self.user.home}

    def make_own(self, folder: Path | str) -> None:
        """Creates `folder` (its parents stay the agent's, PASSABLE) and gives it to the job's user."""
        make_passable(Path(folder).parent)
        Path(folder).mkdir(exist_ok=True)
        if self.switches:
            assert self.user is not None
            # A job's folder from an earlier attempt is the job's: a link it put there is refused,
            # never followed (chown through it would give the job whatever it points at).
            if not stat.S_ISDIR(os.lstat(folder).st_mode):
                raise OSError(errno.ELOOP, "not a folder of its own (a link?)", str(folder))
            os.chown(folder, self.user.uid, self.user.gid, follow_symlinks=False)

    def problem(self, folders: list[Path]) -> str | None:
        """Why the job's user cannot run jobs here (None: it can). Runs the interpreter once as that
        user: it must start, import the rank runner, and reach each of `folders`."""
        if not self.switches:
            return None
        assert self.user is not None
        advice = ("set ETT_AGENT_JOB_PYTHON to an interpreter that user can run, with ett installed "
                  "(docs/agent.md, \"The job's user\")")
        try:
            done = subprocess.run([self.python, "-P", "-c", PREFLIGHT_SCRIPT, *map(str, folders)], **self.popen(),
                                  env=os.environ | self.env(), cwd="/", capture_output=True,
                                  timeout=PREFLIGHT_TIMEOUT_SECONDS)  # fmt: skip
        except OSError as exc:
            return f"job user {self.user.name} cannot run {self.python}: {exc.strerror}; {advice}"
        except subprocess.TimeoutExpired:
            return f"job user {self.user.name}: {self.python} did not start within {PREFLIGHT_TIMEOUT_SECONDS:g}s"
        if done.returncode == CLOSED_FOLDER_EXIT:
            closed = done.stdout.decode(errors="replace").strip()
            return (f"job user {self.user.name} cannot enter {describe_folder(closed)}, on the way to its job "
                    f"folders: let other users pass through it (chmod o+x {closed}) or give the agent a "
                    "--data-dir (and ETT_AGENT_LOCAL_CHECKPOINT_DIR) outside it")
        if done.returncode != 0:
            lines = done.stderr.decode(errors="replace").strip().splitlines() or [f"exit code {done.returncode}"]
            return f"job user {self.user.name} cannot run jobs with {self.python}: {lines[-1]}; {advice}"
        return None
