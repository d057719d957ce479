"""A job spec file (.toml or .json) read and checked as `ett submit` does: each mistake is one
line, `FILE:LINE: field: what is wrong`, with the line found in the file (docs/jobspec.md)."""

import difflib
import json
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

from service.schemas import field_and_message

KEY_PART = re.compile(r'\s*("[^"]*"|\'[^\']*\'|[A-Za-z0-9_-]+)\s*(\.|$)')
TOML_POSITION = re.compile(r"\s*\(at (?:line (\d+), column \d+|end of document)\)$")
# pydantic names the branch of a union it tried as a part of the location: not a field.
UNION_BRANCH = re.compile(r"^(constrained-\w+|literal\[.*\]|function-\w+\[.*\]|str|int|float|bool|list\[.*\]|none)$")


class SpecFileError(Exception):
    """One line per mistake, each naming the file, the line where it can be found, and the field."""


def _key_path(text: str) -> tuple[str, ...]:
    parts, rest = [], text
    while rest.strip():
        match = KEY_PART.match(rest)
        if match is None:
            return ()
        parts.append(match[1].strip("\"'"))
        rest = rest[match.end():]
    return tuple(parts)


def toml_line(text: str, loc: tuple) -> int | None:
    """The line of `loc` (a pydantic location: keys and array indices) in a TOML document: the line
    whose table and key are the longest start of `loc`."""
    table: tuple = ()
    seen: dict[tuple, int] = {}
    best, best_length = None, 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.startswith("[["):
            name = _key_path(line[2:line.find("]]")])
            seen[name] = seen.get(name, -1) + 1
            path = table = (*name, seen[name])
        elif line.startswith("["):
            path = table = _key_path(line[1:line.find("]")])
        elif "=" in line and not line.startswith("#"):
            path = (*table, *_key_path(line.split("=", 1)[0]))
        else:
            continue
        if path and loc[: len(path)] == path and len(path) > best_length:
            best, best_length = number, len(path)
    return best


def json_line(text: str, loc: tuple) -> int | None:
    key = next((str(p) for p in reversed(loc) if isinstance(p, str)), None)
    for number, line in enumerate(text.splitlines(), 1):
        if key is not None and f'"{key}"' in line:
            return number
    return None


def _classes(annotation: Any) -> Iterator[Any]:
    """An annotation and every type inside it (Optional, list, Annotated...)."""
    yield annotation
    for arg in get_args(annotation):
        yield from _classes(arg)


def fields_beside(model: type[BaseModel], loc: tuple) -> list[str]:
    """The field names of the section that holds `loc`: what a misspelt key there could have meant."""
    for part in loc[:-1]:
        if isinstance(part, int):
            continue  # an item of a list: the list's own model comes next
        field = model.model_fields.get(part)
        nested = [t for t in _classes(field.annotation) if isinstance(t, type) and issubclass(t, BaseModel)] if field else []
        if not nested:
            return []
        model = nested[0]
    return list(model.model_fields)


def unknown_field(model: type[BaseModel], loc: tuple) -> str:
    """"not a field; did you mean 'checkpoint'?" or the section's fields when none is close."""
    known = fields_beside(model, loc)
    close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6) if loc else []
    if close:
        return f"not a field; did you mean {close[0]!r}?"
    return f"not a field (the fields here: {', '.join(known)})" if known else "not a field"


def _mistakes(exc: ValidationError, model: type[BaseModel]) -> dict[tuple, list[str]]:
    """The errors by field: union branches folded into their field, one message list per field."""
    by_field: dict[tuple, list[str]] = {}
    for error in exc.errors():
        loc = tuple(p for p in error["loc"] if not (isinstance(p, str) and UNION_BRANCH.match(p)))
        message = unknown_field(model, loc) if error["type"] == "extra_forbidden" else error["msg"]
        field, message = field_and_message(".".join(map(str, loc)), message)
        loc = tuple(int(p) if p.isdigit() else p for p in field.split(".")) if field else ()
        messages = by_field.setdefault(loc, [])
        if message not in messages:
            messages.append(message)
    return by_field


def _one_line(messages: list[str]) -> str:
    """Messages of one field's union branches as one: "Input should be A, or B"."""
    first, *others = messages
    return ", or ".join([first, *(m.removeprefix("Input should be ") for m in others)])


def _nested_overrides(spec: dict[str, Any]) -> list[tuple[tuple, str]]:
    """Unquoted dotted override keys: TOML reads `train.steps = 60` as a table `train`."""
    overrides = spec.get("trainer", {}).get("overrides", {}) if isinstance(spec.get("trainer"), dict) else {}
    found = []
    for name, value in overrides.items() if isinstance(overrides, dict) else ():
        if isinstance(value, dict):
            inner, inner_value = next(iter(value.items()), ("field", "value"))
            found.append((("trainer", "overrides", name, inner), f"an override key with a dot must be quoted in "
                          f"TOML: write \"{name}.{inner}\" = {json.dumps(inner_value)}"))
    return found


def load_spec(path: Path) -> dict[str, Any]:
    """Reads and checks a job spec; SpecFileError with one line per mistake."""
    from service.spec.job_spec import JobSpec

    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecFileError(f"{path}: {exc.strerror}") from None
    try:
        if path.suffix == ".toml":
            spec, find_line = tomllib.loads(text), toml_line
        elif path.suffix == ".json":
            spec, find_line = json.loads(text), json_line
        else:
            raise SpecFileError(f"{path}: a job spec is a .toml or a .json file")
    except json.JSONDecodeError as exc:
        raise SpecFileError(f"{path}:{exc.lineno}: {exc.msg}") from None
    except tomllib.TOMLDecodeError as exc:
        position = TOML_POSITION.search(str(exc))
        line = position[1] if position and position[1] else len(text.splitlines()) if position else "?"
        raise SpecFileError(f"{path}:{line}: {TOML_POSITION.sub('', str(exc))}") from None
    mistakes = _nested_overrides(spec)
    if not mistakes:
        try:
            JobSpec.model_validate(spec)
        except ValidationError as exc:
            mistakes = [(loc, _one_line(messages)) for loc, messages in _mistakes(exc, JobSpec).items()]
    if mistakes:
        located = sorted(((find_line(text, loc), loc, message) for loc, message in mistakes),
                         key=lambda m: m[0] or len(text))  # in the file's order, as a person reads it
        lines = [f"{path}:{line or '?'}: {'.'.join(map(str, loc)) or '(top level)'}: {message}"
                 for line, loc, message in located]
        raise SpecFileError("\n".join(lines))
    return spec
