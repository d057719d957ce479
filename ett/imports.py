"""What a job's script imported, for its agents to warm its next attempts (docs/agent.md, "Warm start").

When its agent asks (ETT_LEARN_IMPORTS: a `python SCRIPT` job that names no `warm_imports`), each
node's local rank 0 writes, once at `ett.init`, the modules of installed packages and of the
standard library it has loaded (ett/protocol, IMPORTS_FILE). They are the leaves of their package
trees (importing `a.b.c` imports `a` and `a.b`) in the order they were first loaded, so a warm
server that imports them in that order loads what the script did, lazily loaded submodules
(`transformers.trainer`) included, and the names it meets already loaded cost it a lookup each.

Never a module of the job's own: a top-level module is counted only where the interpreter's
installed paths (the standard library, site-packages, PYTHONPATH, an editable install's finder),
which are the warm server's, find the very file that was loaded. One from the script's folder, from
a folder the script put on sys.path, or one standing in for an installed one stays out, and so does
everything below it.
"""

import importlib.machinery
import json
import logging
import os
import re
import site
import sys
import sysconfig
import types

from ett.protocol import (
    IMPORTS_FILE,
    IMPORTS_FILE_MAX_BYTES,
    IMPORTS_MAX_NAMES,
    MODULE_NAME_MAX_CHARS,
    MODULE_NAME_PATTERN,
    acts_at_import,
)

logger = logging.getLogger("ett")
_NAME = re.compile(MODULE_NAME_PATTERN, re.ASCII)


def _beneath(path: str, folders: list[str]) -> bool:
    return any(path == folder or path.startswith(folder + os.sep) for folder in folders)


def installed_paths() -> list[str]:
    """The entries of sys.path a fresh `python -P` of this interpreter and environment has too:
    below the standard library, site-packages or PYTHONPATH. The script's folder is not one, nor
    a folder the script added."""
    roots = {sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.update(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        roots.add(site.getusersitepackages())
    roots.update(os.environ.get("PYTHONPATH", "").split(os.pathsep))
    real_roots = [os.path.realpath(root) for root in roots if root]
    return [entry for entry in sys.path if entry and _beneath(os.path.realpath(entry), real_roots)]


def _found_as_loaded(top: str, module: object, paths: list[str]) -> bool:
    """Whether the import system, searching only `paths` (and the finders an install added), finds
    the top-level module `top` where the loaded one came from."""
    if not isinstance(module, types.ModuleType):
        return False
    for finder in sys.meta_path:
        try:
            if finder is importlib.machinery.PathFinder:
                spec = importlib.machinery.PathFinder.find_spec(top, paths)
            else:
                find = getattr(finder, "find_spec", None)
                spec = find(top, None) if find is not None else None
        except Exception:  # a finder of some package's own: whatever it does, not counted
            continue
        if spec is None:
            continue
        loaded = module.__dict__.get("__file__")
        if spec.origin is not None and isinstance(loaded, str):
            return os.path.realpath(spec.origin) == os.path.realpath(loaded)
        locations = list(spec.submodule_search_locations or [])  # a namespace package: no file of its own
        held = list(getattr(module, "__path__", []) or [])
        return bool(locations) and sorted(map(os.path.realpath, locations)) == sorted(map(os.path.realpath, held))
    return False


def installed_imports(script: str | None) -> list[str]:
    """The modules of installed packages this process has loaded, as leaves in load order (above),
    within the bounds of ett/protocol; `script`: the job's script (its folder is never counted)."""
    paths = installed_paths()
    own = [os.path.dirname(os.path.abspath(script)), os.path.dirname(os.path.realpath(script))] if script else []
    tops: dict[str, bool] = {}
    kept: list[str] = []
    for name, module in list(sys.modules.items()):
        if len(name) > MODULE_NAME_MAX_CHARS or not _NAME.fullmatch(name) or acts_at_import(name):
            continue  # `__main__` (the script) among them: a warm server imports none of these
        file = module.__dict__.get("__file__") if isinstance(module, types.ModuleType) else None
        top = name.partition(".")[0]
        if top not in tops:
            tops[top] = _found_as_loaded(top, sys.modules.get(top), paths)
        if tops[top] and isinstance(file, str) and not _beneath(file, own):
            kept.append(name)
    ancestors = {".".join(parts[:i]) for parts in (name.split(".") for name in kept) for i in range(1, len(parts))}
    leaves, size = [], 32  # the JSON's frame
    for name in kept:
        if name in ancestors:
            continue
        size += len(name) + 4
        if len(leaves) >= IMPORTS_MAX_NAMES or size > IMPORTS_FILE_MAX_BYTES:
            break  # the first ones loaded are kept: the frameworks, before what the script loads late
        leaves.append(name)
    return leaves


def write_imports(event_dir: str) -> None:
    """Writes the list to IMPORTS_FILE in `event_dir`, whole (a rename): the agent reads it once.
    A failure only costs the next attempt its warm start, never this one a step."""
    main = sys.modules.get("__main__")
    script = main.__dict__.get("__file__") if isinstance(main, types.ModuleType) else None
    path = os.path.join(event_dir, IMPORTS_FILE)
    try:
        data = json.dumps({"modules": installed_imports(script if isinstance(script, str) else None)})
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w") as f:
            f.write(data)
        os.replace(temporary, path)
    except OSError as exc:
        logger.warning("ett: what this script imported was not written for its next attempts' warm start: %s", exc)
