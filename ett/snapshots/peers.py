"""The replicated fast tier: each rank's local snapshot also goes to a peer on the next node.

A lost node takes its disk's snapshots with it. With `checkpoint.snapshots` on a job of several
nodes, each rank also sends every snapshot it writes to its peer: the rank of the same local rank
on the next node, in a ring over the nodes (rank r to r + ranks-per-node, modulo the world). The
peer keeps it on its node-local disk, beside its own (ett/snapshots/folder.py): a node holds the
snapshots of its own ranks and those of the node before it, `KEEP` of each.

With `checkpoint.snapshot_copies = k` (default 1), each snapshot goes to the same local rank on
each of the next k nodes, and a node keeps those of the k nodes before it: any k neighbouring
nodes may be lost at once.

Off the training process group and the loop: once the rank's snapshot writer thread has written a
snapshot, a sender thread per peer (ett/snapshots/sender.py) sends that file, then its MAC, and
waits for the peer's word that it is stored; a slow peer costs that copy's freshness, never the
loop or the local tier. The peer's receiver thread streams it to disk through one buffer
(bounded memory), and once whole and its MAC matches, renames it into place beside its seal,
then acknowledges; its CRC-32 (the snapshot's trailer, ett/snapshots/file_format.py) and its seal are
checked before a restore takes it.

Other jobs' processes share the nodes, and a snapshot's header is unpickled on restore: a receiver
takes copies only from the ranks it keeps copies for, over a connection that proved it knows the job's
attempt secret (HMAC-SHA256 of a fresh nonce; the secret is handed to the ranks over their own
process group), and each copy only with its MAC, its header judged before a byte of it is read
(ett/snapshots/mac.py: which keys, where the proof lives until the restore, the size bound). All of
it is per connection and per message: more peers would be more of the same.
"""

import hmac
import logging
import os
import secrets
import socket
import threading
import time
from pathlib import Path

import torch.distributed as dist

from ett.snapshots import mac as snapshot_mac
from ett.snapshots.folder import SnapshotFolder
from ett.snapshots.mac import MAC_BYTES, PROOF, STREAM, copy_through, from_secret
from ett.snapshots.sender import (
    CHUNK_BYTES,
    HANDSHAKE_SECONDS,
    HELLO,
    MESSAGE,
    NONCE_BYTES,
    REFUSED,
    STORED,
    TRANSFER_SECONDS,
    PeerSender,
    receive_exactly,
)

logger = logging.getLogger(__name__)

HANDSHAKES_AT_ONCE = 4  # connections not yet proved; more are closed at once


