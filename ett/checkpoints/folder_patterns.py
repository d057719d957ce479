"""What names a framework's checkpoint folders, as a user writes it (docs/library.md, "Frameworks
that own the loop"): a format such as "step_{step}" or "ckpt-{step:06d}", a regular expression
such as r"step_(\\d+)" (as a string or compiled), whose group `step`, or else its first group, is
the step. Each becomes one compiled pattern that matches a whole folder name."""

import re
import string
from pathlib import Path

from ett.errors import UsageError

# "{step}" or "{step:...}" in a string makes it a format: a regular expression has no use for it.
_FORMAT_FIELD = re.compile(r"\{step(?::[^{}]*)?\}")


def folder_pattern(pattern: str | re.Pattern) -> re.Pattern:
    """The compiled pattern of `pattern` (a format, a regular expression, or a compiled one, as it is)."""
    if isinstance(pattern, re.Pattern):
        return _with_a_step_group(pattern, pattern.pattern)
    if not isinstance(pattern, str) or not pattern:
        raise UsageError(f"checkpoint folder pattern {pattern!r}: give a format such as 'step_{{step}}' or a "
                         r"regular expression such as 'step_(\d+)'")
    if _FORMAT_FIELD.search(pattern):
        return _from_format(pattern)
    try:
        compiled = re.compile(rf"(?:{pattern})\Z")  # the whole name: 'step_12.tmp' is no 'step_(\d+)'
    except re.error as error:
        raise UsageError(f"checkpoint folder pattern {pattern!r}: not a regular expression ({error})") from None
    return _with_a_step_group(compiled, pattern)


def _from_format(fmt: str) -> re.Pattern:
    parts = []
    try:
        parsed = list(string.Formatter().parse(fmt))
    except ValueError as error:
        raise UsageError(f"checkpoint folder pattern {fmt!r}: not a format ({error})") from None
    for literal, field, _spec, _conversion in parsed:
        parts.append(re.escape(literal))
        if field is None:
            continue
        if field != "step" or "(?P<step>" in "".join(parts):
            raise UsageError(f"checkpoint folder pattern {fmt!r}: a format names the step once, as {{step}}, "
                             "and nothing else")
        parts.append(r"(?P<step>\d+)")
    return re.compile("".join(parts) + r"\Z")


def _with_a_step_group(compiled: re.Pattern, given: str) -> re.Pattern:
    if "step" not in compiled.groupindex and compiled.groups < 1:
        raise UsageError(f"checkpoint folder pattern {given!r}: it needs a group for the step, as in "
                         r"'step_(\d+)'")
    return compiled


def pattern_of_folder(folder: str | Path, step: int) -> re.Pattern | None:
    """The pattern of `folder`'s siblings of other steps: its name with the run of digits that
    spells `step` as the step (`ckpt-00000040` at 40: `ckpt-(\\d+)`); None when its name does not
    spell the step. Where several runs spell it (`ckpt_20_of_20`), the one under which most of the
    folders beside it match (`ckpt_(\\d+)_of_20`), the last one on a tie."""
    folder = Path(folder)
    candidates = [re.compile(rf"{re.escape(folder.name[: m.start()])}(?P<step>\d+){re.escape(folder.name[m.end() :])}\Z")
                  for m in re.finditer(r"\d+", folder.name) if int(m.group()) == step]  # fmt: skip
    if len(candidates) < 2:
        return candidates[0] if candidates else None
    try:
        siblings = [p.name for p in folder.parent.iterdir() if p != folder]
    except OSError:
        siblings = []
    return max(reversed(candidates), key=lambda c: sum(1 for name in siblings if c.match(name)))
