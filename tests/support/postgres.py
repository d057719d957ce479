"""A throwaway PostgreSQL server: initdb into a temporary folder, pg_ctl on loopback, stop at the end."""

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support.processes import TEST_MARK_ENV


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _as_postgres(argv: list[str]) -> list[str]:
    # PostgreSQL refuses to run as root; CI and these machines run tests as root.
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *argv]
    return argv


@dataclass
class PostgresServer:
    """A running server: its URL, and a stop and start for tests of the service's outages."""

    url: str
    data: Path
    options: str
    log: Path
    env: dict[str, str]

    def _ctl(self, *argv: str) -> None:
        subprocess.run(_as_postgres(["pg_ctl", "-D", str(self.data), *argv]), check=True, capture_output=True,
                       env=self.env)

    def stop(self) -> None:
        self._ctl("-m", "fast", "-w", "stop")

    def start(self) -> None:
        self._ctl("-o", self.options, "-l", str(self.log), "-w", "start")


@contextmanager
def postgres_instance(database: str = "ett") -> Iterator[PostgresServer]:
    """A fresh database on a server that lives for the block (or until stopped)."""
    if shutil.which("initdb") is None:
        raise RuntimeError("initdb not found: install PostgreSQL (apt-get install postgresql)")
    root = Path(tempfile.mkdtemp(prefix="ett-pg-"))
    data, port = root / "data", free_port()
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
    # The server outlives the test that first asks for it: not one of that test's processes.
    env = {k: v for k, v in os.environ.items() if k != TEST_MARK_ENV}
    run = lambda argv: subprocess.run(_as_postgres(argv), check=True, capture_output=True, env=env)  # noqa: E731
    try:
        run(["initdb", "-D", str(data), "-U", "ett", "--auth=trust", "-E", "UTF8", "--no-sync"])
        # fsync off: a test database need not survive a power cut, and it is much faster. A new
        # cluster makes a new 16 MB WAL file whenever it fills one (a long-running one recycles
        # old ones); zero-filling it stalled every commit for 40 ms or more in the load bench.
        options = (f"-h 127.0.0.1 -p {port} -k {root} -c fsync=off -c full_page_writes=off -c wal_init_zero=off "
                   "-c max_connections=200")  # fmt: skip
        server = PostgresServer(f"postgresql+psycopg://ett@127.0.0.1:{port}/{database}", data, options, root / "log", env)
        server.start()
        run(["psql", "-h", "127.0.0.1", "-p", str(port), "-U", "ett", "-d", "postgres", "-c",
             f"CREATE DATABASE {database}"])
        yield server
    finally:
        subprocess.run(_as_postgres(["pg_ctl", "-D", str(data), "-m", "immediate", "stop"]), capture_output=True, env=env)
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def postgres_server(database: str = "ett") -> Iterator[str]:
    """Yields a SQLAlchemy URL of a fresh database on a server that lives for the block."""
    with postgres_instance(database) as server:
        yield server.url
