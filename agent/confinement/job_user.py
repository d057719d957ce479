"""Who a job's processes run as, and with which interpreter (docs/agent.md, "The job's user").

An agent started as root never runs a job as root, nor two owners' jobs as one user: each owner's
torchrun, rank runners, ranks and warm server run as a uid of its own, ETT_AGENT_JOB_UID_BASE plus
the number the service gave the owner at its first job, so the same on every node (checkpoints on
shared storage keep their owner), with a home folder of its own under the agent's data folder. Its
folders are 0700, its processes' umask 077: no other owner's job reads or writes them. An operator
may name one user for every job instead (ETT_AGENT_JOB_USER; root only with
ETT_AGENT_ALLOW_ROOT_JOBS=true), which keeps jobs from the node but not from each other. An agent
started as any other user runs jobs as itself.

The interpreter must be one that user can run, with ett installed (ETT_AGENT_JOB_PYTHON; default
the agent's own): an interpreter under root's home folder is not. The agent checks this once at
start, as an unprivileged job user, and refuses to start with a one-line reason rather than fail
every launch.
"""

import errno
import grp
import logging
import os
import pwd
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.confinement.become import command, root_may_run
from agent.files.closed_folder import first_closed_folder
from ett.protocol.messages import LaunchCommand

log = logging.getLogger(__name__)
_SAID_UNSAFE_FOR_ROOT: set[str] = set()  # the interpreters RunAs.start_kept warned of, once each
PREFLIGHT_TIMEOUT_SECONDS = 120.0
# Folders the agent makes above a job's own: the job's user passes through them but cannot list
# them (no job learns the others' ids). Set after mkdir, so the agent's umask cannot close them.
PASSABLE = 0o711
OWN = 0o700  # a job's own folders: its user's alone
JOB_UMASK = 0o077  # what a job's processes create is its user's alone
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
    "import agent.launching.rank_runner\n"
)


def make_passable(folder: Path) -> None:
    """Creates `folder` and each missing folder above it, every one of them PASSABLE."""
    for path in reversed([p for p in (folder, *folder.parents) if not p.exists()]):
        path.mkdir(exist_ok=True)
        path.chmod(PASSABLE)


def _make_folder_at(folder_fd: int, name: str) -> bool:
    """mkdir in the folder `folder_fd` holds; False when something of that name is there already."""
    try:
        os.mkdir(name, dir_fd=folder_fd)
    except FileExistsError:
        return False
    return True


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
    # A uid of one owner's alone (the agent's range): once that owner's last attempt on the node has
    # ended, no process of it lives on (agent.confinement.cgroups). Not a user the operator named,
    # whose other processes are none of the agent's business.
    owners_alone: bool = False

    @classmethod
    def of(cls, entry: pwd.struct_passwd) -> "JobUser":
        return cls(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir)


