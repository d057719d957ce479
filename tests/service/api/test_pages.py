"""The pages over a live service: their figures (the API's, and `ett report`'s), sign-in, the
timeline in a real headless Chromium, and a drawing that stays small at 10 attempts x 10^5 steps."""

import logging
import re
import time
from collections import Counter, defaultdict
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

from ett_cli.render import report_table
from service.accounting.engine import CATEGORIES
from service.accounting.memory import MemoryJob
from service.models import Job
from service.pages.job_view import MEANINGS
from service.pages.timeline import SaveSpan, StepTime, build_timeline, frame_of
from tests.deploy.replayed import clean_success, failed_at_start, replayed_job
from tests.service.accounting.timelines import Timeline
from tests.service.factories import give_attempt, register_agent, report_failure, submit
from tests.support.browser import chromium

ARTIFACTS = Path(__file__).resolve().parents[3] / "artifacts"
SQLITE_ONLY = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
# The categories drawn in each lane of tests/deploy/replayed.py's job.
LANES = {
    0: {"init", "productive", "checkpoint_save", "wasted", "recovery"},
    1: {"init", "restore", "wasted", "recovery"},
    2: {"init", "restore", "productive", "checkpoint_save", "idle"},
}


class PageDom(HTMLParser):
    """What a test reads of a page: the `data-figure` texts, and the timeline's lanes and marks."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.figures: dict[str, str] = {}
        self.lanes: dict[int, list[str]] = defaultdict(list)  # attempt -> categories of its runs
        self.failure_marks: dict[int, str] = {}  # attempt -> cause
        self._figure: str | None = None
        self._lane: int | None = None
        self._g_depth = 0
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if "data-figure" in a:
            self._figure = a["data-figure"]
            self.figures[self._figure] = ""
        if tag == "g":
            self._g_depth += 1
            if "lane" in classes:
                self._lane, self._lane_depth = int(a["data-attempt"]), self._g_depth
                self.lanes[self._lane] = []
            if "failure-mark" in classes:
                assert int(a["data-attempt"]) == self._lane, "a failure mark outside its lane"
                self.failure_marks[self._lane] = a["data-cause"]
        if tag == "rect" and "run" in classes:
            self.lanes[self._lane].append(a["data-category"])

    def handle_endtag(self, tag: str) -> None:
        if tag == "g":
            if self._lane is not None and self._g_depth == self._lane_depth:
                self._lane = None
            self._g_depth -= 1
        self._figure = None

    def handle_data(self, data: str) -> None:
        if self._figure is not None:
            self.figures[self._figure] += data.strip()


def number(text: str) -> float | None:
    return None if text == "-" else float(re.sub(r"%$| s$| steps?$", "", text))


def test_job_page_and_ett_report_show_the_apis_numbers(service):
    job = replayed_job(service, time.time() - 200)
    alice = service.client(job.user_token)
    page = PageDom(alice.get(f"/jobs/{job.id}").text)
    api = alice.get(f"/api/v1/jobs/{job.id}/ett").json()
    expected = {
        "ett_percent": api["ett_percent"], "wall_seconds": api["wall_seconds"],
        "full_speed_percent": api["full_speed_percent"], "slow_seconds": api["slow_seconds"],
        "queued_seconds": api["queued_seconds"], "time_to_start_seconds": api["time_to_start_seconds"],
        "restarts": api["restarts"], "mtbf_seconds": api["mtbf_seconds"],
        "recommended_checkpoint_interval_seconds": api["recommended_checkpoint_interval_seconds"],
        # In the job's unit, steps, at its mean step (every step of the replayed job takes 1 s).
        "checkpoint_interval_steps": 5, "checkpoint_interval_seconds": 5.0,
        "recommended_checkpoint_interval_steps": round(api["recommended_checkpoint_interval_seconds"]),
        **{f"seconds.{c}": v for c, v in api["seconds"].items()},
        **{f"checkpoints.{k}": v for k, v in api["checkpoints"].items()},
        **{f"failures.{i}.{k}": f[k] for i, f in enumerate(api["failures"])
           for k in ("time_to_recover_seconds", "lost_steps")},
    }  # fmt: skip
    assert set(page.figures) == set(expected)
    assert {a: set(runs) for a, runs in page.lanes.items()} == LANES
    assert page.failure_marks == {0: "exit", 1: "hang"}
    for name, value in expected.items():  # the page rounds to 0.1 (seconds by category: 0.01)
        assert number(page.figures[name]) == pytest.approx(value, abs=0.051), name
    for name in ("checkpoint_interval_steps", "recommended_checkpoint_interval_steps"):
        assert page.figures[name].endswith(" steps"), name
    assert page.figures["checkpoint_interval_seconds"].endswith(" s")
    # `ett report` prints the same figures, to the same digits.
    table = report_table(api)
    assert f"ETT {page.figures['ett_percent']}" in table and f"wall {page.figures['wall_seconds']}" in table
    for category in CATEGORIES:
        assert re.search(rf"^  {category} +{re.escape(page.figures[f'seconds.{category}'])} ", table, re.M), category
    for i, failure in enumerate(api["failures"]):
        ttr = page.figures[f"failures.{i}.time_to_recover_seconds"]
        assert f"attempt {failure['attempt']}: {failure['cause']:9} time to recover {ttr}" in table
    # The jobs list shows the same ETT; a job not allocated yet has a page without a timeline.
    jobs = alice.get("/jobs").text
    assert f"/jobs/{job.id}" in jobs and page.figures["ett_percent"] in jobs
    waiting = submit(alice, nodes=8)
    page = alice.get(f"/jobs/{waiting['id']}")
    assert page.status_code == 200 and "Not allocated yet" in page.text and not PageDom(page.text).lanes


def test_every_page_answers_for_every_kind_of_job(service):
    """A clean success, a failure at start, a rollback, a queued and a cancelled job: each job's page,
    the list and the fleet answer 200 on both databases (a job without a rollback was a 500 on SQLite)."""
    now = time.time()
    success = replayed_job(service, now - 100, "clean", clean_success)
    failed = replayed_job(service, now - 50, "failed-at-start", failed_at_start)
    rollback = replayed_job(service, now - 200, "rollback")
    alice = service.client(success.user_token)
    queued = submit(alice, name="queued", nodes=8)
    cancelled = submit(alice, name="cancelled", nodes=8)
    assert alice.post(f"/api/v1/jobs/{cancelled['id']}/cancel").status_code == 200
    lanes = {}
    for job_id in (success.id, failed.id, rollback.id, queued["id"], cancelled["id"]):
        page = alice.get(f"/jobs/{job_id}")
        assert page.status_code == 200, (job_id, page.text[-500:])
        lanes[job_id] = PageDom(page.text).lanes
    assert {c for runs in lanes[success.id].values() for c in runs} >= {"init", "productive", "checkpoint_save"}
    assert "wasted" not in lanes[success.id][0]
    assert set(lanes[failed.id]) == {0, 1} and not lanes[queued["id"]] and not lanes[cancelled["id"]]
    for page in ("/jobs", "/fleet?window=all", "/jobs?state=cancelled"):
        assert alice.get(page).status_code == 200, page


def test_fleet_page_shows_the_apis_figures_where_time_went_and_each_job(service):
    job = replayed_job(service, time.time() - 200)
    alice = service.client(job.user_token)
    api = alice.get("/api/v1/ett").json()
    html = alice.get("/fleet?window=all").text
    page = PageDom(html)
    assert number(page.figures["ett_percent"].removeprefix("ETT ")) == pytest.approx(api["ett_percent"], abs=0.051)
    assert api["failure_causes"] == {"exit": 1, "hang": 1} and api["by_job"][job.id]["name"] == "moe-pages"
    # Where the time went: every non-productive category the API has, the largest first.
    rows = re.findall(r"<tr><td>(\w+)</td><td class=\"num\">([\d.]+)</td>", html.split('id="lost"')[1].split("</table>")[0])
    expected = sorted(((c, s) for c, s in api["seconds"].items() if c != "productive" and s > 0), key=lambda cs: -cs[1])
    assert [c for c, _ in rows] == [c for c, _ in expected]
    assert f'data-job-id="{job.id}"' in html and '<td>exit</td><td class="num">1</td>' in html
    assert alice.get("/fleet?window=3").status_code == 422


@SQLITE_ONLY
def test_markup_in_a_jobs_name_failure_and_output_is_shown_escaped_on_the_job_list_and_fleet_pages(service):
    alice = service.client(service.token("user", "alice"))
    job = submit(alice, nodes=8, procs_per_node=1)  # more nodes than registered: the scheduler leaves it be
    agent = service.client(service.token("agent", "node-a"))
    register_agent(agent, "node-a")
    give_attempt(service, job["id"], "node-a")
    with service.context.sessions() as session:  # a name the API refuses, as a tool or an older service stored it
        session.get(Job, job["id"]).name = "<b>bold</b>"
        session.commit()
    log = "[rank0]: ValueError: <img src=x onerror=alert(1)>\n<script>alert('log')</script>\n"
    piece = {"job_id": job["id"], "attempt": 0, "rank": 0, "text": log, "skipped": 0}
    assert agent.post("/api/v1/agents/node-a/logs", json={"logs": [piece]}).status_code == 200
    assert report_failure(agent, "node-a", job["id"], "rank 0 exit code 1 <script>alert('detail')</script>").is_success
    pages = {path: alice.get(path).text for path in (f"/jobs/{job['id']}", "/jobs", "/fleet?window=all")}
    for path, html in pages.items():
        assert "&lt;b&gt;bold&lt;/b&gt;" in html and "<b>" not in html, path
        assert "<script" not in html and "<img" not in html, path
    page = pages[f"/jobs/{job['id']}"]
    assert "exit code 1 &lt;script&gt;alert(&#39;detail&#39;)&lt;/script&gt;" in page  # the failure's detail
    assert "exception: ValueError: &lt;img src=x onerror=alert(1)&gt;" in page  # its diagnosis
    assert "\n&lt;script&gt;alert(&#39;log&#39;)&lt;/script&gt;" in page  # the rank's last lines


class Explained(HTMLParser):
    """Each `title` of the page by the text it explains (an abbr's, a legend item's), the
    breakdown's "what it is" cell by category, and the links to the failures table."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.titles: dict[str, str] = {}
        self.meanings: dict[str, str] = {}
        self.failure_links: list[str] = []
        self._title: str | None = None
        self._text = ""
        self._row: str | None = None
        self._meaning = False
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if tag in ("abbr", "span") and "title" in a:
            self._title, self._text = a["title"], ""
        if tag == "tr":
            self._row = a.get("data-category")
        self._meaning = tag == "td" and "meaning" in (a.get("class") or "")
        if tag == "a" and (a.get("href") or "").startswith("#failure-"):
            self.failure_links.append(a["href"])

    def handle_endtag(self, tag: str) -> None:
        if tag in ("abbr", "span") and self._title is not None and self._text.strip():
            self.titles[self._text.strip()] = self._title
            self._title = None
        self._meaning = False

    def handle_data(self, data: str) -> None:
        self._text += data
        if self._meaning and self._row is not None:
            self.meanings[self._row] = data


