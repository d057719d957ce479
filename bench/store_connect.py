"""How late a torchrun store client connects when the master's store comes up after it: torch's
own back-off against agent.launching.guard's wait (a probe every 5 ms), in one run.

    python bench/store_connect.py [--delays 0 0.05 0.2 0.5]

Each row: the store (TCPStore, as the master node's torchrun makes it) starts `delay` seconds
after the client starts connecting; the figure is the client's connect time less that delay.
"""

import argparse
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from agent.launching.guard import wait_for_listener  # noqa: E402
from tests.support.postgres import free_port  # noqa: E402


def connect_late(delay: float, wait_first: bool) -> float:
    port = free_port()
    up = threading.Event()

    def master() -> None:
        time.sleep(delay)
        store = dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)
        up.wait(10)
        del store

    thread = threading.Thread(target=master)
    thread.start()
    start = time.perf_counter()
    if wait_first:
        wait_for_listener(f"127.0.0.1:{port}")
    dist.TCPStore("127.0.0.1", port, 2, False)
    seconds = time.perf_counter() - start
    up.set()
    thread.join()
    return seconds - delay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delays", type=float, nargs="+", default=[0.0, 0.05, 0.2, 0.5])
    args = parser.parse_args()
    print("| store late by | torchrun's back-off: connected after it by | with the guard's wait |")
    print("| --- | --- | --- |")
    for delay in args.delays:
        backoff, waited = connect_late(delay, False), connect_late(delay, True)
        print(f"| {delay * 1000:.0f} ms | {backoff * 1000:.0f} ms | {waited * 1000:.0f} ms |")


if __name__ == "__main__":
    main()
