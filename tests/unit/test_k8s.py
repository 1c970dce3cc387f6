"""The Kubernetes manifests: valid against KubeRay v1.7.0's CRDs, serveConfigV2 parses with our
own config models, import paths resolve, and the committed files equal `poolserve k8s render`."""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from deployments.config import parse, resolve
from deployments.k8s import render

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
CONFIG = REPO / "deployments" / "configs" / "k8s.yaml"
CRDS = {"RayService": "ray.io_rayservices.yaml", "RayJob": "ray.io_rayjobs.yaml", "RayCluster": "ray.io_rayclusters.yaml"}


def strict(schema):
    """Like `kubectl --validate=strict`: unknown fields are errors wherever the schema lists
    its properties and does not ask to keep unknown fields."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(x) for x in schema]
    return schema


def crd_schema(kind: str, version: str = "v1") -> dict:
    crd = yaml.safe_load((REPO / "data" / "kuberay-crds" / CRDS[kind]).read_text())
    assert crd["spec"]["names"]["kind"] == kind
    [v] = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return strict(v["schema"]["openAPIV3Schema"])


def manifests() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            out.append((path.name, doc))
    return out


KUBERAY = [(name, doc) for name, doc in manifests() if doc.get("apiVersion", "").startswith("ray.io/")]


def test_there_is_a_rayservice_and_a_rayjob():
    assert {doc["kind"] for _, doc in KUBERAY} == {"RayService", "RayJob"}


@pytest.mark.parametrize("name, doc", KUBERAY, ids=[n for n, _ in KUBERAY])
def test_kuberay_manifests_validate_against_the_crds(name, doc):
    jsonschema.validate(doc, crd_schema(doc["kind"]), cls=jsonschema.Draft7Validator)


def test_strict_validation_catches_a_typo():
    doc = copy.deepcopy(next(d for _, d in KUBERAY if d["kind"] == "RayService"))
    doc["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParms"] = {}
    with pytest.raises(jsonschema.ValidationError, match="rayStartParms"):
        jsonschema.validate(doc, crd_schema("RayService"), cls=jsonschema.Draft7Validator)


def _service() -> dict:
    return next(d for _, d in KUBERAY if d["kind"] == "RayService")


def test_rayservice_shape():
    spec = _service()["spec"]["rayClusterConfig"]
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    config = yaml.safe_load(CONFIG.read_text())
    assert set(groups) == set(config["pools"])
    for pool, g in groups.items():
        assert g["resources"] == {f"pool-{pool}": "1"}  # each pool on its own nodes
        assert config["pools"][pool]["replicas"]["resources"] == {f"pool-{pool}": 1}
        [c] = g["template"]["spec"]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    for c in [head] + [g["template"]["spec"]["containers"][0] for g in groups.values()]:
        assert {"name": "RAY_worker_niceness", "value": "0"} in c["env"]  # not Ray's 15
        assert not any(e["name"] == "RAY_SERVE_ENABLE_HA_PROXY" for e in c["env"])  # `ray.haproxy` is off


def test_serve_config_parses_with_our_models_and_its_import_path_resolves():
    """One application at / (the control one) and one per pool at its prefix, named as the
    pools' and the router's look-ups expect them (`deployments.app.build_apps`)."""
    from deployments.app import pool_app_name

    serve_config = yaml.safe_load(_service()["spec"]["serveConfigV2"])
    apps = {a["args"]["part"]: a for a in serve_config["applications"]}
    assert set(apps) == {"control", "online-chat", "offline-batch"}
    for part, app in apps.items():
        module, attr = app["import_path"].split(":")
        assert callable(getattr(importlib.import_module(module), attr))
        config = parse(app["args"]["config"], "serveConfigV2")
        base = app["args"]["base_dir"].replace("/home/ray/poolserve", str(REPO))
        resolved = resolve(config, Path(base))
        assert set(resolved.pools) == {"online-chat", "offline-batch"}
        assert all(rp.config.engine.accelerator == "gpu" for rp in resolved.pools.values())
        control = app["args"]["name"]
        if part == "control":
            assert (app["name"], app["route_prefix"]) == (control, "/")
        else:
            assert (app["name"], app["route_prefix"]) == (pool_app_name(part, control),
                                                          resolved.pools[part].config.route_prefix)


def test_committed_manifests_equal_render_output():
    files = render(CONFIG)
    drift = [rel for rel, text in files.items() if (K8S / rel).read_text() != text]
    assert not drift, f"run `poolserve k8s render {CONFIG.relative_to(REPO)}`: {drift} differ"


def test_rayjob_reads_the_key_from_the_secret_and_targets_the_router():
    job = next(d for _, d in KUBERAY if d["kind"] == "RayJob")
    assert "deployments.batch_job" in job["spec"]["entrypoint"]
    assert "http://poolserve-serve-svc:8000" in job["spec"]["entrypoint"]
    [head] = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in head["env"]}
    assert env["POOLSERVE_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "poolserve-keys"
    secret = yaml.safe_load((K8S / "secret-example.yaml").read_text().split("\n", 1)[1])
    assert env["POOLSERVE_KEY"]["valueFrom"]["secretKeyRef"]["key"] in secret["stringData"]


def test_podmonitor_scrapes_the_ray_metrics_port():
    pm = next(d for _, d in manifests() if d["kind"] == "PodMonitor")
    port = pm["spec"]["podMetricsEndpoints"][0]["port"]
    spec = _service()["spec"]["rayClusterConfig"]
    containers = spec["headGroupSpec"]["template"]["spec"]["containers"] + \
        [c for g in spec["workerGroupSpecs"] for c in g["template"]["spec"]["containers"]]
    assert all(any(p["name"] == port and p["containerPort"] == 8080 for p in c["ports"]) for c in containers)


def test_kustomization_lists_existing_files():
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for rel in k["resources"] + k["configMapGenerator"][0]["files"]:
        assert (K8S / rel).exists(), rel


GRAFANA_PANEL = {
    "type": "object",
    "required": ["id", "type", "title", "gridPos"],
    "properties": {
        "id": {"type": "integer"}, "type": {"enum": ["row", "timeseries", "stat", "gauge", "table"]},
        "title": {"type": "string", "minLength": 1},
        "gridPos": {"type": "object", "required": ["h", "w", "x", "y"],
                    "properties": {k: {"type": "integer", "minimum": 0} for k in "hwxy"}},
        "targets": {"type": "array", "items": {"type": "object", "required": ["refId", "expr"]}},
    },
}
GRAFANA = {"type": "object", "required": ["uid", "title", "schemaVersion", "panels", "templating"],
           "properties": {"panels": {"type": "array", "minItems": 1, "items": GRAFANA_PANEL},
                          "schemaVersion": {"type": "integer", "minimum": 30}}}


def test_dashboard_is_valid_grafana_json():
    board = json.loads((K8S / "dashboards" / "poolserve.json").read_text())
    jsonschema.validate(board, GRAFANA)
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for p in board["panels"]:
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] != "row":
            assert p["targets"] and all(t["expr"] for t in p["targets"])


def test_no_secret_is_applied_and_no_key_is_baked_into_the_serve_config():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    applied = [doc for name in kustomization["resources"] for doc in yaml.safe_load_all((K8S / name).read_text())]
    assert not [d for d in applied if d and d.get("kind") == "Secret"]  # the real Secret is never overwritten
    serve = yaml.safe_load(_service()["spec"]["serveConfigV2"])["applications"][0]["args"]["config"]
    text = json.dumps(serve)
    assert "key_sha256" not in text and not __import__("re").search(r"\b[0-9a-f]{64}\b", text)
    assert serve["router"]["keys_dir"] == "/etc/poolserve/keys"


def test_every_pod_that_may_host_the_router_mounts_the_keys_read_only():
    spec = _service()["spec"]["rayClusterConfig"]
    for template in [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]:
        [volume] = [v for v in template["spec"]["volumes"] if v["name"] == "keys"]
        assert volume["secret"]["secretName"] == "poolserve-keys" and volume["secret"]["defaultMode"] == 0o400
        [mount] = [m for m in template["spec"]["containers"][0]["volumeMounts"] if m["name"] == "keys"]
        assert mount == {"name": "keys", "mountPath": "/etc/poolserve/keys", "readOnly": True}


def _selects(selector: dict, labels: dict) -> bool:
    """Kubernetes label-selector semantics (matchLabels, matchExpressions with In / Exists)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        if e["operator"] == "In" and labels.get(e["key"]) not in e["values"]:
            return False
        if e["operator"] == "Exists" and e["key"] not in labels:
            return False
    return True


