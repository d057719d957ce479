"""What crosses a process boundary between the ranks, the agents and the service, named once:
event kinds, exit codes, the files of an attempt's folder and the job's environment. The typed
messages (the launch command, the attempt report) are in ett/protocol/messages.py, each event
kind's `data` fields in ett/protocol/event_fields.py.

Standard library only: the rank runner, started fresh for every rank, imports this.
"""

from collections.abc import Mapping

# -- event kinds (docs/events.md) -------------------------------------------------------------
# Written by a rank (the library, the trainer): timings, saves and restores.
RANK_KINDS = frozenset({"init_start", "init_end", "restore_start", "restore_end", "step", "ckpt_start", "ckpt_staged",
                        "ckpt_committed", "ckpt_failed", "train_end", "step_timing", "elastic"})  # fmt: skip
# Written by a node's agent: its ranks' start, exit and hang.
AGENT_KINDS = frozenset({"workers_launched", "worker_exited", "hang_detected"})
# Written by the service: allocation, failure, stop and finish of attempts and jobs.
SERVICE_KINDS = frozenset({"attempt_allocated", "attempt_failed", "attempt_stopped", "job_finished",
                           "checkpoint_interval"})  # fmt: skip
EVENT_KINDS = RANK_KINDS | AGENT_KINDS | SERVICE_KINDS
CHECKPOINT_KINDS = frozenset({"ckpt_start", "ckpt_staged", "ckpt_committed", "ckpt_failed"})

# -- exit codes of a rank (docs/trainer.md, docs/library.md) ----------------------------------
EXIT_OK = 0
EXIT_FAILED = 1  # an exception: a failure, retried by the service
# A configuration that cannot work (a bad preset or value, a launch the agent refused, a program
# or script that cannot start): retrying cannot help, and the service never does.
EXIT_CONFIG_ERROR = 3
EXIT_STOPPED = 4  # SIGTERM: stopped after the current step and a final checkpoint

# -- an attempt's folder on its node: DATA_DIR/spool/JOB/ATTEMPT/ (docs/agent.md) -------------
# The attempt's folder is the agent's (root's, 0711); only these three folders in it are the job's.
EVENTS_DIR = "events"  # the ranks' spools the agent forwards: `rank-N.jsonl`, and progress marks
CONTROL_DIR = "control"  # what the agent tells the ranks, and the rank runners' records
LOGS_DIR = "logs"  # each rank's output, `rank-R.log` (and its older part, `rank-R.log.1`)
RANKS_FILE = "ranks.jsonl"  # in CONTROL_DIR: the rank runners' records: started, exited
LOG_FILE = "torchrun.log"
ENDED_MARKER = "ended"
INTERVAL_FILE = "checkpoint-interval"  # in CONTROL_DIR: "<interval_steps> <from_step>" per change
SPOOL_SUFFIX = ".jsonl"
RANK_SPOOL_GLOB = "rank-*.jsonl"
NODE_SPOOL_GLOB = "node-*.jsonl"
PROGRESS_GLOB = "progress-rank-*"

# -- a committed checkpoint: its folder holds this JSON manifest (ett/checkpoints/folders.py), which
# the agent checks before it forwards a commit (agent/checkpoints/checkpoint_check.py).
MARKER = "COMMITTED"


def rank_spool(rank: int) -> str:
    """A rank's events, in EVENTS_DIR."""
    return f"rank-{rank}{SPOOL_SUFFIX}"


def node_spool(node: str) -> str:
    """The agent's events about the attempt on its node, in the attempt's folder (not the job's)."""
    return f"node-{node}{SPOOL_SUFFIX}"


def rank_log(rank: int) -> str:
    """A rank's stdout and stderr, in LOGS_DIR (agent/launching/rank_log.py)."""
    return f"rank-{rank}.log"


def progress_file(rank: int) -> str:
    """A rank's progress mark, overwritten in place in EVENTS_DIR (ett/events.py)."""
    return f"progress-rank-{rank}"


def rank_of_progress_file(name: str) -> int | None:
    """The rank whose progress mark `name` is (None: not a mark's name)."""
    rank = name.removeprefix("progress-rank-")
    return int(rank) if rank != name and rank.isdigit() else None


# A live rank's library counts this mark's pulse up every PULSE_SECONDS from a thread of its own;
# its agent takes a rank whose pulse and CPU time both stood still for FROZEN_SECONDS for a hang
# (agent/groups/hang.py, "A frozen rank").
# Five pulses: a rank held up by its machine (a thread runnable or in a page fault) is never taken for
# frozen (agent/groups/progress.py), so what stands still this long stands still by its own code.
# A rank the kernel reports stopped by a signal (state T: SIGSTOP, the `hang` fault) can run no
# thread until a SIGCONT, whatever its machine does: three pulses of stillness are enough there. A
# tracing stop (t: a debugger, py-spy's sample) is no such word and waits the full FROZEN_SECONDS.
PULSE_SECONDS = 0.1
FROZEN_SECONDS = 0.5
STOPPED_SECONDS = 0.3


# -- heartbeats (docs/reliability.md, "Node loss") --------------------------------------------------
# The longest an agent waits before it retries a failed heartbeat: the service counts no silence
# until this long after it (or its database) came back (service/jobs/peer_loss.py).
HEARTBEAT_RETRY_MAX_SECONDS = 5.0


