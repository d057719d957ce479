"""One rank's copies to one peer (ett/snapshots/peers.py): the wire's messages, and the sender.

A sender thread of its own sends each snapshot file it is offered through one buffer, hashing it
on the way, then its MAC (ett/snapshots/mac.py), over a TCP connection of its own, and waits for
the peer's word that it is stored. At most one snapshot is in flight; one written meanwhile
waits, and a newer one replaces it (the local tier never waits for the peer). A peer that cannot
be reached is tried again after `RETRY_SECONDS`. With several copies of each snapshot
(`checkpoint.snapshot_copies`), a rank has one sender per peer, each at its own pace.
"""

import logging
import os
import socket
import struct
import threading
import time
from pathlib import Path

from ett.snapshots import mac as snapshot_mac
from ett.snapshots.mac import PROOF, STREAM, copy_through, from_secret

logger = logging.getLogger(__name__)

NONCE_BYTES = 16
HELLO = struct.Struct("<32sq")  # snapshot_mac.from_secret(secret, PROOF, nonce, source rank), the source rank
MESSAGE = struct.Struct("<qQ")  # the step, the file's size; then the file's bytes, then their MAC (MAC_BYTES)
STORED, REFUSED = b"\x01", b"\x00"
CHUNK_BYTES = 4 << 20
HANDSHAKE_SECONDS = 5.0
TRANSFER_SECONDS = 60.0  # a peer that takes longer to store a snapshot is skipped until RETRY_SECONDS
RETRY_SECONDS = 30.0


def receive_exactly(conn: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the connection closed")
        data += chunk
    return bytes(data)


class PeerSender:
    """Sends rank `rank`'s snapshots to the peer rank `sends_to` at `address`, in a thread of its own."""

    def __init__(self, rank: int, sends_to: int, address: tuple[str, int], secret: bytes) -> None:
        self.rank, self.sends_to, self._peer_address, self._secret = rank, sends_to, address, secret
        self._conn: socket.socket | None = None
        self._stream_key = b""  # the connection's (snapshot_mac.from_secret)
        self._retry_at = 0.0
        self.cpu_seconds = 0.0  # the thread's CPU time so far, which the node's steps lose
        self._newest: tuple[int, Path] | None = None  # written, not yet sent
        self._sending = self._closed = False
        self._wake = threading.Condition()
        threading.Thread(target=self._send_newest, name="ett-snapshot-peer-out", daemon=True).start()

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

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()

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
            if receive_exactly(conn, 1) != STORED:
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
            nonce = receive_exactly(conn, NONCE_BYTES)
            conn.sendall(HELLO.pack(from_secret(self._secret, PROOF, nonce, self.rank), self.rank))
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
