"""Jobs over real HTTP, against SQLite and PostgreSQL (the same bodies for both)."""

from tests.service.factories import job_spec, submit


def test_submit_then_get_and_list(service):
    alice = service.client(service.token("user", "alice"))
    job = submit(alice, name="first")
    assert job["state"] == "queued" and job["owner"] == "alice" and job["attempts"] == []
    assert alice.get(f"/api/v1/jobs/{job['id']}").json()["spec"] == job_spec(name="first")
    listed = alice.get("/api/v1/jobs").json()
    assert listed["total"] == 1 and [j["id"] for j in listed["items"]] == [job["id"]]


def test_list_filters_by_state_and_pages(service):
    alice = service.client(service.token("user", "alice"))
    ids = [submit(alice, name=f"j{i}")["id"] for i in range(5)]
    alice.post(f"/api/v1/jobs/{ids[0]}/cancel").raise_for_status()
    queued = alice.get("/api/v1/jobs", params={"state": "queued"}).json()
    assert queued["total"] == 4 and ids[0] not in {j["id"] for j in queued["items"]}
    pages = [alice.get("/api/v1/jobs", params={"limit": 2, "offset": o}).json() for o in (0, 2, 4)]
    seen = [j["id"] for page in pages for j in page["items"]]
    assert sorted(seen) == sorted(ids) and all(p["total"] == 5 for p in pages)
    assert alice.get("/api/v1/jobs", params={"state": "bogus"}).status_code == 422


def test_cancel_a_queued_job(service):
    alice = service.client(service.token("user", "alice"))
    job = submit(alice)
    cancelled = alice.post(f"/api/v1/jobs/{job['id']}/cancel").json()
    assert cancelled["state"] == "cancelled" and cancelled["finished_at"] is not None


def test_users_see_only_their_jobs_and_admins_see_all(service):
    alice = service.client(service.token("user", "alice"))
    bob = service.client(service.token("user", "bob"))
    admin = service.client(service.token("admin"))
    job = submit(alice)
    assert bob.get(f"/api/v1/jobs/{job['id']}").status_code == 404
    assert bob.post(f"/api/v1/jobs/{job['id']}/cancel").status_code == 404
    assert bob.get("/api/v1/jobs").json()["total"] == 0
    assert admin.get(f"/api/v1/jobs/{job['id']}").status_code == 200
    assert admin.get("/api/v1/jobs").json()["total"] == 1
    assert admin.post(f"/api/v1/jobs/{job['id']}/cancel").json()["state"] == "cancelled"


def test_health_and_readiness(service):
    anonymous = service.client()
    assert anonymous.get("/healthz").json() == {"status": "ok"}
    assert anonymous.get("/readyz").json() == {"status": "ready"}
    assert "/api/v1/jobs" in anonymous.get("/openapi.json").json()["paths"]
    assert anonymous.get("/docs").status_code == 200


def test_hang_detection_can_be_turned_off_with_null_or_off(service):
    alice = service.client(service.token("user", "alice"))
    for value in (None, "off"):
        job = submit(alice, hang_timeout_seconds=value)
        assert job["spec"]["hang_timeout_seconds"] is None
    refused = alice.post("/api/v1/jobs", json=job_spec(hang_timeout_seconds="never"))
    assert refused.status_code == 422 and "hang_timeout_seconds" in refused.text
