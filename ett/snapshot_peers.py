"""The replicated fast tier: each rank's local snapshot also goes to a peer on the next node.

A lost node takes its disk's snapshots with it. With `checkpoint.snapshots` on a job of several
nodes, each rank also sends every snapshot it writes to its peer: the rank of the same local rank
on the next node, in a ring over the nodes (rank r to r + ranks-per-node, modulo the world). The
peer keeps it on its node-local disk, beside its own (ett/snapshot_folder.py): a node holds the
snapshots of its own ranks and those of the node before it, `KEEP` of each.

Off the training process group and the loop: once the rank's snapshot writer thread has written a
snapshot, a sender thread sends that file through one buffer, hashing it on the way, then its MAC,
over a TCP connection of its own, and waits for the peer's word that it is stored. At most one
snapshot per rank is in flight; one written meanwhile waits, and a newer one replaces it (the
local tier never waits for the peer). The peer's receiver thread streams it to disk through one
buffer (bounded memory), and once whole and its MAC matches, renames it into place beside its
seal, then acknowledges; its CRC-32 (the snapshot's trailer, ett/snapshot_file.py) and its seal
are checked before a restore takes it. A peer that cannot be reached is tried again after
`RETRY_SECONDS`; the local tier goes on meanwhile.

Other jobs' processes share the nodes, and a snapshot's header is unpickled on restore: a receiver
takes copies only from its own ring neighbour, over a connection that proved it knows the job's
attempt secret (HMAC-SHA256 of a fresh nonce; the secret is handed to the ranks over their own
process group), and each copy only with its MAC, its header judged before a byte of it is read
(ett/snapshot_mac.py: which keys, where the proof lives until the restore, the size bound). All of
it is per connection and per message: more peers would be more of the same.
"""

import hmac
import logging
import os
import secrets
import socket
import struct
import threading
import time
from pathlib import Path

import torch.distributed as dist

from ett import snapshot_mac
from ett.snapshot_folder import SnapshotFolder
from ett.snapshot_mac import MAC_BYTES, PROOF, STREAM, copy_through, from_secret

logger = logging.getLogger(__name__)

NONCE_BYTES = 16
HELLO = struct.Struct("<32sq")  # snapshot_mac.from_secret(secret, PROOF, nonce, source rank), the source rank
MESSAGE = struct.Struct("<qQ")  # the step, the file's size; then the file's bytes, then their MAC (MAC_BYTES)
STORED, REFUSED = b"\x01", b"\x00"
CHUNK_BYTES = 4 << 20
HANDSHAKE_SECONDS = 5.0
TRANSFER_SECONDS = 60.0  # a peer that takes longer to store a snapshot is skipped until RETRY_SECONDS
RETRY_SECONDS = 30.0
HANDSHAKES_AT_ONCE = 4  # connections not yet proved; more are closed at once


def ring_peers(rank: int, world_size: int, ranks_per_node: int) -> tuple[int, int] | None:
    """(the rank this rank sends its snapshots to, the rank whose snapshots it keeps); None on one
    node, or nodes of unequal sizes."""
    if ranks_per_node < 1 or world_size <= ranks_per_node or world_size % ranks_per_node:
        return None
    return (rank + ranks_per_node) % world_size, (rank - ranks_per_node) % world_size


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


