"""What a receiver checks of a peer's snapshot copy: its header before its bytes, its MAC after
them, its seal before a restore takes it: proof that it is the one its rank sent.

Other jobs' processes share the nodes and their network, and a snapshot's header is a pickle: a
copy placed by anyone but the job's rank would run its code at restore. The receiver's handshake
(ett/snapshots/peers.py) proves who opened a connection; the MACs here prove what came over it,
and that what a restore takes is what came.

On the wire. Each message (the step, the size, the file's bytes) ends in
HMAC-SHA256(stream key, step | source rank | size | SHA-256 of the bytes): hash-then-MAC, so the
bytes are hashed once, as they pass, and the one digest serves both MACs below. The stream key is
drawn from the attempt's secret (rank 0's, handed over the process group) and the receiver's
handshake nonce: one key per connection (a message replayed on another connection fails; one
replayed on its own is a copy its rank sent, stored again), apart from the handshake's proof by
its label. The header comes before the MAC can be checked, so it is judged first (`refusal`): a
step not negative, a size of at least a snapshot's and within `size_bound`, and exactly that many
bytes read. The receiver streams the bytes to a staging file, hashing them, and renames the copy
into place only when the MAC matches; else the copy is deleted, refused (never acknowledged as
stored), logged, and the connection closed.

On disk, until the restore. The restore comes in a later attempt, whose secret is new, and the
job hands its ranks no secret that outlives an attempt (JobEnv, ett/protocol, holds none). So the
receiver seals each copy it verified with a key of the node's: HMAC-SHA256(node key, step | whose |
size | the same digest), written beside it (`rank-R.seal`, ett/snapshots/folder.py) before the copy
is renamed into place. The node key is 32 random bytes in the job's node-local snapshots folder
(`copies.key`, 0600), made by the first rank of the node that needs it. That folder is the job's:
the agent makes it per job, 0700, of the owner's uid, keeps it across the job's attempts and
removes it once the job succeeded. So every later attempt on the node has the key, with the copies
it seals, and another owner's job cannot read it. At restore the holder checks a copy's CRC-32 and
its seal in one pass (`verify`) before the copy goes anywhere (ett/snapshots/restore.py); one
without a matching seal is removed as a corrupt one is. A peer's copy is unpickled only at the end
of that chain: its MAC on arrival (the attempt's secret), its seal at restore (the node's key).

What the seal cannot do: the key lies in the folder it guards, so a process that may write there
(the job's own uid: its owner's other jobs, or every job where the operator runs all as one user)
may read it too. The folder's permissions guard the bytes at rest, as they guard the rank's own
snapshots; the seal proves that a copy in the folder is one the receiver verified, so one that
came any other way (from a version without MACs, a receiver's bug, a hand) is never unpickled.

A rank's own snapshots carry no MAC: the rank wrote them into the job's 0700 folder and their bytes
never left the node's processes; a key would lie in the same folder and prove nothing its
permissions do not, and a hash pass per snapshot would cost the steps' CPU budget. A copy fetched
at restore for a lost node's rank (snapshot_restore.fetch) comes, once its holder checked its
seal, over the job's process group, a channel whose collectives already unpickle what they carry
(`all_gather_object`); it becomes that rank's own snapshot.
"""

import hashlib
import hmac
import os
import secrets
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

from ett.snapshots import file_format as snapshot_file
from ett.snapshots.folder import SnapshotFolder

MAC_BYTES = 32  # HMAC-SHA256: after each message's bytes; a seal file's contents
FIELDS = struct.Struct("<qqQ")  # bound into each MAC: the step, the rank whose state it is, the size
PROOF, STREAM = b"ett snapshot proof\0", b"ett snapshot stream\0"  # what a key drawn from the secret is for
KEY_FILE = "copies.key"
# The most a copy may announce (`size_bound`): SIZE_MARGIN times the receiving rank's own newest
# snapshot, SIZE_FLOOR at least, never more than the disk can take beside that rank's next one.
SIZE_MARGIN, SIZE_FLOOR = 4, 64 << 20


