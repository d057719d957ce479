"""`ett kubernetes`: the Kubernetes manifests of a deployment, rendered from one values file
(docs/kubernetes.md). Plain YAML out of Python rather than a Helm chart: the suite renders and
validates it with what the project already has, and the names the pods share with the code (the
settings' environment variables, the commands, the ports) are taken from the code, not retyped.

    ett kubernetes [--values deploy/kubernetes/values.toml] > ett.yaml && kubectl apply -f ett.yaml
"""

import argparse
import sys
import tomllib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent.settings import AgentSettings
from service.settings import Settings

IMAGE_UID = 10001  # the Dockerfile's unprivileged user
SERVICE_PORT = 8000
AGENT_METRICS_PORT = 9101
POSTGRES_IMAGE = "postgres:16.4-bookworm"
AGENT_TOKEN_SECRET = "ett-agent-token"  # key `token`: `ett token create --role agent` (docs/kubernetes.md)
POSTGRES_SECRET = "ett-postgres"  # key `password`
DATABASE_SECRET = "ett-database"  # key `url`, with database = "external"


class KubernetesValues(BaseModel):
    """What differs between clusters; everything else follows from it."""

    model_config = ConfigDict(extra="forbid")
    namespace: str = "ett"
    image: str = "ett:0.1.0"
    service_replicas: int = Field(2, ge=1)
    database: Literal["statefulset", "external"] = "statefulset"
    database_storage: str = "20Gi"
    checkpoint_storage: str = "1Ti"
    checkpoint_storage_class: str | None = None  # a ReadWriteMany class (NFS, Lustre, Filestore, ...)
    gpu_resource: str = "nvidia.com/gpu"
    gpus_per_node: int = Field(8, ge=1)
    gpu_node_selector: dict[str, str] = {"nvidia.com/gpu.present": "true"}
    agent_data_host_path: str = "/var/lib/ett-agent"
    local_checkpoint_host_path: str = "/mnt/local/ett"


def settings_env(settings: type, field: str) -> str:
    """The environment variable a settings field is read from: named by its class, never retyped."""
    assert field in settings.model_fields, f"{settings.__name__} has no field {field}"
    return f"{settings.model_config['env_prefix']}{field}".upper()


def _env(settings: type, values: dict[str, Any]) -> list[dict]:
    return [{"name": settings_env(settings, k), "value": str(v)} for k, v in values.items()]


def _meta(name: str, v: KubernetesValues, component: str, **extra: Any) -> dict:
    labels = {"app.kubernetes.io/name": "ett", "app.kubernetes.io/component": component}
    return {"name": name, "namespace": v.namespace, "labels": labels, **extra}


def _scraped(port: int) -> dict:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def _password() -> dict:
    return {"secretKeyRef": {"name": POSTGRES_SECRET, "key": "password"}}


def _database_env(v: KubernetesValues) -> list[dict]:
    url = settings_env(Settings, "database_url")
    if v.database == "external":
        return [{"name": url, "valueFrom": {"secretKeyRef": {"name": DATABASE_SECRET, "key": "url"}}}]
    return [{"name": "ETT_POSTGRES_PASSWORD", "valueFrom": _password()},
            {"name": url, "value": "postgresql+psycopg://ett:$(ETT_POSTGRES_PASSWORD)@ett-postgres:5432/ett"}]


def _service_env(v: KubernetesValues) -> list[dict]:
    paths = {"data_dir": "/var/lib/ett", "checkpoint_root": "/var/lib/ett/checkpoints"}
    return _database_env(v) + _env(Settings, paths)


UNPRIVILEGED = {"runAsUser": IMAGE_UID, "runAsNonRoot": True, "allowPrivilegeEscalation": False}


def _pod(containers: list[dict], **spec: Any) -> dict:
    # No pod talks to the Kubernetes API: no service account token in any of them.
    return {"automountServiceAccountToken": False, "containers": containers, **spec}


