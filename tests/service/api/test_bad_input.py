"""Bad input: 422 naming the field for bad specs, 413 for bodies over the limit."""

import pytest

from tests.service.factories import job_spec

BAD_SPECS = [
    ({"bogus": 1}, "bogus"),
    ({"name": ""}, "name"),
    ({"name": "has space"}, "name"),
    ({"name": "x" * 129}, "name"),
    ({"nodes": 0}, "nodes"),
    ({"nodes": "2"}, "nodes"),
    ({"procs_per_node": 1.5}, "procs_per_node"),
    ({"max_restarts": -1}, "max_restarts"),
    ({"hang_timeout_seconds": 0}, "hang_timeout_seconds"),
    ({"entrypoint": "python train.py"}, "entrypoint"),
    ({"entrypoint": []}, "entrypoint"),
    ({"checkpoint": {"interval_steps": 0}}, "checkpoint.interval_steps"),
    ({"checkpoint": {"interval_steps": "often"}}, "checkpoint.interval_steps"),
    ({"checkpoint": {"dir": "relative/path"}}, "checkpoint.dir"),
    ({"checkpoint": {"keep": 3, "extra": True}}, "checkpoint.extra"),
    ({"trainer": {"preset": "tiny", "overrides": {"Not A Key": 1}}}, "trainer.overrides"),
    ({"trainer": {"preset": "tiny", "overrides": {"moe.num_experts": [1]}}}, "trainer.overrides"),
    ({"faults": [{"attempt": 0, "rank": 0, "at_step": 3, "action": "explode"}]}, "faults.0.action"),
    ({"faults": [{"attempt": 0, "rank": 0, "at_step": 3, "action": "exit"}]}, "faults.0"),
    ({"faults": [{"attempt": 0, "rank": 0, "at_step": 3, "action": "fill_disk"}]}, "faults.0"),  # no path
    ({"faults": [{"attempt": 0, "rank": 0, "at_step": 3, "action": "raise", "exception": "os.system"}]},
     "faults.0.exception"),
    ({"faults": [{"attempt": 0, "rank": 9, "at_step": 3, "action": "kill"}]}, "faults"),
    ({"entrypoint": ["python", "t.py"], "warm_imports": ["json", "antigravity"]}, "warm_imports.1"),
    ({"entrypoint": ["python", "t.py"], "warm_imports": ["unittest.__main__"]}, "warm_imports.0"),
    ({"env": {"1BAD": "x"}}, "env"),
    ({"env": {"OK": 1}}, "env.OK"),
    ({"slurm": {"partition": "a b"}}, "slurm.partition"),
    ({"slurm": {"time_limit": "an hour"}}, "slurm.time_limit"),
    ({"slurm": {"options": ["--nodes=3"]}}, "slurm.options"),
    ({"slurm": {"options": ["-N 3"]}}, "slurm.options"),
    ({"slurm": {"options": ["--qos=high --exclusive"]}}, "slurm.options"),
    ({"slurm": {"options": ["--outp=/etc/cron.d/x"]}}, "slurm.options.0"),  # sbatch's abbreviation of --output
    ({"slurm": {"options": ["--qos=high", "--chdi=/root"]}}, "slurm.options.1"),
    ({"slurm": {"options": ["--arr=1-9"]}}, "slurm.options.0"),
    ({"slurm": {"options": ["--export-file=/root/.env"]}}, "slurm.options.0"),
    ({"slurm": {"options": ["--container=/tmp/bundle"]}}, "slurm.options.0"),
    ({"slurm": {}}, "slurm"),  # valid, but this service does not run jobs on Slurm (ETT_SLURM is off)
]


@pytest.mark.parametrize("change,field", BAD_SPECS, ids=[f for _, f in BAD_SPECS])
def test_bad_spec_is_422_naming_the_field(service, change, field):
    client = service.client(service.token("user"))
    response = client.post("/api/v1/jobs", json=job_spec(**change))
    assert response.status_code == 422, response.text
    fields = [error["field"] for error in response.json()["detail"]]
    assert any(f.startswith(field) for f in fields), fields
    assert client.get("/api/v1/jobs").json()["total"] == 0  # nothing stored


def test_body_not_json_is_422(service):
    client = service.client(service.token("user"))
    response = client.post("/api/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 422


def test_body_over_the_limit_is_413_declared_or_streamed(service):
    client = service.client(service.token("user"))
    limit = service.context.settings.max_request_bytes
    big = job_spec(env={"PAD": "x" * 4000 for _ in range(1)} | {f"V{i}": "x" * 4000 for i in range(limit // 4000)})
    response = client.post("/api/v1/jobs", json=big)
    assert response.status_code == 413 and "limit" in response.json()["detail"]

    def chunks():
        for _ in range(limit // 65536 + 2):
            yield b" " * 65536

    streamed = client.post("/api/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413
    assert client.get("/api/v1/jobs").json()["total"] == 0
