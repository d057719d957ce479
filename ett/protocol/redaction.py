"""The values of a job's `env` blanked in what its ranks write, by one rule in every place: on the
node, as the rank runner copies a rank's output into its log (agent/launching/rank_log.py) and as
the log shipper reads that log piece by piece (agent/forwarding/log_shipper.py: a rank may write its
log file itself, past its runner), so no secret is shipped even when it is written in two pieces;
and by the service before it stores a piece of output (service/ingest/logs.py) or an event's strings
(service/ingest/store.py), in case the node did not know the secrets (an agent restarted).

What "the secret" is: its characters in order, with anything a reader does not see, or sees as one
mark, ignored between them: NULs, and bytes that are no UTF-8 (shown as U+FFFD once decoded, or
as U+DC80 to U+DCFF where they are decoded to be written back as they were). "alpha-\\0s3cr3t" and
"alpha-\\xffs3cr3t" are the secret "alpha-s3cr3t" for whoever reads them, and are blanked whole.

Standard library only: the rank runner, started fresh for every rank, imports this.
"""

import re
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ett.protocol.event_fields import FIELD_NAMES

REDACTED = "[redacted]"
# Shorter values ("1", "true", "gpu") are not secrets, and blanking them would garble the text.
SECRET_MIN_CHARS = 4
# Unseen characters (runs of them): NUL, U+FFFD, and the surrogates surrogateescape makes of bytes that are no UTF-8.
INVISIBLE = re.compile("[\x00\ufffd\udc80-\udcff]+")
# An event's fields kept as sent though a secret be in them: the service acts on their value (it
# resumes from a committed checkpoint's path), and the job chose it.
KEPT_AS_SENT: dict[str, frozenset[str]] = {"ckpt_committed": frozenset({"path"})}


def secrets_of(values: Iterable[str]) -> list[str]:
    """The values to blank (unseen characters taken out), longest first: where two begin at one
    place, the longer is blanked whole."""
    visible = {INVISIBLE.sub("", value) for value in values}
    return sorted({value for value in visible if len(value) >= SECRET_MIN_CHARS}, key=len, reverse=True)


def _visible(text: str) -> tuple[str, Callable[[int], int]]:
    """`text` without its unseen characters, and the map from a position in it back to `text`."""
    runs = list(INVISIBLE.finditer(text))
    if not runs:
        return text, lambda position: position
    parts, kept_at, text_at = [], [], []  # each visible part: where it starts in the result and in `text`
    kept, pos = 0, 0
    for run in [*runs, None]:
        part = text[pos : run.start() if run else len(text)]
        parts.append(part)
        kept_at.append(kept)
        text_at.append(pos)
        kept += len(part)
        pos = run.end() if run else pos
    # Runs are maximal, so only the first part may be empty: the last part starting at or before a
    # position is the one holding it.
    return "".join(parts), lambda position: text_at[(i := bisect_right(kept_at, position) - 1)] + position - kept_at[i]


