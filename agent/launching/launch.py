"""The torchrun command line and environment of an attempt, built as lists: no shell anywhere."""

import json
import os
import sys
from pathlib import Path
from typing import Any

import agent
from agent.confinement.job_user import RunAs
from agent.confinement.procs import GROUP_CGROUP_ENV, GROUP_MARKER_ENV, GROUP_PLACER_ENV
from agent.files.spool import AttemptPaths
from agent.launching.rank_log import DEFAULT_MAX_BYTES
from agent.warm.client import WARM_SOCKET_ENV, python_module, runs_script
from ett.protocol import LIBRARY_FAULT_ACTIONS, JobEnv
from ett.protocol.messages import CheckpointSpec, LaunchCommand, TrainerSpec


# The guard and every rank runner are fresh interpreters at every launch, on the restart's path. They import
# only the standard library and our own packages, so they start without `site` (-S: no site-packages scan,
# no .pth file, no editable install's finder), our packages' folder put first on the path by hand: less
# start-up than a `python -P -m` (BENCHMARKS.md, "Twenty-fifth session"), on CPUs the ranks want too.
PACKAGES_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(agent.__file__)))


def lean_main(python: str, module: str) -> list[str]:
    """`python -S -P -c BOOT ARGS`: runs `module.main(ARGS)` and exits with what it returns (see above).
    With our packages from where the agent has them: only for the agent's own interpreter. Another
    job_python has its own install of ett, which its `site` finds (python_module)."""
    if os.path.abspath(python) != os.path.abspath(sys.executable):
        return python_module(python, module)
    boot = f"import sys; sys.path.insert(0, {PACKAGES_ROOT!r}); from {module} import main; sys.exit(main(sys.argv[1:]))"
    return [python, "-S", "-P", "-c", boot]


