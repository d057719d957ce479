"""The replicated fast tier (ett/snapshots/peers.py, ett/snapshots/restore.py) with real processes:
each rank's snapshots reach its peer node; a lost node's rank resumes from its peer's copy; a
torn or corrupt copy is refused for the next one; a process that is not the job's rank cannot
place a copy; a copy altered on its way, announced beyond bound, or on disk without its seal is
refused (ett/snapshots/mac.py)."""

import json
import os
import logging
import pickle
import shutil
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from ett.snapshots import file_format as snapshot_file
from ett.snapshots import mac as snapshot_mac
from ett.snapshots.folder import SnapshotFolder, snapshots_root
from ett.snapshots.peers import HELLO, MESSAGE, NONCE_BYTES, REFUSED, PeerReplica, ring_peers
from ett.snapshots.restore import choose
from tests.support import warm
from tests.trainer.trainer_runs import REPO


def ranks(base: Path, world: int, *args: str, before_end=None, copies: int = 1) -> list[str]:
    """`world` ranks of tests/ett/checkpoints/peer_ranks.py; `before_end` runs once every rank wrote its address."""
    # A fresh rendezvous file each call: gloo's FileStore may leave its file behind when a run's
    # processes end, and a second run on a stale file reads the first run's keys and hangs.
    call = uuid.uuid4().hex
    env = {**os.environ, "PEER_COPIES": str(copies), "PEER_RENDEZVOUS": str(base / f"rendezvous-{call}")}
    outputs = [(base / f"rank-{rank}-{call}.out", base / f"rank-{rank}-{call}.err") for rank in range(world)]
    processes = []
    for rank, (out, err) in enumerate(outputs):  # forked from the suite's warm server (tests/support/warm.py)
        with open(out, "w") as out_file, open(err, "w") as err_file:
            processes.append(warm.start([sys.executable, "-m", "tests.ett.checkpoints.peer_ranks", str(base), str(rank),
                                         str(world), *args], REPO, env, out_file.fileno(), err_file.fileno()))
    try:
        if before_end is not None:
            before_end()
    finally:
        (base / "go").touch()
        for process in processes:
            process.wait(timeout=120)
    for process, (_, err) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, err.read_text()[-3000:]
    return [out.read_text() for out, _ in outputs]


def node(base: Path, rank: int, world: int = 2) -> SnapshotFolder:
    return SnapshotFolder(snapshots_root(base / f"node-{rank}", world))


def restored(base: Path, world: int = 2, copies: int = 1) -> list[dict]:
    return [json.loads(out.strip().splitlines()[-1]) for out in ranks(base, world, "restore", copies=copies)]


@pytest.fixture(scope="module")
def saved_once(tmp_path_factory) -> Path:
    """Two nodes of one rank each, four snapshots each, replicated."""
    base = tmp_path_factory.mktemp("saved")
    ranks(base, 2, "save", "4")
    return base


@pytest.fixture
def saved(saved_once, tmp_path) -> Path:
    """A copy of the two nodes' folders, for a test to change."""
    for folder in ("node-0", "node-1"):
        shutil.copytree(saved_once / folder, tmp_path / folder)
    return tmp_path


def test_the_ring_pairs_each_rank_with_the_same_local_rank_of_the_next_node():
    assert ring_peers(0, 4, 2) == ([2], [2]) and ring_peers(3, 4, 2) == ([1], [1])
    assert ring_peers(1, 6, 2) == ([3], [5])  # sends to the next node, keeps for the one before
    assert ring_peers(1, 8, 2, copies=2) == ([3, 5], [7, 5])  # the next two nodes; keeps for the two before
    assert ring_peers(0, 4, 2, copies=3) == ([2], [2])  # at most every other node
    assert ring_peers(0, 2, 2) is None and ring_peers(0, 5, 2) is None  # one node; unequal nodes


def test_the_newest_step_every_ranks_state_is_offered_of_is_chosen_own_copies_first():
    offers = [{0: {5: 1, 4: 1}, 1: {4: 1, 3: 1}}, {}]  # rank 1's node lost: rank 0 keeps its copies
    assert choose(offers, 2) == (4, {0: 0, 1: 0})
    offers = [{0: {5: 1, 4: 1}, 1: {5: 1}}, {1: {5: 1}, 0: {5: 1}}]
    assert choose(offers, 2) == (5, {0: 0, 1: 1})
    assert choose([{0: {5: 1}}, {1: {4: 1}}], 2) == (None, {})