class Secrets:
    """A job's secrets, compiled once: blanks them in text, and says where a text's end may begin one."""

    def __init__(self, values: Iterable[str]) -> None:
        self.values = secrets_of(values)
        # One pass, leftmost first and at one place the first alternative (the longest) first: the
        # same text whatever the order of the job's `env`.
        self._pattern = re.compile("|".join(map(re.escape, self.values))) if self.values else None

    def __bool__(self) -> bool:
        return self._pattern is not None

    def spans(self, text: str) -> Iterator[tuple[int, int]]:
        """Where the secrets are in `text` (start, end), unseen characters inside them included."""
        if self._pattern is None:
            return
        visible, at = _visible(text)
        for found in self._pattern.finditer(visible):
            yield at(found.start()), at(found.end() - 1) + 1

    def blank(self, text: str) -> str:
        out, pos = [], 0
        for start, end in self.spans(text):
            out += [text[pos:start], REDACTED]
            pos = end
        return "".join(out) + text[pos:] if out else text

    def blank_data(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        """An event's `data` with every secret in it blanked, at any depth: in strings, in names but
        the kind's declared fields' (a name may be a secret: {"note": {SECRET: 1}}) and in numbers outside its
        declared fields (a secret of digits written as a number becomes the blank), but for the fields
        KEPT_AS_SENT. The top's declared names stay, as the service reads them typed, and so do its
        declared numbers but one that is a secret written as a number (`"tokens": 48151623`, 48151623.0
        too), which is dropped: the blank is no number, and the field is the accounting's (a step
        whose duration is dropped is no step, and is refused and set aside). A declared number
        holding a secret among other digits is kept: a secret of 4 digits ("2024") would otherwise
        erase the counts that hold them (120245 tokens).
        Changed in place, without recursion (a job's JSON may nest as deep as its parser allows)."""
        if self._pattern is None:
            return data
        kept = KEPT_AS_SENT.get(kind, frozenset())
        declared = FIELD_NAMES.get(kind, frozenset())
        for key in [key for key in declared if self._is_a_secret(data.get(key))]:
            del data[key]
        stack: list[dict[str, Any] | list[Any]] = [data]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                for key in [key for key in node if isinstance(key, str) and self.blank(key) != key
                            and not (node is data and key in declared)]:
                    node[self.blank(key)] = node.pop(key)
            for key, value in list(node.items() if isinstance(node, dict) else enumerate(node)):
                top = node is data
                if isinstance(value, str):
                    if not top or key not in kept:
                        node[key] = self.blank(value)
                elif isinstance(value, int | float) and not isinstance(value, bool):
                    if not (top and key in declared) and self.blank(str(value)) != str(value):
                        node[key] = REDACTED
                elif isinstance(value, dict | list):
                    stack.append(value)
        return data

    def _is_a_secret(self, value: object) -> bool:
        """Whether a number, as JSON writes it (an integral float also without its ".0"), is a secret."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        texts = [str(value)] + ([str(int(value))] if isinstance(value, float) and value.is_integer() else [])
        return any(self.blank(text) == REDACTED for text in texts)

    def hold_from(self, text: str) -> int:
        """Where the longest end of `text` begins that a secret begins with (but is not all of),
        unseen characters ignored; len(text) when none."""
        visible, at = _visible(text)
        longest = 0
        for secret in self.values:
            tail = visible[len(visible) - len(secret) + 1 :] if len(visible) >= len(secret) else visible
            start = tail.find(secret[:1])
            while start != -1 and len(tail) - start > longest:
                if secret.startswith(tail[start:]):
                    longest = len(tail) - start
                    break
                start = tail.find(secret[:1], start + 1)
        return at(len(visible) - longest) if longest else len(text)


def redact(text: str, values: Iterable[str]) -> str:
    """`text` with each secret among `values` blanked."""
    return Secrets(values).blank(text)


def _unfinished_character(data: bytes) -> int:
    """How many bytes at the end of `data` begin a UTF-8 character that is not all there yet."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return 0
        if byte >= 0xC0:  # a lead byte: its character's length
            return back if back < (2 if byte < 0xE0 else 3 if byte < 0xF0 else 4) else 0
    return 0


class Redactor:
    """Blanks secrets in output read piece by piece (bytes, as a pipe or a growing file gives them).
    A rank may write a secret in two writes, a pause between them, and a read may end inside it: the
    end of what was read that begins a secret (or a character) is kept back until the next piece, or
    until `flush` at the rank's end. Output that ends otherwise (a newline: nearly all) is kept back
    not at all, so a followed log is not delayed. What is kept back is bounded (`HOLD_MAX_CHARS`
    past the longest secret): a secret with more unseen bytes inside it than that, cut by a read,
    is blanked in pieces."""

    HOLD_MAX_CHARS = 4096

    def __init__(self, values: "Iterable[str] | Secrets") -> None:
        self._secrets = values if isinstance(values, Secrets) else Secrets(values)
        self._hold_max = (len(self._secrets.values[0]) + self.HOLD_MAX_CHARS) if self._secrets else 0
        self._held = b""

    @property
    def held(self) -> int:
        """The bytes kept back, at the end of what was fed."""
        return len(self._held)

    def feed(self, data: bytes) -> bytes:
        """What of `data` (after what was kept back) may be written now, its secrets blanked."""
        if not self._secrets:
            return data
        raw = self._held + data
        # Each byte that is no UTF-8 becomes one character of its own, and is written back as it was.
        text = raw.decode("utf-8", "surrogateescape")
        hold_from = min(self._secrets.hold_from(text), len(text) - _unfinished_character(raw))
        hold_from = max(hold_from, len(text) - self._hold_max)
        out, pos = [], 0
        for start, end in self._secrets.spans(text):
            # A secret found in what is kept back may yet be the start of a longer one: blanked later.
            if start >= hold_from:
                break
            out += [text[pos:start], REDACTED]
            pos = end
        hold_from = max(hold_from, pos)
        out.append(text[pos:hold_from])
        self._held = text[hold_from:].encode("utf-8", "surrogateescape")
        return "".join(out).encode("utf-8", "surrogateescape")

    def flush(self) -> bytes:
        """What is kept back, its secrets blanked: the rank ended, or its last words are wanted now."""
        held, self._held = self._held, b""
        if not held or not self._secrets:
            return held
        return self._secrets.blank(held.decode("utf-8", "surrogateescape")).encode("utf-8", "surrogateescape")
