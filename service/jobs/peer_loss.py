"""A node lost to its peers, known in about a second, and fenced (docs/reliability.md, "Node loss").

The heartbeat deadline (heartbeat_timeout_seconds, 30 s) is silence alone, and long: an agent may
pause for seconds and come back. A lost node gives more evidence than silence, and sooner: the
ranks on the other nodes lose their connection to it and fail within a second, saying so (gloo's
"Connection closed by peer", NCCL's remote error, the rendezvous store gone: the `peer_lost`
diagnosis, service/failures/failure_text.py). That failure sends a stop to the attempt's nodes still
running; a live agent has it at once (its heartbeat long-polls) and heartbeats again at once. A node
the survivor's text implicates that then stays silent for peer_loss_silence_seconds is lost for
that job: its share fails with `node_lost` and the next attempt starts without it.

Such a node is fenced, as it may not be dead, only cut off: it takes no new work until its agent
shows it runs nothing of that attempt (it is told again to stop it while it does: the first stop may
have gone to a dead connection), and what it sends of that attempt is refused (service/ingest/
batches.py), a checkpoint commit too, so no late commit of a cut-off node is ever a resume point.

Never fenced: a node merely late with no peer's failure to tell on it (silence alone waits for
the deadline), a node whose own ranks failed (its agent reports the failure: it is not silent),
and any node while the service itself has just come back (its agents may be in their retry's
backoff, HEARTBEAT_RETRY_MAX_SECONDS).
"""

import re
from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session, contains_eager

from ett.protocol import HEARTBEAT_RETRY_MAX_SECONDS
from ett.protocol.messages import AttemptReport, StopCommand
from service.agents import commands
from service.models import ACTIVE_ATTEMPT_STATES, Attempt, AttemptNode, AttemptState, Node, NodeState, utc_at
from service.settings import Settings

PEER_LOST = "peer_lost"
# Words of a failure that lost the rendezvous store, which the attempt's master node (node rank 0) keeps.
STORE_WORDS = re.compile(r"[Ss]tore|[Rr]endezvous|failed to recv, got 0 bytes")
# An [address]:port as gloo and c10d name the other end (failure_text.PEER_ADDRESS), its parts taken.
NAMED_PEER = re.compile(r"\[([\w.:-]{1,64})\]:(\d{1,5})")


def implicated(summary: str, master_port: int, shares: Sequence[AttemptNode]) -> list[AttemptNode]:
    """The shares (of those still running, with their nodes) a survivor's lost connection points
    at: the master's (node rank 0) when it lost the rendezvous store (its words, or the store's
    port); those on an address it names, when some are; else all of them (it names no peer, or an
    address every node shares, as on one machine), and their silence tells which went."""
    named = NAMED_PEER.findall(summary)
    if STORE_WORDS.search(summary) or any(int(port) == master_port for _, port in named):
        preferred = [share for share in shares if share.node_rank == 0]
    else:
        addresses = {address for address, _ in named}
        preferred = [share for share in shares if share.node.address in addresses]
    return preferred or list(shares)


def lost_to_their_peers(session: Session, settings: Settings, now: float,
                        up_since: float | None = None) -> list[tuple[AttemptNode, str]]:
    """The shares whose node is lost for their attempt by its peers' evidence, each with the words
    said for it: of an attempt that failed `peer_lost`, still running, implicated by the survivor's
    text, and whose node sent no heartbeat since the attempt ended (its stop was queued) for
    peer_loss_silence_seconds. `up_since`: when the service (or its database) came back."""
    window = settings.peer_loss_silence_seconds
    cutoff = now - window
    if up_since is not None and up_since + HEARTBEAT_RETRY_MAX_SECONDS > cutoff:
        return []  # agents back off up to HEARTBEAT_RETRY_MAX_SECONDS while the service is away: no silence
    running = session.scalars(
        select(AttemptNode).join(Attempt).join(Node, AttemptNode.node_id == Node.id)
        .options(contains_eager(AttemptNode.attempt), contains_eager(AttemptNode.node))
        .where(Attempt.state == AttemptState.failed, Attempt.diagnosis == PEER_LOST,
               AttemptNode.state.in_(ACTIVE_ATTEMPT_STATES), Node.state != NodeState.lost)
        .order_by(AttemptNode.attempt_id, AttemptNode.node_rank)
        .with_for_update(of=(AttemptNode, Node), skip_locked=True)  # two service processes: one declares it
    ).all()  # fmt: skip
    by_attempt: dict[int, list[AttemptNode]] = {}
    for share in running:
        by_attempt.setdefault(share.attempt_id, []).append(share)
    lost = []
    for shares in by_attempt.values():
        attempt = shares[0].attempt
        ended = attempt.ended_at
        if ended is None or ended > utc_at(cutoff):
            continue  # the window is not over yet
        for share in implicated(attempt.summary or "", attempt.master_port, shares):
            if share.node.last_heartbeat_at < ended:
                said = (f"agent {share.node.name} sent no heartbeat for {window:g} s after its peers lost their "
                        f"connection to it ({attempt.summary})")
                lost.append((share, said[:512]))
    return lost