def _receive_exactly(conn: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the connection closed")
        data += chunk
    return bytes(data)


class PeerReplica:
    """One rank's side of the ring: a receiver for the rank it keeps copies of, a sender to its
    peer. Made by `join`."""

    @classmethod
    def join(cls, folder: SnapshotFolder, group: dist.ProcessGroup | None) -> "PeerReplica | None":
        """A collective of every rank of `group`: each opens its receiver and learns its peer's
        address and the attempt's secret. None on every rank when there is no ring (one node, or
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
        ring = ring_peers(rank, world_size, ranks_per_node)
        if ring is None or any(other[3] != ranks_per_node or other[0] is None for other in everyone):
            if listener is not None:
                listener.close()
            return None
        return cls(folder, rank, ring, listener, everyone[0][2], everyone[ring[0]][:2])

    def __init__(self, folder: SnapshotFolder, rank: int, ring: tuple[int, int], listener: socket.socket,
                 secret: bytes, peer_address: tuple[str, int]) -> None:
        self.folder, self.rank, (self.sends_to, self.keeps_for) = folder, rank, ring
        self._listener, self._secret, self._peer_address = listener, secret, peer_address
        self._conn: socket.socket | None = None
        self._stream_key = b""  # the connection's (snapshot_mac.from_secret)
        self._retry_at = 0.0
        self.cpu_seconds = 0.0  # the sender's and receiver's CPU time so far, which the node's steps lose
        self._newest: tuple[int, Path] | None = None  # written, not yet sent
        self._sending = self._closed = False
        self._wake = threading.Condition()
        self._handshakes = threading.BoundedSemaphore(HANDSHAKES_AT_ONCE)
        threading.Thread(target=self._accept, name="ett-snapshot-peer", daemon=True).start()
        threading.Thread(target=self._send_newest, name="ett-snapshot-peer-out", daemon=True).start()

    def _proof(self, nonce: bytes, source: int) -> bytes:
        return from_secret(self._secret, PROOF, nonce, source)

    # -- sending, in a thread of its own ----------------------------------------------------------
    def offer(self, step: int, path: Path) -> None:
        """Hands the snapshot file just written to the sender thread. One is in flight at a time;
        a newer snapshot replaces one still waiting, so a slow peer costs the copies' freshness,
        never the loop's time (the local write never waits for the peer)."""
        with self._wake:
            self._newest = (step, path)
            self._wake.notify_all()

    def flush(self, timeout: float) -> bool:
        """Waits, `timeout` seconds at most, until the newest snapshot offered has been sent."""
        with self._wake:
            return self._wake.wait_for(lambda: self._newest is None and not self._sending, timeout)

    def _send_newest(self) -> None:
        chunk = memoryview(bytearray(CHUNK_BYTES))  # the buffer each file passes through
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._newest is not None or self._closed)
                if self._closed:
                    break
                (step, path), self._newest, self._sending = self._newest, None, True
            started = time.thread_time()
            self._send(step, path, chunk)
            self.cpu_seconds += time.thread_time() - started
            with self._wake:
                self._sending = False
                self._wake.notify_all()
        self._drop_connection()

    def _send(self, step: int, path: Path, chunk: memoryview) -> bool:
        """Sends the snapshot file of `step` to the peer through `chunk`, then its MAC; True once
        the peer stored it whole."""
        if time.monotonic() < self._retry_at:
            return False
        try:
            file = open(path, "rb")  # noqa: SIM115 (open, it stays readable even if pruned meanwhile)
        except FileNotFoundError:  # pruned before its turn: a newer one is on its way
            return False
        try:
            with file:
                conn, size = self._conn or self._connect(), os.fstat(file.fileno()).st_size
                conn.sendall(MESSAGE.pack(step, size))
                # Read to be hashed, and sent from the same buffer: one pass (sendfile would need a second).
                digest = copy_through(file.readinto, conn.sendall, chunk, size)
                conn.sendall(snapshot_mac.mac(self._stream_key, step, self.rank, size, digest))
            if _receive_exactly(conn, 1) != STORED:
                raise ConnectionError("it refused the copy (see its log)")
            return True
        except OSError as error:
            logger.warning("snapshot of step %d not replicated to rank %d at %s:%d: %s; trying again in %.0f s",
                           step, self.sends_to, *self._peer_address, error, RETRY_SECONDS)
            self._drop_connection()
            self._retry_at = time.monotonic() + RETRY_SECONDS
            return False

    def _connect(self) -> socket.socket:
        conn = socket.create_connection(self._peer_address, timeout=HANDSHAKE_SECONDS)
        try:
            nonce = _receive_exactly(conn, NONCE_BYTES)
            conn.sendall(HELLO.pack(self._proof(nonce, self.rank), self.rank))
            conn.settimeout(TRANSFER_SECONDS)
        except OSError:
            conn.close()
            raise
        self._conn, self._stream_key = conn, from_secret(self._secret, STREAM, nonce, self.rank)
        return conn

    def _drop_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

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
                    logger.warning("a connection to the snapshot receiver of rank %d did not prove it is rank %d "
                                   "of this job; closed", self.rank, self.keeps_for)
                    return
                source, key = proved
                conn.settimeout(TRANSFER_SECONDS)
                chunk = memoryview(bytearray(CHUNK_BYTES))
                while True:
                    try:
                        step, size = MESSAGE.unpack(_receive_exactly(conn, MESSAGE.size))
                    except ConnectionError:  # the sender closed between two snapshots
                        return
                    if why := snapshot_mac.refusal(self.folder, self.rank, step, size):
                        logger.warning("rank %d announced a snapshot copy of step %d, %d bytes: refused unread (%s); "
                                       "connection closed", source, step, size, why)
                        conn.sendall(REFUSED)
                        return  # its bytes follow, unread: the connection cannot go on
                    started = time.thread_time()
                    stored = self._store(conn, chunk, key, source, step, size)
                    self.cpu_seconds += time.thread_time() - started
                    conn.sendall(STORED if stored else REFUSED)
                    if not stored:  # altered on its way, or not from the rank it proved: trusted no more
                        return
            except OSError as error:
                logger.info("snapshot copies from rank %d: connection ended (%s)", self.keeps_for, error)

    def _handshake(self, conn: socket.socket) -> tuple[int, bytes] | None:
        """The rank the connection proved it is (the one this rank keeps copies for) and the key of
        its messages, else None."""
        try:
            conn.settimeout(HANDSHAKE_SECONDS)
            nonce = secrets.token_bytes(NONCE_BYTES)
            conn.sendall(nonce)
            proof, source = HELLO.unpack(_receive_exactly(conn, HELLO.size))
        finally:
            self._handshakes.release()
        if source != self.keeps_for or not hmac.compare_digest(proof, self._proof(nonce, source)):
            return None
        return source, from_secret(self._secret, STREAM, nonce, source)

    def _store(self, conn: socket.socket, chunk: memoryview, key: bytes, source: int, step: int, size: int) -> bool:
        """Streams one snapshot to disk through `chunk`, a buffer reused for the connection's life,
        hashing it on the way, then reads its MAC; renamed into place, its seal beside it, only
        when its MAC matches, else deleted: False. Its CRC-32 is checked with its seal before any
        restore takes it (ett/snapshot_restore.py): a pass for it here would cost the node's steps
        CPU at every snapshot. Raises when the connection breaks (the partial file goes)."""
        staging = self.folder.staging(step, source, "peer")
        try:
            with open(staging, "wb") as file:
                digest = copy_through(conn.recv_into, file.write, chunk, size)
            if not hmac.compare_digest(_receive_exactly(conn, MAC_BYTES),
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
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._listener.close()