def _admits(policy: dict, target: dict, source: dict, port: int) -> bool:
    """Whether a NetworkPolicy lets `source` reach `target` on `port` (pods as {"labels",
    "namespace"}, both in the policy's namespace unless named; a pod it does not select is
    not its business)."""
    if not _selects(policy["spec"]["podSelector"], target["labels"]):
        return True
    for rule in policy["spec"]["ingress"]:
        if "ports" in rule and port not in {p["port"] for p in rule["ports"]}:
            continue
        if "from" not in rule:
            return True
        for peer in rule["from"]:
            ns_ok = (_selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": source["namespace"]})
                     if "namespaceSelector" in peer else source["namespace"] == "poolserve-ns")
            if ns_ok and _selects(peer.get("podSelector", {}), source["labels"]):
                return True
    return False


def test_the_dashboard_is_guarded_by_token_auth_and_a_network_policy():
    templates = []
    for doc in (d for _, d in KUBERAY):
        cluster = doc["spec"].get("rayClusterConfig") or doc["spec"]["rayClusterSpec"]
        assert cluster["authOptions"] == {"mode": "token"}, doc["kind"]
        templates += [cluster["headGroupSpec"]["template"]] + [w["template"] for w in
                                                               cluster.get("workerGroupSpecs", [])]
    job = next(d for _, d in KUBERAY if d["kind"] == "RayJob")
    assert job["spec"]["submissionMode"] == "HTTPMode"  # no submitter pod needs the dashboard
    policy = yaml.safe_load((K8S / "networkpolicy.yaml").read_text())

    def pod(labels: dict, namespace: str = "poolserve-ns") -> dict:
        return {"labels": labels, "namespace": namespace}
    stranger = pod({"app": "someone-else"})
    operator = pod({"app.kubernetes.io/name": "kuberay-operator"}, "default")
    impostor = pod({"app.kubernetes.io/name": "kuberay-operator"}, "someone-elses-namespace")
    other_ray = pod({"app.kubernetes.io/created-by": "kuberay-operator", "ray.io/cluster": "another"})
    for template in templates:  # every pod of poolserve's clusters, heads and workers
        ours = pod(template["metadata"]["labels"])
        assert _selects(policy["spec"]["podSelector"], ours["labels"]), template["metadata"]
        for port in (8000, 8080):
            assert _admits(policy, ours, stranger, port)
        for port in (8265, 6379, 10001):  # the Jobs API, the GCS, the client server
            assert not _admits(policy, ours, stranger, port)
            assert not _admits(policy, ours, impostor, port)
            assert not _admits(policy, ours, other_ray, port)
            assert _admits(policy, ours, operator, port)
            assert all(_admits(policy, ours, pod(t["metadata"]["labels"]), port) for t in templates)


