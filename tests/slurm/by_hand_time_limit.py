"""A job on Slurm reaching its time limit; run by hand (about two minutes: Slurm's limits are whole
minutes and slurmctld checks them every 30 s, too slow for the suite):

    .venv/bin/python tests/slurm/by_hand_time_limit.py /tmp/time-limit

Expected: attempt 0 failed with cause time_limit, its last step committed as the final
checkpoint, attempt 1 resuming from it in a new allocation, 0 lost steps.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.proofs.cluster import cluster  # noqa: E402
from tests.slurm.conftest import service_env  # noqa: E402
from tests.slurm.test_slurm_jobs import PLAIN_DDP  # noqa: E402
from tests.support.job_user import job_python, open_folder  # noqa: E402
from tests.support.slurm import slurm_cluster  # noqa: E402


def main(root: Path) -> None:
    # The jobs run as their owner's uid: their interpreter and folders where that uid may enter.
    with slurm_cluster(root / "slurm") as slurm, open_folder("ett-time-limit-") as shared:
        python = job_python(shared / "job-python")
        (shared / "ett").mkdir()
        with cluster(shared / "ett", **service_env(slurm, python)) as ett:
            spec = {"name": "time-limited", "nodes": 2, "procs_per_node": 1,
                    "entrypoint": [str(python), str(PLAIN_DDP), "--steps", "500", "--step-seconds", "0.2"],
                    "checkpoint": {"interval_steps": 1000}, "slurm": {"partition": "batch", "time_limit": "1"}}  # fmt: skip
            started = time.time()
            job_id = ett.submit(spec)
            job = ett.wait_job(job_id, 400)
            print(f"job {job['state']} after {time.time() - started:.0f} s")
            for attempt in job["attempts"]:
                print(f"attempt {attempt['number']}: {attempt['state']} {attempt['cause']} {attempt['detail']} "
                      f"resume_from={attempt['resume_from']}")
            print("slurm", job["slurm"])
            last_steps: dict[int, int] = {}
            for event in ett.events(job_id, kind="step"):
                last_steps[event.attempt] = max(last_steps.get(event.attempt, 0), event.step)
            print("committed", [(e.attempt, e.step) for e in ett.events(job_id, kind="ckpt_committed")],
                  "last steps", last_steps)
            print("failures", ett.report(job_id)["failures"])


if __name__ == "__main__":
    main(Path(sys.argv[1]))
