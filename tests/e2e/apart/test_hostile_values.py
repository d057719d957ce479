"""What a job writes is hostile input (#48), the values and names: event values no column holds, file
names that pose as a rank's, module names that act when imported, links where root removes and
moves. Each test is an attack a real job makes on a real root agent (torchrun, the owner's own uid);
after each the agent lives and another owner's job on the same node succeeds. One service and one
agent serve the module."""

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from service.models import Job, RankLog
from tests.support.cluster import Cluster, events
from tests.support.hostile import checkpoint_dir, hostile_node, run, the_agent_lives_and_another_owners_job_succeeds
from tests.support.job_user import open_folder
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="needs an agent started as root")]

HEAD = """
import json, os, sys, time
EV, CK, ATTEMPT = os.environ["ETT_EVENT_DIR"], os.environ["ETT_CHECKPOINT_DIR"], int(os.environ["ETT_ATTEMPT"])
LOGS = os.path.join(os.path.dirname(EV), "logs")
def line(seq, kind="init_start", step=None, **data):
    return json.dumps({"kind": kind, "ts": time.time(), "attempt": ATTEMPT, "source": "rank:0", "seq": seq,
                       "step": step, "data": data})
def wait_end():
    open(os.path.join(CK, "done"), "w").close()
    while not os.path.exists(os.path.join(CK, "end")):
        time.sleep(0.1)
"""
# Values that pass JSON but no column: each alone on its line, then a good event of the job's own.
POISON = HEAD + r"""
bad = [line(1, "step", 1, duration=1e308), line(2, "step", 2, duration=0.5, tokens=10**40),
       line(3, "step", 3, duration=-1.0), line(4, "step", 4, duration=0.5, loss=1e308, s="\ud800"),
       line(6, "step_timing", None, first_step=1, steps=2, duration=float(2**70), work=0.1),
       line(7).replace('"data": {}', '"data": {"ts": NaN}'),
       line(8, "step", 8, duration=0.5).replace("0.5", "Infinity")]
with open(os.path.join(EV, "rank-0.jsonl"), "a") as f:
    f.write("\n".join(bad) + "\n" + line(9, after="the poison") + "\n")
while not os.path.exists(os.path.join(CK, "go")):  # a line past 4 MiB is cut, what was written with it skipped
    time.sleep(0.1)
with open(os.path.join(EV, "rank-0.jsonl"), "a") as f:
    f.write(line(5, "ckpt_failed", 5, error="x" * (10 << 20)) + "\n")
wait_end()
"""
# Files that pose as rank 0's spool or log, or a rank's that is none, beside the real ones.
NAMES = HEAD + """
spools = [b"rank-0.jsonl\\n", b"rank-1.jsonl\\n", b"rank--1.jsonl", b"rank-01.jsonl", b"rank-00.jsonl",
          b"rank-0\\xff.jsonl", "rank-\\u0660.jsonl".encode(), b"rank-+0.jsonl", b"r" * 249 + b".jsonl", b"\\n"]
for i, name in enumerate(spools):
    with open(os.path.join(os.fsencode(EV), name), "w") as f:
        f.write(line(100 + i, posing=repr(name)[:60]) + "\\n")
for name in [b"rank-0.log\\n", b"rank-00.log", b"rank-\\xff.log", b"rank--1.log", b"l" * 251 + b".log"]:
    with open(os.path.join(os.fsencode(LOGS), name), "w") as f:
        f.write("FAKE output of rank 0\\n")
with open(os.path.join(EV, "rank-0.jsonl"), "a") as f:
    f.write(line(0, real=True) + "\\n")
print("rank 0's own words", flush=True)
wait_end()
"""
# A learned list naming modules that act when imported: unittest's __main__ parsed the warm
# server's arguments and ended it, antigravity opens a browser.
HARMFUL = HEAD + """
if ATTEMPT == 0:
    with open(os.path.join(EV, "rank-0.jsonl"), "a") as f:
        f.write(line(0, "step", 1, duration=0.01) + "\\n")
    with open(os.path.join(EV, "imports.json"), "w") as f:
        json.dump({"modules": ["json", "unittest.__main__", "venv.__main__", "antigravity", "this",
                               "idlelib.idle"]}, f)
    time.sleep(2)
    sys.exit(1)
"""
# Links where root removes (events/, the node-local checkpoint folder) and moves (logs/): to a folder
# of root's, at the top and deep; then the job waits for the test's word and ends.
LINKS = HEAD + """
victim = sys.argv[1]
for folder in (EV, LOGS, os.environ["ETT_CHECKPOINT_LOCAL_DIR"]):
    os.symlink(victim, os.path.join(folder, "victim-dir"))
    os.symlink(os.path.join(victim, "keep.txt"), os.path.join(folder, "victim-file"))
    os.makedirs(os.path.join(folder, "sub", "deeper"))
    os.symlink(victim, os.path.join(folder, "sub", "deeper", "victim-dir"))
wait_end()
"""
# The same owner's other job, as the same uid, swaps a folder for a link to the victim, again and
# again, in the first job's folders while root removes or moves them (removed again at each pass
# until it goes: the node-local folder, removed once, is not raced).
RACER = HEAD + """
victim, folders = sys.argv[1], sys.argv[2:]
open(os.path.join(CK, "racing"), "w").close()
deadline, swaps = time.monotonic() + 60, 0
while time.monotonic() < deadline and any(os.path.isdir(f) for f in folders):
    for folder in folders:
        try:
            os.makedirs(os.path.join(folder, "swap", "inner"), exist_ok=True)
            os.rename(os.path.join(folder, "swap"), os.path.join(folder, "old"))
            os.symlink(victim, os.path.join(folder, "swap"))
            os.unlink(os.path.join(folder, "swap"))
            os.rename(os.path.join(folder, "old"), os.path.join(folder, "swap"))
            swaps += 1
        except OSError:
            pass
open(os.path.join(CK, "swaps"), "w").write(str(swaps))
"""


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[Cluster, Path]]:
    """The service and one agent started as root (two slots); the scripts in a folder every user may read."""
    scripts = {"poison.py": POISON, "names.py": NAMES, "harmful.py": HARMFUL, "links.py": LINKS, "racer.py": RACER}
    with hostile_node("ett-values-", scripts, slots=2) as served:
        yield served


