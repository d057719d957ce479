"""Scheduling decisions: what the service does with the attempt states agents report."""

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.models import Attempt, AttemptNode, AttemptState, Node
from service.schemas.agents import AttemptReport


def on_reports(session: Session, node: Node, reports: Sequence[AttemptReport]) -> None:
    """Records each reported attempt state on the node's share of that attempt."""
    for report in reports:
        share = session.scalar(
            select(AttemptNode)
            .join(Attempt)
            .where(Attempt.job_id == report.job_id, Attempt.number == report.attempt, AttemptNode.node_id == node.id)
        )
        if share is not None:
            share.state = AttemptState(report.state)

