"""A rank's events on a full disk (ett/events.py): kept in memory in order, written when space
returns, dropped and counted only past the bound; the progress mark says so all along. The disk
is a real 64 KiB tmpfs filled up (ENOSPC) where this machine lets the test mount one, else the
write is made to fail with ENOSPC."""

import errno
import os
import subprocess
from pathlib import Path

import pytest

import ett.events
from ett.events import EventWriter
from ett.protocol import progress_file, rank_spool
from tests.support.waiting import wait_for
from tests.trainer.trainer_runs import read_events


class FullDisk:
    def __init__(self, folder: Path, monkeypatch):
        self.folder, self.monkeypatch = folder, monkeypatch
        folder.mkdir()
        try:
            self.real = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)],
                                       capture_output=True).returncode == 0  # fmt: skip
        except FileNotFoundError:  # no mount(8) here
            self.real = False
        self.full = False

    def fill(self) -> None:
        if self.real:
            with open(self.folder / "filler", "wb", buffering=0) as filler:
                try:
                    while True:
                        filler.write(b"\0" * 1024)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
        else:
            real_write = os.write

            def failing_write(fd: int, data: bytes) -> int:
                if self.full and fd not in (1, 2):
                    raise OSError(errno.ENOSPC, "No space left on device")
                return real_write(fd, data)

            self.monkeypatch.setattr(ett.events.os, "write", failing_write)
        self.full = True

    def free(self) -> None:
        if self.real:
            (self.folder / "filler").unlink()
        self.full = False

    def unmount(self) -> None:
        if self.real:
            subprocess.run(["umount", "--lazy", str(self.folder)], check=True)


@pytest.fixture
def disk(tmp_path, monkeypatch):
    disk = FullDisk(tmp_path / "disk", monkeypatch)
    yield disk
    disk.unmount()


def mark(folder: Path) -> list[int]:
    path = folder / progress_file(0)
    return [int(f) for f in path.read_bytes().split()] if path.exists() else [0]


def test_a_full_disk_loses_no_event_once_space_returns(disk):
    writer = EventWriter(str(disk.folder), rank=0, attempt=0)
    writer.emit("init_start", pid=1)
    wait_for(lambda: len(read_events(disk.folder / rank_spool(0))) == 1, 10, "the writer")
    disk.fill()
    for step in range(1, 201):  # about 20 KiB of events, none of which fits
        writer.emit("step", step=step, duration=0.01, tokens=64, loss=1.0)
        writer.progress(step)
    wait_for(lambda: mark(disk.folder)[0] == 200, 10, "the writer")
    step, beats, unwritten, dropped, *_ = mark(disk.folder)
    assert unwritten > 0 and dropped == 0  # the agent reads this (agent/groups/progress.py)
    assert len(read_events(disk.folder / rank_spool(0))) < 201

    disk.free()
    writer.close()
    events = read_events(disk.folder / rank_spool(0))
    assert [e["seq"] for e in events] == list(range(201))  # every event, once, in order
    assert [e["step"] for e in events[1:]] == list(range(1, 201))
    assert mark(disk.folder) == [200, 0, 0, 0, 0, 0]  # closed: pulse 0


def test_past_its_bound_a_rank_drops_events_and_counts_them(disk, monkeypatch):
    monkeypatch.setattr(ett.events, "MAX_UNWRITTEN_BYTES", 2000)
    writer = EventWriter(str(disk.folder), rank=0, attempt=0)
    writer.progress(1)
    wait_for(lambda: mark(disk.folder)[0] == 1, 10, "the writer")
    disk.fill()
    for step in range(2, 102):
        writer.emit("step", step=step, duration=0.01)
    writer.progress(101)
    wait_for(lambda: mark(disk.folder)[0] == 101, 10, "the writer")
    _, _, unwritten, dropped, *_ = mark(disk.folder)
    assert unwritten + dropped == 100 and dropped > 0 and unwritten * 80 < 2000
    disk.free()
    writer.close()
    kept = read_events(disk.folder / rank_spool(0))
    assert len(kept) == unwritten and [e["seq"] for e in kept] == list(range(unwritten))  # the first ones, in order