@SQLITE_ONLY
def test_a_failures_text_stands_once_and_each_figure_and_category_says_what_it_is(service):
    alice = service.client(service.token("user", "alice"))
    job = submit(alice, nodes=8, procs_per_node=1, max_restarts=0)  # more nodes than registered: left be
    agent = service.client(service.token("agent", "node-a"))
    register_agent(agent, "node-a")
    give_attempt(service, job["id"], "node-a")
    detail = "rank 0 exit code 1 (the one failure)"
    assert report_failure(agent, "node-a", job["id"], detail).is_success
    assert alice.get(f"/api/v1/jobs/{job['id']}").json()["state"] == "failed"
    html = alice.get(f"/jobs/{job['id']}").text
    # Its text is the failures table's alone: the job's reason ("failed after 0 restarts: ...") and the
    # attempt's row refer to it there, and its diagnosis (from no output: the detail, cut) is not repeated.
    assert html.count(detail) == 1 and 'id="failure-0"' in html
    page = Explained(html)
    assert page.failure_links == ["#failure-0", "#failure-0"]
    assert 'id="reason">failed after 0 restarts: <a href="#failure-0">' in html
    # Each figure and category says what it is where it stands.
    labels = {"ETT": "ett", "at full speed": "full_speed", "slow": "slow", "wall": "wall", "queued": "queued",
              "time to start": "time_to_start", "restarts": "restarts", "MTBF": "mtbf", "committed": "committed",
              "last step": "last_step", "mean blocking": "mean_blocking", "mean commit": "mean_commit",
              "interval": "interval", "recommended interval": "recommended_interval",
              "time to recover": "time_to_recover", "lost steps": "lost_steps",
              **{c: c for c in CATEGORIES}}  # the timeline's legend  # fmt: skip
    assert {label: page.titles.get(label) for label in labels} == {label: MEANINGS[m] for label, m in labels.items()}
    assert page.meanings == {c: MEANINGS[c] for c in CATEGORIES}


