"""What a job's script imported, as the root agent reads it (agent/warm/learned.py): the job's
file, so hostile input: real files in a real attempt folder, each way a job could write it wrong."""

import json
import os

import pytest

from agent.files.spool import AttemptPaths
from agent.warm.learned import NotImports, module_names, read_learned_imports
from ett.protocol import IMPORTS_FILE, IMPORTS_FILE_MAX_BYTES, IMPORTS_MAX_NAMES, MODULE_NAME_MAX_CHARS


@pytest.fixture
def paths(tmp_path) -> AttemptPaths:
    paths = AttemptPaths(tmp_path / "spool" / "job" / "0")
    paths.events_dir.mkdir(parents=True)
    return paths


def write(paths: AttemptPaths, value: object) -> None:
    (paths.events_dir / IMPORTS_FILE).write_text(json.dumps(value))


def test_a_list_of_module_names_is_read_in_its_order_without_duplicates(paths):
    assert read_learned_imports(paths) is None  # not written yet: asked again later
    write(paths, {"modules": ["idna.core", "torch.nn.parallel", "idna.core", "_bz2"]})
    assert read_learned_imports(paths) == ["idna.core", "torch.nn.parallel", "_bz2"]


@pytest.mark.parametrize("value", [
    ["idna"],  # no object
    {"modules": "idna"},
    {"modules": [1]},
    {"modules": ["../etc/passwd"]},
    {"modules": ["os; import shutil"]},
    {"modules": ["idna."]},
    {"modules": [".idna"]},
    {"modules": ["idna..core"]},
    {"modules": ["1idna"]},
    {"modules": ["ïdna"]},  # a Python identifier, and no installed package's name: ASCII only
    {"modules": ["idna\n"]},
    {"modules": ["a" * (MODULE_NAME_MAX_CHARS + 1)]},
    # Modules that act when imported (ett.protocol.acts_at_import): the job's library writes none.
    {"modules": ["json", "unittest.__main__"]},
    {"modules": ["venv.__main__"]},
    {"modules": ["antigravity"]},
    {"modules": ["this"]},
    {"modules": ["idlelib.idle"]},
    {"modules": [f"m{i}" for i in range(IMPORTS_MAX_NAMES + 1)]},
])  # fmt: skip
def test_anything_but_a_bounded_list_of_dotted_names_is_no_list(paths, value):
    write(paths, value)
    with pytest.raises(NotImports):
        read_learned_imports(paths)


def test_a_file_past_the_bound_is_no_list_and_is_read_no_further(paths):
    (paths.events_dir / IMPORTS_FILE).write_bytes(b'{"modules": ["' + b"a" * (4 * IMPORTS_FILE_MAX_BYTES) + b'"]}')
    with pytest.raises(NotImports, match="bytes"):
        read_learned_imports(paths)
    with pytest.raises(NotImports, match="JSON"):
        module_names(b"[" * 100_000)  # nested past the parser's recursion


def test_a_link_a_hard_link_or_a_fifo_is_not_read(paths, tmp_path):
    secret = tmp_path / "root-only"
    secret.write_text(json.dumps({"modules": ["idna"]}))
    target = paths.events_dir / IMPORTS_FILE
    target.symlink_to(secret)
    with pytest.raises(OSError):
        read_learned_imports(paths)
    target.unlink()
    os.link(secret, target)  # two links: a file the job could not read itself
    with pytest.raises(OSError):
        read_learned_imports(paths)
    target.unlink()
    os.mkfifo(target)  # would block a reader that waits for a writer
    with pytest.raises(OSError):
        read_learned_imports(paths)
