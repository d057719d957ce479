"""Files in a job's folders, read and written by the agent (root) without following a link
anywhere below a folder of its own: the job owns everything below, and could lay a link to any
file of the machine where the agent expects its own (docs/reliability.md, "Security")."""

import os
import stat
import subprocess
from pathlib import Path

MODE = 0o644  # what the agent writes there is for the ranks to read


def open_folder_beneath(anchor: Path, relative: Path) -> int:
    """A descriptor of anchor/relative, each folder below `anchor` (the agent's own) opened without
    following a link; OSError (ELOOP, ENOTDIR) where one is a link or not a folder."""
    fd = os.open(anchor, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in relative.parts:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_beneath(folder_fd: int, name: str, max_bytes: int) -> bytes:
    """The first `max_bytes` of the regular file `name` in the folder; b"" when there is none."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder_fd)  # a FIFO must not block
    except FileNotFoundError:
        return b""
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{name} is not a regular file")
        return f.read(max_bytes)


def replace_beneath(folder_fd: int, name: str, data: bytes) -> None:
    """Writes `data` to a new file beside `name` and renames it over `name`: a reader sees the old
    file or the new one. Whatever the job left under the staging name is removed first, never
    written through."""
    staging = f"{name}.new"
    try:
        os.unlink(staging, dir_fd=folder_fd)
    except FileNotFoundError:
        pass
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, MODE, dir_fd=folder_fd)
    with open(fd, "wb") as f:
        f.write(data)
    os.replace(staging, name, src_dir_fd=folder_fd, dst_dir_fd=folder_fd)


def remove_tree(path: Path | str) -> None:
    """Removes a folder a job filled, whatever its depth or contents. GNU rm walks it by descriptors
    (fts), follows no link in it and stays on its file system; shutil.rmtree recurses in Python, and
    a tree of 1,100 folders a job made ended the agent with RecursionError (found by review). What
    cannot be removed stays: the caller looks."""
    subprocess.run(["rm", "-rf", "--one-file-system", "--", str(path)], stdin=subprocess.DEVNULL,
                   capture_output=True, check=False)
