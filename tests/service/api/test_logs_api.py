"""Rank logs through the service: an agent ships its ranks' output for its own attempts only; the
job's owner reads a rank's last part, follows it with `since`, never sees the job's env values;
another user gets 404. The agents' side (rotation, shipping) is tests/agent/launching/test_rank_log.py."""

from service.ingest.logs import LOG_KEEP_CHARS
from tests.service.factories import give_attempt, register_agent, submit


def ship(agent, name, pieces):
    return agent.post(f"/api/v1/agents/{name}/logs", json={"logs": pieces})


def test_a_ranks_output_is_kept_followed_redacted_and_its_owners_alone(service):
    alice = service.client(service.token("user", "alice"))
    job = submit(alice, nodes=1, procs_per_node=2, env={"WANDB_API_KEY": "s3cr3t-key-123"})
    node_a = service.client(service.token("agent", "node-a"))
    node_b = service.client(service.token("agent", "node-b"))
    register_agent(node_a, "node-a"), register_agent(node_b, "node-b")
    give_attempt(service, job["id"], "node-a")
    piece = {"job_id": job["id"], "attempt": 0, "rank": 1, "text": "step 1\nkey=s3cr3t-key-123\n", "skipped": 0}

    assert ship(node_b, "node-b", [piece]).status_code == 403  # not node-b's attempt
    assert ship(node_b, "node-a", [piece]).status_code == 403  # not node-b's name
    assert ship(node_a, "node-a", [piece]).status_code == 200
    log = alice.get(f"/api/v1/jobs/{job['id']}/logs", params={"rank": 1}).json()
    assert log["text"] == "step 1\nkey=[redacted]\n" and log["node"] == "node-a" and log["ranks"] == [1]

    ship(node_a, "node-a", [piece | {"text": "step 2\n", "skipped": 5000}])
    follow = alice.get(f"/api/v1/jobs/{job['id']}/logs", params={"rank": 1, "since": log["end"]}).json()
    assert follow["text"] == "[... 5000 bytes not shipped ...]\nstep 2\n"
    assert alice.get(f"/api/v1/jobs/{job['id']}/logs", params={"rank": 1, "tail": 1}).json()["text"] == "step 2\n"
    empty = alice.get(f"/api/v1/jobs/{job['id']}/logs").json()  # rank 0 by default: nothing printed yet
    assert (empty["rank"], empty["node"], empty["text"]) == (0, None, "")

    # Bounded: the service keeps a rank's last LOG_KEEP_CHARS characters.
    line = "x" * 1023 + "\n"
    for _ in range(3):
        ship(node_a, "node-a", [piece | {"text": line * ((LOG_KEEP_CHARS // 1024) // 2)}])
    whole = alice.get(f"/api/v1/jobs/{job['id']}/logs", params={"rank": 1}).json()
    assert len(whole["text"]) == LOG_KEEP_CHARS and whole["end"] - whole["start"] == LOG_KEEP_CHARS

    bob = service.client(service.token("user", "bob"))
    assert bob.get(f"/api/v1/jobs/{job['id']}/logs").status_code == 404
    assert alice.get(f"/api/v1/jobs/{job['id']}/logs", params={"attempt": 3}).status_code == 404
