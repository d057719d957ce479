"""A job's steps for people over a live service: GET /api/v1/jobs/{id}/steps (paged, rolled-back steps
marked by the engine's rule, each attempt's nodes), reduced capacity in the report, `ett report`
and /metrics, and the job page's chart of loss and step time with each attempt's size, in Chromium."""

import re
import time
from dataclasses import asdict
from html.parser import HTMLParser

import pytest

from ett_cli.render import report_table
from tests.deploy.replayed import replayed_job
from tests.service.accounting.test_reduced_capacity import shrinks_and_grows_back
from tests.service.accounting.timelines import Timeline
from tests.service.factories import submit
from tests.service.accounting.test_metrics import scrape
from tests.support.browser import chromium

SQLITE_ONLY = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


def all_steps(client, job_id: str, limit: int) -> tuple[list[dict], list[list[tuple[int, int]]]]:
    """Every step, page by page; and each page's (step, attempt) rows."""
    steps, pages, since = [], [], -1
    while since is not None:
        page = client.get(f"/api/v1/jobs/{job_id}/steps", params={"since_step": since, "limit": limit})
        assert page.status_code == 200, page.text
        body = page.json()
        steps += body["steps"]
        pages.append([(s["step"], s["attempt"]) for s in body["steps"]])
        since = body["next_since_step"]
    return steps, pages


def test_steps_api_pages_marks_rolled_back_steps_and_names_each_attempts_nodes(service):
    job = replayed_job(service, time.time() - 300, "elastic", shrinks_and_grows_back)
    alice = service.client(job.user_token)
    whole = alice.get(f"/api/v1/jobs/{job.id}/steps").json()
    rows = [(s["step"], s["attempt"]) for s in whole["steps"]]
    assert len(rows) == 32 and rows == sorted(rows) and whole["next_since_step"] is None
    # Steps 11 and 12 of attempt 0 were rolled back by attempt 1's restore of step 10 (docs/ett.md, "Rollback").
    assert {(s["step"], s["attempt"]) for s in whole["steps"] if s["rolled_back"]} == {(11, 0), (12, 0)}
    assert {s["attempt"]: s["nodes"] for s in whole["steps"]} == {0: 2, 1: 1, 2: 2}
    assert whole["attempts"] == [{"attempt": 0, "nodes": ["n0", "n1"], "full_nodes": 2},
                                 {"attempt": 1, "nodes": ["n0"], "full_nodes": 2},
                                 {"attempt": 2, "nodes": ["n0", "n1"], "full_nodes": 2}]  # fmt: skip
    step_11 = next(s for s in whole["steps"] if (s["step"], s["attempt"]) == (11, 1))
    assert step_11 == {"step": 11, "attempt": 1, "at": pytest.approx(step_11["at"]), "seconds": 4.0, "loss": 2.0,
                       "tokens": 1024, "nodes": 1, "rolled_back": False}  # fmt: skip
    # Paged: the same rows, and a page never splits a step (11 and 12 were stepped by attempts 0 and 1).
    for limit in (1, 5, 11, 31):
        steps, pages = all_steps(alice, job.id, limit)
        assert steps == whole["steps"], limit
        assert all({s for s, _ in p[limit - 1 :]} <= {p[-1][0]} for p in pages), (limit, pages)  # over: ties only
        assert all(a[-1][0] < b[0][0] for a, b in zip(pages, pages[1:-1])), (limit, pages)
    _, pages = all_steps(alice, job.id, 11)
    assert pages[0][-2:] == [(11, 0), (11, 1)] and pages[1][0] == (12, 0)
    # Bounded, and only for who may see the job.
    too_many = alice.get(f"/api/v1/jobs/{job.id}/steps", params={"limit": 10_001})
    assert too_many.status_code == 422 and "limit" in too_many.text
    assert alice.get(f"/api/v1/jobs/{job.id}/steps", params={"since_step": -2}).status_code == 422
    bob = service.client(service.token("user", "bob"))
    assert bob.get(f"/api/v1/jobs/{job.id}/steps").status_code == 404


def test_reduced_capacity_in_the_report_ett_report_and_metrics(service):
    job = replayed_job(service, time.time() - 300, "elastic", shrinks_and_grows_back)
    report = service.client(job.user_token).get(f"/api/v1/jobs/{job.id}/ett").json()
    assert report["reduced_capacity_seconds"] == pytest.approx(20)
    assert report["capacity_percent"] == pytest.approx(100 * 60 / 112)
    assert report["ett_percent"] == pytest.approx(100 * 80 / 112)  # ETT's rule is unchanged
    table = report_table(report)
    assert "capacity 53.6%  reduced capacity 20.0 s  sizes: attempt 0: 2 of 2 nodes, attempt 1: 1 of 2 nodes, " \
           "attempt 2: 2 of 2 nodes" in table
    labels = frozenset({"job_id": job.id, "job_name": "elastic"}.items())
    samples = scrape(service.client())
    assert samples[("ett_job_reduced_capacity_seconds", labels)] == pytest.approx(20)
    assert samples[("ett_job_capacity_ratio", labels)] == pytest.approx(60 / 112)
    # The job page draws its steps on both databases (the chart's bands and mean loss are summed in SQL).
    page = Chart(service.client(job.user_token).get(f"/jobs/{job.id}").text)
    assert [line[1:] for line in page.lines if line[0] == "loss"] == [(0, False, 10), (0, True, 2), (1, False, 10),
                                                                      (2, False, 10)]  # fmt: skip
    assert page.sizes[1] == "attempt 1: 1 of 2 nodes"
    # A job that never shrank: no sizes line, capacity equal to ETT.
    clean = replayed_job(service, time.time() - 100, "clean")
    plain = service.client(clean.user_token).get(f"/api/v1/jobs/{clean.id}/ett").json()
    assert plain["reduced_capacity_seconds"] == 0 and plain["capacity_percent"] == pytest.approx(plain["ett_percent"])
    assert "sizes:" not in report_table(plain)


