"""Where a node's warm servers (agent.warm.servers) listen: a folder of the agent's own, short enough for any socket."""

import contextlib
import errno
import hashlib
import os
import stat
import tempfile
from pathlib import Path

from agent.confinement.become import writable_only_by
from agent.confinement.job_user import PASSABLE

SOCKET_PATH_MAX_BYTES = 107  # sun_path
LONGEST_SOCKET = f"{2**32 - 1}/w-{'0' * 10}.sock"  # below the sockets' folder: a uid's, a server of a job's imports
SHORT_ROOT_AS_ROOT = Path("/run/ett-warm")  # root's alone to write; a tmpfs, emptied at boot


def socket_folder(data_dir: Path) -> Path:
    """Where an agent with this data folder puts its warm servers' sockets and its cgroup placer's:
    DATA_DIR/warm, unless a socket there could be past sun_path's 107 bytes (a deep --data-dir, pytest's
    folders), which no server could bind: then a short folder of its own, named after that one,
    /run/ett-warm/HASH as root, TMPDIR/ett-warm-UID/HASH else. Such a folder is made where missing
    and taken only as the agent's: a folder, no link, its owner's alone to write (OSError else)."""
    folder = (data_dir / "warm").resolve()
    if len(os.fsencode(folder / LONGEST_SOCKET)) <= SOCKET_PATH_MAX_BYTES:
        return folder
    euid = os.geteuid()
    root = SHORT_ROOT_AS_ROOT if euid == 0 else Path(tempfile.gettempdir()) / f"ett-warm-{euid}"
    short = root / hashlib.sha1(os.fsencode(folder)).hexdigest()[:12]
    for path in (root, short):
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
            os.chmod(path, PASSABLE)  # whatever the umask: a job's user passes through to its own folder
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or not writable_only_by(st, euid):
            raise OSError(errno.EPERM, "not a folder of this agent's own (another user's, or a link)", str(path))
    return short