def test_the_example_secret_holds_only_placeholders_that_validation_refuses():
    from router.auth import SHIPPED_KEYS

    secret = yaml.safe_load((K8S / "secret-example.yaml").read_text())
    assert all(v in SHIPPED_KEYS or v == "hf_CHANGE-ME" for v in secret["stringData"].values()), secret


def test_haproxy_reaches_every_pod_when_the_config_asks_for_it():
    from deployments.k8s import RenderSettings, rayservice

    config = yaml.safe_load(CONFIG.read_text())
    config.setdefault("ray", {})["haproxy"] = True
    spec = rayservice(config, RenderSettings())["spec"]["rayClusterConfig"]
    pods = [spec["headGroupSpec"]] + spec["workerGroupSpecs"]
    for pod in pods:
        [c] = pod["template"]["spec"]["containers"]
        assert {"name": "RAY_SERVE_ENABLE_HA_PROXY", "value": "1"} in c["env"]


def test_the_batch_job_manifest_follows_the_config(tmp_path):
    """It named the tenant batch-team and the prefix /offline whatever the config said: the
    job's pod failed to start on a missing Secret key, or sent to a pool that was not there."""
    config = yaml.safe_load(CONFIG.read_text())
    config["pools"]["offline-batch"]["route_prefix"] = "/bulk"
    for t in config["tenants"]:
        t["name"] = {"batch-team": "team-a"}.get(t["name"], t["name"])
    path = tmp_path / "k8s.yaml"
    path.write_text(yaml.safe_dump(config))
    job = yaml.safe_load(render(path)["rayjob-batch.yaml"].split("\n", 1)[1])
    assert "--pool bulk " in job["spec"]["entrypoint"]
    [head] = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert {e["name"]: e for e in head["env"]}["POOLSERVE_KEY"]["valueFrom"]["secretKeyRef"]["key"] == "team-a"


