"""The README's first command: `ett demo` as a newcomer runs it, a real process from end to end."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ETT = Path(sys.executable).with_name("ett")


def test_ett_demo_recovers_both_faults_and_prints_the_report():
    done = subprocess.run([str(ETT), "demo", "--timeout", "400"], capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    # The cause as first reported; the report below gives the root cause.
    assert "attempt 0: failed (" in out, out
    assert re.search(r"attempt 1: failed \(hang: ", out), out
    assert "attempt 2: succeeded" in out and "state succeeded" in out, out
    assert re.search(r"attempt 1: allocated on node-0, node-1, resuming from \S+/step-\d{8}", out), out
    for category in ("productive", "wasted", "checkpoint_save", "restore", "init", "recovery", "idle"):
        assert re.search(rf"^  {category} +\d+\.\d\d +\d+\.\d%$", out, re.MULTILINE), (category, out)
    assert re.search(r"attempt 0: signal +time to recover \d+\.\d s +lost steps \d+", out), out
    assert "recommended checkpoint interval" in out, out
