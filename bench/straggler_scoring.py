"""Straggler scoring a pass (issue #50 item 5): what the straggler watch costs the service's clock
at 2,048 and 16,384 ranks, against the rule it replaced.

A migrated database (SQLite in a temporary folder; PostgreSQL with `--backend postgresql`, a
server of its own) holds one running attempt of `--ranks` ranks, rank 1 three times slower. Each
round stores one new window of every rank's `step_timing` (not timed), and times a pass of the
watch (service/stragglers/watch.py: its read of what arrived and the scoring; the pass after the
one that finds rank 1 a straggler records its flag) until the window is scored (a pass reads for
PASS_SECONDS at most: a big window takes several), then a pass with nothing new. The rule before
(the newest 60 steps read back and each rank compared with a median of its peers, in the
scheduler's transaction) is timed on the same windows with `--before`. Each pass's CPU time (its
thread's) is given beside its wall time: on a loaded machine the wall time holds other processes'
turns on the cores, the CPU time only the pass's own work; so are the collector's pauses in passes.

    .venv/bin/python bench/straggler_scoring.py --ranks 2048 16384 --windows 8 --before 2048
"""

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.support

from sqlalchemy import insert, select  # noqa: E402

from service.db import make_engine, make_session_factory  # noqa: E402
from service.migrate import upgrade  # noqa: E402
from service.models import Attempt, AttemptNode, AttemptState, Job, JobEvent, Node, Role, Token  # noqa: E402
from service.settings import Settings  # noqa: E402
from service.stragglers.scoring import LOOKBACK_STEPS, STEP_SHARE, RELATIVE_LIMIT, Timing  # noqa: E402
from service.stragglers.watch import Watch, read_timings  # noqa: E402
from tests.service.factories import job_spec  # noqa: E402