def suspects(attempt: Attempt, settings: Settings, now: float) -> list[AttemptNode]:
    """The shares of a failed attempt the next may start without, on spares in their place: of an attempt
    that failed `peer_lost` peer_loss_grace_seconds ago or more, the shares still running when every one
    of them is implicated by the survivor's text and none has reported since (a survivor still stopping
    is waited for). Their silence window goes on: lost_to_their_peers declares them lost, or they report."""
    running = [share for share in attempt.nodes if share.state in ACTIVE_ATTEMPT_STATES]
    ended = attempt.ended_at
    if (not running or attempt.state != AttemptState.failed or attempt.diagnosis != PEER_LOST or ended is None
            or ended > utc_at(now - settings.peer_loss_grace_seconds)):
        return []
    named = implicated(attempt.summary or "", attempt.master_port, running)
    if len(named) != len(running) or any(share.node.last_heartbeat_at >= ended for share in running):
        return []
    return running


def next_due(session: Session, settings: Settings, now: float) -> float | None:
    """The next moment a node-loss decision falls due, for the scheduler to tick then and not at its
    next period: the grace's end (suspects) or the silence window's (lost_to_their_peers) of an
    attempt that failed `peer_lost` with shares still running."""
    ends = session.scalars(
        select(Attempt.ended_at).join(AttemptNode)
        .where(Attempt.state == AttemptState.failed, Attempt.diagnosis == PEER_LOST,
               AttemptNode.state.in_(ACTIVE_ATTEMPT_STATES),
               Attempt.ended_at > utc_at(now - settings.peer_loss_silence_seconds))
    ).all()  # fmt: skip
    due = [end.timestamp() + window for end in ends
           for window in (settings.peer_loss_grace_seconds, settings.peer_loss_silence_seconds)]
    return min((t for t in due if t > now), default=None)


def fence(node: Node, share: AttemptNode, now: float) -> None:
    """Takes the node out of the scheduler's choice until its agent shows it runs nothing of the
    share's attempt (answer_fenced), and refuses what it sends of that attempt from now on."""
    share.fenced_at = utc_at(now)
    attempt = share.attempt
    node.fenced = f"lost for job {attempt.job_id} attempt {attempt.number}: fenced until its agent stops it"[:512]


def answer_fenced(session: Session, node: Node, reports: Sequence[AttemptReport], pending: bool) -> bool:
    """A fenced node's heartbeat: while it reports an attempt it was fenced from as still running, it
    is told to stop it (again, unless a command already waits for it: the first stop may have been
    answered to a dead connection); once it reports none running, it may take work again. Whether
    a stop was queued."""
    fenced = {(job_id, number) for job_id, number in session.execute(
        select(Attempt.job_id, Attempt.number).join(AttemptNode)
        .where(AttemptNode.node_id == node.id, AttemptNode.fenced_at.is_not(None)))}  # fmt: skip
    still = [r for r in reports if r.key in fenced and r.state in {s.value for s in ACTIVE_ATTEMPT_STATES}]
    if not still:
        node.fenced = None
        return False
    if pending:
        return False
    for report in still:
        commands.enqueue(session, node, StopCommand(type="stop", job_id=report.job_id, attempt=report.attempt,
                                                    reason="fenced: this node was declared lost for it", at_once=True))
    return True


