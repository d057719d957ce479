"""Which folder keeps a user from a file: the first one on the way to it, its links followed as the
kernel follows them, that the user may not pass through. An interpreter the operator names
(ETT_AGENT_JOB_PYTHON, a venv's bin/python) is often a link into a folder of root's
(/root/.pyenv/...): "Permission denied" on the venv does not say which folder to open or avoid.

Read by the agent (root) from the folders' owners and modes alone, for a message to the operator:
nothing is opened, created or changed. A folder whose access list (ACL) lets the user in despite
its mode is taken as closed; the caller then says no more than the error it had.
"""

import os
import stat

MAX_LINKS = 40  # the kernel's own limit (ELOOP) on links followed in one path


def first_closed_folder(path: str, uid: int, gid: int) -> str | None:
    """The first folder on the way to `path` that a process of `uid` and `gid` (no other groups, as
    the agent starts the job's) may not pass through; None when it may pass through every one."""
    if uid == 0:
        return None
    parts = list(reversed(os.path.abspath(path).split(os.sep)))  # to walk, the next one last
    folder, links = os.sep, 0
    while parts:
        name = parts.pop()
        if name in ("", "."):
            continue
        if name == "..":  # `folder` has no link left in it: its parent is the parent by name
            folder = os.path.dirname(folder)
            continue
        if not _passable(folder, uid, gid):
            return folder
        here = os.path.join(folder, name)
        try:
            target = os.readlink(here)
        except OSError:  # not a link (or not there: nothing further to find)
            folder = here
            continue
        links += 1
        if links > MAX_LINKS:
            return None
        parts.extend(reversed(target.split(os.sep)))
        if os.path.isabs(target):
            folder = os.sep
    return None


def _passable(folder: str, uid: int, gid: int) -> bool:
    try:
        st = os.stat(folder)
    except OSError:
        return True  # not there: another error than a closed folder
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid == gid:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)
