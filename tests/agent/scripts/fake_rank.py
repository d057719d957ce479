"""A stand-in for a trainer rank: writes schema-v1 events to the spool and steps, no torch.

Behaviour is chosen by flags so each agent test can ask for one way of ending.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from ett.protocol import RANKS_FILE, JobEnv, rank_spool

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--step-seconds", type=float, default=0.05)
parser.add_argument("--exit-code", type=int, default=0, help="exit code after the last step")
parser.add_argument("--fail-rank", type=int, default=None, help="rank that fails (default: every rank)")
parser.add_argument("--fail-at-step", type=int, default=None)
parser.add_argument("--fail-code", type=int, default=1)
parser.add_argument("--fail-signal", default=None, help="kill itself with this signal instead of exiting")
parser.add_argument("--hang-at-step", type=int, default=None, help="0: hang before the first step")
parser.add_argument("--slow-step", type=int, default=None, help="a step that takes --slow-seconds, without a beat")
parser.add_argument("--slow-seconds", type=float, default=0.0)
parser.add_argument("--ignore-sigterm", action="store_true")
parser.add_argument("--spawn-child", action="store_true", help="start a sleeping grandchild")
parser.add_argument("--lay-traps", action="store_true",
                    help="lay in the events folder what a hostile job would: a folder named like a spool, an endless line")
parser.add_argument("--escape", type=str, default=None, metavar="PID_FILE",
                    help="rank 0 starts a process that leaves its session and environment behind (setsid, env -i) "
                         "and writes its pid here")
parser.add_argument("--forge-pid", type=int, default=None,
                    help="rank 1 writes a record into the runners' records naming this pid as its own")
parser.add_argument("--forge-commit", type=int, default=None, metavar="STEP",
                    help="rank 0 says a checkpoint of this step was committed, with no such folder")
args = parser.parse_args()

rank = int(os.environ["RANK"])
attempt = int(os.environ.get(JobEnv.ATTEMPT, "0"))
spool = os.path.join(os.environ[JobEnv.EVENT_DIR], rank_spool(rank))
seq = 0


def emit(kind: str, step: int | None = None, **data: object) -> None:
    global seq
    event = {"kind": kind, "ts": time.time(), "attempt": attempt, "source": f"rank:{rank}", "seq": seq,
             "step": step, "data": data}
    with open(spool, "a") as f:
        f.write(json.dumps(event) + "\n")
    seq += 1


def hang() -> None:
    while True:
        time.sleep(60)


if args.ignore_sigterm:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if args.spawn_child:
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])

emit("init_start", pid=os.getpid())
if args.forge_pid and rank == 1:
    records = os.path.join(os.path.dirname(os.environ[JobEnv.CHECKPOINT_INTERVAL_FILE]), RANKS_FILE)
    with open(records, "a") as f:
        f.write(json.dumps({"rank": 1, "pid": args.forge_pid, "runner_pid": args.forge_pid}) + "\n")
if args.escape and rank == 0:
    # The escaped process writes its own pid once env -i has run: Popen's pid is setsid's, which still has
    # this rank's environment until it execs on.
    says_its_pid = ("import os, sys, time; f = open(sys.argv[1] + '.tmp', 'w'); f.write(str(os.getpid())); "
                    "f.close(); os.rename(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(600)")
    subprocess.Popen(["setsid", "env", "-i", sys.executable, "-c", says_its_pid, args.escape])
if args.lay_traps and rank == 0:
    events = os.environ[JobEnv.EVENT_DIR]
    os.mkdir(os.path.join(events, rank_spool(9)))
    with open(os.path.join(events, rank_spool(8)), "wb") as f:
        f.write(b"{" + b"x" * (100 << 20))  # 100 MB, no newline, ever
emit("init_end")
if args.hang_at_step == 0:
    hang()
fails_here = args.fail_rank is None or args.fail_rank == rank
for step in range(1, args.steps + 1):
    time.sleep(args.slow_seconds if step == args.slow_step else args.step_seconds)
    if rank == 0:
        emit("step", step, duration=args.step_seconds, tokens=64, loss=1.0 / step)
    if rank == 0 and step == args.forge_commit:
        emit("ckpt_committed", step, verified=True, bytes=1,
             path=os.path.join(os.environ[JobEnv.CHECKPOINT_DIR], f"step-{step:08d}"))
    if step == args.hang_at_step and fails_here:
        hang()
    if step == args.fail_at_step and fails_here:
        if args.fail_signal:
            os.kill(os.getpid(), signal.Signals[args.fail_signal])
        sys.exit(args.fail_code)
emit("train_end")
sys.exit(args.exit_code)
