"""The values of a job's `env` blanked in its ranks' output, by one rule in two places: on the node,
as the rank runner copies a rank's output into its log (agent/launching/rank_log.py), so no secret
is shipped even when a rank prints it in two writes; and by the service before it stores what an
agent shipped (service/jobs/logs.py), in case a job wrote into its log file itself.

Standard library only: the rank runner, started fresh for every rank, imports this.
"""

import re
from collections.abc import Iterable

REDACTED = "[redacted]"
# Shorter values ("1", "true", "gpu") are not secrets, and blanking them would garble the text.
SECRET_MIN_CHARS = 4


def secrets_of(values: Iterable[str]) -> list[str]:
    """The values to blank, longest first: where two begin at one place, the longer is blanked whole."""
    return sorted({value for value in values if len(value) >= SECRET_MIN_CHARS}, key=len, reverse=True)


def _pattern(secrets: list[bytes] | list[str]) -> re.Pattern:
    # One pass, leftmost first and at one place the first alternative (the longest) first: the same
    # text whatever the order of the job's `env`.
    return re.compile(b"|".join(map(re.escape, secrets)) if isinstance(secrets[0], bytes)
                      else "|".join(map(re.escape, secrets)))  # fmt: skip


def redact(text: str, values: Iterable[str]) -> str:
    """`text` with each secret among `values` blanked."""
    secrets = secrets_of(values)
    return _pattern(secrets).sub(REDACTED, text) if secrets else text


class Redactor:
    """Blanks secrets in output read piece by piece (bytes, as a pipe gives them). A rank may print a
    secret in two writes, a pause between them, and a read may end inside it: the end of what was
    read that begins a secret (at most the longest secret's length less one) is kept back until the
    next piece, or until `flush` at the rank's end. Output that ends otherwise (a newline: nearly
    all) is kept back not at all, so a followed log is not delayed."""

    def __init__(self, values: Iterable[str]) -> None:
        self._secrets = [secret.encode() for secret in secrets_of(values)]
        self._pattern = _pattern(self._secrets) if self._secrets else None
        self._held = b""

    def feed(self, data: bytes) -> bytes:
        """What of `data` (after what was kept back) may be written now, its secrets blanked."""
        if self._pattern is None:
            return data
        text = self._held + data
        hold_from = len(text) - self._beginning_of_a_secret(text)
        out, pos = [], 0
        for found in self._pattern.finditer(text):
            # A secret found in what is kept back may yet be the start of a longer one: blanked later.
            if found.start() >= hold_from:
                break
            out += [text[pos : found.start()], REDACTED.encode()]
            pos = found.end()
        hold_from = max(hold_from, pos)
        out.append(text[pos:hold_from])
        self._held = text[hold_from:]
        return b"".join(out)

    def flush(self) -> bytes:
        """What is kept back, its secrets blanked: the rank ended, or its last words are wanted now."""
        held, self._held = self._held, b""
        return self._pattern.sub(REDACTED.encode(), held) if self._pattern is not None else held

    def _beginning_of_a_secret(self, text: bytes) -> int:
        """The length of the longest end of `text` that a secret begins with (but is not all of)."""
        longest = 0
        for secret in self._secrets:
            tail = text[len(text) - len(secret) + 1 :] if len(text) >= len(secret) else text
            start = tail.find(secret[:1])
            while start != -1 and len(tail) - start > longest:
                if secret.startswith(tail[start:]):
                    longest = len(tail) - start
                    break
                start = tail.find(secret[:1], start + 1)
        return longest
