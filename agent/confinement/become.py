"""A process that outlives its user's jobs (the warm server, agent.warm.server), started as root, becomes
that user itself before it runs a line the user's jobs could have written:

    python -s -P -m agent.confinement.become UID GID UMASK MODULE ARGS...

then runs MODULE as `python -P -m MODULE ARGS` as that user would. A job must never attach to it: a
process of its uid that ptraces it or opens its /proc/PID/mem keeps that hold after the process makes
itself undumpable, and could leave code running in it after its job. Started as that user (exec'd
with its uid), it was open to them from the exec until its own first line: an exec that changes no
credential makes a process dumpable. A change of uid (setresuid from root) makes it undumpable
instead (fs.suid_dumpable: 0 or 2, never 1), and no exec follows here: from the exec to the change it
is root's, from the change on undumpable, so no process of the user ever attaches to it.

As root, it runs only the interpreter, its standard library and its own site-packages (their .pth
files: the operator's, as for the agent), none of the user's: -s keeps the user's site-packages
(~/.local, under HOME, the user's home) from root, -P the working folder; nothing else here reads
HOME. The agent starts it so only with an interpreter that root alone may change (root_may_run).
Once it is the user, the user's site-packages go where a start as that user would have put them
(add_user_site): the same sys.path, for it and what it forks.
"""

import os
import runpy
import site
import stat
import sys

MODULE = "agent.confinement.become"
USAGE = f"usage: python -s -P -m {MODULE} UID GID UMASK MODULE ARGS..."  # UMASK in octal
OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH  # a group's right to write, or any user's


def command(argv: list[str], uid: int, gid: int, umask: int) -> list[str]:
    """`python -P -m MODULE ARGS` (agent.warm.client.python_module), started as root instead: the
    command that becomes `uid` and `gid`, with `umask`, before MODULE runs."""
    python, safe_path, dash_m, module, *args = argv
    if (safe_path, dash_m) != ("-P", "-m"):
        raise ValueError(f"not python -P -m MODULE: {argv!r}")
    return [python, "-s", "-P", "-m", MODULE, str(uid), str(gid), f"{umask:o}", module, *args]


def become(uid: int, gid: int) -> None:
    """Drops root for good, to `uid` and `gid` alone (no other group): real, effective and saved, so
    nothing can take root back. Also makes the process undumpable (above)."""
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)


def add_user_site() -> None:
    """The user's site-packages, where a start as that user would have them: before the base
    interpreter's site-packages (after a virtual environment's own), its .pth files processed, as
    that user. None in a virtual environment that leaves out the system's site-packages (site.PREFIXES
    then holds its own prefix alone), where Python uses no user site either."""
    if not {sys.base_prefix, sys.base_exec_prefix} & set(site.PREFIXES):
        return
    site.ENABLE_USER_SITE = True  # as for that user: pip and the like look at it
    user_site = site.getusersitepackages()  # from HOME, as for that user: the environment is theirs
    if os.path.isdir(user_site):
        bases = {os.path.normcase(p) for p in site.getsitepackages([sys.base_prefix, sys.base_exec_prefix])}
        at = next((i for i, path in enumerate(sys.path) if os.path.normcase(path) in bases), len(sys.path))
        rest = sys.path[at:]
        del sys.path[at:]
        site.addsitedir(user_site)
        sys.path.extend(path for path in rest if path not in sys.path)
    site.execusercustomize()


def writable_only_by(st: os.stat_result, uid: int) -> bool:
    """Whether only `uid` (and root) may change what `st` describes, or write in it: its owner's, and no
    group's or other user's to write."""
    return st.st_uid == uid and not st.st_mode & OTHERS_WRITE


def root_may_run(python: str) -> str | None:
    """Why root must not run the interpreter `python` (None: it may): what another user could change of
    what it starts from. Root's alone to write: its file (links followed); the folder it is named in, and
    the one above (a virtual environment's, whose pyvenv.cfg, in either, names the interpreter's home),
    and that home and the one above (the standard library's prefix), as the kernel finds them; the real
    file's folder and the one above. A folder higher up may be one anyone may write in whose sticky bit
    keeps them from renaming root's folder in it (/tmp)."""
    real = os.path.realpath(python)
    named = os.path.dirname(os.path.abspath(python))
    home = _venv_home(named)
    folders = [named, *([home] if home else []), os.path.dirname(real)]
    closest = {real} | {os.path.realpath(f) for folder in folders for f in (folder, os.path.dirname(folder))}
    higher = {above for path in closest for above in _above(path)} - closest
    for path in sorted(closest | higher):
        try:
            st = os.stat(path)  # a real path: no link left in it
        except OSError as exc:
            return f"{path}: {exc.strerror}"
        sticky = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX and st.st_uid == 0
        if not writable_only_by(st, 0) and not (path in higher and sticky):
            return f"{path} ({stat.filemode(st.st_mode)}, uid {st.st_uid}) is not root's alone to change"
    return None


def _venv_home(folder: str) -> str | None:
    """The `home` a pyvenv.cfg in `folder`, or the one above, names, as Python looks for it."""
    for config in (os.path.join(folder, "pyvenv.cfg"), os.path.join(os.path.dirname(folder), "pyvenv.cfg")):
        try:
            with open(config, encoding="utf-8") as lines:
                return next((value.strip() for key, _, value in (line.partition("=") for line in lines)
                             if key.strip().lower() == "home"), None)
        except OSError:
            continue
    return None


def _above(path: str) -> list[str]:
    parents = []
    while (parent := os.path.dirname(path)) != path:
        parents.append(parent)
        path = parent
    return parents


def main() -> None:
    if len(sys.argv) < 5:
        sys.exit(USAGE)
    uid, gid, umask, module = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3], 8), sys.argv[4]
    become(uid, gid)
    os.umask(umask)  # the user's from here only: what root wrote before (bytecode caches) stays readable to all
    add_user_site()
    sys.argv[:] = sys.argv[4:]  # as `python -m MODULE ARGS` has them: argv[0] becomes MODULE's file (runpy)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