def test_each_snapshot_reaches_the_peer_node_byte_for_byte_and_each_keeps_two(saved):
    for rank, peer in ((0, 1), (1, 0)):
        assert node(saved, rank).steps(rank) == [4, 3]
        assert node(saved, peer).steps(rank) == [4, 3]  # the copies, on the other node
        assert node(saved, peer).path(4, rank).read_bytes() == node(saved, rank).path(4, rank).read_bytes()
        assert snapshot_mac.verify(node(saved, peer), 4, rank, sealed=True) is None  # its seal beside it


def test_a_lost_nodes_rank_resumes_from_its_peers_copy(saved):
    lost = saved / "node-1"
    shutil.rmtree(lost)  # its disk went with it; its replacement starts with an empty folder
    first, second = restored(saved)
    assert (first["step"], first["source"], first["value"]) == (4, "local-snapshot", 4.0)
    assert (second["step"], second["source"], second["value"], second["position"]) == (4, "peer-snapshot", 104.0, 4)
    assert node(saved, 1).steps(1) == [4]  # the replacement's node holds its state again


def test_with_two_copies_two_neighbouring_nodes_lost_at_once_resume_from_the_third(tmp_path):
    """Three nodes of one rank each, each snapshot kept by the next two: nodes 1 and 2 go, node 0
    holds both their states."""
    ranks(tmp_path, 3, "save", "3", copies=2)
    assert [node(tmp_path, 0, 3).steps(whose) for whose in (0, 1, 2)] == [[3, 2]] * 3
    for lost in ("node-1", "node-2"):
        shutil.rmtree(tmp_path / lost)
    got = [(r["step"], r["source"], r["value"]) for r in restored(tmp_path, 3, copies=2)]
    assert got == [(3, "local-snapshot", 3.0), (3, "peer-snapshot", 103.0), (3, "peer-snapshot", 203.0)]


def test_in_four_nodes_a_lost_middle_nodes_rank_resumes_from_the_next_nodes_copy(tmp_path):
    ranks(tmp_path, 4, "save", "2")
    shutil.rmtree(tmp_path / "node-2")  # its copies of rank 1 go with it; rank 2's are on node 3
    got = [(r["step"], r["source"], r["value"]) for r in restored(tmp_path, 4)]
    assert got == [(2, "local-snapshot", 2.0), (2, "local-snapshot", 102.0), (2, "peer-snapshot", 202.0),
                   (2, "local-snapshot", 302.0)]


def test_a_corrupt_copy_is_refused_and_the_next_step_used_and_none_left_means_the_persistent_tier(saved):
    shutil.rmtree(saved / "node-1")
    copy = node(saved, 0).path(4, 1)
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 0xFF
    copy.write_bytes(data)
    first, second = restored(saved)
    assert [(r["step"], r["source"], r["value"]) for r in (first, second)] == [
        (3, "local-snapshot", 3.0), (3, "peer-snapshot", 103.0)]
    assert not copy.exists()  # refused for good

    shutil.rmtree(saved / "node-1")
    torn = node(saved, 0).path(3, 1)
    torn.write_bytes(torn.read_bytes()[:-100])
    assert [r["step"] for r in restored(saved)] == [None, None]


def test_a_process_without_the_jobs_secret_cannot_place_a_copy(tmp_path):
    """Another job's process on the node connects to rank 1's receiver, claims to be rank 0 and
    sends a snapshot: the connection is closed and nothing is stored; then it floods the receiver
    with connections."""
    def attack() -> None:
        address = tmp_path / "address-1"
        deadline = time.monotonic() + 60
        while not address.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        host, port = json.loads(address.read_text())
        with socket.create_connection((host, port), timeout=10) as conn:
            conn.recv(NONCE_BYTES)
            conn.sendall(HELLO.pack(b"\0" * 32, 0) + MESSAGE.pack(99, 64) + b"x" * 64)
            try:
                answer = conn.recv(1)
            except ConnectionResetError:  # closed with our bytes unread
                answer = b""
            assert answer == b""  # closed without a word
        # A flood of connections that never speak: four wait for their proof (a nonce each), the
        # rest are closed at once; no thread is held for them.
        flood = [socket.create_connection((host, port), timeout=10) for _ in range(6)]
        try:
            answers = [conn.recv(NONCE_BYTES) for conn in flood]
        finally:
            for conn in flood:
                conn.close()
        assert [len(answer) for answer in answers] == [NONCE_BYTES] * 4 + [0, 0]
    ranks(tmp_path, 2, "save", "2", before_end=attack)
    assert node(tmp_path, 1).steps(0) == [2, 1]  # rank 0's own copies, not step 99