# -- injected faults (docs/jobspec.md, "faults") -------------------------------------------------
# The agent sets these off (agent/groups/faults.py); lose_node only where its settings allow the drill.
AGENT_FAULT_ACTIONS = ("kill", "hang", "exit", "lose_node")
LIBRARY_FAULT_ACTIONS = ("raise", "fill_memory", "fill_disk", "slow")  # the rank's ett.Run does (ett/faults.py)
FAULT_ACTIONS = AGENT_FAULT_ACTIONS + LIBRARY_FAULT_ACTIONS
NODE_LOSS_FAULT = "lose_node"


def fault_exit_file(rank: int) -> str:
    """The exit code an injected `exit` fault ends the rank with, in CONTROL_DIR."""
    return f"rank-{rank}.exit"


# -- where the commands and the agents find the service (README, "Your first ten minutes") -----------
SERVICE_URL_ENV = "ETT_SERVICE_URL"
SERVICE_PORT_ENV = "ETT_PORT"  # the port `ett service` listens on (service/settings.py)
DEFAULT_SERVICE_PORT = 8000


def service_url(environ: Mapping[str, str]) -> str:
    """The service that `ett submit`, `ett jobs`, ... and `ett agent` call when none is named:
    ETT_SERVICE_URL, else the one on this machine at ETT_PORT, so that a shell which moved its
    service moves its commands and agents with it. ValueError, naming the variable, when it is bad."""
    url = environ.get(SERVICE_URL_ENV)
    if url:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{SERVICE_URL_ENV}={url} must start with http:// or https://")
        return url.rstrip("/")
    port = environ.get(SERVICE_PORT_ENV) or str(DEFAULT_SERVICE_PORT)
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise ValueError(f"{SERVICE_PORT_ENV}={port} is not a port (1-65535)")
    return f"http://127.0.0.1:{int(port)}"


# -- what a job's script imported, learned for its warm restarts (docs/agent.md, "Warm start") --
# A `python SCRIPT` job that names no `warm_imports`: each node's local rank 0 writes, once at its
# `ett.init`, the modules of installed packages it imported, {"modules": [...]}, in the order
# they were loaded (ett/imports.py). Its agent reads it as hostile input, bounded (agent/warm/learned.py)
# and starts a warm server of them at once; the service keeps it for the job's next attempts.
IMPORTS_FILE = "imports.json"  # in EVENTS_DIR
IMPORTS_MAX_NAMES = 4096  # an HF Trainer script: about 2,200
MODULE_NAME_MAX_CHARS = 128
IMPORTS_FILE_MAX_BYTES = 256 << 10  # the rank keeps its list within it, the agent reads no more
# A dotted name of ASCII identifiers: nothing else is ever passed on or imported.
MODULE_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"
# Modules that act when imported, which a warm server (which imports the names it is given, as the
# job's user, for good) must never import: a package's `__main__` (runs its program with the server's
# arguments: unittest's parsed them and ended the server, venv's and ensurepip's install), and the
# standard library's that open a browser (antigravity), print (this, __hello__, __phello__), start a
# program (idlelib.idle, turtledemo) or run tests (test.autotest). Found by review (#48). A script
# that imports one of them imports it itself, cold; never learned, never named.
ACTS_AT_IMPORT = frozenset({"antigravity", "this", "__hello__", "__phello__", "idlelib", "turtledemo", "test"})


def acts_at_import(name: str) -> bool:
    """Whether importing the module `name` (a dotted name) does more than define it (above)."""
    parts = name.split(".")
    return parts[0] in ACTS_AT_IMPORT or parts[-1] in ("__main__", "__mp_main__")


# -- the job's environment, set by the agent for every rank (docs/library.md) -----------------
class JobEnv:
    JOB_ID = "ETT_JOB_ID"
    ATTEMPT = "ETT_ATTEMPT"
    EVENT_DIR = "ETT_EVENT_DIR"
    CHECKPOINT_DIR = "ETT_CHECKPOINT_DIR"
    CHECKPOINT_LOCAL_DIR = "ETT_CHECKPOINT_LOCAL_DIR"
    RESUME_FROM = "ETT_RESUME_FROM"
    CHECKPOINT_INTERVAL_STEPS = "ETT_CHECKPOINT_INTERVAL_STEPS"
    CHECKPOINT_KEEP = "ETT_CHECKPOINT_KEEP"
    CHECKPOINT_INTERVAL_FILE = "ETT_CHECKPOINT_INTERVAL_FILE"
    CHECKPOINT_SNAPSHOTS = "ETT_CHECKPOINT_SNAPSHOTS"
    CHECKPOINT_SNAPSHOT_COPIES = "ETT_CHECKPOINT_SNAPSHOT_COPIES"  # peer nodes that keep each snapshot
    # The faults a rank's own code sets off (ett/faults.py): a JSON list, only where the job has some.
    FAULTS = "ETT_FAULTS"
    # "1": this node's local rank 0 writes what it imported to IMPORTS_FILE (above).
    LEARN_IMPORTS = "ETT_LEARN_IMPORTS"
    # An elastic job (spec `elastic.min_nodes`) running on fewer nodes than its full size: the world
    # size it has at full size (WORLD_SIZE is the present one). Unset: the present size is the full.
    FULL_WORLD_SIZE = "ETT_FULL_WORLD_SIZE"
