"""A failed rank's last output read as what it is, text the job wrote: bounded, and matched in
linear time (docs/reliability.md, "Failure diagnosis").

Only the last TAIL_LINES lines of a rank's log are read, and of each only its first LINE_CHARS
characters, found from the end of the log without splitting the whole of it. The built-in patterns
are written so that no two unbounded repetitions trade characters (the old `NCCL.*[Tt]imed? ?out`
and the exception pattern took 1.9 s on one line of 32 Ki characters, minutes on 256 Ki):
"a, then later b" is the first `a` held (an atomic group), then `b` looked for once after it.
torchrun's and torch.distributed's line prefixes (`[default0]:`, `[rank0]:`, then c10's
`[W1115 10:24:11.960449418 ProcessGroupNCCL.cpp:1250]`) are taken off before matching, so a
traceback printed as `[rank0]: ValueError: bad batch` reads as `ValueError: bad batch`.
"""

import re
from collections.abc import Sequence
from dataclasses import dataclass

TAIL_LINES = 60
LINE_CHARS = 1024  # of each line, its first; a summary keeps SUMMARY_CHARS of them
SUMMARY_CHARS = 240


def _then(first: str, later: str) -> str:
    """A pattern for "`first`, then `later` further on the line", in one pass: from the line's start,
    the first `first` is held, and `later` is looked for once after it."""
    return rf"\A(?>.*?(?:{first})).*?(?:{later})"


PEER_ADDRESS = r"\[[\w.:-]{1,64}\]:\d"  # the other end of a connection, as gloo and c10d write it
PEER_ERRORS = "Connection reset by peer|Broken pipe|Connection refused"

# (diagnosis, pattern): the first diagnosis whose pattern matches a line of the rank's last
# output wins (so the specific before the general: a CUDA out-of-memory is also an exception);
# the summary is the last line it matched.
DEFAULT_PATTERNS: tuple[tuple[str, str], ...] = (
    ("import_error", r"^(?:ModuleNotFoundError|ImportError): ."),
    ("cuda_out_of_memory", r"torch\.(?:cuda\.)?OutOfMemoryError|CUDA out of memory"),
    ("out_of_memory", r"^MemoryError\b|Cannot allocate memory|std::bad_alloc|out-of-memory killer"),
    ("collective_timeout", "Watchdog caught collective operation timeout|"
                           f"{_then('NCCL', '[Tt]imed? ?out')}|{_then('[Gg]loo', '[Tt]imed out')}"),
    ("hardware_error",
     r"\bXid\b|uncorrectable ECC|CUDA error: (?:an illegal memory access|unspecified launch failure)"),
    ("disk_full", r"No space left on device|Disk quota exceeded"),
    # A survivor's end when a peer went away (its node lost, service/jobs/peer_loss.py): gloo's closed or
    # reset connection, NCCL's remote error, the rendezvous store gone. A reset, a broken pipe or a
    # refusal counts only beside an [address]:port as gloo and c10d name the other end (a job's own
    # downloads see resets too).
    ("peer_lost", "Connection closed by peer|ncclRemoteError|remote process exited|DistNetworkError|DistStoreError|"
                  "RendezvousConnectionError|failed to recv, got 0 bytes|"
                  f"{_then(PEER_ADDRESS, PEER_ERRORS)}|{_then(PEER_ERRORS, PEER_ADDRESS)}"),
    # `module.path.` (each part taken whole), then a class name holding Error, Exception or
    # Interrupt (its first such word held), then the end or `: message`.
    ("exception", r"^(?:[A-Za-z_]\w*+\.)*+(?>[A-Z]\w*?(?:Error|Exception|Interrupt))\w*+(?::.*)?$"),
)  # fmt: skip

# torchrun's `[default0]:` (--tee, --redirects) and torch.distributed's `[rank0]:` (a word ending in
# a number, then a colon; up to four deep), then c10's log prefix if any (`[W socket.cpp:464]`, or
# with the date and time: `[E1115 10:24:11.960449418 ProcessGroupNCCL.cpp:607]`). Each part bounded.
RANK_PREFIX = re.compile(r"(?:\[[A-Za-z_][\w-]{0,63}(?<=\d)\]: ?){0,4}"
                         r"(?:\[[IWEF][\d :.]{0,40}[\w.-]{1,128}:\d{1,6}\] ?)?")
# What differs between two runs of the same failure: hex addresses, long hex words with a digit,
# numbers (pids, ports, addresses, durations, steps).
_VARYING = re.compile(r"0[xX][0-9A-Fa-f]++|\b(?=[0-9A-Fa-f]*\d)[0-9A-Fa-f]{8,}+\b|\d++(?:\.\d++)?")


@dataclass(frozen=True)
class Diagnosis:
    kind: str
    summary: str


def compile_patterns(extra: Sequence[tuple[str, str]] = ()) -> list[tuple[str, re.Pattern[str]]]:
    return [(kind, re.compile(pattern)) for kind, pattern in (*extra, *DEFAULT_PATTERNS)]


DEFAULT_COMPILED = compile_patterns()


def last_lines(text: str, count: int = TAIL_LINES) -> list[str]:
    """The first LINE_CHARS characters of each of the text's last `count` lines, found from its end:
    each line costs its own length to find, whatever the text's."""
    lines: list[str] = []
    end = len(text) - 1 if text.endswith("\n") else len(text)
    while text and end >= 0 and len(lines) < count:
        start = text.rfind("\n", 0, end) + 1
        lines.append(text[start:min(end, start + LINE_CHARS)])
        end = start - 1
    return lines[::-1]


def seen_through(line: str) -> str:
    """The line without the prefixes torchrun and torch.distributed put before what a rank printed."""
    found = RANK_PREFIX.match(line)
    return line[found.end():] if found else line


def read_lines(lines: Sequence[str], patterns: Sequence[tuple[str, re.Pattern[str]]]) -> Diagnosis | None:
    """The diagnosis the lines tell, and the last line that tells it; each line cut to LINE_CHARS
    characters and seen through its prefixes first."""
    examined = [seen_through(line[:LINE_CHARS]).strip() for line in lines]
    for kind, pattern in patterns:
        matched = [line for line in examined if pattern.search(line)]
        if matched:
            return Diagnosis(kind, matched[-1][:SUMMARY_CHARS])
    return None


def failure_key(summary: str | None) -> str | None:
    """A summary as two runs of one failure both print it: numbers, pids, ports, durations and
    addresses taken out (`worker (pid 4242) ... after 12.5 s` and `(pid 4377) ... after 9.1 s` agree)."""
    return None if summary is None else _VARYING.sub("#", summary)
