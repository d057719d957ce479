"""A rank's output on its node: rotated at its bound whatever the rank prints, its job's secrets
blanked however they are printed, and shipped to the service piece by piece, a rotation's rest
included, nothing lost across an agent restart."""

import array
import fcntl
import json
import os
import random
import subprocess
import sys
import termios

import httpx
import pytest

from agent.forwarding.log_shipper import PIECE_BYTES, LogShipper
from agent.files.spool import AttemptPaths
from agent.launching.rank_log import PipeCopier, RotatingLog
from ett.protocol import LOGS_DIR, rank_log
from ett.protocol.messages import LaunchCommand
from ett.protocol.redaction import REDACTED, Redactor, redact
from tests.support.waiting import wait_for


def test_a_rank_that_prints_without_end_keeps_at_most_twice_the_bound(tmp_path):
    read_fd, write_fd = os.pipe()
    path = tmp_path / rank_log(0)
    copying = PipeCopier(read_fd, RotatingLog(str(path), max_bytes=100_000))
    line = b"y" * 99 + b"\n"
    for i in range(20_000):  # 2 MB
        os.write(write_fd, b"%08d" % i + line[8:])
    os.close(write_fd)
    copying.join(10)
    sizes = [path.stat().st_size, path.with_name(rank_log(0) + ".1").stat().st_size]
    assert all(size <= 100_000 + 65536 for size in sizes) and sum(sizes) <= 2 * (100_000 + 65536)
    assert path.read_bytes().endswith(b"%08d" % 19_999 + line[8:])  # the newest output is kept
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_caught_up_means_what_the_pipe_held_is_in_the_log_though_a_child_still_holds_it(tmp_path):
    """The runner's question once its rank has exited: the rank's last words are copied, and a
    child of the rank that keeps the pipe open (a data loader's worker, a checkpoint process) is not
    waited for; what the child writes later is still copied until it lets go."""
    read_fd, write_fd = os.pipe()
    path = tmp_path / rank_log(0)
    copying = PipeCopier(read_fd, RotatingLog(str(path)))
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read(); print('the child, late')"],
                             stdin=subprocess.PIPE, stdout=write_fd)  # holds the pipe until told
    last_words = b"x" * 50_000 + b"\nMemoryError\n"
    os.write(write_fd, last_words)
    os.close(write_fd)  # the rank exits
    assert copying.caught_up(timeout=30)
    assert path.read_bytes() == last_words and child.poll() is None
    child.communicate(b"")  # the child writes its line and exits
    copying.join(30)
    assert path.read_bytes() == last_words + b"the child, late\n"


def unread(fd: int) -> int:
    """Bytes waiting in the pipe `fd` reads (FIONREAD)."""
    count = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, count)
    return count[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small file system")
def test_a_full_disk_loses_the_ranks_output_not_the_rank(tmp_path):
    """The log's disk fills up: the copy goes on reading the pipe (a pipe nobody reads would stop the
    rank at its next print, a closed one end it), and writes again once there is room."""
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], check=True)
    try:
        read_fd, write_fd = os.pipe()
        path, printed = small / rank_log(0), tmp_path / "printed"
        copying = PipeCopier(read_fd, RotatingLog(str(path), max_bytes=1 << 20))
        rank = subprocess.Popen([sys.executable, "-c", "import sys\nfor i in range(20_000): print('x' * 99)\n"
                                 f"sys.stdout.flush(); open({str(printed)!r}, 'w').close()\n"
                                 "sys.stdin.read(); print('room again')"],
                                stdin=subprocess.PIPE, stdout=write_fd)  # 2 MB, then a line once told
        os.close(write_fd)
        wait_for(printed.exists, 60, "the rank to print its 2 MB")
        # Its last lines may still be in the pipe: read by the copy (and lost to the full disk) first.
        wait_for(lambda: unread(read_fd) == 0, 60, "the copy to read what the rank printed")
        assert path.stat().st_size <= 64 << 10
        os.truncate(path, 0)  # room again
        rank.communicate(b"")
        copying.join(30)
        assert rank.returncode == 0
        # A chunk the copy held as the room came back may land first: lines of x, never the rank's end.
        logged = path.read_bytes()
        assert logged.endswith(b"room again\n") and set(logged[:-len(b"room again\n")]) <= set(b"x\n")
    finally:
        subprocess.run(["umount", str(small)], check=False)