def test_a_peer_that_never_answers_holds_up_neither_the_loop_nor_the_local_tier(tmp_path, monkeypatch):
    """The sender is stuck on a receiver that takes the connection and says nothing; meanwhile the
    loop takes 20 snapshots, each written locally, and the copies wait (the newest replacing the
    one before)."""
    import torch

    from ett.snapshots.peers import PeerReplica
    from ett.snapshots.tier import LocalSnapshots

    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel does) and never speaks
    snapshots = LocalSnapshots(str(tmp_path), rank=0, world_size=2, every=1)
    snapshots.peers = PeerReplica(snapshots.folder, 0, ([1], [1]), socket.create_server(("127.0.0.1", 0)),
                                  b"s" * 32, [silent.getsockname()[:2]])
    state = {"weights": torch.zeros(1 << 18)}
    for step in range(1, 21):
        state["weights"].fill_(step)
        assert snapshots.maybe_save(step, state)
    snapshots.wait()
    [sender] = snapshots.peers.senders
    assert sender._sending and snapshots.steps() == [20, 19]  # the first copy still stuck
    assert sender._newest[0] == 20  # the newest waits; those between were passed over
    monkeypatch.setattr("ett.snapshots.tier.FLUSH_SECONDS", 0.1)
    snapshots.close()  # waits for the copy FLUSH_SECONDS at most
    silent.close()


def test_a_copy_arriving_while_its_steps_folder_is_pruned_still_lands(tmp_path):
    """The node's own rank prunes step 1 (its last snapshot there: the folder goes) while rank 1's
    copy of step 1 is still arriving: the copy is staged outside the step folders and lands."""
    folder = SnapshotFolder(tmp_path)
    own = folder.staging(1, 0, "own")
    own.write_bytes(b"rank 0")
    folder.place(own, 1, 0)
    arriving = folder.staging(1, 1, "peer")
    arriving.write_bytes(b"rank 1")
    folder.remove(1, 0)  # the prune: the step's folder is gone
    assert not folder.path(1, 0).parent.exists()
    folder.place(arriving, 1, 1)
    assert folder.steps(1) == [1] and folder.path(1, 1).read_bytes() == b"rank 1"
    folder.staging(2, 1, "peer").write_bytes(b"half")  # a writer killed mid-copy
    folder.forget_newer_than(1, 1)  # at restore
    assert not list((tmp_path / "incoming").iterdir()) and folder.steps(1) == [1]


