"""ETT reports as terminal tables: the same numbers as GET /api/v1/jobs/{id}/ett and GET /api/v1/ett; and
what a job wrote made safe to show on a terminal."""

import re
from datetime import UTC, datetime
from typing import Any

CATEGORY_ORDER = ("productive", "wasted", "checkpoint_save", "restore", "init", "recovery", "idle")
# What a terminal takes as a command rather than text: the C0 controls but tab and newline (ESC
# starts the sequences that move the cursor, retitle the window, write the clipboard), DEL, and
# the C1 controls (0x9b is CSI to some terminals).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def terminal_safe(text: str) -> str:
    """Text a job wrote, fit for the user's terminal: each control character but tab and newline
    shown as its escape (ESC as `\\x1b`), so what a job prints cannot drive the terminal."""
    return _CONTROL.sub(lambda found: f"\\x{ord(found.group()):02x}", text)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def _sizes(report: dict[str, Any]) -> list[str]:
    """An elastic job's sizes, where an attempt ran on fewer nodes than its full size (docs/ett.md,
    "Reduced capacity"); nothing for a job that never shrank."""
    sizes = report.get("attempt_sizes", [])  # a service from before #51 sends none
    if not any(s["nodes"] and s["full_nodes"] and s["nodes"] < s["full_nodes"] for s in sizes):
        return []
    said = ", ".join(f"attempt {s['attempt']}: {s['nodes']} of {s['full_nodes']} nodes" for s in sizes if s["nodes"])
    reduced = _seconds(report["reduced_capacity_seconds"])
    return [f"capacity {report['capacity_percent']:.1f}%  reduced capacity {reduced}  sizes: {said}"]


def report_table(report: dict[str, Any], max_failures: int | None = None) -> str:
    wall = report["wall_seconds"]
    lines = [
        f"job {report['job_id']}  state {report['state']}",
        f"ETT {report['ett_percent']:.1f}%  wall {_seconds(wall)}  queued {_seconds(report['queued_seconds'])}"
        f"  time to start {_seconds(report['time_to_start_seconds'])}",
        f"at full speed {report['full_speed_percent']:.1f}%  slow {_seconds(report['slow_seconds'])}"
        "  ideal step " + ("-" if report["ideal_step_seconds"] is None else f"{report['ideal_step_seconds']:.3f} s"),
        *_sizes(report),
        "",
        f"  {'category':16} {'seconds':>10} {'share':>7}",
    ]
    for category in CATEGORY_ORDER:
        seconds = report["seconds"][category]
        share = 100 * seconds / wall if wall else 0.0
        lines.append(f"  {category:16} {seconds:>10.2f} {share:>6.1f}%")
    for s in report.get("stragglers", []):
        lines.append(f"straggler: rank {s['rank']} on {s['node']} (attempt {s['attempt']})"
                     f" since step {s['since_step']}:"
                     f" {s['relative']:.1f}x its peers' work, {s['action']}"
                     + (f": {s['reason']}" if s.get("reason") else ""))
    for s in report.get("slowdowns", []):
        lines.append(f"slowdown ({'the whole job' if s['cause'] == 'whole_job' else 'a straggler'}, attempt "
                     f"{s['attempt']}): {s['factor']:.1f}x its ideal step from step {s['since_step']}"
                     f" {'on' if s['ongoing'] else 'to ' + str(s['last_step'])}, {_seconds(s['slow_seconds'])} slow")
    failures = report["failures"]
    lines += ["", f"failures {len(failures)}  restarts {report['restarts']}  MTBF {_seconds(report['mtbf_seconds'])}"]
    for failure in failures[:max_failures]:
        lines.append(
            f"  attempt {failure['attempt']}: {failure['cause']:9} time to recover "
            f"{_seconds(failure['time_to_recover_seconds'])}  lost steps {failure['lost_steps']}"
            + (f"  {failure['detail']}" if failure.get("detail") else "")
        )
        if failure.get("diagnosis") and failure.get("summary") != failure.get("detail"):
            lines.append(f"    {failure['diagnosis']}: {failure['summary']}")
    if max_failures is not None and len(failures) > max_failures:
        lines.append(f"  ... and {len(failures) - max_failures} more")
    checkpoints = report["checkpoints"]
    lines += [
        "",
        f"checkpoints committed {checkpoints['committed']}  last step {checkpoints['last_committed_step']}"
        f"  blocking {_seconds(checkpoints['mean_blocking_seconds'])}"
        f"  commit {_seconds(checkpoints['mean_commit_seconds'])}",
        f"recommended checkpoint interval {_seconds(report['recommended_checkpoint_interval_seconds'])}",
    ]
    return "\n".join(lines)


def progress_line(report: dict[str, Any]) -> str:
    """One line of a followed report: when, the state, ETT and what changes it."""
    now = datetime.now(UTC).strftime("%H:%M:%S")
    return (f"{now}  {report['state']}  ETT {report['ett_percent']:.1f}%  wall {_seconds(report['wall_seconds'])}  "
            f"productive {_seconds(report['seconds']['productive'])}  failures {len(report['failures'])}  "
            f"restarts {report['restarts']}")


def _utc(unix: float | None) -> str:
    return "the start" if unix is None else datetime.fromtimestamp(unix, UTC).strftime("%Y-%m-%d %H:%M UTC")


def fleet_table(fleet: dict[str, Any]) -> str:
    wall = fleet["wall_seconds"]
    lines = [
        f"fleet from {_utc(fleet['since'])} to {_utc(fleet['until'])}: {fleet['jobs']} jobs",
        f"ETT {fleet['ett_percent']:.1f}%  at full speed {fleet['full_speed_percent']:.1f}%  job time {_seconds(wall)}"
        f"  failures {fleet['failures']}"
        f"  mean time to recover {_seconds(fleet['mean_time_to_recover_seconds'])}",
        "",
        "where the rest of the time went:",
    ]
    lost = sorted(((k, v) for k, v in fleet["seconds"].items() if k != "productive" and v > 0), key=lambda kv: -kv[1])
    lines += [f"  {category:16} {seconds:>10.1f} s {100 * seconds / wall:>6.1f}%" for category, seconds in lost]
    lines += ["", "failures by cause: " + (", ".join(f"{c} {n}" for c, n in fleet["failure_causes"].items()) or "none")]
    lines += ["failures by diagnosis: " + (", ".join(f"{d} {n}" for d, n in fleet["failure_diagnoses"].items())
                                           or "none")]
    lines += ["", f"  {'JOB':32}  {'NAME':20}  {'ETT':>6}  {'JOB TIME':>10}  FAILURES"]
    for job_id, job in sorted(fleet["by_job"].items(), key=lambda item: item[1]["ett_percent"]):
        lines.append(f"  {job_id:32}  {job['name'][:20]:20}  {job['ett_percent']:>5.1f}%  "
                     f"{_seconds(job['wall_seconds']):>10}  {job['failures']}")
    return "\n".join(lines)