class Service:
    """The logs endpoint's answers, recorded (the service's own side is tests/service/api/test_logs_api.py)."""

    def __init__(self) -> None:
        self.pieces: list[dict] = []
        self.status = 200

    def __call__(self, pieces: list[dict]) -> httpx.Response:
        if self.status == 200:
            self.pieces += pieces
        return httpx.Response(self.status, json={})


def test_shipping_sends_each_byte_once_through_rotation_outage_and_restart(tmp_path):
    logs = tmp_path / "spool" / "job" / "0" / LOGS_DIR
    logs.mkdir(parents=True)
    log = RotatingLog(str(logs / rank_log(3)), max_bytes=1000)
    service = Service()
    shipper = LogShipper(tmp_path / "spool", tmp_path, service)
    written = b""
    for i in range(30):
        chunk = f"line {i}\n".encode() * 10  # 70-80 bytes
        log.write(chunk)
        written += chunk
        if i % 4 == 0:
            assert shipper.ship_once()
        if i == 13:
            service.status = 503  # down: nothing moves
            assert not shipper.ship_once()
            service.status = 200
        if i == 20:
            shipper = LogShipper(tmp_path / "spool", tmp_path, service)  # a restarted agent
    assert shipper.ship_once()
    received = "".join(p["text"] for p in service.pieces)
    assert received == written.decode() and {(p["job_id"], p["attempt"], p["rank"]) for p in service.pieces} == {
        ("job", 0, 3)}
    assert shipper.shipped(tmp_path / "spool" / "job" / "0")
    assert json.loads((tmp_path / "log-positions.json").read_text())


def test_a_rank_printing_faster_than_shipping_has_its_middle_skipped_and_counted(tmp_path):
    logs = tmp_path / "spool" / "job" / "0" / LOGS_DIR
    logs.mkdir(parents=True)
    (logs / rank_log(0)).write_bytes(b"a" * (PIECE_BYTES * 3))
    (logs / rank_log(1)).symlink_to("/etc/passwd")  # the job's folder: a link is not read
    service = Service()
    assert LogShipper(tmp_path / "spool", tmp_path, service).ship_once()
    [piece] = service.pieces
    assert piece["skipped"] == PIECE_BYTES * 2 and len(piece["text"]) == PIECE_BYTES


def test_a_refused_jobs_output_never_takes_another_jobs_with_it_and_a_429_keeps_it_for_later(tmp_path):
    """A job lays `rank-999999.log` (the service refuses a rank beyond the attempt's world with a
    422): the other job's output on the node is shipped all the same. Told to slow down (429), the
    shipper keeps every byte for its next round."""
    for job, rank in (("bad", 999999), ("good", 0)):
        logs = tmp_path / "spool" / job / "0" / LOGS_DIR
        logs.mkdir(parents=True)
        (logs / rank_log(rank)).write_text(f"{job} says hello\n")

    class Refusing(Service):
        def __call__(self, pieces: list[dict]) -> httpx.Response:
            if self.status == 200 and any(p["rank"] >= 16 for p in pieces):
                return httpx.Response(422, json={"detail": "logs.0.rank: beyond the attempt's world"})
            return super().__call__(pieces)

    service = Refusing()
    shipper = LogShipper(tmp_path / "spool", tmp_path, service)
    service.status = 429
    assert not shipper.ship_once() and service.pieces == []
    service.status = 200
    assert shipper.ship_once()
    assert [(p["job_id"], p["text"]) for p in service.pieces] == [("good", "good says hello\n")]
    assert shipper.shipped(tmp_path / "spool" / "good" / "0")


# A rank prints its secret in two writes with a flush and a pause between them (the shipper ships
# meanwhile), then once more whole. A variable too short to be a secret is left alone.
SPLIT_SECRET = """
import os, sys, time
key = os.environ["WANDB_API_KEY"]
sys.stdout.write("starting\\nkey " + key[:7]); sys.stdout.flush()
sys.stdin.readline()  # the shipper has shipped what came so far
sys.stdout.write(key[7:] + " in two writes\\nkey " + key + " whole, gpu " + os.environ["GPU"] + "\\n")
"""