def _checkpoints_volume() -> dict:
    return {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ett-checkpoints"}}


def postgres(v: KubernetesValues) -> list[dict]:
    labels = {"app.kubernetes.io/name": "ett", "app.kubernetes.io/component": "postgres"}
    container = {
        "name": "postgres", "image": POSTGRES_IMAGE, "ports": [{"containerPort": 5432, "name": "postgres"}],
        "env": [{"name": "POSTGRES_USER", "value": "ett"}, {"name": "POSTGRES_DB", "value": "ett"},
                {"name": "PGDATA", "value": "/var/lib/postgresql/data/pgdata"},
                {"name": "POSTGRES_PASSWORD", "valueFrom": _password()}],
        "readinessProbe": {"exec": {"command": ["pg_isready", "-U", "ett", "-d", "ett"]}, "periodSeconds": 5},
        "volumeMounts": [{"name": "data", "mountPath": "/var/lib/postgresql/data"}],
    }  # fmt: skip
    claim = {"metadata": {"name": "data"}, "spec": {"accessModes": ["ReadWriteOnce"],
                                                    "resources": {"requests": {"storage": v.database_storage}}}}
    return [
        {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta("ett-postgres", v, "postgres"),
         "spec": {"serviceName": "ett-postgres", "replicas": 1, "selector": {"matchLabels": labels},
                  "template": {"metadata": {"labels": labels}, "spec": _pod([container])},
                  "volumeClaimTemplates": [claim]}},
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta("ett-postgres", v, "postgres"),
         "spec": {"selector": labels, "ports": [{"port": 5432, "targetPort": "postgres", "name": "postgres"}]}},
    ]  # fmt: skip


def service(v: KubernetesValues) -> list[dict]:
    labels = {"app.kubernetes.io/name": "ett", "app.kubernetes.io/component": "service"}
    probe = {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 10}
    container = {
        "name": "service", "image": v.image,
        "args": ["service", "run", "--host", "0.0.0.0", "--port", str(SERVICE_PORT)],
        "ports": [{"containerPort": SERVICE_PORT, "name": "http"}], "env": _service_env(v),
        "readinessProbe": probe,
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 20},
        "securityContext": UNPRIVILEGED,
        "volumeMounts": [{"name": "checkpoints", "mountPath": "/var/lib/ett/checkpoints"}],
    }  # fmt: skip
    migrate = {"name": "migrate", "image": v.image, "args": ["service", "migrate"], "env": _database_env(v),
               "securityContext": UNPRIVILEGED}
    return [
        # The schema first: a service process refuses to start on a database not at head, and
        # Kubernetes restarts it until this Job has run.
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": _meta("ett-migrate", v, "migrate"),
         "spec": {"backoffLimit": 20, "template": {"spec": _pod([migrate], restartPolicy="OnFailure")}}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta("ett-service", v, "service"),
         "spec": {"replicas": v.service_replicas, "selector": {"matchLabels": labels},
                  "template": {"metadata": {"labels": labels, "annotations": _scraped(SERVICE_PORT)},
                               "spec": _pod([container], volumes=[_checkpoints_volume()])}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta("ett-service", v, "service"),
         "spec": {"selector": labels, "ports": [{"port": SERVICE_PORT, "targetPort": "http", "name": "http"}]}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": _meta("ett-checkpoints", v, "checkpoints"),
         "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": v.checkpoint_storage}},
                  **({"storageClassName": v.checkpoint_storage_class} if v.checkpoint_storage_class else {})}},
    ]  # fmt: skip