def setup(sessions, ranks: int) -> tuple[str, int]:
    """A running attempt of `ranks` ranks, 8 to a node; (its job, its attempt's id)."""
    with sessions() as s:
        token = Token(subject="bench", role=Role.agent, token_hash=f"bench-{ranks}")
        s.add(token)
        s.flush()
        job = Job(id=f"bench{ranks}", name="bench", owner="bench",
                  spec=job_spec(nodes=ranks // 8, procs_per_node=8, stragglers="report"))
        attempt = Attempt(job=job, number=0, master_addr="10.0.0.1", master_port=29500, state=AttemptState.running)
        for i in range(ranks // 8):
            node = Node(name=f"n{ranks}-{i}", address="10.0.0.1", slots=8, token_id=token.id)
            attempt.nodes.append(AttemptNode(node=node, node_rank=i, state=AttemptState.running))
        s.add_all([job, attempt])
        s.commit()
        return job.id, attempt.id


def store_window(sessions, job_id: str, step: int, ranks: range) -> None:
    rows = [{"job_id": job_id, "attempt": 0, "source": f"rank:{r}", "seq": step, "kind": "step_timing",
             "ts": 1.7e9 + step, "step": step, "clock_offset_seconds": 0.0,
             "data": {"steps": 5, "duration": 0.4, "work": 0.3 if r == 1 else 0.1 + 0.001 * (r % 7),
                      "work_low": 0.29 if r == 1 else 0.1, "total_steps": 10_000}} for r in ranks]  # fmt: skip
    with sessions() as s:
        s.execute(insert(JobEvent), rows)
        s.commit()


def rule_before(timings: list[Timing], world: int) -> list[int]:
    """The rule as it was (service/jobs/stragglers.py before issue #50): each rank of each complete
    window, newest first while it is slow, against a median of its peers taken anew: O(world^2)."""
    windows: dict[int, dict[int, Timing]] = {}
    for t in timings:
        windows.setdefault(t.step, {})[t.rank] = t
    complete = [windows[s] for s in sorted(windows) if len(windows[s]) == world]
    found = []
    for rank in range(world):
        for window in reversed(complete):
            mine, step = window[rank], statistics.median(t.duration for t in window.values())
            peer = statistics.median(t.value for r, t in window.items() if r != rank)
            if mine.value - peer < STEP_SHARE * step or mine.value < RELATIVE_LIMIT * peer:
                break  # as it was: the second-lowest work's median only for a rank slow by the first
            low = statistics.median(t.steady for r, t in window.items() if r != rank)
            if mine.steady - low < STEP_SHARE * step or mine.steady < RELATIVE_LIMIT * low:
                break
            found.append(rank)
    return found


CPU: dict[str, list[float]] = {}  # each timed thing's CPU seconds, beside its wall seconds
PAUSES: list[float] = []  # the collector's pauses in the timed passes


def timed(fn, name: str = "") -> tuple[float, object]:
    start, cpu = time.perf_counter(), time.thread_time()
    TIMING.append(name)
    result = fn()
    TIMING.pop()
    CPU.setdefault(name, []).append(time.thread_time() - cpu)
    return time.perf_counter() - start, result


TIMING: list[str] = []  # what is being timed now, if anything
COLLECTION_START: list[float] = [0.0]


def collector_pauses(phase: str, info: dict) -> None:
    if phase == "start":
        COLLECTION_START[0] = time.perf_counter()
    elif TIMING:
        PAUSES.append(time.perf_counter() - COLLECTION_START[0])


def run(url: str, ranks: int, windows: int, before: bool) -> dict:
    engine = make_engine(url)
    sessions = make_session_factory(engine)
    settings = Settings(database_url=url, data_dir=Path(tempfile.gettempdir()))
    job_id, _ = setup(sessions, ranks)
    watch, counts, wall = Watch(), [], {}
    watch.run(sessions, settings, time.time())  # the attempt's score made (its spec read once)
    [score] = watch.scores.values()

    def one_pass(kind: str) -> None:
        """A timed pass, listed as `kind`, or as the pass that finds a straggler or writes its flag."""
        unrecorded = len(watch.unrecorded)
        seconds, found = timed(lambda: watch.run(sessions, settings, time.time()), "pass")
        if found:
            kind = "the pass that finds"
        elif len(watch.unrecorded) < unrecorded:
            kind = "the pass that writes the flag"
        wall.setdefault(kind, []).append(seconds)
        CPU.setdefault(f"{kind}, CPU", []).append(CPU["pass"].pop())

    for i in range(1, windows + 1):
        store_window(sessions, job_id, 5 * i, range(ranks))
        count = 0
        while score.done_step != 5 * i:  # the passes it takes to read and score the window
            one_pass("a pass")
            count += 1
        counts.append(count)
        one_pass("nothing new")
    out = {"ranks": ranks, "passes": counts, "collector pauses": PAUSES[:]} | wall
    out |= {name: CPU.pop(name) for name in list(CPU) if name.endswith(", CPU")}
    PAUSES.clear()
    if before:
        def before_pass() -> list[int]:
            with sessions() as s:
                return rule_before(read_timings(s, job_id, 0, 5 * windows - LOOKBACK_STEPS), ranks)
        out["before"] = [timed(before_pass)[0]]
    engine.dispose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2048, 16384])
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--before", type=int, nargs="*", default=[2048], help="the rank counts to time the old rule at")
    parser.add_argument("--backend", choices=["sqlite", "postgresql"], default="sqlite")
    args = parser.parse_args()
    # The service's own collector settings (service/asgi/background.py, YoungCollector): counted
    # collections rare, the young generation collected on a clock (not here: a pass is short).
    gc.freeze()
    gc.set_threshold(200_000, 10, 10)
    gc.callbacks.append(collector_pauses)
    print(f"load average {os.getloadavg()[0]:.1f} {os.getloadavg()[1]:.1f} {os.getloadavg()[2]:.1f}, {args.backend}")
    with tempfile.TemporaryDirectory(prefix="ett-bench-scoring-") as root:
        for ranks in args.ranks:
            if args.backend == "postgresql":
                from tests.support.postgres import postgres_server

                with postgres_server(f"bench{ranks}") as url:
                    upgrade(url)
                    result = run(url, ranks, args.windows, ranks in args.before)
            else:
                url = f"sqlite:///{root}/ett-{ranks}.db"
                upgrade(url)
                result = run(url, ranks, args.windows, ranks in args.before)
            line = [f"{result['ranks']:>6} ranks:"]
            line.append(f"a window read and scored in {min(result['passes'])}-{max(result['passes'])} passes")
            for name in ("a pass", "a pass, CPU", "the pass that finds", "the pass that finds, CPU",
                         "the pass that writes the flag", "the pass that writes the flag, CPU", "nothing new",
                         "nothing new, CPU", "before", "collector pauses"):
                if result.get(name):
                    ms = [1000 * s for s in result[name]]
                    p90 = sorted(ms)[int(0.9 * (len(ms) - 1))]
                    line.append(f"{name} median {statistics.median(ms):.1f} ms, p90 {p90:.1f} ms, max {max(ms):.1f} ms"
                                f" ({len(ms)})")
            print("; ".join(line), flush=True)


if __name__ == "__main__":
    main()