@SQLITE_ONLY
def test_query_token_becomes_an_httponly_cookie_and_leaves_the_address(service):
    job = replayed_job(service, time.time() - 200)
    browser = httpx.Client(base_url=service.url)
    first = browser.get("/jobs", params={"token": job.user_token, "state": "queued"})
    assert first.status_code == 303 and first.headers["location"] == "/jobs?state=queued"
    cookie = first.headers["set-cookie"]
    assert "ett_token=" in cookie and "HttpOnly" in cookie and "SameSite=lax" in cookie
    # The cookie alone opens the pages afterwards; the API still wants its bearer header.
    assert job.id in browser.get("/jobs?state=queued").text
    assert browser.get(f"/jobs/{job.id}").status_code == 200
    assert browser.get(f"/api/v1/jobs/{job.id}/ett").status_code == 401
    assert browser.post("/logout").status_code == 303
    assert browser.get("/jobs").status_code == 401


@SQLITE_ONLY
def test_pages_refuse_bad_tokens_and_hide_other_users_jobs(service):
    job = replayed_job(service, time.time() - 200)
    anonymous = service.client()
    for token in (None, "ett_not-a-token", service.token("agent", "node-a")):
        response = anonymous.get("/jobs", params={"token": token} if token else {})
        assert response.status_code == 401 and "Sign in" in response.text
        assert token is None or token not in response.text
    bob = service.client(service.token("user", "bob"))
    assert job.id not in bob.get("/jobs").text
    assert bob.get(f"/jobs/{job.id}").status_code == 404
    admin = service.client(job.admin_token)
    assert admin.get(f"/jobs/{job.id}").status_code == 200


