"""README.md's "Your first ten minutes", run as written: its shell blocks are read from the README
(so it cannot drift from what runs), in one bash in a fresh folder, as the user running the suite
(root on CI: agents that run jobs as nobody). Then the job it submitted is opened on its page.

Only what the README says to set differs: the job interpreter an agent started as root needs
(ETT_AGENT_JOB_PYTHON, step 3's text), and a free port instead of 8000 (ETT_PORT alone, as a reader
would change it: the agents and the commands find the service at that port without being told), so
the test can run beside anything else on this machine.
"""

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ett.protocol import LOG_FILE
from tests.support.cluster import REPO
from tests.support.job_user import job_python, open_folder
from tests.support.postgres import free_port

pytestmark = pytest.mark.slow
FENCE = re.compile(r"^ *```bash\n(.*?)^ *```", re.M | re.S)


def walkthrough_blocks() -> list[str]:
    """The shell blocks of "Your first ten minutes", in order, unindented."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Your first ten minutes", 1)[1].split("\n## ", 1)[0]
    return ["\n".join(line.strip() for line in block.splitlines()) for block in FENCE.findall(section)]


def as_one_script(blocks: list[str]) -> str:
    """The blocks as one bash script; `ett service`, which the README runs in a shell of its own,
    goes to the background, and the next block waits until it answers."""
    lines = []
    for line in "\n".join(blocks).splitlines():
        command = line.split("  #", 1)[0].rstrip()
        if command.endswith("ett service"):
            lines += [f"{command} > service.log 2>&1 &",
                      "until (exec 3<>/dev/tcp/127.0.0.1/$ETT_PORT) 2> /dev/null; do sleep 0.2; done"]
        else:
            lines.append(line)
    return "\n".join(["set -euo pipefail", *lines, 'echo "TOKEN=$ETT_TOKEN"', 'echo "JOB=$JOB"'])


@pytest.fixture
def home_folder() -> Iterator[Path]:
    """A folder the job's user may enter (pytest's are closed to other users), as a home folder is."""
    with open_folder("ett-readme-") as folder:
        yield folder


def test_the_readme_walkthrough_runs_as_written_and_its_job_has_a_page(home_folder):
    blocks = walkthrough_blocks()
    assert len(blocks) == 4 and "ett agent" in blocks[1] and "ett submit" in blocks[2], blocks
    (home_folder / ".venv").symlink_to(REPO / ".venv")
    (home_folder / "examples").symlink_to(REPO / "examples")
    url = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "ETT_PORT": url.rsplit(":", 1)[1],
           "ETT_AGENT_JOB_PYTHON": str(job_python(home_folder / "job-python"))}  # fmt: skip
    for name in [n for n in env if n.startswith(("ETT_AGENT_JOB_USER", "ETT_AGENT_ALLOW", "ETT_DATA"))
                 or n in ("ETT_SERVICE_URL", "ETT_AGENT_SERVICE_URL")]:
        del env[name]
    # Into a file: the agents it leaves running keep their standard output open.
    with open(home_folder / "walkthrough.log", "w") as out:
        script = subprocess.Popen(["bash", "-c", as_one_script(blocks)], cwd=home_folder, env=env, stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        script.wait(timeout=240)  # step 5's `ett report --follow` returns once the job has ended
        out = (home_folder / "walkthrough.log").read_text()
        assert script.returncode == 0, out + logs(home_folder)
        token, job_id = re.search(r"^TOKEN=(\S+)$", out, re.M)[1], re.search(r"^JOB=(\w+)$", out, re.M)[1]
        assert f"job {job_id}  state succeeded" in out, out + logs(home_folder)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as api:
            job = api.get(f"/api/v1/jobs/{job_id}").json()
        assert job["state"] == "succeeded" and job["name"] == "plain-ddp"
        if os.geteuid() == 0:  # the README's agents ran it as its owner's uid, through the folders umask 077 made
            assert (home_folder / "agent-node-0").stat().st_mode & 0o001
        # Step 6: the page, signed in with the token in the address, then by its cookie.
        with httpx.Client(base_url=url, follow_redirects=True) as browser:
            page = browser.get(f"/jobs/{job_id}", params={"token": token})
        assert page.status_code == 200 and "plain-ddp" in page.text and "succeeded" in page.text
    finally:
        with contextlib.suppress(ProcessLookupError):  # none left: the script failed before starting them
            os.killpg(script.pid, signal.SIGTERM)  # the service and the agents the script left running
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _group_alive(script.pid):
            time.sleep(0.2)
        if _group_alive(script.pid):
            os.killpg(script.pid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def logs(folder: Path) -> str:
    found = [*folder.glob("*.log"), *folder.glob(f"agent-node-*/*/*/*/{LOG_FILE}"),
             *folder.glob("agent-node-*/*/*/*/logs/*.log")]
    return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-3000:]}" for p in found)
