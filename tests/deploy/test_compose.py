"""docker-compose.yml and what it mounts: parses, pinned, secrets required, start order, and the
files, ports and names it shares with the Prometheus and Grafana configuration all agree."""

import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from agent.settings import AgentSettings
from ett_cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ETT_IMAGE = "ett:0.1.0"
SECRETS = ("ETT_POSTGRES_PASSWORD", "GRAFANA_ADMIN_PASSWORD")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def bind_mounts(compose: dict) -> list[tuple[str, Path, str]]:
    """(service, host path, container path) of each mount of a file or folder of the repository."""
    mounts = []
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith((".", "/")):
                mounts.append((name, (ROOT / source).resolve(), target))
    return mounts


def test_compose_has_the_deployment_and_every_mounted_file_exists(compose):
    expected = {"postgres", "migrate", "agent-token", "service", "agent", "prometheus", "alertmanager", "grafana"}
    assert set(compose["services"]) == expected
    mounts = bind_mounts(compose)
    assert {(s, t) for s, _, t in mounts} >= {
        ("prometheus", "/etc/prometheus/prometheus.yml"), ("prometheus", "/etc/prometheus/alerts.yml"),
        ("grafana", "/etc/grafana/provisioning"), ("grafana", "/etc/grafana/dashboards"),
        ("alertmanager", "/etc/alertmanager/alertmanager.yml"),
    }  # fmt: skip
    for service, path, _ in mounts:
        assert path.exists() and path.is_relative_to(ROOT), f"{service} mounts {path}, missing from the repository"
    named = {v.split(":")[0] for s in compose["services"].values() for v in s.get("volumes", []) if ":" in v}
    named = {v for v in named if not v.startswith((".", "/"))}
    assert named == set(compose["volumes"]), "every named volume is declared, and only those"
    assert "postgres-data:/var/lib/postgresql/data" in compose["services"]["postgres"]["volumes"]


def test_every_image_is_pinned_to_a_version(compose):
    for name, service in compose["services"].items():
        image = service["image"]
        repository, _, tag = image.rpartition(":")
        assert repository and re.fullmatch(r"v?\d+(\.\d+)+(-[a-z0-9.]+)?", tag), f"{name}: {image} is not pinned"
    ett = [n for n, s in compose["services"].items() if s["image"] == ETT_IMAGE]
    assert [n for n in ett if "build" in compose["services"][n]] == ["migrate"]
    assert all(compose["services"][n]["pull_policy"] == "never" for n in ett if n != "migrate")
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:\d+\.\d+\.\d+-slim-bookworm$", dockerfile, re.M)
    assert "--index-url https://download.pytorch.org/whl/cpu torch==2.13.0" in dockerfile


def test_secrets_come_from_required_environment_variables(compose):
    text = (ROOT / "docker-compose.yml").read_text()
    for secret in SECRETS:
        uses = re.findall(rf"\$\{{{secret}(.?.?)", text)
        assert uses and all(u == ":?" for u in uses), f"{secret} must be used as ${{{secret}:?message}}"
    for name, service in compose["services"].items():
        env = service.get("environment", {})
        for key, value in env.items():
            if re.search(r"PASSWORD|SECRET|TOKEN", key):
                assert re.fullmatch(r"\$\{\w+:\?[^}]+\}", str(value)), f"{name}: {key} is not a required variable"
    assert re.search(r"postgresql\+psycopg://ett:\$\{ETT_POSTGRES_PASSWORD:\?[^}]+\}@postgres:5432/ett", text)


def test_start_order_database_migration_service_agent(compose):
    services = compose["services"]
    assert services["postgres"]["healthcheck"]["test"][0] == "CMD-SHELL"
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert services["migrate"]["restart"] == "no"
    assert services["service"]["depends_on"] == {
        "postgres": {"condition": "service_healthy"}, "migrate": {"condition": "service_completed_successfully"},
    }  # fmt: skip
    assert services["agent"]["depends_on"]["service"] == {"condition": "service_healthy"}
    assert services["agent"]["depends_on"]["agent-token"] == {"condition": "service_completed_successfully"}
    assert "/readyz" in " ".join(services["service"]["healthcheck"]["test"])


def test_commands_are_real_ett_commands(compose):
    services = compose["services"]
    parser = build_parser()
    assert parser.parse_args(services["migrate"]["command"]).action == "migrate"
    run = parser.parse_args(services["service"]["command"])
    assert (run.action, run.host, run.port) == ("run", "0.0.0.0", 8000)
    (mint,) = services["agent-token"]["command"]
    argv = re.search(r"\bett (token create [^>]*)>", mint).group(1).split()
    assert parser.parse_args(argv).role == "agent"
    (start,) = services["agent"]["command"]
    assert start.endswith("exec ett agent") and parser.parse_args(["agent"]).command == "agent"
    agent_env = services["agent"]["environment"]
    fields = {f"ETT_AGENT_{name.upper()}" for name in AgentSettings.model_fields}
    assert set(agent_env) <= fields, set(agent_env) - fields
    assert agent_env["ETT_AGENT_SERVICE_URL"] == "http://service:8000"


def test_prometheus_scrapes_what_compose_runs(compose):
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    agent_port = compose["services"]["agent"]["environment"]["ETT_AGENT_METRICS_PORT"]
    assert targets == {"ett-service": ["service:8000"], "ett-agent": [f"agent:{agent_port}"]}
    [alertmanagers] = config["alerting"]["alertmanagers"]
    assert alertmanagers["static_configs"][0]["targets"] == ["alertmanager:9093"]
    assert "--config.file=/etc/alertmanager/alertmanager.yml" in compose["services"]["alertmanager"]["command"]


def test_grafana_provisions_the_datasource_and_the_dashboard_it_mounts(compose):
    provisioning = DEPLOY / "grafana" / "provisioning"
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert datasource["url"] == "http://prometheus:9090" and datasource["type"] == "prometheus"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "ett.yml").read_text())["providers"]
    mounted = {t: p for s, p, t in bind_mounts(compose) if s == "grafana"}
    assert (mounted[provider["options"]["path"]] / "ett.json").exists()
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "ett.json").read_text())
    uids = {p["datasource"]["uid"] for p in dashboard["panels"]} | {
        t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]
    }
    assert uids == {datasource["uid"]}
    assert [v["name"] for v in dashboard["templating"]["list"]][0] == "job"
    home = compose["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/ett.json"


def test_the_image_copies_every_package_the_project_installs():
    # The packages pyproject.toml installs (ett, ett_cli, service, agent, trainer, and the migrations
    # the service reads by path): one left out of the image installs nothing and fails only when
    # first imported (or, the migrations, first read) in a container.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {name.rstrip("*") for name in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = set(re.findall(r"^COPY (\w+) \1$", (ROOT / "Dockerfile").read_text(), re.M))
    assert packages == copied == {"ett", "ett_cli", "service", "agent", "trainer", "migrations"}
