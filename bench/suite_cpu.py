"""Where the test suite's CPU goes: runs pytest and samples /proc every 0.3 s, then sums each
process's CPU time (user + system, as last seen) by what it runs (`-m MODULE`, a script, `-c`).

    .venv/bin/python bench/suite_cpu.py [PYTEST ARGS...]      (default: -n 2 --dist loadfile)

Processes of the pytest run only (descendants of it, forks of the agents' warm servers included);
one that lives under 0.3 s is missed, so the sum is a floor. The suite is bound by the two cores:
what a change saves here, the suite's wall time saves about half of.
"""

import collections
import os
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def what_runs(cmdline: bytes) -> str:
    argv = cmdline.decode(errors="replace").split("\0")
    for i, arg in enumerate(argv):
        if arg == "-m" and i + 1 < len(argv):
            return f"-m {argv[i + 1]}"
        if arg == "-c":
            return "-c (the xdist workers, and short snippets)"
        if arg.endswith(".py"):
            return arg.rsplit("/", 2)[-1]
    return " ".join(argv[:2])[-40:]


def sample(root: int, seen: dict, parents: dict) -> None:
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = open(f"/proc/{name}/stat").read().rsplit(")", 1)[1].split()
            cmdline = open(f"/proc/{name}/cmdline", "rb").read()
        except OSError:
            continue
        pid, parents[int(name)] = int(name), int(fields[1])
        ancestor, depth = pid, 0
        while ancestor not in (root, 0, 1) and depth < 40:
            ancestor, depth = parents.get(ancestor, 0), depth + 1
        if ancestor != root:
            continue
        key = (pid, fields[19])  # pid and start time: one process
        label = seen.get(key, ("", 0.0))[0] or (what_runs(cmdline) if cmdline else "")
        seen[key] = (label, (int(fields[11]) + int(fields[12])) / TICK)


def main(args: list[str]) -> int:
    pytest = subprocess.Popen([sys.executable, "-m", "pytest", "-q", *(args or ["-n", "2", "--dist", "loadfile"])])
    seen: dict = {}
    parents: dict = {}
    started = time.monotonic()
    while pytest.poll() is None:
        sample(pytest.pid, seen, parents)
        time.sleep(0.3)
    total, count = collections.Counter(), collections.Counter()
    for label, cpu in seen.values():
        total[label or "(ended before its command line was read)"] += cpu
        count[label or "(ended before its command line was read)"] += 1
    print(f"\nwall {time.monotonic() - started:.1f} s; CPU by what runs (s, processes):")
    for label, cpu in total.most_common(20):
        print(f"{cpu:8.1f} {count[label]:5d}  {label}")
    print(f"{sum(total.values()):8.1f}        in all")
    return pytest.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
