"""The rank runners' records of one attempt (control/ranks.jsonl, written by agent.launching.rank_runner):
each rank's pids, that its output is all in its log, how it ended.

The file is the job's to write: a pid read there is signalled only where the group owns it by the
kernel's word (WorkerGroup.owns), and an out-of-memory kill is the kernel's word too (agent.groups.oom),
never the record's. Kept apart from the group, which decides from these records how it ends.
"""

import signal
from collections.abc import Callable, Container, Iterator
from pathlib import Path
from typing import Any

from agent.files.spool import SpoolReader
from agent.groups.oom import OomWatch
from agent.groups.states import GroupEnd, WorkerState
from agent.launching.rank_log import OUTPUT_DRAIN_SECONDS, OUTPUT_IN_LOG
from ett.protocol.event_fields import WorkerExitedData

# How long after a rank's exit record its output is waited for at most (its runner's drain, and a margin).
OUTPUT_WAIT_SECONDS = OUTPUT_DRAIN_SECONDS + 0.5
RECORD_TEXT_CHARS = 512  # a runner's words on an exit are short; a job's forged ones are cut here


def exit_record(record: dict[str, Any]) -> WorkerExitedData:
    """An exit record as a runner writes it: the fields of its type, each of that type (text cut
    short), a signal only by a signal's name, whatever else the job's line held left out; `oom` is
    the kernel's word, never the line's."""
    kept: dict[str, Any] = {}
    for name, kind in WorkerExitedData.__annotations__.items():
        value = record.get(name)
        if name == "signal" and not (isinstance(value, str) and value in signal.Signals.__members__):
            continue  # a job's words in root's log and the job's reason: a name, or nothing
        if name != "oom" and type(value) is kind:  # bool is no exit code
            kept[name] = value[:RECORD_TEXT_CHARS] if isinstance(value, str) else value
    return WorkerExitedData(**kept)  # type: ignore[typeddict-item]


def end_of_rank(record: dict[str, Any]) -> GroupEnd | None:
    """The failure a rank runner's exit record describes, or None for a clean exit."""
    rank = record["rank"]
    if "signal" in record:
        oom = f": the kernel's out-of-memory killer ({record['oom']})" if record.get("oom") else ""
        return GroupEnd(WorkerState.FAILED, "signal", f"rank {rank} killed by {record['signal']}{oom}")
    code = record.get("exit_code")
    if code == 0:
        return None
    if record.get("error"):  # the rank's program could not be started at all (agent.launching.launch_check)
        return GroupEnd(WorkerState.FAILED, "exit", f"rank {rank} cannot start: {record['error']}", code)
    note = " (injected fault)" if record.get("fault") else ""
    return GroupEnd(WorkerState.FAILED, "exit", f"rank {rank} exit code {code}{note}", code)


class RankRecords:
    def __init__(self, ranks_file: Path, ranks: int, on_runner: Callable[[int], None], world: int) -> None:
        self.ranks_file = ranks_file
        self.ranks = ranks  # the local ranks torchrun starts
        self.world = world  # a record of a rank outside the job's is not one of ours
        self.on_runner = on_runner  # told each rank runner's pid as it is read: the group watches its exit
        self.rank_pids: dict[int, int] = {}
        self.runner_pids: dict[int, int] = {}
        self.exited: dict[int, dict[str, Any]] = {}
        self.exited_at: dict[int, float] = {}  # when each rank's exit record was read
        self.in_log: set[int] = set()  # ranks whose runner said their output is all in their log
        self._oom = OomWatch()  # the kernel's out-of-memory kills from now on
        self._reader = SpoolReader()

    @property
    def all_started(self) -> bool:
        return len(self.rank_pids) == self.ranks

    @property
    def all_exited(self) -> bool:
        return len(self.exited) == self.ranks

    @property
    def all_succeeded(self) -> bool:
        return self.all_exited and all(end_of_rank(r) is None for r in self.exited.values())

    def read(self, now: float) -> Iterator[tuple[int, dict[str, Any]]]:
        """Reads on; yields each new exit record as (rank, record), in the file's order."""
        for record in self._reader.read(self.ranks_file):
            rank = record.get("rank")
            if type(rank) is not int or not 0 <= rank < self.world:
                continue
            if "pid" in record:
                pid, runner_pid = record["pid"], record.get("runner_pid")
                if isinstance(pid, int) and isinstance(runner_pid, int):  # only ever signalled if owns() says so
                    self.rank_pids[rank], self.runner_pids[rank] = pid, runner_pid
                    self.on_runner(runner_pid)
                continue
            if record.get(OUTPUT_IN_LOG) is True:
                self.in_log.add(rank)
                continue
            record = dict(exit_record(record))
            if "signal" not in record and "exit_code" not in record:
                continue  # says nothing of how the rank ended: no exit record
            if record.get("signal") == "SIGKILL" and rank in self.rank_pids:
                killed = self._oom.killed({self.rank_pids[rank]})  # by the out-of-memory killer? (oom.py)
                if killed:
                    record["oom"] = next(iter(killed.values()))
            self.exited[rank], self.exited_at[rank] = record, now
            yield rank, record

    def unrecorded(self, clock: Callable[[], float]) -> Iterator[tuple[int, dict[str, Any]]]:
        """The ranks that started and left no exit record, recorded now as SIGKILLed: their runner was
        (by the agent or by its parent's death), and so were they."""
        for rank in sorted(self.rank_pids.keys() - self.exited.keys()):
            self.exited[rank], self.exited_at[rank] = {"rank": rank, "signal": "SIGKILL"}, clock()
            yield rank, self.exited[rank]

    def output_in(self, ranks: set[int], now: float, watched: Container[int]) -> bool:
        """Whether the output of these exited ranks is all in their logs: their runners said so or
        have exited (no longer `watched`, agent.launching.rank_runner), or they were waited for long enough."""
        return all(rank in self.in_log or self.runner_pids.get(rank) not in watched
                   or now - self.exited_at[rank] >= OUTPUT_WAIT_SECONDS for rank in ranks)

    def close(self) -> None:
        self._oom.close()