def dead_letters(c: Cluster, job_id: str) -> list[dict]:
    path = c.root / "node-a" / "dead-letters.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(text) for text in lines if job_id in text]


@pytest.mark.over_budget("a job, its events one by one through the service's refusals, and another owner's job")
def test_event_values_no_column_holds_are_set_aside_and_hold_up_nothing(node):
    """1e308 seconds, 10**40 tokens, a negative duration, half a UTF-16 pair (which stopped forwarding
    for every job of the node), a 10 MB string, NaN and Infinity: each set aside alone, the job's next
    event stored, another owner's job served."""
    c, python = node
    job_id = run(c, c.user, python, "poison.py")
    wait_for(lambda: [e for e in events(c, job_id, "init_start") if (e.data or {}).get("after")], 60,
             "the job's event after the poison", explain=lambda: c.logs()[-3000:])
    (checkpoint_dir(c, "alice", job_id) / "go").touch()
    wait_for(lambda: (checkpoint_dir(c, "alice", job_id) / "done").exists(), 60, "the 10 MB line written")
    (checkpoint_dir(c, "alice", job_id) / "end").touch()
    assert c.wait_job(job_id, timeout=60)["state"] == "succeeded", c.logs()
    assert events(c, job_id, "step") == [] and events(c, job_id, "step_timing") == []
    letters = wait_for(lambda: found if len(found := dead_letters(c, job_id)) >= 8 else None, 30,
                       "the poison set aside", explain=lambda: repr(dead_letters(c, job_id)))
    errors = " ".join(json.dumps(letter["error"]) for letter in letters)
    # Eight lines; the 10 MB one is two where the agent read it half written (cut, then its rest).
    assert len(letters) in (8, 9) and "less than or equal to 1000000000" in errors, errors
    assert "Traceback" not in (c.root / "node-a.log").read_text(errors="replace")
    the_agent_lives_and_another_owners_job_succeeds(c, python)


