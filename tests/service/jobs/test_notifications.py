"""Job notifications (docs/jobspec.md, "notify"): the real service sends each event of a job to its
webhooks once, signed with the job's secret; a receiver that never answers delays neither the
other receiver nor the scheduler; a failed delivery is tried again; only the job's owner sees them."""

import hashlib
import hmac
import time

import pytest

from service.jobs.catalog import check_webhooks
from service.outcomes import Unprocessable
from service.settings import Settings
from service.spec.job_spec import JobSpec
from tests.service.factories import register_agent, submit
from tests.support.waiting import wait_for
from tests.support.webhook import silent_receiver, webhook_receiver

SECRET = "a-secret-of-alice-0123"


def allocated(admin, job_id: str, attempts: int) -> bool:
    return len(admin.get(f"/api/v1/jobs/{job_id}").json()["attempts"]) >= attempts


def test_each_event_arrives_once_signed_and_a_silent_receiver_delays_nothing(service):
    admin, alice = service.client(service.token("admin")), service.client(service.token("user", "alice"))
    agent = service.client(service.token("agent", "node-a"))
    register_agent(agent, "node-a", slots=1)
    with webhook_receiver() as good, silent_receiver() as silent:
        notify = {"webhooks": [f"{silent}/hook", f"{good.url}/hook"], "secret": SECRET}
        job = submit(alice, name="moe-notified", nodes=1, procs_per_node=1, max_restarts=1, notify=notify)
        assert job["spec"]["notify"]["secret"] == "********"  # never shown again, not even to its owner
        wait_for(lambda: allocated(admin, job["id"], 1), 30, "the first attempt")

        failed = {"job_id": job["id"], "attempt": 0, "state": "failed", "cause": "exit", "detail": "rank 0 exit code 1",
                  "exit_code": 1}  # fmt: skip
        reported = time.monotonic()
        agent.post("/api/v1/agents/node-a/heartbeat", json={"clock": time.time(), "attempts": [failed]})
        wait_for(lambda: [d for d in good.at("/hook") if d.json()["event"] == "failed"], 10, "the failure's notice")
        failure_seen = time.monotonic() - reported
        wait_for(lambda: allocated(admin, job["id"], 2), 10, "the restart")  # the scheduler goes on meanwhile
        restarted = time.monotonic() - reported
        wait_for(lambda: [d for d in good.at("/hook") if d.json()["event"] == "restarted"], 10, "the restart's notice")
        assert alice.post(f"/api/v1/jobs/{job['id']}/cancel").status_code == 200
        wait_for(lambda: [d for d in good.at("/hook") if d.json()["event"] == "stopped"], 10, "the stop's notice")
        time.sleep(1.5)  # two more passes of the sender: nothing is sent again

        # The silent receiver holds each of its deliveries for the 10 s timeout, in parallel.
        assert failure_seen < 5.0 and restarted < 5.0, (failure_seen, restarted)
        deliveries = good.at("/hook")
        assert [d.json()["event"] for d in deliveries] == ["failed", "restarted", "stopped"]
        for delivery in deliveries:
            body = delivery.json()
            expected = "sha256=" + hmac.new(SECRET.encode(), delivery.body, hashlib.sha256).hexdigest()
            assert delivery.headers["x-ett-signature-256"] == expected
            assert (delivery.headers["x-ett-event"], delivery.headers["x-ett-delivery"]) == (body["event"], body["id"])
            assert body["job"] | {"id": job["id"], "name": "moe-notified", "owner": "alice"} == body["job"]
        assert deliveries[0].json()["data"]["cause"] == "exit" and deliveries[1].json()["attempt"] == 1

        listed = alice.get(f"/api/v1/jobs/{job['id']}/notifications").json()
        assert sorted((n["event"], n["url"], n["state"]) for n in listed) == sorted(
            [(e, f"{good.url}/hook", "delivered") for e in ("failed", "restarted", "stopped")]
            + [(e, f"{silent}/hook", "pending") for e in ("failed", "restarted", "stopped")])
        bob = service.client(service.token("user", "bob"))
        assert bob.get(f"/api/v1/jobs/{job['id']}/notifications").status_code == 404  # not bob's job


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # the first test takes both backends
def test_a_delivery_refused_is_tried_again_and_arrives_once(service):
    admin, alice = service.client(service.token("admin")), service.client(service.token("user", "alice"))
    register_agent(service.client(service.token("agent", "node-a")), "node-a", slots=1)
    with webhook_receiver() as receiver:
        receiver.status = 500  # in trouble: answers, but not 2xx
        notify = {"webhooks": [f"{receiver.url}/hook"], "events": ["stopped"], "secret": SECRET}
        job = submit(alice, nodes=1, procs_per_node=1, notify=notify)
        wait_for(lambda: allocated(admin, job["id"], 1), 30, "the first attempt")
        alice.post(f"/api/v1/jobs/{job['id']}/cancel")

        def tried_twice() -> bool:
            [n] = alice.get(f"/api/v1/jobs/{job['id']}/notifications").json()
            return n["tries"] >= 2 and n["last_error"] == "HTTP 500" and n["state"] == "pending"

        wait_for(tried_twice, 15, "two refused tries")  # 1 s apart, then 2 s
        receiver.status = 200
        wait_for(lambda: receiver.at("/hook"), 15, "the delivery once the receiver is back")
        time.sleep(1.0)
        [delivery] = receiver.at("/hook")
        assert delivery.json()["event"] == "stopped"
        [n] = alice.get(f"/api/v1/jobs/{job['id']}/notifications").json()
        assert (n["state"], n["id"]) == ("delivered", delivery.json()["id"])


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_webhook_must_be_http_and_not_link_local(service):
    alice = service.client(service.token("user", "alice"))
    for url, says in (("file:///etc/passwd", "is not an http or https URL"),
                      ("http://169.254.169.254/latest", "link-local")):
        notify = {"webhooks": ["http://example.com/ok", url], "secret": SECRET}
        response = alice.post("/api/v1/jobs", json={"name": "x", "notify": notify})
        assert response.status_code == 422
        [problem] = response.json()["detail"]
        assert problem["field"] == "notify.webhooks.1" and says in problem["msg"], problem
    short = alice.post("/api/v1/jobs", json={"name": "x", "notify": {"webhooks": ["http://example.com/"],
                                                                     "secret": "short"}})
    assert short.status_code == 422 and "secret" in short.text


def test_an_operator_can_limit_webhooks_to_listed_hosts():
    spec = JobSpec.model_validate({"name": "x", "notify": {"webhooks": ["http://hooks.example.com/a",
                                                                       "http://10.0.0.9/b"], "secret": SECRET}})
    check_webhooks(Settings(), spec)  # no list: any host
    with pytest.raises(Unprocessable) as refused:
        check_webhooks(Settings(notify_hosts=["hooks.example.com"]), spec)
    assert refused.value.field == "notify.webhooks.1" and "10.0.0.9 is not a host" in refused.value.message