@SQLITE_ONLY
def test_access_log_masks_the_query_token(service, caplog):
    access = logging.getLogger("uvicorn.access")
    access.addHandler(caplog.handler)  # uvicorn's access logger does not propagate to the root
    try:
        with caplog.at_level(logging.INFO, logger="uvicorn.access"):
            secret = service.token("user", "alice")
            service.client().get("/jobs", params={"token": secret})
    finally:
        access.removeHandler(caplog.handler)
    assert "/jobs?token=***" in caplog.text and secret not in caplog.text


@SQLITE_ONLY
def test_job_page_in_headless_chromium_draws_lanes_and_failure_marks(service, tmp_path):
    # A clean success first: its page was a 500 on SQLite (no rollback to group the steps by).
    clean = replayed_job(service, time.time() - 100, "clean", clean_success)
    dom = chromium("--dump-dom", f"{service.url}/jobs/{clean.id}?token={clean.user_token}", profile=tmp_path)
    assert set(PageDom(dom).lanes) == {0} and "productive" in PageDom(dom).lanes[0]
    job = replayed_job(service, time.time() - 200)
    # The browser signs in the way a person does: the token once in the address, then the cookie.
    url = f"{service.url}/jobs/{job.id}?token={job.user_token}"
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "job-page.png"
    shot.unlink(missing_ok=True)
    dom = chromium("--dump-dom", f"--screenshot={shot}", "--window-size=1280,1100", url, profile=tmp_path)
    page = PageDom(dom)
    assert {a: set(runs) for a, runs in page.lanes.items()} == LANES
    assert page.failure_marks == {0: "exit", 1: "hang"}
    assert page.figures["checkpoint_interval_steps"] == "5 steps"  # the job's unit, its time beside
    explained = Explained(dom)  # as the browser holds them: what a pointer over each label shows
    assert explained.titles["at full speed"] == MEANINGS["full_speed"] and explained.titles["slow"] == MEANINGS["slow"]
    assert explained.meanings["idle"] == MEANINGS["idle"]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


