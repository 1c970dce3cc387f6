"""`poolserve k8s render CONFIG`: the KubeRay manifests and the Grafana dashboard, generated
from the same config file the local run uses.

    k8s/rayservice.yaml        RayService: CPU-only head (num-cpus 0), one GPU worker group per
                               pool offering a custom resource (pool-<name>) that only that pool's
                               replicas request, in-tree autoscaling; serveConfigV2 embeds the config
    k8s/rayjob-batch.yaml      RayJob: a batch file from a volume through the router, on its own
                               small CPU cluster, the tenant key from a Secret
    k8s/podmonitor.yaml        Prometheus Operator PodMonitor for Ray's metrics port
    k8s/networkpolicy.yaml     who may reach poolserve's Ray pods: the serving port and metrics for
                               all; every other port (the dashboard's Jobs API runs code) only those
                               clusters' own pods and KubeRay's operator in its namespace
                               (--operator-namespace), which submits the batch RayJob (HTTPMode)
    k8s/secret-example.yaml    the shape of the Secret `poolserve-keys` (tenant keys, admin key, HF
                               token), which the router reads at start; never applied: create your own
    k8s/batch-pvc.yaml         the volume batch files are read from and written to
    k8s/files-pvc.yaml         the Batch API's volume (ReadWriteMany), mounted at `batches.dir` on
                               every pod of the RayService: only when the config sets `batches.dir`
    k8s/kustomization.yaml     all of the above but the Secret, and the dashboard as a ConfigMap

Ray's token authentication is on in both clusters (`authOptions`): KubeRay generates the token
and gives it to every Ray container.
    k8s/dashboards/poolserve.json

The committed files are this command's output; a test fails when they drift.
"""

from __future__ import annotations

import argparse
import json
import posixpath
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from deployments.config import RayConfig, Resolved, load
from deployments.dashboard import dashboard

APP_IMPORT_PATH = "deployments.app:app_builder"
IMAGE_HOME = "/home/ray/poolserve"
METRICS_PORT = 8080
KEYS_DIR = "/etc/poolserve/keys"


@dataclass(frozen=True)
class RenderSettings:
    name: str = "poolserve"
    image: str = "ghcr.io/poolserve/poolserve:0.1.0-gpu"
    ray_version: str = "2.60.0"
    worker_cpu: str = "8"
    worker_memory: str = "48Gi"
    gpus_per_worker: int = 1
    operator_namespace: str = "default"  # where KubeRay's operator runs (its Helm chart's namespace)
    files_storage_class: str | None = None  # the Batch API's volume's (one offering ReadWriteMany); None: the default


# -- manifests -----------------------------------------------------------------------------------

def _container(s: RenderSettings, name: str, resources: dict, ports: list[dict], env: list[dict] = (),
               mounts: list[dict] = ()) -> dict:
    return {"name": name, "image": s.image, "resources": {"limits": resources, "requests": resources},
            "ports": ports, "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
                "name": f"{s.name}-keys", "key": "hf-token", "optional": True}}}, *env],
            "volumeMounts": [{"name": "keys", "mountPath": KEYS_DIR, "readOnly": True}, *map(dict, mounts)]}


CLUSTER_LABEL = "poolserve.io/cluster"


def _cluster_labels(s: RenderSettings, batch: bool = False) -> dict:
    """Every pod (head and workers) of one of poolserve's Ray clusters: what the NetworkPolicy
    guards and admits."""
    return {CLUSTER_LABEL: f"{s.name}-batch" if batch else s.name}


def _keys_volume(s: RenderSettings) -> dict:
    """The Secret as files, owner-readable: the router (on any pod) reads tenant and admin keys."""
    return {"name": "keys", "secret": {"secretName": f"{s.name}-keys", "defaultMode": 0o400}}


def files_mount(config: dict) -> str | None:
    """Where the Batch API's volume is mounted: where the app resolves `batches.dir` in the
    image (None: unset, the API is off). The batch jobs run on the head and reach the router
    through its own proxy (`batches.router_url`'s default), and Ray's job client in the batch
    service follows `RAY_ADDRESS`, which KubeRay sets to its own cluster's head in every pod."""
    folder = (config.get("batches") or {}).get("dir")
    return posixpath.normpath(posixpath.join(f"{IMAGE_HOME}/deployments/configs", folder)) if folder else None