def from_secret(secret: bytes, purpose: bytes, nonce: bytes, source: int) -> bytes:
    """HMAC-SHA256 of the attempt's secret over a connection's nonce and its sender's rank: the
    handshake's proof (`PROOF`) or the connection's stream key (`STREAM`), never one for the other."""
    return hmac.new(secret, purpose + nonce + source.to_bytes(8, "little", signed=True), hashlib.sha256).digest()


def mac(key: bytes, step: int, whose: int, size: int, digest: bytes) -> bytes:
    """A snapshot's MAC: its step, whose state it is and its size, and the SHA-256 of its bytes."""
    return hmac.new(key, FIELDS.pack(step, whose, size) + digest, hashlib.sha256).digest()


def refusal(folder: SnapshotFolder, rank: int, step: int, size: int) -> str | None:
    """Why rank `rank`'s receiver refuses a message announcing a copy of `step`, `size` bytes, before
    a byte of it is read (a message's header is not under its MAC until its end), or None."""
    if step < 0:
        return "a negative step"
    if size < snapshot_file.MIN_BYTES:
        return "too small to be a snapshot"
    if size > (bound := size_bound(folder, rank)):
        return f"beyond this receiver's bound of {bound} bytes"
    return None


def size_bound(folder: SnapshotFolder, rank: int) -> int:
    """The most bytes a copy to rank `rank` may announce. Memory is never at stake (a copy streams
    through one buffer, `copy_through`); the node's disk and the receiver's time are. The peer is
    the same local rank of another node, holding the same share of the model and optimizer as this
    rank, give or take a pipeline stage's embedding: SIZE_MARGIN times this rank's own newest
    snapshot covers it, SIZE_FLOOR a small state whose other values weigh. Before this rank has one
    (the first step's copy may come first) only the disk bounds: its free space, less the room this
    rank's own next snapshot needs (the node's own tier comes first)."""
    own = 0
    if steps := folder.steps(rank):
        try:
            own = folder.path(steps[0], rank).stat().st_size
        except FileNotFoundError:  # pruned meanwhile: a newer one is there
            pass
    folder.root.mkdir(parents=True, exist_ok=True)  # where the copy goes, before this rank's first snapshot made it
    room = shutil.disk_usage(folder.root).free - own
    return min(room, max(SIZE_MARGIN * own, SIZE_FLOOR)) if own else room


def copy_through(read_into: Callable[[memoryview], int | None], write: Callable[[memoryview], object],
                 chunk: memoryview, size: int) -> bytes:
    """Moves exactly `size` bytes from `read_into` to `write` through `chunk` (memory bounded by
    it, never by `size`); the SHA-256 of what passed. Raises ConnectionError when cut short."""
    digest = hashlib.sha256()
    while size > 0:
        got = read_into(chunk[: min(len(chunk), size)])
        if not got:
            raise ConnectionError(f"cut short, {size} bytes before its end")
        digest.update(chunk[:got])
        write(chunk[:got])
        size -= got
    return digest.digest()


def node_key(root: Path) -> bytes:
    """The job's key for the seals of the copies its ranks keep on this node, in `root`: made once,
    whole or not at all (linked into place), by whichever rank of the node comes first."""
    path = root / KEY_FILE
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        draft = root / f"{KEY_FILE}.{secrets.token_hex(8)}"
        with open(os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb") as file:
            file.write(secrets.token_bytes(MAC_BYTES))
        try:
            os.link(draft, path)
        except FileExistsError:  # another rank of the node made it meanwhile: its key it is
            pass
        finally:
            draft.unlink()
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as file:
        return file.read()


def verify(folder: SnapshotFolder, step: int, whose: int, sealed: bool) -> str | None:
    """Why the snapshot of rank `whose` at `step` in `folder` must not be loaded, or None: it is
    whole (its CRC-32) and, `sealed` (a peer's copy), its seal matches. One pass over its bytes."""
    path, digest = folder.path(step, whose), hashlib.sha256()
    if (why := snapshot_file.verify(path, digest.update if sealed else None)) or not sealed:
        return why
    try:
        seal = folder.seal(step, whose).read_bytes()
        expected = mac(node_key(folder.root), step, whose, path.stat().st_size, digest.digest())
    except OSError:
        return "it has no seal (no proof that it passed its MAC on arrival)"
    return None if hmac.compare_digest(seal, expected) else "its seal does not match (not the copy that arrived)"