def test_timeline_of_ten_attempts_and_1e5_steps_is_small_and_true_to_the_report():
    """Attempt a restores the 9th checkpoint of attempt a-1 and runs 10^4 steps of 0.1 s,
    saving every 1000, then dies: 1000 steps of every failed attempt are wasted."""
    tl, t, restored = Timeline(), 0.0, None
    for a in range(10):
        start = restored or 0
        tl.start_attempt(a, allocated=t, init_end=t + 5, restore=(t + 5, t + 7, start) if a else None)
        t += 7
        for k in range(10):
            t = tl.steps(a, start + 1000 * k + 1, start + 1000 * (k + 1), start=t, duration=0.1)
            if k < 9:
                tl.checkpoint(a, start + 1000 * (k + 1), start=t, staged=t + 0.5, committed=t + 2)
                t += 0.5
        if a < 9:
            tl.service("attempt_failed", t + 1, a, cause="signal")
            restored, t = start + 9000, t + 10
    tl.service("job_finished", t + 1, 9, state="succeeded")
    job = MemoryJob("big")
    job.ingest(tl.events)
    report = job.report(now=t + 100)
    cut = {n: a.rolled_back_to for n, a in job.account.attempts.items()}  # the engine's settled rollbacks
    steps = [e for e in tl.events if e.kind == "step"]
    assert len(steps) == 100_000
    # One stretch per step here; the page has the database sum them per column (timeline_data.py).
    wasted = [cut[e.attempt] is not None and e.step > cut[e.attempt] for e in steps]
    step_time = StepTime.from_rows(
        [(e.attempt, w, e.ts - e.data["duration"], e.data["duration"]) for e, w in zip(steps, wasted, strict=True)]
    )
    saves = [SaveSpan(c.attempt, c.started_at, c.staged_at) for c in job.checkpoints.values()]
    timeline = build_timeline(job.account, frame_of(job.account, t + 100), step_time, saves)
    assert [lane.attempt for lane in timeline.lanes] == list(range(10))
    assert [lane.failure is not None for lane in timeline.lanes] == [True] * 9 + [False]
    runs = [run for lane in timeline.lanes for run in lane.runs]
    assert len(runs) <= 60  # init, (restore,) productive, wasted, recovery per lane: not one per step
    columns = Counter()
    for run in runs:
        columns[run.category] += run.last - run.first
    column_seconds = report["wall_seconds"] / timeline.columns
    for category in ("productive", "wasted", "init", "recovery"):
        # Each run is exact to a column at each end; lanes meet on a shared column.
        assert columns[category] * column_seconds == pytest.approx(report["seconds"][category], abs=25 * column_seconds)
    assert report["seconds"]["wasted"] == pytest.approx(9 * 1000 * 0.1)