def files_pvc(s: RenderSettings) -> dict:
    """The Batch API's files and batches: every router replica writes uploads, the batch service
    and its jobs (on the head) read them, so every pod mounts it, and no pod starts until it is
    bound: the storage class must offer ReadWriteMany."""
    spec = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "100Gi"}}}
    if s.files_storage_class:
        spec["storageClassName"] = s.files_storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": f"{s.name}-files", "labels": {"app.kubernetes.io/name": s.name}}, "spec": spec}


def rayservice(config: dict, s: RenderSettings) -> dict:
    from deployments.app import pool_app_name

    files_at = files_mount(config)
    files = [] if files_at is None else [{"name": "files", "persistentVolumeClaim": {"claimName": f"{s.name}-files"}}]
    mounts = [] if files_at is None else [{"name": "files", "mountPath": files_at}]

    def volumes() -> list[dict]:  # each pod its own copy: YAML anchors would make the manifests hard to read
        return [_keys_volume(s), *json.loads(json.dumps(files))]
    # the control application at / and one per pool at its prefix (deployments.app.build_apps)
    parts = [("control", s.name, "/")] + [(pool, pool_app_name(pool, s.name), p["route_prefix"])
                                          for pool, p in config["pools"].items()]
    serve_config = {"applications": [{
        "name": name, "route_prefix": prefix, "import_path": APP_IMPORT_PATH,
        "args": {"base_dir": f"{IMAGE_HOME}/deployments/configs", "config": json.loads(json.dumps(config)),  # no
                 "part": part, "name": s.name},  # YAML aliases: each application carries its own copy
    } for part, name, prefix in parts]}
    head_ports = [{"containerPort": 6379, "name": "gcs"}, {"containerPort": 8265, "name": "dashboard"},
                  {"containerPort": 10001, "name": "client"}, {"containerPort": 8000, "name": "serve"},
                  {"containerPort": METRICS_PORT, "name": "metrics"}]
    # Ray starts workers at nice 15 unless told: the serving path would rank below every
    # ordinary process on the node (see `ray.worker_niceness`).
    ray_config = RayConfig(**config.get("ray", {}))
    env = [{"name": "RAY_worker_niceness", "value": str(ray_config.worker_niceness)}]
    if ray_config.haproxy:  # Serve's HTTP entry on every node is HAProxy, to the replicas' own ports
        env.append({"name": "RAY_SERVE_ENABLE_HA_PROXY", "value": "1"})
    workers = []
    for pool, p in config["pools"].items():
        r = p.get("replicas", {})
        resource = f"pool-{pool}"
        workers.append({
            "groupName": pool,
            "replicas": max(1, r.get("min", 1)), "minReplicas": r.get("min", 1), "maxReplicas": r.get("max", 1),
            "resources": {resource: "1"},
            "rayStartParams": {},
            "template": {"metadata": {"labels": _cluster_labels(s)}, "spec": {
                "containers": [_container(s, "ray-worker", {
                    "cpu": s.worker_cpu, "memory": s.worker_memory, "nvidia.com/gpu": str(s.gpus_per_worker)},
                    [{"containerPort": METRICS_PORT, "name": "metrics"}], [dict(e) for e in env], mounts)],
                "volumes": volumes(),
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            }},
        })
    return {
        "apiVersion": "ray.io/v1", "kind": "RayService",
        "metadata": {"name": s.name, "labels": {"app.kubernetes.io/name": s.name}},
        "spec": {
            "serveConfigV2": yaml.safe_dump(serve_config, sort_keys=False, width=120),
            "rayClusterConfig": {
                "rayVersion": s.ray_version,
                "authOptions": {"mode": "token"},
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": {"upscalingMode": "Default", "idleTimeoutSeconds": 600},
                "headGroupSpec": {
                    # the dashboard listens on the pod's address for KubeRay and job submitters; the
                    # NetworkPolicy (networkpolicy.yaml) and token auth keep everyone else out
                    "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
                    "template": {"metadata": {"labels": _cluster_labels(s)},
                                 "spec": {"containers": [_container(s, "ray-head", {"cpu": "4", "memory": "16Gi"},
                                                                    head_ports, [dict(e) for e in env], mounts)],
                                          "volumes": volumes()}},
                },
                "workerGroupSpecs": workers,
            },
        },
    }


