"""Headless Chromium, as a person's browser opens the service's pages."""

import shutil
import subprocess
from pathlib import Path


def chromium(*args: str, profile: Path) -> str:
    binary = shutil.which("chromium")
    assert binary, "headless Chromium is needed: apt-get install chromium (.ci/run does)"
    argv = [
        binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}", *args,
    ]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout
