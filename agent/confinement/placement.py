"""Root moves a warm-forked process into its attempt's cgroup; the job's user moves nothing.

A process the warm server (agent.warm.server) forks is born in its user's `warm/` cgroup and must
run in its attempt's. Under cgroup v2 a user may move a process between two cgroups only if it may
write `cgroup.procs` of their common ancestor, `owner-UID`: and whoever may write that may also move
any process of its own out of its attempt, into `owner-UID`, `warm/` or another attempt, and outlive
the attempt's end. So, as slurmstepd does, root does the moving: the forked process, before a line
of the job runs, asks the agent over a socket (SOCK_SEQPACKET, root's, in a folder of the agent's)
to be placed; the agent believes only the kernel (the caller's pid and uid from SO_PEERCRED, its
cgroup from /proc) and moves it only out of that uid's `warm/` into a live attempt of that uid
(NodeCgroups.place). The job's user writes no `cgroup.procs` at all.

A round trip on the node (a millisecond) per forked process: a warm restart keeps its speed.
The server never blocks on a caller: connections are read when readable, at most
MAX_CONNECTIONS_PER_UID open per uid and each closed after IDLE_SECONDS, so one job cannot make
another owner's ranks wait. What it refuses is logged once an interval per uid, then
counted (agent.files.log_limit): a job that asks in a loop does not fill root's log (4 MB in 15 s, found by
review).
"""

import contextlib
import json
import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from agent.files.log_limit import LogLimit

log = logging.getLogger(__name__)
PLACED = b"placed"
MAX_REQUEST_BYTES = 4096
MAX_CONNECTIONS_PER_UID = 64
IDLE_SECONDS = 5.0
ASK_TIMEOUT_SECONDS = 10.0


class PlacementRefused(Exception):
    """Why a process is not moved: said to the caller."""


def ask_to_be_placed(placer: str, cgroup: str, timeout: float = ASK_TIMEOUT_SECONDS) -> None:
    """Asks the agent at `placer` to move this process into `cgroup`; OSError when it does not."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
        conn.settimeout(timeout)
        conn.connect(placer)
        conn.sendall(json.dumps({"cgroup": cgroup}).encode())
        answer = conn.recv(MAX_REQUEST_BYTES)
    if answer != PLACED:
        raise PermissionError(f"the agent did not move it into {cgroup}: {answer.decode(errors='replace')}")


class Placer:
    """The agent's side: a thread serving `socket_path`, `place(pid, uid, cgroup)` doing each move
    (PlacementRefused: why not)."""

    def __init__(self, socket_path: Path, place: Callable[[int, int, str], None]) -> None:
        self.socket_path, self._place = socket_path, place
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        socket_path.unlink(missing_ok=True)  # a predecessor's: its folder is the agent's alone
        self._listener.bind(str(socket_path))
        os.chmod(socket_path, 0o666)  # every job's user asks; the answer is the kernel's word, not theirs
        self._listener.listen(256)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._open: dict[socket.socket, tuple[int, float]] = {}  # each connection's uid and deadline
        self._warnings = LogLimit(log)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="cgroup-placer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closing.set()
        self._thread.join(timeout=5.0)
        self.socket_path.unlink(missing_ok=True)

    def _serve(self) -> None:
        try:
            while not self._closing.is_set():
                try:
                    self._serve_once()
                except Exception:  # never the end of placing for every job
                    log.exception("cgroup placer")
                    time.sleep(0.1)
        finally:
            for conn in list(self._open):
                self._drop(conn)
            self._selector.close()
            self._listener.close()

    def _serve_once(self) -> None:
        for key, _ in self._selector.select(timeout=0.2):
            if key.fileobj is self._listener:
                self._accept()
            else:
                self._answer(key.fileobj)  # type: ignore[arg-type]
        now = time.monotonic()
        for conn in [c for c, (_, deadline) in self._open.items() if deadline < now]:
            self._drop(conn)
        self._warnings.flush(now)

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # out of descriptors, say: the callers wait, and are told when they time out
            self._warnings.warn("accepting", "cgroup placer: %s", exc)
            time.sleep(0.1)
            return
        try:
            _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if sum(1 for u, _ in self._open.values() if u == uid) >= MAX_CONNECTIONS_PER_UID:
                conn.close()  # that user's own processes wait, no one else's
                return
            conn.setblocking(False)
            self._selector.register(conn, selectors.EVENT_READ)
            self._open[conn] = (uid, time.monotonic() + IDLE_SECONDS)
        except OSError:
            conn.close()

    def _answer(self, conn: socket.socket) -> None:
        try:
            pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            request = conn.recv(MAX_REQUEST_BYTES)
            if not request:
                return
            try:
                cgroup = json.loads(request)["cgroup"]
                if not isinstance(cgroup, str):
                    raise PlacementRefused("no cgroup named")
                self._place(pid, uid, cgroup)
                answer = PLACED
            except (ValueError, KeyError, TypeError, RecursionError) as exc:
                answer = f"refused: not a request ({type(exc).__name__})".encode()
            except PlacementRefused as exc:
                self._warnings.warn(f"uid {uid}", "process %d (uid %d) not moved into %s: %s", pid, uid,
                                    str(cgroup)[:200], exc)
                answer = f"refused: {exc}".encode()
            conn.send(answer[:MAX_REQUEST_BYTES])
        except OSError:
            pass  # the caller went: nothing to answer
        finally:
            self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        self._open.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        conn.close()