def rayjob(s: RenderSettings, resolved: Resolved) -> dict:
    """A batch job on a cluster of its own, sending to the config's batch pool under the key of
    the first tenant whose default pool that is (else the first that may use it)."""
    pool = resolved.batch_pool or next(iter(resolved.pools))
    users = [t for t in resolved.config.tenants if pool in t.pools] or list(resolved.config.tenants)
    tenant = next((t for t in users if (t.default_pool or t.pools[0]) == pool), users[0]).name
    entry = (f"python -m deployments.batch_job --input /data/input.jsonl --output /data/output.jsonl "
             f"--url http://{s.name}-serve-svc:8000 --pool {resolved.pools[pool].config.route_prefix.lstrip('/')} "
             "--concurrency 256")
    volume = {"name": "batch-data", "persistentVolumeClaim": {"claimName": f"{s.name}-batch"}}
    mount = {"name": "batch-data", "mountPath": "/data"}
    head = _container(s, "ray-head", {"cpu": "2", "memory": "4Gi"}, [{"containerPort": 8265, "name": "dashboard"}])
    head["env"].append({"name": "POOLSERVE_KEY", "valueFrom": {"secretKeyRef": {
        "name": f"{s.name}-keys", "key": tenant}}})
    head["volumeMounts"] = [mount]  # the job needs its tenant's key only, not the key folder
    return {
        "apiVersion": "ray.io/v1", "kind": "RayJob",
        "metadata": {"name": f"{s.name}-batch", "labels": {"app.kubernetes.io/name": s.name}},
        "spec": {
            "entrypoint": entry,
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 3600,
            "backoffLimit": 2,
            "submissionMode": "HTTPMode",  # the operator submits: no submitter pod needs the dashboard
            "rayClusterSpec": {
                "rayVersion": s.ray_version,
                "authOptions": {"mode": "token"},
                "headGroupSpec": {"rayStartParams": {"dashboard-host": "0.0.0.0"},
                                  "template": {"metadata": {"labels": _cluster_labels(s, batch=True)},
                                               "spec": {"containers": [head], "volumes": [volume]}}},
            },
        },
    }


def podmonitor(s: RenderSettings) -> dict:
    return {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
        "metadata": {"name": f"{s.name}-ray", "labels": {"app.kubernetes.io/name": s.name}},
        "spec": {"selector": {"matchLabels": {"ray.io/is-ray-node": "yes"}},
                 "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}]},
    }


def networkpolicy(s: RenderSettings) -> dict:
    """Ingress to every pod of poolserve's Ray clusters: the serving port and metrics from
    anywhere in the cluster; every other port (the dashboard's Jobs API, the GCS, Ray's own
    ports among them) only from those clusters' own pods and from KubeRay's operator in its
    namespace. Token authentication guards the dashboard behind it."""
    ours = {"key": CLUSTER_LABEL, "operator": "In", "values": [s.name, f"{s.name}-batch"]}
    operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": s.operator_namespace}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}}
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": f"{s.name}-ray", "labels": {"app.kubernetes.io/name": s.name}},
        "spec": {
            "podSelector": {"matchExpressions": [ours]},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": [{"port": 8000, "protocol": "TCP"}, {"port": METRICS_PORT, "protocol": "TCP"}]},
                {"from": [{"podSelector": {"matchExpressions": [ours]}}, operator]},
            ],
        },
    }


SECRET_HEADER = ("# An example of the Secret the router reads its keys from; never applied by the kustomization.\n"
                 "# Create your own: see docs/kubernetes.md (the router refuses to start with these values).\n")


