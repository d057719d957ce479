"""The README's first command: `ett demo` as a newcomer runs it, on a terminal (a real pseudo-
terminal), a real process from end to end: live progress, the report, then the service stays up
with a login that opens the job's page, until Ctrl-C; a terminal closed mid-job stops it all."""

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.processes import pids_with_env

pytestmark = pytest.mark.slow

ETT = Path(sys.executable).with_name("ett")


def read_until(fd: int, pattern: str, timeout: float, out: list[str]) -> re.Match:
    deadline = time.monotonic() + timeout
    while (match := re.search(pattern, "".join(out))) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"no {pattern!r} in the demo's output:\n" + "".join(out))
        ready, _, _ = select.select([fd], [], [], 1)
        if ready:
            try:
                out.append(os.read(fd, 65536).decode(errors="replace"))
            except OSError:  # the terminal closed: the demo is gone
                raise AssertionError("the demo ended early:\n" + "".join(out)) from None
    return match


@pytest.mark.over_budget("the whole `ett demo`: 60 steps, four attempts, a node loss waiting out its 6 s deadline")
def test_ett_demo_on_a_terminal_shows_progress_the_report_and_stays_up_until_ctrl_c():
    main, terminal = pty.openpty()
    demo = subprocess.Popen([str(ETT), "demo", "--timeout", "400"], stdin=terminal, stdout=terminal,
                            stderr=terminal, start_new_session=True)
    os.close(terminal)
    out: list[str] = []
    try:
        stay = read_until(main, r"open (http://127\.0\.0\.1:\d+)/jobs/(\w+)\?token=(\S+)", 480, out)
        text = "".join(out).replace("\r\n", "\n")
        # Live progress, rewritten in place: attempt, step, ETT so far.
        assert re.search(r"\r  attempt 0: step \d+/60, ETT so far \d+\.\d%", text), text
        # The cause as first reported; the report below gives the root cause.
        assert "attempt 0: failed (" in text and re.search(r"attempt 1: failed \(hang: ", text), text
        assert "attempt 3: succeeded" in text and "state succeeded" in text, text
        assert re.search(r"attempt 1: allocated on node-0, node-1 \(newest checkpoint: \S+/step-\d{8}\)", text), text
        # The ranks went on from their newest snapshot, or at worst the checkpoint of step 20. (The
        # SIGKILL is due at step 25; on a loaded machine the agent's fault may land a step or two later.)
        resumed = re.search(r"attempt 1: resumed from step (\d+)\n", text)
        assert resumed and 20 <= int(resumed.group(1)) < 45, text
        for category in ("productive", "wasted", "checkpoint_save", "restore", "init", "recovery", "idle"):
            assert re.search(rf"^  {category} +\d+\.\d\d +\d+\.\d%$", text, re.MULTILINE), (category, text)
        assert re.search(r"attempt 0: signal +time to recover \d+\.\d s +lost steps \d+", text), text
        # The lost node's place goes to the spare, whose ranks take their state from the copies of
        # their snapshots the survivor kept: at most the step in flight is lost.
        assert "attempt 3: allocated on node-0, node-2" in text, text
        assert re.search(r"attempt 2: node_lost +time to recover \d+\.\d s +lost steps [01]\b", text), text

        # The login printed opens the job's page (and the service is still there to serve it).
        url, job_id, token = stay.groups()
        page = httpx.get(f"{url}/jobs/{job_id}?token={token}", follow_redirects=True, timeout=10)
        assert page.status_code == 200 and "succeeded" in page.text
        os.killpg(demo.pid, signal.SIGINT)  # Ctrl-C
        assert demo.wait(timeout=120) == 0  # the demo gives its processes 20 s to stop, then SIGKILL
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/readyz", timeout=5)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
        os.close(main)


@pytest.mark.over_budget("the whole demo (service, three agents, a job) up before its terminal closes")
def test_a_terminal_closed_mid_job_stops_the_demos_service_and_agents():
    main, terminal = pty.openpty()
    demo = subprocess.Popen([str(ETT), "demo"], stdin=terminal, stdout=terminal, stderr=terminal,
                            start_new_session=True)
    os.close(terminal)
    out: list[str] = []
    try:
        root = read_until(main, r"working in (\S+)\r?\n", 60, out).group(1)
        read_until(main, r"attempt 0: running", 240, out)
        # The service and the agents run in sessions of their own: no terminal signal reaches them.
        ours = [("ETT_DATA_DIR", f"{root}/service")] + [("ETT_AGENT_DATA_DIR", f"{root}/node-{i}") for i in (0, 1)]
        assert all(pids_with_env(*env) for env in ours)
        os.kill(demo.pid, signal.SIGHUP)  # the terminal window closed
        assert demo.wait(timeout=60) == 1
        assert not any(pids_with_env(*env) for env in ours)
        assert not Path(root).exists()
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
        os.close(main)