def test_files_that_pose_as_a_ranks_spool_or_log_are_not_read(node):
    c, python = node
    job_id = run(c, c.user, python, "names.py")
    wait_for(lambda: (checkpoint_dir(c, "alice", job_id) / "done").exists(), 120, "the names laid")
    wait_for(lambda: "rank 0's own words" in c.user.get(f"/api/v1/jobs/{job_id}/logs", params={"rank": 0})
             .json().get("text", ""), 60, "rank 0's output shipped")  # fmt: skip
    (checkpoint_dir(c, "alice", job_id) / "end").touch()
    assert c.wait_job(job_id, timeout=60)["state"] == "succeeded", c.logs()
    wait_for(lambda: events(c, job_id, "init_start"), 30, "rank 0's event")
    assert [e.data for e in events(c, job_id, "init_start")] == [{"real": True}]
    with c.service.context.sessions() as session:
        logs = session.execute(select(RankLog.rank, RankLog.text).where(RankLog.job_id == job_id)).all()
    assert [rank for rank, _ in logs] == [0] and "FAKE" not in logs[0][1], logs
    the_agent_lives_and_another_owners_job_succeeds(c, python)


@pytest.mark.over_budget("a job of two attempts, the second after a warm server's start, then another owner's job")
def test_a_learned_list_naming_modules_that_act_when_imported_is_no_list(node):
    c, python = node
    job_id = run(c, c.user, python, "harmful.py", max_restarts=1)
    job = c.wait_job(job_id, timeout=180)
    assert job["state"] == "succeeded" and len(job["attempts"]) == 2, job
    with c.service.context.sessions() as session:
        assert not session.scalars(select(Job.learned_imports).where(Job.id == job_id)).one()
    warm_logs = "\n".join(p.read_text(errors="replace") for p in (c.root / "node-a").glob("warm-*.log"))
    assert "usage:" not in warm_logs and "Zen of Python" not in warm_logs, warm_logs[-3000:]
    assert "acts when imported" in (c.root / "node-a.log").read_text(errors="replace")
    the_agent_lives_and_another_owners_job_succeeds(c, python)


@pytest.mark.over_budget("two jobs of one owner, one racing root's clean-up of the other, then another owner's job")
def test_links_where_root_removes_and_moves_a_jobs_folders_lead_nowhere(node):
    c, python = node
    with open_folder("ett-victim-") as victim:
        (victim / "keep.txt").write_text("root's")
        (victim / "keep.txt").chmod(0o644)
        (victim / "sub").mkdir()
        before = sorted((p.relative_to(victim), p.lstat().st_uid, p.lstat().st_mode) for p in victim.rglob("*"))
        job_id = run(c, c.user, python, "links.py", str(victim))
        wait_for(lambda: (checkpoint_dir(c, "alice", job_id) / "done").exists(), 120, "the links laid")
        attempt = c.root / "node-a" / "spool" / job_id / "0"
        c.start_agent("node-b", slots=1, job_python=python)  # a node runs one attempt at a time: the racer's
        racer = run(c, c.user, python, "racer.py", str(victim), str(attempt / "events"), str(attempt / "logs"))
        wait_for(lambda: (checkpoint_dir(c, "alice", racer) / "racing").exists(), 120, "the racer running")
        (checkpoint_dir(c, "alice", job_id) / "end").touch()
        assert c.wait_job(job_id, timeout=60)["state"] == "succeeded", c.logs()
        assert c.wait_job(racer, timeout=120)["state"] == "succeeded", c.logs()
        finished = c.root / "node-a" / "finished" / job_id / "0"
        assert not attempt.exists() and (finished / "logs" / "victim-dir").is_symlink(), c.logs()  # moved, as it was
        assert not (c.root / "node-a" / "checkpoints" / job_id).exists()
        print("swaps while root removed:", (checkpoint_dir(c, "alice", racer) / "swaps").read_text())
        after = sorted((p.relative_to(victim), p.lstat().st_uid, p.lstat().st_mode) for p in victim.rglob("*"))
        assert after == before and (victim / "keep.txt").read_text() == "root's"
        assert victim.stat().st_uid == 0 and victim.stat().st_mode & 0o777 == 0o755
    the_agent_lives_and_another_owners_job_succeeds(c, python)
