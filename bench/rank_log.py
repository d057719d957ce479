"""What a rank's output costs through its runner's pipe into the rotated log (agent/launching/rank_log.py),
against the same output written straight to a file: a child process prints N lines of 100 bytes.

    .venv/bin/python bench/rank_log.py [--lines 2000000] [--reps 3]
"""

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agent.launching.rank_log import PipeCopier, RotatingLog

PRINTER = "import sys\nline = 'x' * 99 + '\\n'\nfor _ in range(int(sys.argv[1])):\n    sys.stdout.write(line)\n"


def run(lines: int, folder: Path, through_pipe: bool) -> tuple[float, float]:
    """Wall seconds of the printer, and the CPU seconds this process (the runner's copy) spent."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    if through_pipe:
        read_fd, write_fd = os.pipe()
        copying = PipeCopier(read_fd, RotatingLog(str(folder / "rank-0.log"), 16 << 20))
        subprocess.run([sys.executable, "-c", PRINTER, str(lines)], stdout=write_fd, check=True)
        os.close(write_fd)
        copying.join()
    else:
        with open(folder / "direct.log", "wb") as out:
            subprocess.run([sys.executable, "-c", PRINTER, str(lines)], stdout=out, check=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=2_000_000)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    megabytes = args.lines * 100 / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            direct, _ = run(args.lines, Path(tmp), through_pipe=False)
            piped, cpu = run(args.lines, Path(tmp), through_pipe=True)
            print(f"rep {rep}: {megabytes:.0f} MB printed: straight to a file {direct:.2f} s, through the runner's "
                  f"pipe and rotated log {piped:.2f} s ({piped / direct:.2f}x); the copy's CPU {cpu:.2f} s "
                  f"({1000 * cpu / megabytes:.2f} ms per MB)")


if __name__ == "__main__":
    main()