def test_a_config_with_shipped_keys_is_not_rendered_for_a_cluster():
    """Rendered, the local config's example keys (the admin key among them) were served on every
    address: the serveConfig sets no host, and the check had read the config's 127.0.0.1."""
    from deployments.config import ConfigError

    with pytest.raises(ConfigError, match="a key poolserve ships in its examples"):
        render(REPO / "deployments/configs/local.yaml")


def _pods(service: dict) -> list[dict]:
    spec = service["spec"]["rayClusterConfig"]
    return [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]


def _files_mounts(service: dict) -> list[tuple[str, str]]:
    """Each pod's files volume's claim and where its one container mounts it."""
    out = []
    for pod in _pods(service):
        [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == "files"]
        [mount] = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "files"]
        out.append((volume["persistentVolumeClaim"]["claimName"], mount["mountPath"]))
    return out


def test_the_batch_api_is_on_a_volume_every_pod_mounts_when_the_config_turns_it_on(tmp_path):
    """The Batch API could not run on KubeRay: its files must be on one volume that every pod
    mounts (any router replica takes uploads; the batch service and its jobs, on the head, read
    them). No pod starts until that volume is bound, so the shipped config leaves it off."""
    from deployments.k8s import RenderSettings

    config = yaml.safe_load(CONFIG.read_text())
    assert "batches" not in config and not [v for pod in _pods(_service()) for v in pod["spec"]["volumes"]
                                            if v["name"] == "files"]
    for folder, mounted in (("/var/lib/poolserve/batches", "/var/lib/poolserve/batches"),
                            ("../../files", "/home/ray/poolserve/files")):  # where the app resolves it
        config["batches"] = {"dir": folder}
        path = tmp_path / "k8s.yaml"
        path.write_text(yaml.safe_dump(config))
        files = render(path, RenderSettings(name="ps", files_storage_class="cephfs"))
        service = yaml.safe_load(files["rayservice.yaml"].split("\n", 1)[1])
        jsonschema.validate(service, crd_schema("RayService"), cls=jsonschema.Draft7Validator)
        assert set(_files_mounts(service)) == {("ps-files", mounted)}
        app = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
        assert app["config"]["batches"] == {"dir": folder}  # the jobs reach the router on the head, where they run
        resolved = resolve(parse(app["config"], "serveConfigV2"), Path(app["base_dir"]))
        assert __import__("posixpath").normpath(resolved.batches_dir) == mounted
        pvc = yaml.safe_load(files["files-pvc.yaml"].split("\n", 1)[1])
        assert pvc["metadata"]["name"] == "ps-files" and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
        assert pvc["spec"]["storageClassName"] == "cephfs"
        assert "files-pvc.yaml" in yaml.safe_load(files["kustomization.yaml"].split("\n", 1)[1])["resources"]
    assert "files-pvc.yaml" not in render(CONFIG) and "files-pvc" not in render(CONFIG)["kustomization.yaml"]
