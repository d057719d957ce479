"""The Kubernetes manifests (deploy/kubernetes/ett.yaml): rendered from the values file alone, valid
against the Kubernetes API schemas (kubernetes-validate, strict: no unknown field), and agreeing
with the code they run: the settings the pods set, the commands, the image's user, the Secrets the
docs tell an operator to create, the ports Prometheus scrapes."""

import copy
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from agent.settings import AgentSettings
from ett_cli.kubernetes_cmd import IMAGE_UID, KubernetesValues, dump, load_values, render
from ett_cli.main import build_parser, main
from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "deploy" / "kubernetes"
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())  # an older cluster, and the newest schemas


@pytest.fixture(scope="module")
def documents() -> list[dict]:
    return list(yaml.safe_load_all((FOLDER / "ett.yaml").read_text()))


def by_kind(documents: list[dict], kind: str, name: str) -> dict:
    [document] = [d for d in documents if d["kind"] == kind and d["metadata"]["name"] == name]
    return document


def containers(documents: list[dict]) -> list[dict]:
    templates = [d["spec"]["template"] for d in documents if "template" in d.get("spec", {})]
    return [c for template in templates for c in template["spec"]["containers"]]


def test_the_committed_manifests_are_the_values_files_rendering(capsys):
    assert main(["kubernetes", "--values", str(FOLDER / "values.toml")]) == 0
    assert capsys.readouterr().out == (FOLDER / "ett.yaml").read_text(), "run `ett kubernetes --values ...` again"
    assert load_values(FOLDER / "values.toml") == KubernetesValues()  # the file shows the defaults


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(documents, version):
    kinds = {d["kind"] for d in documents}
    assert kinds == {"Namespace", "StatefulSet", "Service", "Job", "Deployment", "PersistentVolumeClaim", "DaemonSet"}
    for document in documents:
        kubernetes_validate.validate(document, version, strict=True)
    typo = copy.deepcopy(by_kind(documents, "DaemonSet", "ett-agent"))
    typo["spec"]["template"]["spec"]["hostNetwrok"] = True  # the validator is strict: this must not pass
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, version, strict=True)


def test_an_external_database_drops_the_statefulset_and_reads_the_url_from_a_secret():
    documents = render(KubernetesValues(database="external", checkpoint_storage_class="nfs"))
    assert not [d for d in documents if d["kind"] == "StatefulSet"]
    for document in documents:
        kubernetes_validate.validate(document, VERSIONS[-1], strict=True)
    for container in containers(documents):
        if container["name"] in ("service", "migrate"):
            [url] = [e for e in container["env"] if e["name"] == "ETT_DATABASE_URL"]
            assert url["valueFrom"]["secretKeyRef"] == {"name": "ett-database", "key": "url"}
    assert yaml.safe_load_all(dump(documents))  # and it dumps


def test_a_bad_values_file_is_one_line_naming_the_file_and_the_field(tmp_path, capsys):
    bad = tmp_path / "values.toml"
    bad.write_text('gpus_per_node = 0\n')
    with pytest.raises(SystemExit) as exit_:
        main(["kubernetes", "--values", str(bad)])
    assert str(exit_.value) == f"ett kubernetes: {bad}: gpus_per_node: Input should be greater than or equal to 1"
    bad.write_text('gpu_per_node = 8\n')  # a typo is not ignored
    with pytest.raises(SystemExit, match="gpu_per_node: Extra inputs are not permitted"):
        main(["kubernetes", "--values", str(bad)])


def test_the_pods_run_the_commands_and_settings_the_code_has(documents, monkeypatch, tmp_path):
    parser = build_parser()
    for container in containers(documents):
        if container["image"].startswith("ett:"):
            parser.parse_args(container["args"])  # an `ett` command line the image's entry point takes
    agent = by_kind(documents, "DaemonSet", "ett-agent")["spec"]["template"]["spec"]["containers"][0]
    env = {variable["name"]: variable.get("value", "10.0.0.7") for variable in agent["env"]}  # the pod's own filled in
    token_mount = next(m["mountPath"] for m in agent["volumeMounts"] if m["name"] == "agent-token")
    assert Path(env["ETT_AGENT_TOKEN_FILE"]).parent == Path(token_mount)  # the Secret's key `token`, mounted
    (tmp_path / "token").write_text("a-token\n")
    for name, value in (env | {"ETT_AGENT_TOKEN_FILE": str(tmp_path / "token")}).items():
        monkeypatch.setenv(name, value)
    settings = AgentSettings()  # the agent's settings, read from these variables
    assert (settings.name, settings.address, settings.slots, settings.token) == ("10.0.0.7", "10.0.0.7", 8, "a-token")
    service = by_kind(documents, "Deployment", "ett-service")["spec"]["template"]["spec"]["containers"][0]
    names = {e["name"] for e in service["env"]} - {"ETT_POSTGRES_PASSWORD"}  # only a part of the URL
    assert names <= {f"ETT_{field}".upper() for field in Settings.model_fields}


def test_only_the_agent_runs_as_root_and_the_image_user_is_the_dockerfiles(documents):
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(rf"useradd .*--uid {IMAGE_UID}\b", dockerfile)
    for container in containers(documents):
        context = container.get("securityContext", {})
        if container["name"] == "agent":
            assert context == {"privileged": True, "runAsUser": 0}
        elif container["name"] != "postgres":
            assert context["runAsUser"] == IMAGE_UID and context["runAsNonRoot"]
    for document in documents:  # no pod needs the Kubernetes API
        if "template" in document.get("spec", {}):
            assert document["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_the_secrets_referenced_are_those_the_docs_tell_an_operator_to_create(documents):
    def secrets(node) -> set[str]:
        if isinstance(node, list):
            return set().union(*map(secrets, node))
        if not isinstance(node, dict):
            return set()
        found = {node["secretKeyRef"]["name"]} if "secretKeyRef" in node else set()
        found |= {node["secret"]["secretName"]} if "secret" in node else set()
        return found.union(*map(secrets, node.values()))

    referenced = secrets(documents)
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    created = set(re.findall(r"kubectl -n ett create secret generic (\S+)", docs))
    assert referenced == {"ett-agent-token", "ett-postgres"} and referenced <= created


def test_prometheus_scrapes_the_ports_the_pods_expose(documents):
    for kind, name in (("Deployment", "ett-service"), ("DaemonSet", "ett-agent")):
        template = by_kind(documents, kind, name)["spec"]["template"]
        annotations = template["metadata"]["annotations"]
        ports = {p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
        assert annotations["prometheus.io/scrape"] == "true" and int(annotations["prometheus.io/port"]) in ports
