"""Debian's real Prometheus and Alertmanager on loopback, for the deployment's tests."""

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import yaml

from tests.support.postgres import free_port
from tests.support.waiting import wait_for


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is needed: apt-get install prometheus prometheus-alertmanager (.ci/run does)"
    return path


@contextmanager
def prometheus(config: dict, folder: Path) -> Iterator[str]:
    """A real Prometheus on loopback for the block: its URL."""
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    with _server([tool("prometheus"), f"--config.file={folder / 'prometheus.yml'}",
                  f"--storage.tsdb.path={folder / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                 port, folder / "prometheus.log") as url:
        yield url


@contextmanager
def alertmanager(config: dict, folder: Path) -> Iterator[str]:
    """A real Alertmanager on loopback for the block, clustering off: its URL."""
    (folder / "alertmanager.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    with _server([tool("prometheus-alertmanager"), f"--config.file={folder / 'alertmanager.yml'}",
                  f"--storage.path={folder / 'alertmanager'}", f"--web.listen-address=127.0.0.1:{port}",
                  "--cluster.listen-address="], port, folder / "alertmanager.log") as url:
        yield url


@contextmanager
def _server(argv: list[str], port: int, log_path: Path) -> Iterator[str]:
    log = open(log_path, "wb")
    process = subprocess.Popen([*argv, "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: process.poll() is None and _answers(f"{url}/-/ready"), 30, f"{argv[0]} to be ready",
                 interval=0.2, explain=log_path.read_text)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