class Chart(HTMLParser):
    """The steps chart as the browser holds it: each polyline's panel, attempt and rolled-back flag and
    point count; each size in the legend."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.lines: list[tuple[str, int, bool, int]] = []
        self.sizes: dict[int, str] = {}
        self.figures: dict[str, str] = {}
        self._panel: str | None = None
        self._size: int | None = None
        self._figure: str | None = None
        self._spans = 0  # spans open inside the size's
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if tag == "g" and "data-panel" in a:
            self._panel = a["data-panel"]
        if tag == "polyline":
            self.lines.append((self._panel, int(a["data-attempt"]), a["data-rolled-back"] == "true",
                               len(a["points"].split())))  # fmt: skip
        if tag == "span" and self._size is not None:
            self._spans += 1
        if tag == "span" and "size" in (a.get("class") or "").split():
            self._size, self._spans = int(a["data-attempt"]), 0
            self.sizes[self._size] = ""
        if "data-figure" in a:
            self._figure = a["data-figure"]

    def handle_endtag(self, tag: str) -> None:
        if tag == "span" and self._size is not None:
            self._spans -= 1
            self._size = self._size if self._spans >= 0 else None
        self._figure = None

    def handle_data(self, data: str) -> None:
        if self._size is not None:
            self.sizes[self._size] += data.strip()
        if self._figure is not None:
            self.figures[self._figure] = data.strip()


@SQLITE_ONLY
def test_job_page_in_chromium_draws_loss_and_step_time_per_attempt_with_its_size(service, tmp_path):
    job = replayed_job(service, time.time() - 300, "elastic", shrinks_and_grows_back)
    dom = chromium("--dump-dom", f"{service.url}/jobs/{job.id}?token={job.user_token}", profile=tmp_path)
    chart = Chart(dom)
    # Per panel: attempt 0's kept steps (1-10) and rolled-back ones (11-12), attempts 1 and 2 (10 steps each).
    expected = [(0, False, 10), (0, True, 2), (1, False, 10), (2, False, 10)]
    for panel in ("loss", "seconds"):
        assert [line[1:] for line in chart.lines if line[0] == panel] == expected, panel
    assert chart.sizes == {0: "attempt 0: 2 of 2 nodes", 1: "attempt 1: 1 of 2 nodes", 2: "attempt 2: 2 of 2 nodes"}
    assert chart.figures["capacity_percent"] == "53.6%" and chart.figures["reduced_capacity_seconds"] == "20.0 s"
    # Attempt 1's steps took twice as long: its line stands at the top of the step time panel.
    seconds = re.search(r'data-panel="seconds".*?</g>', dom, re.S).group()
    tops = {int(a): {float(y) for y in re.findall(r",([\d.]+)", pts)}
            for a, pts in re.findall(r'data-attempt="(\d)" data-rolled-back="false" points="([^"]+)"', seconds)}
    assert tops[1] == {0.0} and tops[2] == {60.0}


def many_steps(t0: float) -> Timeline:
    """Three attempts of 2,000 steps each, the second on 1 of 2 nodes, each restoring where the last stopped."""
    tl = Timeline(t0)
    t = 0.0
    for attempt in range(3):
        tl.service("attempt_allocated", t, attempt, nodes=["n0"] if attempt == 1 else ["n0", "n1"],
                   **({"full_nodes": 2} if attempt == 1 else {}))  # fmt: skip
        first = 2000 * attempt + 1
        if attempt:
            tl.rank0("restore_start", t + 1, attempt, first - 1)
            tl.rank0("restore_end", t + 2, attempt, first - 1)
        t = tl.steps(attempt, first, first + 1999, start=t + 2, duration=0.02 if attempt == 1 else 0.01) + 1
    tl.service("job_finished", t, 2, state="succeeded")
    return tl


def test_a_long_job_comes_in_bounded_pages_and_a_chart_of_a_few_hundred_points(service):
    admin, alice = service.client(service.token("admin")), service.client(service.token("user", "alice"))
    job = submit(alice, name="long", nodes=8)
    events = [asdict(e) for e in many_steps(time.time() - 600).events]
    for i in range(0, len(events), 2000):
        admin.post(f"/api/v1/jobs/{job['id']}/events", json={"events": events[i : i + 2000]}).raise_for_status()
    first = alice.get(f"/api/v1/jobs/{job['id']}/steps").json()
    assert len(first["steps"]) == 1000 and first["next_since_step"] == 1000  # the default page
    steps, pages = all_steps(alice, job["id"], 10_000)
    assert len(steps) == 6000 and len(pages) == 1 and not any(s["rolled_back"] for s in steps)
    assert {s["nodes"] for s in steps if s["attempt"] == 1} == {1}
    chart = Chart(alice.get(f"/jobs/{job['id']}").text)
    # 300 bands of 20 steps over the 6,000 step numbers: 100 points per attempt and panel, not 2,000.
    assert [line[1:] for line in chart.lines if line[0] == "seconds"] == [(a, False, 100) for a in range(3)]
    assert chart.sizes[1] == "attempt 1: 1 of 2 nodes"
