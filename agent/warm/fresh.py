"""What keeps a warm server (agent.warm.server) from forking code a fresh interpreter would not run.

A server serves the modules it imported, for as long as it lives: a module edited since (a job's
own, installed editable or on PYTHONPATH, the trainer, an upgraded package) would run its old
version warm and its new one cold. So the server records the mtime and size of each module's
file as it imports it, and before each fork stats them again (a stat per file: a few ms for
torch's thousands); one that changed makes the server stale: it forks nothing more and exits, for
the agent to start a fresh one.

A job's script runs with its folder first on the path: a module there named like one the server
holds (an `agent.py` beside the script, say, where the server holds ETT's `agent`) is the one a
fresh `python SCRIPT` imports, so the server does not fork that script at all. The script itself
is not counted: one named like a package it uses must take its folder off the path to import that
package at all (examples/lightning.py does).
"""

import contextlib
import importlib.machinery
import os
import sys
import types
from collections.abc import Iterator


def _stat(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)  # through links: a venv's python is one
    except OSError:
        return None  # a module from a zip, say: nothing to compare, and nothing that changes
    return st.st_mtime_ns, st.st_size


def _file(module: object) -> str | None:
    # From its __dict__: a lazy module's __getattr__ would import what it stands for.
    file = module.__dict__.get("__file__") if isinstance(module, types.ModuleType) else None
    return file if isinstance(file, str) else None


class Fingerprint:
    """The mtime and size of the interpreter and of each loaded module's file, as it was loaded."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[int, int] | None] = {}

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Records a module's source as the import system looks at it, before it reads it: an edit
        in between then shows as a change, never as the recorded state."""
        loader = importlib.machinery.SourceFileLoader
        path_stats = loader.path_stats

        def recorded(this: importlib.machinery.SourceFileLoader, path: str) -> dict:
            self.files.setdefault(path, _stat(path))
            return path_stats(this, path)

        loader.path_stats = recorded  # type: ignore[method-assign]
        try:
            yield
        finally:
            loader.path_stats = path_stats  # type: ignore[method-assign]

    def changed(self) -> str | None:
        """The first file no longer as it was loaded, else None. Files not seen loading (extension
        modules, the interpreter, a module imported later) are recorded as they are at the first call."""
        for file in [sys.executable, *filter(None, map(_file, list(sys.modules.values())))]:
            now = _stat(file)
            if self.files.setdefault(file, now) != now:
                return file
        return None


def shadowed(script: str) -> str | None:
    """The file or package beside `script` (an absolute path) that `python SCRIPT` would import in
    place of a module this process holds from elsewhere, else None. Standard library names are left
    out: which of them a fresh interpreter has loaded before the script's first line is the
    interpreter's business."""
    folder = os.path.dirname(script)
    held = {name: file for name, module in list(sys.modules.items())
            if "." not in name and name not in sys.stdlib_module_names and (file := _file(module))}
    try:
        entries = os.listdir(folder)
    except OSError:
        return None  # the script is not there either: it fails warm as it would cold
    suffixes = importlib.machinery.all_suffixes()
    for entry in entries:
        path = os.path.join(folder, entry)
        if path == script:
            continue
        name = next((entry[: -len(s)] for s in suffixes if entry.endswith(s)), entry)
        if name not in held or (name == entry and not any(os.path.isfile(os.path.join(path, "__init__" + s))
                                                          for s in suffixes)):
            continue  # not held, or a folder that is no package (a namespace portion loses to one)
        real, held_file = os.path.realpath(path), os.path.realpath(held[name])
        if held_file != real and not held_file.startswith(real + os.sep):  # the held one is not this
            return path
    return None
