"""Whether a rank's command can start at all: its program found and runnable, and the script a
Python interpreter is handed there to read. Run by the rank runner, so as the job's user, in the
job's working folder and with its PATH (the job interpreter's folder first: agent.launching.launch).

A command that cannot start fails the same way on every try: the runner records it with
EXIT_CONFIG_ERROR, which the service does not retry.
Light on purpose: the rank runner starts fresh for every rank.
"""

import os
import re
import stat

PYTHON = re.compile(r"python[0-9.]*$")
OPTIONS_WITH_A_VALUE = {"-W", "-X", "-Q"}  # `python -X importtime script.py`
NO_SCRIPT = {"-m", "-c", "-"}  # a module, a string, standard input: nothing to look for


def launch_problem(argv: list[str]) -> str | None:
    """Why `argv` cannot start here, naming the file and the error; None when it can."""
    program = find_program(argv[0])
    if program is None:
        return (f"{argv[0]}: not found on the ranks' PATH (the job interpreter's folder first); "
                "name it by its path or install it there")
    problem = _unusable(program, os.X_OK)
    if problem is None and PYTHON.match(os.path.basename(argv[0])):
        script = python_script(argv[1:])
        problem = None if script is None else _unusable(script, os.R_OK)
    return problem


def find_program(name: str) -> str | None:
    """`name` itself when it has a slash (relative to the working folder), else the first match on
    $PATH that is a file; not yet whether it may be run (see `_unusable`)."""
    if os.sep in name:
        return name
    for folder in os.environ.get("PATH", os.defpath).split(os.pathsep):
        candidate = os.path.join(folder or ".", name)
        if os.path.isfile(candidate):
            return candidate
    return None


def python_script(args: list[str]) -> str | None:
    """The script a Python interpreter would run with these arguments, if any."""
    expects_value = False
    for arg in args:
        if expects_value:
            expects_value = False
        elif arg in NO_SCRIPT or arg.startswith(("-m", "-c")) and not arg.startswith("--"):
            return None
        elif arg in OPTIONS_WITH_A_VALUE:
            expects_value = True
        elif not arg.startswith("-"):
            return arg
    return None


def _unusable(path: str, mode: int) -> str | None:
    """Why this user cannot read (R_OK) or run (X_OK) the file at `path`; None when it can."""
    where = "" if os.path.isabs(path) else f" (in {os.getcwd()})"
    try:
        is_folder = stat.S_ISDIR(os.stat(path).st_mode)  # as the job's user: every folder above counts
    except OSError as exc:
        return f"{path}{where}: {exc.strerror}"
    if is_folder:
        return f"{path}{where}: Is a directory"
    return None if os.access(path, mode) else f"{path}{where}: Permission denied"