class RunsCode:
    """A header that, unpickled, creates the file `marker`: what a forged copy could do at restore."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_a_copy_on_disk_without_a_matching_seal_is_never_unpickled(saved):
    """Rank 1's node is lost. Its copy of step 4 on node 0 is replaced by a whole snapshot (its
    CRC-32 matches) whose header runs code, and its copy of step 3 loses its seal: both are
    refused, neither unpickled, and both ranks fall back to the persistent tier."""
    shutil.rmtree(saved / "node-1")
    holder, marker = node(saved, 0), saved / "unpickled"
    with open(holder.path(4, 1), "wb") as file:
        snapshot_file.write(file, pickle.dumps(RunsCode(marker)), torch.empty(0, dtype=torch.uint8))
    holder.seal(3, 1).unlink()
    assert snapshot_file.verify(holder.path(4, 1)) is None  # whole: only its seal tells
    assert snapshot_mac.verify(holder, 4, 1, sealed=True) == "its seal does not match (not the copy that arrived)"
    assert snapshot_mac.verify(holder, 3, 1, sealed=True).startswith("it has no seal")
    assert [r["step"] for r in restored(saved)] == [None, None]
    assert not marker.exists() and holder.steps(1) == []  # never unpickled; refused for good


def snapshot(folder: SnapshotFolder, step: int, rank: int) -> Path:
    staging = folder.staging(step, rank, "own")
    with open(staging, "wb") as file:
        snapshot_file.write(file, pickle.dumps({"step": step}), torch.arange(4096, dtype=torch.uint8))
    return folder.place(staging, step, rank)


def relay(target: tuple[str, int], flip_at: int) -> socket.socket:
    """A man in the middle: relays one connection to `target` both ways, the handshake untouched,
    and flips a bit of the byte `flip_at` bytes into what the sender sends."""
    listener = socket.create_server(("127.0.0.1", 0))

    def pump(source: socket.socket, sink: socket.socket, flip_at: int) -> None:
        passed = 0
        try:
            while data := bytearray(source.recv(1 << 16)):
                if 0 <= flip_at - passed < len(data):
                    data[flip_at - passed] ^= 0x01
                passed += len(data)
                sink.sendall(data)
        except OSError:
            pass
        for conn in (source, sink):
            conn.close()

    def accept() -> None:
        sender, _ = listener.accept()
        receiver = socket.create_connection(target)
        threading.Thread(target=pump, args=(receiver, sender, -1), daemon=True).start()
        pump(sender, receiver, flip_at)

    threading.Thread(target=accept, daemon=True).start()
    return listener


@pytest.mark.parametrize("flip_at", [HELLO.size, HELLO.size + MESSAGE.size + 1000], ids=["step", "payload"])
def test_a_copy_altered_on_its_way_is_refused_and_never_placed(tmp_path, caplog, flip_at):
    """Rank 0 sends its snapshot to rank 1 (real sockets, their real threads) through a man in the
    middle who lets the handshake pass and flips one bit of the step or of the snapshot's bytes."""
    secret, sender_folder, receiver_folder = b"s" * 32, SnapshotFolder(tmp_path / "a"), SnapshotFolder(tmp_path / "b")
    receiver = PeerReplica(receiver_folder, 1, ([0], [0]), socket.create_server(("127.0.0.1", 0)), secret,
                           [("0.0.0.0", 9)])
    middle = relay(receiver._listener.getsockname()[:2], flip_at)
    sender = PeerReplica(sender_folder, 0, ([1], [1]), socket.create_server(("127.0.0.1", 0)), secret,
                         [middle.getsockname()[:2]])
    with caplog.at_level(logging.WARNING):
        sender.offer(2, snapshot(sender_folder, 2, 0))
        assert sender.flush(timeout=30)
    assert receiver_folder.steps(0) == []  # of no step: the flipped one (3) nor the sent one (2)
    assert not list((receiver_folder.root / "incoming").iterdir())  # discarded
    assert "failed its MAC" in caplog.text and "refused the copy" in caplog.text  # said by both
    for replica in (sender, receiver):
        replica.close()
    middle.close()


def test_a_message_beyond_the_bound_or_with_a_negative_step_is_refused_before_a_byte_is_read(tmp_path):
    """The job's own sender (it knows the secret) announces a copy of 1 PiB, one past the bound set by
    the receiver's own snapshot, and one of step -1: each refused and the connection closed with
    only the header sent, nothing staged."""
    folder = SnapshotFolder(tmp_path / "w2")  # not there yet: the receiver's rank has written no snapshot
    receiver = PeerReplica(folder, 1, ([0], [0]), socket.create_server(("127.0.0.1", 0)), b"s" * 32,
                           [("0.0.0.0", 9)])
    address = receiver._listener.getsockname()[:2]

    def announce(step: int, size: int) -> bytes:
        with socket.create_connection(address, timeout=10) as conn:
            nonce = conn.recv(NONCE_BYTES)
            conn.sendall(HELLO.pack(receiver._proof(nonce, 0), 0) + MESSAGE.pack(step, size))
            return conn.recv(1) + conn.recv(1)  # the answer, then the close

    assert announce(1, 1 << 50) == REFUSED  # no own snapshot yet: the disk's free space bounds
    snapshot(folder, 1, 1)  # this rank's own: 4 KiB and its header
    assert announce(2, snapshot_mac.SIZE_FLOOR + 1) == REFUSED
    assert announce(-1, 1 << 20) == REFUSED
    assert not list((folder.root / "incoming").iterdir())  # the own snapshot's staging, renamed; no copy staged
    assert folder.steps(0) == []
    receiver.close()
