"""Appending one JSON record to a file shared by several writers (the rank runners' records, the
forwarder's dead letters). Its own module: the rank runner starts fresh for every rank and
imports only what it needs."""

import json
import os


def append_json_line(path: str | os.PathLike[str], record: dict[str, object], mode: int = 0o644) -> None:
    """One write on an O_APPEND descriptor: concurrent writers never interleave inside a line.
    Never through a link; `mode` for a file it creates."""
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, mode)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