def agents(v: KubernetesValues) -> list[dict]:
    labels = {"app.kubernetes.io/name": "ett", "app.kubernetes.io/component": "agent"}
    env = [
        {"name": settings_env(AgentSettings, "name"), "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        # The ranks of different nodes meet at this address: the node's own, with the host's network.
        {"name": settings_env(AgentSettings, "address"), "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
        *_env(AgentSettings, {
            "service_url": f"http://ett-service.{v.namespace}.svc:{SERVICE_PORT}", "slots": v.gpus_per_node,
            "token_file": "/run/ett/agent-token/token", "data_dir": "/var/lib/ett/agent",
            "local_checkpoint_dir": "/var/lib/ett/local", "checkpoint_root": "/var/lib/ett/checkpoints",
            "metrics_port": AGENT_METRICS_PORT,
        }),
    ]  # fmt: skip
    container = {
        "name": "agent", "image": v.image, "args": ["agent"], "env": env,
        "ports": [{"containerPort": AGENT_METRICS_PORT, "name": "metrics"}],
        "resources": {"limits": {v.gpu_resource: v.gpus_per_node}},
        # Root in a privileged container: the agent starts each job's ranks as an unprivileged user
        # of its own (setuid) and in a cgroup of its own under the pod's (cgroup v2, written rw).
        "securityContext": {"privileged": True, "runAsUser": 0},
        "volumeMounts": [
            {"name": "agent-token", "mountPath": "/run/ett/agent-token", "readOnly": True},
            {"name": "agent-data", "mountPath": "/var/lib/ett/agent"},
            {"name": "local", "mountPath": "/var/lib/ett/local"},
            {"name": "checkpoints", "mountPath": "/var/lib/ett/checkpoints"},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
    }  # fmt: skip
    volumes = [
        {"name": "agent-token", "secret": {"secretName": AGENT_TOKEN_SECRET, "defaultMode": 0o400}},
        # On the node, not in the pod: the spools of a running attempt outlive a restarted agent pod.
        {"name": "agent-data", "hostPath": {"path": v.agent_data_host_path, "type": "DirectoryOrCreate"}},
        {"name": "local", "hostPath": {"path": v.local_checkpoint_host_path, "type": "DirectoryOrCreate"}},
        _checkpoints_volume(),
        {"name": "shm", "emptyDir": {"medium": "Memory"}},  # gloo and NCCL move tensors through /dev/shm
    ]  # fmt: skip
    spec = _pod([container], hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet", nodeSelector=v.gpu_node_selector,
                tolerations=[{"key": v.gpu_resource, "operator": "Exists", "effect": "NoSchedule"}],
                terminationGracePeriodSeconds=60, volumes=volumes)  # fmt: skip
    return [{"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": _meta("ett-agent", v, "agent"),
             "spec": {"selector": {"matchLabels": labels},
                      "template": {"metadata": {"labels": labels, "annotations": _scraped(AGENT_METRICS_PORT)},
                                   "spec": spec}}}]  # fmt: skip


def render(v: KubernetesValues) -> list[dict]:
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": v.namespace}}
    return [namespace, *(postgres(v) if v.database == "statefulset" else []), *service(v), *agents(v)]


def dump(documents: list[dict]) -> str:
    header = "# Rendered by `ett kubernetes` from deploy/kubernetes/values.toml: edit those, not this.\n"
    return header + "---\n".join(yaml.safe_dump(d, sort_keys=False) for d in documents)


def load_values(path: Path | None) -> KubernetesValues:
    """The values of `path` (TOML); a bad one is a one-line error naming the file and the field."""
    if path is None:
        return KubernetesValues()
    try:
        return KubernetesValues.model_validate(tomllib.loads(path.read_text()))
    except OSError as exc:
        raise SystemExit(f"ett kubernetes: {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SystemExit(f"ett kubernetes: {path}: {exc}") from None
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error["loc"])
        raise SystemExit(f"ett kubernetes: {path}: {field}: {error['msg']}") from None


def run(args: argparse.Namespace) -> int:
    sys.stdout.write(dump(render(load_values(args.values))))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("kubernetes", help="print the Kubernetes manifests of a deployment (docs/kubernetes.md)")
    parser.add_argument("--values", type=Path, default=None,
                        help="a TOML file of KubernetesValues (default: all defaults)")
    parser.set_defaults(run=run)
