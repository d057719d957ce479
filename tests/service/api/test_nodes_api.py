"""Nodes for operators (service/api/nodes.py): an admin's drain is stored, so it outlives the service
that took it, until the admin returns the node. Draining nodes for their failures, with real agents:
tests/e2e/test_nodes.py."""

from service.settings import Settings
from tests.service.factories import register_agent
from tests.support.live import live_service


def test_an_admins_drain_is_stored_and_outlives_a_service_restart(settings: Settings):
    with live_service(settings) as first:
        admin_token = first.token("admin")
        register_agent(first.client(first.token("agent", "node-a")), "node-a")
        drained = first.client(admin_token).post("/api/v1/nodes/node-a/drain", json={"reason": "bad DIMM"})
        assert drained.status_code == 200 and drained.json()["drained"] == "drained by admin: bad DIMM"
    with live_service(settings) as second:  # a new service on the same database
        admin = second.client(admin_token)
        [node] = admin.get("/api/v1/nodes").json()
        assert (node["name"], node["drained"]) == ("node-a", "drained by admin: bad DIMM")
        assert admin.post("/api/v1/nodes/node-a/return").json()["drained"] is None
        assert admin.get("/api/v1/nodes").json()[0]["drained"] is None