def resolve_job_user(name: str | None, allow_root: bool) -> JobUser:
    """The one user every job runs as: the agent's own (not root), or the one named (root); JobUserError
    when not allowed."""
    euid = os.geteuid()
    if euid != 0:
        me = pwd.getpwuid(euid)
        if name not in (None, me.pw_name):
            raise JobUserError(f"ETT_AGENT_JOB_USER={name}: an agent that is not root runs jobs as itself "
                               f"({me.pw_name}); start it as root to run them as another user")
        return JobUser.of(me)
    if name is None:
        raise JobUserError("ETT_AGENT_JOB_USER: an agent started as root names the user, or runs a uid per owner")
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
        return {"user": self.user.uid, "group": self.user.gid, "extra_groups": [], "umask": JOB_UMASK}

    def start_kept(self, argv: list[str]) -> tuple[list[str], dict[str, Any]]:
        """`argv` (`python -P -m MODULE ...`) and subprocess.Popen's arguments for a process of the job's user that
        outlives its jobs (a warm server): exec'd as root, it becomes that user before it runs a line of theirs, never
        open to their processes (agent.confinement.become). With an interpreter root may not run (said once): exec'd
        as the user, open to them until it makes itself undumpable."""
        if self.user is None or not self.switches:
            return argv, {}
        why = root_may_run(self.python)
        if why is None:
            return command(argv, self.user.uid, self.user.gid, JOB_UMASK), {}
        if self.python not in _SAID_UNSAFE_FOR_ROOT:
            _SAID_UNSAFE_FOR_ROOT.add(self.python)
            log.warning("warm servers of %s start as the job's user, open to its processes until they make "
                        "themselves undumpable (tens of ms): root runs no interpreter another user may change: %s",
                        self.python, why)
        return argv, self.popen()

    def env(self) -> dict[str, str]:
        """What a login as the job's user would set; nothing when it is the agent's own user."""
        if not self.switches:
            return {}
        assert self.user is not None
        return {"USER": self.user.name, "LOGNAME": self.user.name, "HOME": self.user.home}

    def base_env(self) -> dict[str, str]:
        """What each of the job's processes, and its warm server, starts from: the agent's
        environment less the agent's own settings (its token among them), as the job's user, with the
        interpreter's folder first on PATH (an entrypoint's `python`, torchrun or a script installed
        beside it is the job interpreter's, not whatever comes first on the agent's PATH, a pyenv shim
        under /root)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETT_AGENT_")} | self.env()
        env["PATH"] = os.pathsep.join([os.path.dirname(self.python), env.get("PATH", os.defpath)])
        return env

    def make_own(self, folder: Path | str, anchor: Path | str | None = None) -> None:
        """Creates `folder` and gives it to the job's user alone (OWN: no other user's job may read
        it). `anchor`, a folder above it that no job can change (the agent's own, the operator's
        checkpoint area; default: its parent), is opened by path; every folder below it is opened
        from its parent's descriptor without following a link, made where missing (the agent's,
        PASSABLE). A link a job lays anywhere on the way, even after the launch was checked, is
        refused, never followed: chown through it would give the job whatever it points at."""
        folder = Path(folder)
        anchor = Path(anchor) if anchor is not None else folder.parent
        below = folder.relative_to(anchor).parts  # ValueError: not below it
        if not below or ".." in below:
            raise OSError(errno.EINVAL, f"not a folder below {anchor}", str(folder))
        make_passable(anchor)
        fd = os.open(anchor, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for depth, name in enumerate(below, 1):
                made = _make_folder_at(fd, name)
                try:
                    inner = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except OSError as exc:
                    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    where = str(anchor.joinpath(*below[:depth]))
                    raise OSError(errno.ELOOP, "not a folder of its own (a link?)", where) from None
                os.close(fd)
                fd = inner
                if made and depth < len(below):
                    os.fchmod(fd, PASSABLE)
            if self.switches:
                assert self.user is not None
                os.fchown(fd, self.user.uid, self.user.gid)
                os.fchmod(fd, OWN)
        finally:
            os.close(fd)

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
            denied = exc.errno == errno.EACCES
            closed = first_closed_folder(self.python, self.user.uid, self.user.gid) if denied else None
            if closed is None:
                return f"job user {self.user.name} cannot run {self.python}: {exc.strerror}; {advice}"
            # The folder to name is often not the interpreter's own: a venv's bin/python links into /root/.pyenv.
            real = os.path.realpath(self.python)
            leads = f" (a link to {real})" if real != os.path.abspath(self.python) else ""
            return (f"job user {self.user.name} cannot run {self.python}{leads}: {exc.strerror}: it cannot enter "
                    f"{describe_folder(closed)}; set ETT_AGENT_JOB_PYTHON to an interpreter outside it that user "
                    "can run, with ett installed (docs/agent.md, \"The job's user\")")
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


@dataclass(frozen=True)
class JobUsers:
    """Who each launch runs as: every job as `fixed`, or (None) each owner as a uid of its own."""

    python: str
    fixed: JobUser | None
    uid_base: int = 2_000_000_000
    uid_count: int = 1_000_000
    homes: Path = Path("homes")  # an owner's home folder, HOME for its jobs, is homes/UID

    @property
    def preflight(self) -> RunAs:
        """Who the start-up check runs as: the one user, or the range's first uid (no owner's)."""
        return RunAs(self.python, self.fixed or self._owner_user(0))

    def run_as(self, command: LaunchCommand) -> RunAs:
        """Who runs this launch, its home folder made; JobUserError (the refusal) when no one may."""
        if self.fixed is not None:
            return RunAs(self.python, self.fixed)
        number = command.owner_number
        if number is None:
            raise JobUserError("the launch names no owner number (a service older than this agent?): an agent "
                               "started as root runs no job without its owner's own user")
        if number >= self.uid_count:
            raise JobUserError(f"owner {command.owner} is number {number}, past this agent's "
                               f"ETT_AGENT_JOB_UID_COUNT={self.uid_count}: raise it (the same on every node)")
        run_as = RunAs(self.python, self._owner_user(number))
        assert run_as.user is not None
        run_as.make_own(run_as.user.home)
        return run_as

    def _owner_user(self, number: int) -> JobUser:
        uid = self.uid_base + number
        try:
            name = pwd.getpwuid(uid).pw_name  # an operator may have named the range's users
        except KeyError:
            name = f"ett-{uid}"
        return JobUser(name, uid, uid, str(self.homes / str(uid)), owners_alone=True)


def resolve_job_users(python: str, name: str | None, allow_root: bool, uid_base: int, uid_count: int,
                      homes: Path) -> JobUsers:
    """From the settings and who the agent is; JobUserError when they name no usable user."""
    if os.geteuid() != 0 or name is not None:
        return JobUsers(python, resolve_job_user(name, allow_root))
    return JobUsers(python, None, uid_base, uid_count, homes.resolve())
