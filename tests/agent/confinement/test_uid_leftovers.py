"""What a job's uid leaves that is not a process goes after its owner's last attempt on the node,
and nothing of another uid's with it (agent.confinement.uid_files, uid_ipc): real files owned by
two uids in a folder like /tmp, real System V IPC objects made by a process of the uid."""

import contextlib
import os
import random
import subprocess
import time
from pathlib import Path

import pytest

from agent.confinement.uid_files import MAX_DEPTH, folders_inodes, held_files, remove_files_of
from agent.confinement.uid_ipc import objects_of, remove_ipc_of
from tests.support.waiting import wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="files and IPC objects of other uids need root")

U = 1_700_000_000 + random.randrange(100_000) * 2  # the job's uid: no other test's
V = U + 1  # another uid's files, beside them


def make(path: Path, uid: int, folder: bool = False, mode: int = 0o600) -> Path:
    if folder:
        path.mkdir()
    else:
        path.write_text("x")
    os.chmod(path, mode)
    os.lchown(path, uid, uid)
    return path


def link(path: Path, target: Path, uid: int) -> Path:
    path.symlink_to(target)
    os.lchown(path, uid, uid)
    return path


def newer_than(paths: list[Path], probe: Path) -> int:
    """Touches `probe` until the file system stamps it later than every one of `paths` (its clock
    ticks coarsely); the probe's change time, in ns."""
    last = max(p.lstat().st_ctime_ns for p in paths)

    def stamped() -> int:
        probe.touch()
        return probe.stat().st_ctime_ns if probe.stat().st_ctime_ns > last else 0
    return wait_for(stamped, 10, "the clock to move past the files' stamps")


def test_the_uids_files_go_and_no_other_uids(tmp_path):
    tmp = make(tmp_path / "tmp", 0, folder=True, mode=0o1777)  # as /tmp is
    outside = make(tmp_path / "outside", V, folder=True, mode=0o700)
    target = make(outside / "precious", V)
    gone = [
        make(tmp / "u-file", U),
        make(tmp / "u-tree", U, folder=True, mode=0o700),
        link(tmp / "u-link-to-vs-file", target, U),  # the link goes, never what it names
        link(tmp / "u-link-to-a-folder", outside, U),
    ]
    deep = tmp / "u-tree"
    for level in "abc":
        deep = make(deep / level, U, folder=True, mode=0o755)
        gone.append(deep)
    gone.append(make(deep / "file", U))
    kept = [
        target,
        make(tmp / "v-file", V),
        make(tmp / "u-with-vs", U, folder=True, mode=0o777),  # another uid's file in it: it stays, with the file
        make(tmp / "shared", 0, folder=True, mode=0o1777),
        make(tmp / "v-private", V, folder=True, mode=0o700),  # the uid cannot write there: not looked into
        make(tmp / "agents", 0, folder=True, mode=0o1777),  # the agent's (keep_out), open to all
    ]
    kept += [make(tmp / "u-with-vs" / "vs", V), make(tmp / "v-private" / "u-file", U),
             make(tmp / "agents" / "checkpoint", U), make(tmp / "u-held", U)]
    gone += [make(tmp / "u-with-vs" / "us", U), make(tmp / "shared" / "u-file", U)]
    kept += [make(tmp / "shared" / "v-file", V)]
    owners = {p: p.lstat().st_uid for p in kept}
    since = newer_than(gone + kept, tmp / "u-new")
    os.lchown(tmp / "u-new", U, U)  # the uid's, but made after the sweep began: another run's
    kept.append(tmp / "u-new")
    with open(tmp / "u-held") as held:  # as a warm server holds one
        spared = held_files([os.getpid()])
        removed = remove_files_of(U, spared, folders_inodes([tmp / "agents"]), since, folders=[tmp])
    assert [p for p in gone if p.exists() or p.is_symlink()] == []
    assert [p for p in kept if not p.exists()] == []
    assert removed.removed == len(gone) and removed.left == 0
    assert {p: p.lstat().st_uid for p in owners} == owners  # nothing given to anyone
    assert target.read_text() == "x" and sorted(os.listdir(outside)) == ["precious"]


def test_a_tree_deeper_than_it_looks_is_left_and_counted_not_followed(tmp_path):
    tmp = make(tmp_path / "tmp", 0, folder=True, mode=0o1777)
    top = folder = make(tmp / "deep", U, folder=True, mode=0o700)
    for _ in range(MAX_DEPTH + 5):
        folder = make(folder / "d", U, folder=True, mode=0o700)
    make(folder / "bottom", U)
    shallow = make(top / "shallow", U)
    removed = remove_files_of(U, set(), set(), time.time_ns() + 10**9, folders=[tmp])
    assert not shallow.exists() and removed.left == 1
    assert (folder / "bottom").exists()  # said in the agent's log, left


@contextlib.contextmanager
def ipc_objects(uid: int):
    """A segment, a semaphore set and a message queue made by a process of `uid` (ipcmk)."""
    made = []
    try:
        for kind, flag in (("shm", ["-M", "65536"]), ("sem", ["-S", "1"]), ("msg", ["-Q"])):
            out = subprocess.run(["ipcmk", *flag], user=uid, group=uid, extra_groups=[], capture_output=True,
                                 text=True, check=True).stdout
            made.append((kind, int(out.split()[-1])))
        yield made
    finally:
        for kind, ipc_id in made:
            subprocess.run(["ipcrm", f"-{kind[0]}", str(ipc_id)], capture_output=True, check=False)


def test_the_uids_ipc_objects_go_and_no_other_uids():
    with ipc_objects(U) as theirs, ipc_objects(V) as others:
        assert sorted(objects_of(U)) == sorted(theirs)
        assert remove_ipc_of(U) == 3
        assert objects_of(U) == []
        assert sorted(objects_of(V)) == sorted(others)
