"""The batch job an ETT job's allocation runs: one `ett agent` per node, started by `srun`, bound
to the ETT job by the token it registers with.

The script and the token live in the allocation's folder (ETT_SLURM_DIR/<job id>/<number>/),
which the nodes must see at the same path; the token file is the service's user's alone, mode
600. That user is root: sbatch starts the allocation as the user who submits it, and its agents
must be root to run each owner's jobs as a uid of its own (docs/slurm.md, "Who runs what"). The
secret is in no script, argument or environment, which Slurm keeps and shows (`scontrol show
job`). Each agent's node-local folder is made by mktemp: no one can lay it, or a link in its
place, beforehand.
"""

import shlex
import sys
from pathlib import Path

from service.settings import Settings
from service.spec.job_spec import JobSpec

TOKEN_FILE = "agent.token"
SCRIPT_FILE = "allocation.sh"


def service_url(settings: Settings) -> str:
    return settings.slurm_service_url or f"http://{settings.host}:{settings.port}"


def agent_command(settings: Settings) -> list[str]:
    if settings.slurm_agent_command:
        return shlex.split(settings.slurm_agent_command)
    return [sys.executable, "-P", "-m", "ett_cli.main", "agent"]


def render_script(settings: Settings, folder: Path, procs_per_node: int) -> str:
    """The batch script: the agents' settings, then one agent a node under srun. An agent's
    address is its node's NodeAddr in Slurm, where the other nodes reach it."""
    env = {
        "ETT_AGENT_SERVICE_URL": service_url(settings),
        "ETT_AGENT_TOKEN_FILE": str(folder / TOKEN_FILE),
        "ETT_AGENT_SLOTS": str(procs_per_node),
    } | settings.slurm_agent_env  # fmt: skip
    exports = "\n".join(f"export {name}={shlex.quote(value)}" for name, value in env.items())
    # The data folder: a name no one could guess to lay first (mktemp, made 0700), then 0711 like
    # every agent's (docs/agent.md): each owner's uid passes through to its own 0700 folders in
    # it, and no one else lists it or reads the agent's files (0600) there.
    per_node = (
        'node="$SLURMD_NODENAME"; '
        'addr=$(scontrol show node -o "$node" | tr " " "\\n" | sed -n "s/^NodeAddr=//p"); '
        'data=$(mktemp -d "${TMPDIR:-/tmp}/ett-slurm-$SLURM_JOB_ID-$node.XXXXXXXXXX") && chmod 711 "$data" || exit 1; '
        'exec "$@" --name "slurm-$SLURM_JOB_ID-$node" --address "${addr:-$node}" --data-dir "$data"'
    )
    agent = shlex.join(agent_command(settings))
    return f"""#!/bin/bash
# An ETT job's Slurm allocation (docs/slurm.md): one ett agent per node, bound to the job.
# Submitted with --export=NONE: nothing of the service's environment is here but what follows.
export SLURM_EXPORT_ENV=ALL  # srun passes the agents what this script sets, not NONE
{exports}
exec srun --ntasks-per-node=1 --kill-on-bad-exit=0 bash -c {shlex.quote(per_node)} ett-agent {agent}
"""


def sbatch_options(spec: JobSpec, job_id: str, folder: Path, exclude: list[str]) -> list[str]:
    """sbatch's options for the job's spec: its nodes, its slurm section, no requeue by Slurm
    (the service decides what comes next), the output beside the script, none of the service's
    environment."""
    slurm = spec.slurm
    assert slurm is not None  # only a Slurm job gets an allocation
    # --export=NONE: the service's environment (its database URL among it) never reaches a node.
    options = [f"--job-name=ett-{spec.name}-{job_id[:8]}", f"--nodes={spec.nodes}", "--ntasks-per-node=1",
               "--no-requeue", f"--output={folder / 'slurm-%j.out'}", f"--chdir={folder}", "--export=NONE"]
    for value, option in ((slurm.partition, "--partition"), (slurm.account, "--account"), (slurm.time_limit, "--time")):
        if value:
            options.append(f"{option}={value}")
    if exclude:
        options.append(f"--exclude={','.join(exclude)}")
    return options + list(slurm.options)