def override_value(value: Any) -> str:
    """Trainer overrides as the trainer's CLI reads them: strings as they are, the rest as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def trainer_argv(trainer: TrainerSpec, ckpt: CheckpointSpec, python: str = sys.executable) -> list[str]:
    argv = [*python_module(python, "trainer.train"), "--preset", trainer.preset]
    for name, value in trainer.overrides.items():
        argv += [f"--{name}", override_value(value)]
    if ckpt.dir is not None:
        argv += ["--checkpoint.dir", ckpt.dir]
    if ckpt.local_dir is not None:
        argv += ["--checkpoint.local_dir", ckpt.local_dir]
    argv += ["--checkpoint.interval_steps", str(ckpt.interval_steps), "--checkpoint.keep", str(ckpt.keep)]
    # No checkpoint named by the service (its catalog may lag the disk): the newest that verifies.
    argv += ["--checkpoint.resume_from", ckpt.resume_from or "auto"]
    return argv


def rank_argv(command: LaunchCommand, python: str = sys.executable) -> list[str]:
    """The job's own argv when it has one, else the trainer's."""
    if command.entrypoint is not None:
        return list(command.entrypoint)
    assert command.trainer is not None  # LaunchCommand validates one of the two
    return trainer_argv(command.trainer, command.checkpoint, python)


def torchrun_argv(command: LaunchCommand, paths: AttemptPaths, python: str = sys.executable,
                  go_fd: int | None = None, log_max_bytes: int = DEFAULT_MAX_BYTES) -> list[str]:
    """torchrun, under the group's guard, runs each rank through agent.launching.rank_runner, which records
    its exit code or signal. Stop escalation is the agent's (SIGKILL after its grace), not torchrun's.
    Our modules run with `python -P`: a folder named `agent` or `trainer` where the agent was
    started must not shadow them (the guard and the runner too: lean_main). Every node but the master's
    waits for the master's store (agent.launching.guard) rather than let torchrun back off; with `go_fd`,
    the guard waits for the agent's word that it is in the attempt's cgroup."""
    master = f"{command.master_addr}:{command.master_port}"
    return [
        *lean_main(python, "agent.launching.guard"), str(os.getpid()),
        *(["--go-fd", str(go_fd)] if go_fd is not None else []),
        *(["--wait-for", master] if command.node_rank else []), "--",
        *python_module(python, "torch.distributed.run"),
        "--nnodes", str(command.nnodes),
        "--node-rank", str(command.node_rank),
        "--nproc-per-node", str(command.nproc_per_node),
        "--master-addr", command.master_addr,
        "--master-port", str(command.master_port),
        "--max-restarts", "0",
        "--no-python",
        *lean_main(python, "agent.launching.rank_runner"),
        "--ranks-file", str(paths.ranks_file),
        "--control-dir", str(paths.control_dir),
        "--log-dir", str(paths.logs_dir), "--log-max-bytes", str(log_max_bytes),
        # The names of the job's `env`, whose values the runner blanks in the rank's output.
        *(["--secret-env", ",".join(sorted(command.env))] if command.env else []),
        "--", *rank_argv(command, python),
    ]  # fmt: skip


def job_env(command: LaunchCommand, paths: AttemptPaths) -> dict[str, str]:
    """What every rank of every job is handed, entrypoint or trainer (docs/library.md, "The job's
    environment"); `ett.init()` reads it. Unset values are left out."""
    ckpt = command.checkpoint
    # The faults the ranks' own ett.Run sets off (ett/faults.py); the agent's are agent/groups/faults.py's.
    library_faults = [f.model_dump(exclude_none=True) for f in command.faults if f.action in LIBRARY_FAULT_ACTIONS]
    env = {
        JobEnv.JOB_ID: command.job_id,
        JobEnv.ATTEMPT: str(command.attempt),
        JobEnv.EVENT_DIR: str(paths.events_dir),
        JobEnv.CHECKPOINT_DIR: ckpt.dir,
        JobEnv.CHECKPOINT_LOCAL_DIR: ckpt.local_dir,
        JobEnv.RESUME_FROM: ckpt.resume_from,
        JobEnv.CHECKPOINT_INTERVAL_STEPS: str(ckpt.interval_steps),
        JobEnv.CHECKPOINT_KEEP: str(ckpt.keep),
        JobEnv.CHECKPOINT_INTERVAL_FILE: str(paths.interval_file),
        JobEnv.CHECKPOINT_SNAPSHOTS: "1" if ckpt.snapshots and ckpt.local_dir else None,
        JobEnv.CHECKPOINT_SNAPSHOT_COPIES: str(ckpt.snapshot_copies) if ckpt.snapshots and ckpt.local_dir else None,
        JobEnv.FAULTS: json.dumps(library_faults) if library_faults else None,
        JobEnv.LEARN_IMPORTS: "1" if learns_imports(command) else None,
        JobEnv.FULL_WORLD_SIZE: str(command.full_nnodes * command.nproc_per_node) if command.full_nnodes else None,
    }
    return {name: value for name, value in env.items() if value is not None}


def worker_env(command: LaunchCommand, paths: AttemptPaths, marker: str, warm_socket: Path | None = None,
               run_as: RunAs = RunAs(), cgroup: Path | None = None, placer: Path | None = None) -> dict[str, str]:
    """`cgroup` and `placer`: where a process the warm server forks is moved, and who moves it
    (agent.confinement.placement)."""
    env = run_as.base_env()
    env.update(command.env)
    env.update(job_env(command, paths))
    env.update({GROUP_MARKER_ENV: marker, "PYTHONUNBUFFERED": "1"})
    if cgroup is not None:
        env[GROUP_CGROUP_ENV] = str(cgroup)
    if cgroup is not None and placer is not None:
        env[GROUP_PLACER_ENV] = str(placer)
    if warm_socket is not None and starts_warm(command):
        env[WARM_SOCKET_ENV] = str(warm_socket)
    return env


def starts_warm(command: LaunchCommand) -> bool:
    """Warm start for the trainer, and for a job's `python SCRIPT` (from the server of its
    `warm_imports`, else of the base set every script loads: agent.warm.servers); only with no job
    environment: variables read while torch is imported (in the warm server, long before) could
    not take effect."""
    if command.env:
        return False
    if command.entrypoint is None:
        return True
    return runs_script(command.entrypoint)


def learns_imports(command: LaunchCommand) -> bool:
    """Whether its ranks say what they imported (ett/imports.py): a `python SCRIPT` that names no
    `warm_imports` (nor was handed what an earlier attempt learned), which would start warm with them."""
    if command.env or command.warm_imports or command.entrypoint is None:
        return False
    return runs_script(command.entrypoint)