def test_a_secret_printed_in_two_writes_is_blanked_on_the_node_across_the_pieces_shipped(tmp_path):
    logs = tmp_path / "spool" / "job" / "0" / LOGS_DIR
    logs.mkdir(parents=True)
    env = {"WANDB_API_KEY": "s3cr3t-key-123", "GPU": "a10"}
    read_fd, write_fd = os.pipe()
    copying = PipeCopier(read_fd, RotatingLog(str(logs / rank_log(0))), env.values())
    rank = subprocess.Popen([sys.executable, "-c", SPLIT_SECRET], stdin=subprocess.PIPE, stdout=write_fd,
                            env=os.environ | env)  # fmt: skip
    os.close(write_fd)
    service = Service()
    shipper = LogShipper(tmp_path / "spool", tmp_path, service)
    wait_for(lambda: shipper.ship_once() and "".join(p["text"] for p in service.pieces) == "starting\nkey ", 30,
             "the rank's first write to be shipped, the secret's start kept back")  # fmt: skip
    rank.communicate(b"go on\n", timeout=30)
    copying.join(30)
    assert shipper.ship_once() and len(service.pieces) == 2
    assert service.pieces[1]["text"] == "[redacted] in two writes\nkey [redacted] whole, gpu a10\n"
    shipped = "".join(p["text"] for p in service.pieces) + (logs / rank_log(0)).read_text()
    assert "s3cr3t-" not in shipped and "key-123" not in shipped  # nor on the node


@pytest.mark.parametrize("seed", range(20))
def test_blanking_output_read_in_pieces_gives_what_blanking_it_whole_gives(seed):
    """However the reads cut the output (inside a secret, inside a character), the node blanks what
    the service's rule blanks in the whole text: secrets that begin alike, or one inside another."""
    values = ["hunter22", "hunter22-and-more", "clé-sécrète", "abcabd", "no"]
    whole = "x hunter22 y hunter22-and-more z clé-sécrète abcabcabd hunter2 abcab\n" * 3
    data = whole.encode()
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(data)), 12))
    redactor = Redactor(values)
    out = b"".join(redactor.feed(data[a:b]) for a, b in zip([0, *cuts], [*cuts, len(data)])) + redactor.flush()
    assert out.decode() == redact(whole, values)
    assert "hunter22" not in out.decode() and out.decode().count(REDACTED) == 12


def launch(job_id: str, nproc: int, env: dict[str, str]) -> LaunchCommand:
    return LaunchCommand(type="launch", job_id=job_id, attempt=0, node_rank=0, nnodes=1, nproc_per_node=nproc,
                         master_addr="127.0.0.1", master_port=29500, entrypoint=["python"], env=env)


def test_a_secret_a_rank_writes_into_its_own_log_in_two_pieces_is_blanked_before_shipping(tmp_path):
    """A rank may write its log file itself, past its runner's blanking: the shipper blanks it
    again, and keeps back what may begin a secret until the rest is written or the attempt ends."""
    paths = AttemptPaths.of(tmp_path / "spool", "job", 0)
    paths.logs_dir.mkdir(parents=True)
    service = Service()
    shipper = LogShipper(tmp_path / "spool", tmp_path, service)
    shipper.launches.know(launch("job", 2, {"API_KEY": "echoo-s3cr3t-E5", "GPU": "a10"}))
    own = paths.logs_dir / rank_log(1)
    with open(own, "ab", buffering=0) as f:
        f.write(b"E echoo-s3")
        assert shipper.ship_once() and [p["text"] for p in service.pieces] == ["E "]  # the rest kept back
        assert shipper.ship_once() and len(service.pieces) == 1  # nothing new: nothing sent
        f.write(b"cr3t-E5 then a10\nlast words: echoo-\x00s3cr")  # a NUL inside: the secret all the same
        assert shipper.ship_once() and service.pieces[1]["text"] == f"{REDACTED} then a10\nlast words: "
        paths.ended_marker.write_text("succeeded")  # no more will come: its end is shipped as it is
        assert shipper.ship_once() and service.pieces[2]["text"] == "echoo-\x00s3cr"
    assert shipper.shipped(paths.root)
    shipped = "".join(p["text"] for p in service.pieces)
    assert "echoo-s3cr3t-E5" not in shipped.replace("\x00", "") and shipped.count(REDACTED) == 1


def test_the_log_of_a_rank_beyond_the_attempts_world_is_not_read_nor_holds_its_spool(tmp_path):
    paths = AttemptPaths.of(tmp_path / "spool", "job", 0)
    paths.logs_dir.mkdir(parents=True)
    service = Service()
    shipper = LogShipper(tmp_path / "spool", tmp_path, service)
    shipper.launches.know(launch("job", 2, {}))
    for rank in (0, 2, 999_999):
        (paths.logs_dir / rank_log(rank)).write_text(f"rank {rank} says\n")
    (paths.logs_dir / "rank-00.log").write_text("rank 0 again?\n")
    assert shipper.ship_once()
    assert [(p["rank"], p["text"]) for p in service.pieces] == [(0, "rank 0 says\n")]
    assert shipper.shipped(paths.root)
