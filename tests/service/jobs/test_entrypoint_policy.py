"""The operator's entrypoint policy (ETT_ENTRYPOINT_POLICY): any user, admins only, or listed
programs; a refused job is answered 403 naming the rule, and nothing is stored."""

import pytest

from tests.service.factories import job_spec
from tests.support.live import live_service

OWN = ["python", "train.py", "--lr", "3e-4"]


@pytest.fixture
def policy(settings):
    def serve(name: str, allowed: list[str] | None = None):
        return live_service(settings.model_copy(update={"entrypoint_policy": name,
                                                        "allowed_entrypoints": allowed or []}))  # fmt: skip

    return serve


def test_admins_only(policy):
    with policy("admins") as live:
        alice, admin = live.client(live.token("user", "alice")), live.client(live.token("admin"))
        refused = alice.post("/api/v1/jobs", json=job_spec(entrypoint=OWN))
        assert refused.status_code == 403 and "ETT_ENTRYPOINT_POLICY=admins" in refused.json()["detail"]
        assert alice.post("/api/v1/jobs", json=job_spec()).status_code == 201  # the built-in trainer: always
        assert admin.post("/api/v1/jobs", json=job_spec(entrypoint=OWN)).status_code == 201
        assert admin.get("/api/v1/jobs").json()["total"] == 2


def test_listed_programs(policy):
    with policy("listed", ["python train.py", "/opt/bin/run-job --safe"]) as live:
        admin = live.client(live.token("admin"))  # the list binds admins too
        assert admin.post("/api/v1/jobs", json=job_spec(entrypoint=OWN)).status_code == 201
        assert admin.post("/api/v1/jobs", json=job_spec(entrypoint=["/opt/bin/run-job", "--safe"])).status_code == 201
        for argv in (["python", "-c", "import os"], ["/bin/sh", "-c", "id > /tmp/pwned"], ["python"]):
            refused = admin.post("/api/v1/jobs", json=job_spec(entrypoint=argv))
            assert refused.status_code == 403, argv
            detail = refused.json()["detail"]
            assert "ETT_ENTRYPOINT_POLICY=listed" in detail and "python train.py" in detail
        assert admin.get("/api/v1/jobs").json()["total"] == 2


def test_any_is_the_default(service):
    alice = service.client(service.token("user", "alice"))
    assert alice.post("/api/v1/jobs", json=job_spec(entrypoint=OWN)).status_code == 201


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_env_cannot_change_how_a_listed_program_starts(policy):
    """A listed `python train.py` with PYTHONWARNINGS and BROWSER ran a shell: the interpreter's,
    the loader's and the shell's start-up variables are refused with 422 naming env.NAME."""
    with policy("listed", ["python train.py"]) as live:
        alice = live.client(live.token("user", "alice"))
        for env, field in (({"PYTHONWARNINGS": "::0:antigravity.x:0", "BROWSER": "/bin/sh -c id"}, "env.PYTHONWARNINGS"),
                           ({"LD_PRELOAD": "/tmp/evil.so"}, "env.LD_PRELOAD"), ({"PATH": "/tmp/bin"}, "env.PATH"),
                           ({"ETT_EVENT_DIR": "/tmp/x"}, "env.ETT_EVENT_DIR")):  # fmt: skip
            refused = alice.post("/api/v1/jobs", json=job_spec(entrypoint=OWN, env={"OMP_NUM_THREADS": "1", **env}))
            assert refused.status_code == 422, env
            [problem] = refused.json()["detail"]
            assert problem["field"] == field and problem["msg"].startswith("refused: it changes how"), problem
        assert alice.post("/api/v1/jobs", json=job_spec(entrypoint=OWN, env={"OMP_NUM_THREADS": "1"})).status_code == 201
        assert alice.get("/api/v1/jobs").json()["total"] == 1
