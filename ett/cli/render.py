"""The ETT report as a terminal table: the same numbers as GET /api/v1/jobs/{id}/ett."""

from typing import Any

CATEGORY_ORDER = ("productive", "wasted", "checkpoint_save", "restore", "init", "recovery", "idle")


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def report_table(report: dict[str, Any], max_failures: int | None = None) -> str:
    wall = report["wall_seconds"]
    lines = [
        f"job {report['job_id']}  state {report['state']}",
        f"ETT {report['ett_percent']:.1f}%  wall {_seconds(wall)}  queued {_seconds(report['queued_seconds'])}"
        f"  time to start {_seconds(report['time_to_start_seconds'])}",
        "",
        f"  {'category':16} {'seconds':>10} {'share':>7}",
    ]
    for category in CATEGORY_ORDER:
        seconds = report["seconds"][category]
        share = 100 * seconds / wall if wall else 0.0
        lines.append(f"  {category:16} {seconds:>10.2f} {share:>6.1f}%")
    failures = report["failures"]
    lines += ["", f"failures {len(failures)}  restarts {report['restarts']}  MTBF {_seconds(report['mtbf_seconds'])}"]
    for failure in failures[:max_failures]:
        lines.append(
            f"  attempt {failure['attempt']}: {failure['cause']:9} time to recover "
            f"{_seconds(failure['time_to_recover_seconds'])}  lost steps {failure['lost_steps']}"
        )
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
