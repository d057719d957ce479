"""Sending one batch of events to the service, and what becomes of the events it refuses.

A batch refused with 422 is not retried as it is: the events the answer names (`events.<index>...`)
go to a dead-letter file and the rest is sent again. An answer naming none is bisected until the bad
events stand alone. A line that is not a JSON object is set aside unsent. Apart from the forwarder
(agent.forwarding.forward), which decides when a batch goes and what counts as sent.
"""

import contextlib
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from agent.files.jsonl import append_json_line
from agent.forwarding.spool_files import RAW_KEEP_BYTES, Spooled
from agent.node.metrics import AgentStats

log = logging.getLogger(__name__)
REJECTED_INDEX = re.compile(r"\bevents\.(\d+)\b")
# The dead letters' file is rotated at this size (one older file kept): a job may send garbage for ever.
DEAD_LETTERS_MAX_BYTES = 16 << 20
Send = Callable[[list[dict[str, Any]]], httpx.Response]


def rejected_indices(body: Any) -> set[int]:
    """Event indices a 422 answer names, from FastAPI's `loc` lists or `events.N.field` text."""
    detail = body.get("detail") if isinstance(body, dict) else body
    found = {int(n) for n in REJECTED_INDEX.findall(json.dumps(detail))}
    for error in detail if isinstance(detail, list) else []:
        loc = error.get("loc", []) if isinstance(error, dict) else []
        found |= {b for a, b in zip(loc, loc[1:]) if a == "events" and isinstance(b, int)}
    return found


def bounded(error: Any) -> Any:
    """The service's answer as a dead letter keeps it: as it came, or its JSON text cut short (a
    422 may quote the megabytes it refused)."""
    text = json.dumps(error)
    return error if len(text) <= RAW_KEEP_BYTES else text[:RAW_KEEP_BYTES]


class Delivery:
    def __init__(self, send: Send, stats: AgentStats, dead_letter_file: Path) -> None:
        self.send = send
        self.stats = stats
        self.dead_letter_file = dead_letter_file
        if self.dead_letter_file.exists():  # bounded (DEAD_LETTERS_MAX_BYTES): read whole
            self.stats.dead_letters = len(self.dead_letter_file.read_bytes().splitlines())

    def deliver(self, items: list[Spooled]) -> bool:
        """Sends items (marking each done); False when the service is unreachable or failing."""
        for item in items:
            if item.event is None:
                self._dead_letter(item, "not a JSON object")
        items = [item for item in items if not item.done]
        if not items:
            return True
        events = [item.event | {"job_id": item.file.split("/", 1)[0]} for item in items]
        try:
            response = self.send(events)
        except httpx.HTTPError as exc:
            log.warning("forwarding %d events failed: %s", len(items), exc)
            return False
        if response.status_code == 200:
            for item in items:
                item.done = True
            self.stats.events_forwarded += len(items)
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                self.stats.events_repeated += int(response.json().get("duplicates", 0))
            return True
        if response.status_code not in (413, 422):
            log.warning("forwarding %d events: service answered %d %s", len(items), response.status_code,
                        response.text[:200])
            return False
        detail = response.text
        with contextlib.suppress(ValueError):
            detail = response.json()
        named = {i for i in rejected_indices(detail) if i < len(items)}
        for i in named:
            self._dead_letter(items[i], detail)
        rest = [item for item in items if not item.done]
        if named or not rest:
            return self.deliver(rest)
        if len(rest) == 1:
            self._dead_letter(rest[0], detail)
            return True
        half = len(rest) // 2
        return self.deliver(rest[:half]) and self.deliver(rest[half:])

    def note(self, file: str, error: str) -> None:
        """A dead letter for what was set aside unread (the spools of ranks beyond an attempt's world)."""
        log.error("set aside in %s: %s: %s", self.dead_letter_file, file, error[:200])
        self._append({"file": file, "error": error[:RAW_KEEP_BYTES]})

    def _append(self, letter: dict[str, Any]) -> None:
        with contextlib.suppress(FileNotFoundError):
            if self.dead_letter_file.stat().st_size >= DEAD_LETTERS_MAX_BYTES:
                self.dead_letter_file.replace(self.dead_letter_file.with_name(self.dead_letter_file.name + ".1"))
        append_json_line(self.dead_letter_file, letter, mode=0o600)
        self.stats.dead_letters += 1

    def _dead_letter(self, item: Spooled, error: Any) -> None:
        log.error("event set aside in %s: %s: %s", self.dead_letter_file, item.file, str(error)[:200])
        line = item.raw.decode(errors="replace")  # its start: a job's line may be megabytes
        self._append({"file": item.file, "end_offset": item.end, "line": line, "bytes": item.size,
                      "error": bounded(error)})
        item.done = True
