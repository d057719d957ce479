"""An ended attempt's report waits for the node's events: heartbeats say `running` until the
reporter releases it (after a flush), then carry it until a heartbeat with it is acknowledged."""

from agent.groups.report_book import ReportBook, attempt_report
from agent.groups.states import GroupEnd, WorkerState


def test_an_end_is_sent_only_once_released_and_kept_until_acknowledged():
    book = ReportBook()
    book.set(("j", 0), attempt_report("j", 0, "running", None))
    assert book.held() == [] and book.to_send()[0].state == "running"

    end = GroupEnd(WorkerState.FAILED, "signal", "rank 1 killed by SIGKILL")
    book.set(("j", 0), attempt_report("j", 0, "failed", end))
    assert book.held() == [("j", 0)] and not book.overdue()
    sent = book.to_send()
    assert [r.model_dump() for r in sent] == [
        {"job_id": "j", "attempt": 0, "state": "running", "cause": None, "detail": "", "exit_code": None,
         "kernel": [], "imports": []}]
    book.acknowledge(sent)
    assert book.snapshot()[0].state == "failed"  # a `running` answered 200 does not retire the end

    book.release(book.held())
    sent = book.to_send()
    assert (sent[0].state, sent[0].cause) == ("failed", "signal")
    book.acknowledge(sent)
    assert book.snapshot() == []


def test_a_held_end_is_overdue_after_the_longest_wait(monkeypatch):
    book = ReportBook()
    monkeypatch.setattr(ReportBook, "END_WAIT_SECONDS", 0.0)
    book.set(("j", 1), attempt_report("j", 1, "succeeded", GroupEnd(WorkerState.SUCCEEDED)))
    assert book.overdue()
