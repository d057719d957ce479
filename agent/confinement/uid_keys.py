"""A job uid's kernel keys, cleared after its owner's last attempt on the node (agent.confinement.cgroups).

What a process adds to its user keyring (`keyctl add user NAME DATA @u`) or user session keyring
(`@us`) outlives every process of the uid: the kernel keeps both keyrings of a uid for good (since
Linux 5.3), charged to its key quota (/proc/key-users), so a job's key, a token say, would be there
for the owner's next job and hold the kernel's memory meanwhile.

Root cannot reach another uid's keyrings (keys answer to their possessor and their uid, root is no
exception), so a child process of the agent's becomes the uid (no exec: only this module's calls
run in it) and clears both keyrings: the kernel's collector frees every key only they held. A uid
that is not in /proc/key-users has no keyrings, and is not touched (naming them would make them).
Left: the two keyrings, empty (some 40 bytes of the uid's quota, as for any uid that ever used a key:
invalidated, the kernel makes one again at once); a uid's persistent keyring (`keyctl
get_persistent`), which the kernel expires after /proc/sys/kernel/keys/persistent_keyring_expiry
(3 days): asking for it to clear it would make one.
"""

import ctypes
import os
from pathlib import Path

from agent.confinement.become import become

KEY_USERS = Path("/proc/key-users")
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}  # keyctl(2)'s number, which no library call of Python's makes
KEYCTL_CLEAR = 7
USER_KEYRINGS = (-4, -5)  # KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING
_libc = ctypes.CDLL(None, use_errno=True)


def has_keys(uid: int, key_users: Path = KEY_USERS) -> bool:
    """Whether the kernel holds keys (keyrings included) charged to `uid`."""
    try:
        lines = key_users.read_text().splitlines()
    except OSError:
        return False  # no keys in this kernel
    return any(line.split(":", 1)[0].strip() == str(uid) for line in lines)


def clear_keys_of(uid: int, gid: int) -> bool:
    """Empties the user and user session keyrings of `uid`; whether a child did so. Nothing for a
    uid without keys."""
    number = SYS_KEYCTL.get(os.uname().machine)
    if number is None or not has_keys(uid):
        return False
    pid = os.fork()
    if pid == 0:  # the child: system calls only, then out without Python's clean-up
        code = 1
        try:
            become(uid, gid)
            code = sum(_libc.syscall(number, KEYCTL_CLEAR, keyring) != 0 for keyring in USER_KEYRINGS)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0
