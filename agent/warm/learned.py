"""What a job's script imported, as its first attempt's local rank 0 wrote it (ett/imports.py), read by
the agent, which is root, as the job's hostile input: a regular file of one link, opened without
following a link, at most IMPORTS_FILE_MAX_BYTES read, every name a dotted ASCII identifier of at
most MODULE_NAME_MAX_CHARS that does nothing but define itself when imported (ett.protocol.acts_at_import:
no `__main__`, no antigravity), at most IMPORTS_MAX_NAMES of them. Anything else is no list at all.

The agent itself imports nothing of it: the names go to a warm server, which runs as the job's user
and imports them from its own installed paths (`python -P`: never the job's folder), and to the
service, which hands them to the job's next launches on every node (agent/warm/server.py).
"""

import json
import os
import re

from agent.files.spool import AttemptPaths, open_job_file
from ett.protocol import (
    IMPORTS_FILE,
    IMPORTS_FILE_MAX_BYTES,
    IMPORTS_MAX_NAMES,
    MODULE_NAME_MAX_CHARS,
    MODULE_NAME_PATTERN,
    acts_at_import,
)

_NAME = re.compile(MODULE_NAME_PATTERN, re.ASCII)


class NotImports(ValueError):
    """The file is there and is not a list of imports: it is not read again."""


def module_names(raw: bytes) -> list[str]:
    """The names of the file's {"modules": [...]}, duplicates dropped, in their order; NotImports
    (saying why) for anything else."""
    if len(raw) > IMPORTS_FILE_MAX_BYTES:
        raise NotImports(f"over {IMPORTS_FILE_MAX_BYTES} bytes")
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        raise NotImports("not JSON") from None
    return checked_names(value.get("modules") if isinstance(value, dict) else None)


def checked_names(names: object) -> list[str]:
    """`names`, duplicates dropped, in their order, if it is a list of at most IMPORTS_MAX_NAMES module names that act
    at no import (above); NotImports (saying why) else. Also where a warm server is asked to import a job's list."""
    if not isinstance(names, list) or len(names) > IMPORTS_MAX_NAMES:
        raise NotImports(f'no "modules" list of at most {IMPORTS_MAX_NAMES} names')
    for name in names:
        if not isinstance(name, str) or len(name) > MODULE_NAME_MAX_CHARS or not _NAME.fullmatch(name):
            raise NotImports(f"{str(name)[:MODULE_NAME_MAX_CHARS]!r} is not a module name")
        if acts_at_import(name):  # the job's library never writes one: the list is forged
            raise NotImports(f"{name!r} acts when imported")
    return list(dict.fromkeys(names))


def read_learned_imports(paths: AttemptPaths) -> list[str] | None:
    """The attempt's learned imports; None while its file is not there (its `ett.init` has not come).
    OSError: it is there and is no regular file of one link; NotImports: it is no list of imports."""
    try:
        fd = open_job_file(paths.events_dir / IMPORTS_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return None
    with open(fd, "rb") as f:
        return module_names(f.read(IMPORTS_FILE_MAX_BYTES + 1))
