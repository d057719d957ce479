"""Runs one rank under torchrun and records how it ended, which torchrun itself does not tell.

    torchrun --no-python python -S -P -c BOOT --ranks-file F --control-dir D
        [--log-dir L --log-max-bytes N [--secret-env NAME,...]] -- ARGV...

(BOOT: agent.launching.launch.lean_main, which runs main() below.)

Appends `{"rank", "pid", "runner_pid"}` to F when the rank starts, `{"rank", "exit_code"}` or
`{"rank", "signal"}` when it ends, and `{"rank", "output_in_log": true}` once what the rank wrote is
in its log. Stop signals are passed on to the rank (with SIGCONT, so a
stopped rank can act on them). SIGUSR1 is the agent's "exit" fault: the runner kills the rank and
exits with the code written in D/rank-R.exit, so torchrun and the agent see a real non-zero exit.
The rank lives in its own process group, so torchrun's signals reach it once, through here.
With --log-dir, the rank's stdout and stderr go to L/rank-R.log, rotated at N bytes (agent.launching.rank_log),
the values of the variables --secret-env names (the job's `env`, read from this runner's own
environment: never on a command line) blanked.
With $ETT_WARM_SOCKET set, a rank the agent's warm server can start is forked from there, its
imports already done (agent.warm.server); otherwise, or when the server cannot, it is a fresh process.
"""

import os
import signal
import sys
from types import SimpleNamespace

from agent.confinement.procs import set_parent_death_signal
from agent.files.jsonl import append_json_line
from agent.launching.launch_check import launch_problem
from agent.launching.rank_log import (
    CHILDREN_OUTPUT_SECONDS,
    DEFAULT_MAX_BYTES,
    OUTPUT_DRAIN_SECONDS,
    OUTPUT_IN_LOG,
    PipeCopier,
    RotatingLog,
)
from agent.warm.client import WARM_SOCKET_ENV, start_process
from ett.protocol import EXIT_CONFIG_ERROR, fault_exit_file, rank_log

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
USAGE = ("usage: agent.launching.rank_runner --ranks-file F --control-dir D [--log-dir L --log-max-bytes N "
         "[--secret-env NAME,...]] -- ARGV...")


# The agent's options (agent.launching.launch, which alone writes them) and their defaults.
OPTIONS = {"ranks_file": None, "control_dir": None, "log_dir": None, "log_max_bytes": str(DEFAULT_MAX_BYTES),
           "secret_env": ""}  # secret_env: names of variables whose values the log blanks, by commas


def parse(argv: list[str]) -> tuple[SimpleNamespace, list[str]]:
    """The options, then the rank's argv after `--`. Neither argparse nor a dataclass: this interpreter
    starts at every launch, and either would be a third of its imports."""
    given: dict[str, str] = {}
    while len(argv) >= 2 and argv[0].startswith("--") and argv[0] != "--":
        given[argv[0][2:].replace("-", "_")], argv = argv[1], argv[2:]
    rank_argv = argv[1:] if argv[:1] == ["--"] else argv
    options = {**OPTIONS, **given}
    wrong = sorted(set(given) - set(OPTIONS)) + [name for name in ("ranks_file", "control_dir") if not options[name]]
    wrong += [] if options["log_max_bytes"].isdigit() else ["log_max_bytes"]
    wrong += [] if rank_argv else ["the rank's ARGV after --"]
    if wrong:
        sys.exit(f"{USAGE}\n(wrong or missing: {', '.join(wrong)})")
    return SimpleNamespace(**{**options, "log_max_bytes": int(options["log_max_bytes"])}), rank_argv


def main(argv: list[str]) -> int:
    args, rank_argv = parse(argv)
    rank = int(os.environ["RANK"])

    set_parent_death_signal()  # torchrun gone: we go, and our rank goes with us (below)
    if os.getppid() == 1:
        return 1  # torchrun died before the request above took hold
    problem = launch_problem(rank_argv)
    copying = None
    if problem is None:
        log_write = None
        if args.log_dir is not None:  # the rank's output, in its own bounded file (agent.launching.rank_log)
            log_read, log_write = os.pipe()
            secrets = [os.environ.get(name, "") for name in args.secret_env.split(",")]
            copying = PipeCopier(log_read, RotatingLog(os.path.join(args.log_dir, rank_log(rank)), args.log_max_bytes),
                                 secrets)
        try:
            # Not the rank's business: it is forked warm or started fresh here.
            child = start_process(rank_argv, os.environ.pop(WARM_SOCKET_ENV, None), log_write, process_group=0)
        except OSError as exc:
            problem = f"{rank_argv[0]}: {exc.strerror or exc}"
        finally:
            if log_write is not None:
                os.close(log_write)  # the rank holds it now: the copy ends when the rank and its children do
    if problem is not None:  # it would fail the same way on every try: not retried (agent.launching.launch_check)
        append_json_line(args.ranks_file, {"rank": rank, "exit_code": EXIT_CONFIG_ERROR, "error": problem})
        return EXIT_CONFIG_ERROR
    append_json_line(args.ranks_file, {"rank": rank, "pid": child.pid, "runner_pid": os.getpid()})

    fault_code: int | None = None

    def forward(signum: int, _frame: object) -> None:
        child.send_signal(signum)
        child.send_signal(signal.SIGCONT)

    def fault_exit(_signum: int, _frame: object) -> None:
        nonlocal fault_code
        try:
            with open(os.path.join(args.control_dir, fault_exit_file(rank))) as written:
                fault_code = int(written.read())
        except (OSError, ValueError):
            fault_code = 1
        child.kill()

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    signal.signal(signal.SIGUSR1, fault_exit)

    returncode = child.wait()
    # The record first: the first failure recorded is the attempt's cause (a killed rank's, not the
    # broken collective's of a peer that exits a moment later); then the rank's last lines, which the
    # agent waits for before it reports the failure (agent.groups.workers): the service diagnoses from them.
    if fault_code is not None:
        record, code = {"rank": rank, "exit_code": fault_code, "fault": "exit"}, fault_code
    elif returncode < 0:
        record, code = {"rank": rank, "signal": signal.Signals(-returncode).name}, 128 - returncode
    else:
        record, code = {"rank": rank, "exit_code": returncode}, returncode
    append_json_line(args.ranks_file, record)
    if copying is not None:
        if copying.caught_up(OUTPUT_DRAIN_SECONDS):
            append_json_line(args.ranks_file, {"rank": rank, OUTPUT_IN_LOG: True})
        copying.join(CHILDREN_OUTPUT_SECONDS)  # a child of the rank may hold the pipe: not waited for long
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