def ring_peers(rank: int, world_size: int, ranks_per_node: int, copies: int = 1) -> tuple[list[int], list[int]] | None:
    """(the ranks this rank sends its snapshots to, the ranks whose snapshots it keeps): the same
    local rank on the next `copies` nodes, and on the `copies` nodes before (at most every other
    node); None on one node, or nodes of unequal sizes."""
    if ranks_per_node < 1 or world_size <= ranks_per_node or world_size % ranks_per_node:
        return None
    copies = max(1, min(copies, world_size // ranks_per_node - 1))
    return ([(rank + k * ranks_per_node) % world_size for k in range(1, copies + 1)],
            [(rank - k * ranks_per_node) % world_size for k in range(1, copies + 1)])


def node_address() -> str:
    """This node's address on the network its ranks' rendezvous uses: the interface that reaches
    MASTER_ADDR (a UDP socket's connect sends nothing)."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    family, _, _, _, address = socket.getaddrinfo(master, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


def _open_receiver() -> socket.socket | None:
    """A listening socket on this node's address, or None (said why) when there is none to be had."""
    try:
        host = node_address()
        return socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as error:
        logger.warning("snapshots are not copied to a peer node: no address to receive copies on (%s)", error)
        return None


class PeerReplica:
    """One rank's side of the ring: a receiver for the rank it keeps copies of, a sender to its
    peer. Made by `join`."""

    @classmethod
    def join(cls, folder: SnapshotFolder, group: dist.ProcessGroup | None, copies: int = 1) -> "PeerReplica | None":
        """A collective of every rank of `group`: each opens its receiver and learns its peers'
        addresses and the attempt's secret. None on every rank when there is no ring (one node, or
        nodes that run different numbers of ranks)."""
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        if world_size < 2:
            return None
        listener = _open_receiver()  # a rank without one still joins the gather: none waits for ever
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        address = listener.getsockname()[:2] if listener is not None else None
        offer = (*(address or (None, None)), secrets.token_bytes(32) if rank == 0 else None, ranks_per_node)
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, offer, group=group)
        ring = ring_peers(rank, world_size, ranks_per_node, copies)
        if ring is None or any(other[3] != ranks_per_node or other[0] is None for other in everyone):
            if listener is not None:
                listener.close()
            return None
        return cls(folder, rank, ring, listener, everyone[0][2], [everyone[peer][:2] for peer in ring[0]])

    def __init__(self, folder: SnapshotFolder, rank: int, ring: tuple[list[int], list[int]],
                 listener: socket.socket, secret: bytes, peer_addresses: list[tuple[str, int]]) -> None:
        self.folder, self.rank, (sends_to, keeps_for) = folder, rank, ring
        self.keeps_for = set(keeps_for)
        self._listener, self._secret = listener, secret
        self.senders = [PeerSender(rank, peer, address, secret)
                        for peer, address in zip(sends_to, peer_addresses, strict=True)]
        self._receiver_cpu_seconds = 0.0
        self._handshakes = threading.BoundedSemaphore(HANDSHAKES_AT_ONCE)
        threading.Thread(target=self._accept, name="ett-snapshot-peer", daemon=True).start()

    def _proof(self, nonce: bytes, source: int) -> bytes:
        return from_secret(self._secret, PROOF, nonce, source)

    def offer(self, step: int, path: Path) -> None:
        """Hands the snapshot file just written to each peer's sender (ett/snapshots/sender.py)."""
        for sender in self.senders:
            sender.offer(step, path)

    def flush(self, timeout: float) -> bool:
        """Waits, `timeout` seconds at most, until the newest snapshot offered reached every peer."""
        deadline = time.monotonic() + timeout
        return all([sender.flush(max(0.0, deadline - time.monotonic())) for sender in self.senders])

    @property
    def cpu_seconds(self) -> float:
        """The senders' and the receiver's CPU time so far, which the node's steps lose."""
        return self._receiver_cpu_seconds + sum(sender.cpu_seconds for sender in self.senders)

    # -- receiving, in threads of its own -------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            if not self._handshakes.acquire(blocking=False):  # a flood of connections: no thread each
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="ett-snapshot-peer-in", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                proved = self._handshake(conn)
                if proved is None:
                    logger.warning("a connection to the snapshot receiver of rank %d did not prove it is one of "
                                   "ranks %s of this job; closed", self.rank, sorted(self.keeps_for))
                    return
                source, key = proved
                conn.settimeout(TRANSFER_SECONDS)
                chunk = memoryview(bytearray(CHUNK_BYTES))
                while True:
                    try:
                        step, size = MESSAGE.unpack(receive_exactly(conn, MESSAGE.size))
                    except ConnectionError:  # the sender closed between two snapshots
                        return
                    if why := snapshot_mac.refusal(self.folder, self.rank, step, size):
                        logger.warning("rank %d announced a snapshot copy of step %d, %d bytes: refused unread (%s); "
                                       "connection closed", source, step, size, why)
                        conn.sendall(REFUSED)
                        return  # its bytes follow, unread: the connection cannot go on
                    started = time.thread_time()
                    stored = self._store(conn, chunk, key, source, step, size)
                    self._receiver_cpu_seconds += time.thread_time() - started
                    conn.sendall(STORED if stored else REFUSED)
                    if not stored:  # altered on its way, or not from the rank it proved: trusted no more
                        return
            except OSError as error:
                logger.info("snapshot copies to rank %d: a connection ended (%s)", self.rank, error)

    def _handshake(self, conn: socket.socket) -> tuple[int, bytes] | None:
        """The rank the connection proved it is (the one this rank keeps copies for) and the key of
        its messages, else None."""
        try:
            conn.settimeout(HANDSHAKE_SECONDS)
            nonce = secrets.token_bytes(NONCE_BYTES)
            conn.sendall(nonce)
            proof, source = HELLO.unpack(receive_exactly(conn, HELLO.size))
        finally:
            self._handshakes.release()
        if source not in self.keeps_for or not hmac.compare_digest(proof, self._proof(nonce, source)):
            return None
        return source, from_secret(self._secret, STREAM, nonce, source)

    def _store(self, conn: socket.socket, chunk: memoryview, key: bytes, source: int, step: int, size: int) -> bool:
        """Streams one snapshot to disk through `chunk`, a buffer reused for the connection's life,
        hashing it on the way, then reads its MAC; renamed into place, its seal beside it, only
        when its MAC matches, else deleted: False. Its CRC-32 is checked with its seal before any
        restore takes it (ett/snapshots/restore.py): a pass for it here would cost the node's steps
        CPU at every snapshot. Raises when the connection breaks (the partial file goes)."""
        staging = self.folder.staging(step, source, "peer")
        try:
            with open(staging, "wb") as file:
                digest = copy_through(conn.recv_into, file.write, chunk, size)
            if not hmac.compare_digest(receive_exactly(conn, MAC_BYTES),
                                       snapshot_mac.mac(key, step, source, size, digest)):
                logger.warning("the copy of rank %d's snapshot of step %d failed its MAC (altered on its way, or not "
                               "from that rank); discarded, refused, connection closed", source, step)
                return False
            seal_key = snapshot_mac.node_key(self.folder.root)  # read here: a disk's trouble ends a copy, not the rank
            self.folder.place(staging, step, source, snapshot_mac.mac(seal_key, step, source, size, digest))
        finally:
            staging.unlink(missing_ok=True)
        self.folder.prune(source)
        return True

    def close(self) -> None:
        for sender in self.senders:
            sender.close()
        self._listener.close()