def secret_example(s: RenderSettings, config: dict) -> dict:
    keys = {t["name"]: f"sk-{t['name']}-CHANGE-ME" for t in config["tenants"]}
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": f"{s.name}-keys", "labels": {"app.kubernetes.io/name": s.name}},
            "stringData": {**keys, "admin": "sk-admin-CHANGE-ME", "hf-token": "hf_CHANGE-ME"}}


def batch_pvc(s: RenderSettings) -> dict:
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": f"{s.name}-batch", "labels": {"app.kubernetes.io/name": s.name}},
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "20Gi"}}}}


def kustomization(s: RenderSettings, files: bool) -> dict:
    return {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            # no Secret here: applying this would replace the real keys with the example's
            "resources": ["batch-pvc.yaml", *["files-pvc.yaml"] * files, "rayservice.yaml", "podmonitor.yaml",
                          "networkpolicy.yaml"],
            "configMapGenerator": [{"name": f"{s.name}-dashboard", "files": ["dashboards/poolserve.json"],
                                    "options": {"labels": {"grafana_dashboard": "1"}}}]}


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (serveConfigV2) as readable `|` blocks."""


_BlockDumper.add_representer(
    str, lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", v, style="|" if "\n" in v else None))


def render(config_path: str | Path, s: RenderSettings = RenderSettings()) -> dict[str, str]:
    """Relative path -> file text, for every generated file. The config is validated first."""
    resolved = load(config_path, {"host": "0.0.0.0"})  # refused if invalid; Serve listens on every address there
    config = yaml.safe_load(Path(config_path).read_text())
    header = f"# Generated by `poolserve k8s render` from {Path(config_path).name}; do not edit by hand.\n"

    def doc(obj: dict) -> str:
        return header + yaml.dump(obj, Dumper=_BlockDumper, sort_keys=False, width=120)

    files = files_mount(config) is not None
    return {
        "rayservice.yaml": doc(rayservice(config, s)),
        "rayjob-batch.yaml": doc(rayjob(s, resolved)),
        "podmonitor.yaml": doc(podmonitor(s)),
        "networkpolicy.yaml": doc(networkpolicy(s)),
        "secret-example.yaml": SECRET_HEADER + doc(secret_example(s, config)),
        "batch-pvc.yaml": doc(batch_pvc(s)),
        **({"files-pvc.yaml": doc(files_pvc(s))} if files else {}),
        "kustomization.yaml": doc(kustomization(s, files)),
        "dashboards/poolserve.json": json.dumps(dashboard(), indent=2) + "\n",
    }


def _cmd_render(a) -> int:
    s = RenderSettings(name=a.name, image=a.image, operator_namespace=a.operator_namespace,
                       files_storage_class=a.files_storage_class)
    files = render(a.config, s)
    if a.files_storage_class and "files-pvc.yaml" not in files:
        print("warning: --files-storage-class names the Batch API's volume, which only batches.dir turns on",
              file=sys.stderr)
    out = Path(a.out)
    drift = []
    for rel, text in files.items():
        path = out / rel
        if a.check:
            if not path.exists() or path.read_text() != text:
                drift.append(rel)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    if drift:
        print(f"k8s manifests differ from `poolserve k8s render`: {', '.join(drift)}", file=sys.stderr)
        return 1
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("k8s", help="Kubernetes (KubeRay) manifests")
    ks = p.add_subparsers(dest="k8s_cmd", required=True)
    r = ks.add_parser("render", help="write the RayService (with serveConfigV2), RayJob, PodMonitor, dashboard")
    r.add_argument("config")
    r.add_argument("--out", default="k8s")
    r.add_argument("--name", default=RenderSettings.name)
    r.add_argument("--image", default=RenderSettings.image)
    r.add_argument("--operator-namespace", default=RenderSettings.operator_namespace,
                   help="the namespace KubeRay's operator runs in: the NetworkPolicy admits it from there only")
    r.add_argument("--files-storage-class", default=None,
                   help="the storage class of the Batch API's volume (with batches.dir): one that offers "
                        "ReadWriteMany, or no pod starts")
    r.add_argument("--check", action="store_true", help="exit 1 if the files on disk differ")
    r.set_defaults(fn=_cmd_render)
