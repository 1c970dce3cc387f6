"""Config validation: every bad value is reported with its key, its value and a fix."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deployments.config import ConfigError, parse, resolve

REPO = Path(__file__).resolve().parents[2]
KEY = "a" * 64
SHAPE = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256,
         "head_dim": 64, "torch_dtype": "float32"}


def base() -> dict:
    return {
        "model": {"id": "m", "source": "model", "dtype": "float32", "max_model_len": 2048},
        "pools": {
            "online-chat": {
                "route_prefix": "/online",
                "engine": {"max_num_seqs": 32, "max_num_batched_tokens": 2048, "kv_cache_gb": 1},
                "limits": {"range": [2, 16], "start": 8},
                "slo": {"ttft_p99_ms": 1000, "tpot_p99_ms": 100},
                "queue": {"max_queued": 64},
                "traffic": {"p50_tokens": 300, "p90_tokens": 700, "p99_tokens": 1100},
            },
            "offline-batch": {
                "route_prefix": "/offline",
                "engine": {"max_num_seqs": 64, "max_num_batched_tokens": 4096, "kv_cache_gb": 1},
                "limits": {"range": [8, 32]},
                "slo": {"ttft_p99_ms": 60000, "tpot_p99_ms": 400},
                "queue": {"max_queued": 1000, "max_wait_ms": 200, "min_batch_tokens": 4096},
                "traffic": {"p50_tokens": 300, "p90_tokens": 700, "p99_tokens": 1100},
                "borrow": {"into": "online-chat", "max_share": 0.25, "while_below_utilisation": 0.5},
            },
        },
        "tenants": [{"name": "acme", "key_sha256": KEY, "pools": ["online-chat", "offline-batch"]}],
    }


def set_path(d: dict, path: str, value) -> dict:
    d = copy.deepcopy(d)
    keys = path.split(".")
    node = d
    for k in keys[:-1]:
        node = node[int(k)] if k.isdigit() else node[k]
    last = keys[-1]
    if value is DELETE:
        del node[last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return d


DELETE = object()


@pytest.fixture()
def model_dir(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(SHAPE))
    return tmp_path


def check(data: dict, base_dir: Path):
    return resolve(parse(data), base_dir)


def test_base_config_is_valid(model_dir):
    r = check(base(), model_dir)
    assert r.pools["online-chat"].safe_range.steps == (2, 4, 8, 16)
    assert r.pools["offline-batch"].start_seqs == 8
    assert r.pools["online-chat"].kv_capacity_tokens == 524_288


BAD = [
    ("model.max_model_len", 4, "model.max_model_len", "greater than or equal to 16"),
    ("model.dtype", "fp64", "model.dtype", "float32"),
    ("model.colour", "red", "model.colour", "Extra inputs"),
    ("pools.online-chat.route_prefix", "online", "pools.online-chat.route_prefix", "a slash"),
    ("pools.online-chat.engine.max_num_seqs", 0, "pools.online-chat.engine.max_num_seqs", "greater than"),
    ("pools.online-chat.engine.max_num_seqs", 8, "pools.online-chat.limits.range", "above engine.max_num_seqs"),
    ("pools.online-chat.limits.range", [3, 8], "pools.online-chat.limits", "two ladder steps"),
    ("pools.online-chat.limits.start", 32, "pools.online-chat.limits.start", "inside the range [2, 16]"),
    ("pools.online-chat.limits.range", DELETE, "pools.online-chat.limits", "either `profile`"),
    ("pools.online-chat.limits.profile", "nope.yaml", "pools.online-chat.limits.profile", "cannot load"),
    ("pools.online-chat.queue.max_queued", 0, "pools.online-chat.queue.max_queued", "greater than"),
    ("pools.online-chat.queue.max_queued_tokens", 100, "pools.online-chat.queue.max_queued_tokens",
     "one full-length request"),
    ("pools.online-chat.traffic.p99_tokens", 200, "pools.online-chat.traffic", "p50_tokens <= p90_tokens"),
    ("pools.online-chat.traffic.p99_tokens", 4096, "pools.online-chat.traffic.p99_tokens", "max_model_len"),
    ("pools.online-chat.engine.kv_cache_gb", 0.01, "pools.online-chat.engine.kv_cache_gb", "sequences at the p99"),
    ("pools.online-chat.replicas", {"min": 3, "max": 1}, "pools.online-chat.replicas", "min (3) is above max"),
    ("pools.offline-batch.borrow.into", "nowhere", "pools.offline-batch.borrow.into", "another pool"),
    ("pools.offline-batch.borrow.max_share", 1.5, "pools.offline-batch.borrow.max_share", "less than or equal"),
    ("pools.offline-batch.route_prefix", "/online", "pools.offline-batch.route_prefix", "taken"),
    ("tenants.0.key_sha256", "secret", "tenants.0.key_sha256", "64 lowercase hex"),
    ("tenants.0.pools", ["online-chat", "gpu-pool"], "tenants[0].pools", "unknown pool 'gpu-pool'"),
    ("tenants.0.default_pool", "x", "tenants.0", "default_pool 'x' is not in pools"),
    ("tenants.0.weight", -1, "tenants.0.weight", "greater than 0"),
    ("tenants.0.priority", "urgent", "tenants.0.priority", "interactive"),
    ("tenants", [], "tenants", "at least 1"),
    ("autoscale", {"cooldown_s": 60, "reversal_cooldown_s": 10}, "autoscale", "reversal_cooldown_s"),
    ("pools.online-chat.slo.ttft_p99_ms", float("inf"), "pools.online-chat.slo.ttft_p99_ms", "finite"),
    ("router", {"body_timeout_s": float("inf")}, "router.body_timeout_s", "finite"),
    ("autoscale", {"cooldown_s": float("nan")}, "autoscale.cooldown_s", "finite"),
]


@pytest.mark.parametrize("path, value, key, fragment", BAD, ids=[f"{b[0]}={b[1]}" for b in BAD])
def test_bad_config_names_the_key(model_dir, path, value, key, fragment):
    with pytest.raises(ConfigError) as info:
        check(set_path(base(), path, value), model_dir)
    text = str(info.value)
    assert any(p.key == key for p in info.value.problems), text
    assert fragment in text
    assert "Fix:" in text


def test_every_problem_is_reported_at_once(model_dir):
    data = set_path(set_path(base(), "model.dtype", "fp64"), "tenants.0.weight", 0)
    with pytest.raises(ConfigError) as info:
        check(data, model_dir)
    assert {p.key for p in info.value.problems} >= {"model.dtype", "tenants.0.weight"}


def test_cross_checks_are_collected_together(model_dir):
    data = set_path(base(), "pools.offline-batch.borrow.into", "nowhere")
    data = set_path(data, "tenants.0.pools", ["online-chat", "gpu-pool"])
    with pytest.raises(ConfigError) as info:
        check(data, model_dir)
    assert len(info.value.problems) == 2


def test_validate_cli_exits_nonzero_and_prints_problems(model_dir):
    bad = set_path(base(), "pools.online-chat.engine.max_num_seqs", 8)
    path = model_dir / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    run = subprocess.run([sys.executable, "-m", "deployments.cli", "validate", str(path)],
                         capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 1
    assert "pools.online-chat.limits.range: [2, 16]: top 16 is above engine.max_num_seqs 8" in run.stderr
    good = model_dir / "good.yaml"
    good.write_text(yaml.safe_dump(base()))
    run = subprocess.run([sys.executable, "-m", "deployments.cli", "validate", str(good)],
                         capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 0, run.stderr
    assert "OK" in run.stdout


def test_shipped_local_config_is_valid():
    run = subprocess.run([sys.executable, "-m", "deployments.cli", "validate",
                          str(REPO / "deployments/configs/local.yaml")], capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 0, run.stderr


def test_configuration_doc_is_generated_from_the_models():
    from deployments.config_doc import DOC, render

    assert DOC.read_text() == render(), "run `python -m deployments.config_doc`"


def test_engine_processes_get_their_cores_and_skip_the_broken_aot_cache(model_dir, monkeypatch):
    from deployments.app import llm_config

    r = check(set_path(base(), "pools.online-chat.engine.cpu_threads_bind", "0"), model_dir)
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    env = llm_config(r, r.pools["online-chat"]).runtime_env["env_vars"]
    assert env == {"VLLM_USE_AOT_COMPILE": "0", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")  # an operator's own choice wins
    assert llm_config(r, r.pools["offline-batch"]).runtime_env["env_vars"]["VLLM_USE_AOT_COMPILE"] == "1"


@pytest.mark.parametrize("source, download", [
    ("/models/tiny-llama", False), ("meta-llama/Llama-3.1-8B-Instruct", False),  # vLLM reads or fetches these
    ("s3://bucket/llama", True), ("gs://bucket/llama", True),  # Ray LLM copies these to the node first
], ids=["directory", "hub-id", "s3", "gcs"])
def test_only_a_model_in_cloud_storage_waits_for_ray_llms_node_download(source, download):
    from ray.serve.llm import LLMConfig

    from pools.llm import needs_node_download

    config = LLMConfig(model_loading_config={"model_id": "m", "model_source": source},
                       accelerator_config={"kind": "cpu"})
    assert needs_node_download(config) is download


@pytest.mark.parametrize("field", ["router.admin_key_sha256", "tenants.0.key_sha256"])
def test_a_shipped_example_key_is_refused_where_other_machines_reach_the_router(model_dir, field):
    from router.auth import SHIPPED_KEYS, sha256_hex

    for example in ("admin-CHANGE-ME", "sk-chat-dev"):
        assert example in SHIPPED_KEYS
        reachable = set_path({**base(), "router": {"host": "0.0.0.0"}}, field, sha256_hex(example))
        with pytest.raises(ConfigError) as info:
            check(reachable, model_dir)
        [problem] = [p for p in info.value.problems if p.key == field.replace(".0.", "[0].")]
        assert repr(example) in problem.message and "poolserve hash-key" in problem.fix
        local = check(set_path({**base(), "router": {}}, field, sha256_hex(example)), model_dir)  # loopback: a warning
        assert any(example in w for w in local.warnings)


def test_keys_can_come_from_a_mounted_folder_instead_of_the_config(tmp_path):
    from router.auth import Auth, keys_from_dir
    from router.config import TenantConfig

    (tmp_path / "acme").write_text("sk-acme-from-the-secret\n")
    (tmp_path / "admin").write_text("an-admin-key")
    tenants, admin = keys_from_dir((TenantConfig(name="acme", pools=("p",)),), None, str(tmp_path))
    auth = Auth(tenants, admin)
    assert auth.tenant({"authorization": "Bearer sk-acme-from-the-secret"}).name == "acme"
    auth.admin({"authorization": "Bearer an-admin-key"})
    with pytest.raises(ValueError, match="no key for tenant"):
        keys_from_dir((TenantConfig(name="other", pools=("p",)),), None, str(tmp_path))


def test_a_mounted_secret_holding_the_shipped_example_values_is_refused(tmp_path):
    """The manifests read keys from the Secret at start, where `poolserve validate` never looks:
    the router refuses to start on the example Secret's values, naming the file."""
    from router.auth import keys_from_dir
    from router.config import TenantConfig

    example = yaml.safe_load((REPO / "k8s" / "secret-example.yaml").read_text())["stringData"]
    for name in ("chat-team", "admin"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "chat-team").write_text("a-real-key-1" if name == "admin" else example[name])
        (folder / "admin").write_text(example["admin"] if name == "admin" else "a-real-admin-key")
        with pytest.raises(ValueError, match=f"{folder / name}.*example key.*poolserve hash-key"):
            keys_from_dir((TenantConfig(name="chat-team", pools=("p",)),), None, str(folder))


@pytest.mark.parametrize("on", [False, True])
def test_internal_access_logs_follow_the_config(model_dir, on):
    """Deployments only other deployments call log no access lines unless `ray.access_logs`."""
    from deployments.app import build_batches, build_controller, build_ledger

    data = base()
    data["ray"] = {"access_logs": on}
    data["batches"] = {"dir": "batches", "pool": "offline-batch"}
    r = check(data, model_dir)
    for app in (build_controller(r, "poolserve"), build_ledger(r), build_batches(r)):
        assert app._bound_deployment.logging_config["enable_access_log"] is on


@pytest.mark.parametrize("named", [None, "http://jobs.example:8265"])
def test_batches_go_to_the_ray_poolserve_started_when_another_holds_8265(model_dir, named):
    """Ray gives the dashboard of a Ray poolserve starts the next free port when 8265 is taken
    (another Ray on the machine): the Batch API submitted every batch, the tenant's key with it,
    to that other Ray. A job API the config names is kept."""
    from deployments.app import on_local_dashboard

    data = base() if named is None else {**base(), "batches": {"dashboard_url": named}}
    resolved = check(data, model_dir)
    started = on_local_dashboard(resolved, "http://127.0.0.1:8266")
    assert started.config.batches.dashboard_url == (named or "http://127.0.0.1:8266")
    assert started.pools == resolved.pools and started.config.router == resolved.config.router
    assert on_local_dashboard(resolved, None) is resolved  # no dashboard: nothing to submit to


def test_the_dashboard_takes_the_first_free_port_from_8265():
    """Where Ray would pick its dashboard's port itself, poolserve could not know where it went."""
    import socket

    from deployments.app import free_port

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        assert free_port("127.0.0.1", taken) > taken
        assert free_port("127.0.0.1", taken, skip={taken + 1}) not in (taken, taken + 1)  # the metrics port, say
    with pytest.raises(OSError):  # not a taken port but an address this host does not have: said, not skipped
        free_port("192.0.2.1", 8265)


@pytest.mark.parametrize("dashboard, named, refused", [(False, False, True), (True, False, False), (False, True, False)])
def test_a_batch_api_with_no_job_api_to_submit_to_is_refused_before_ray_starts(model_dir, dashboard, named, refused):
    """With no dashboard, a Ray that poolserve starts has no job API: the Batch API sent every
    batch to whatever held 8265."""
    from deployments.config import local_jobs_problem

    batches = {"dir": "batches", "pool": "offline-batch", **({"dashboard_url": "http://jobs.example:8265"} if named else {})}
    resolved = check({**base(), "ray": {"dashboard": dashboard}, "batches": batches}, model_dir)
    problem = local_jobs_problem(resolved)
    assert (problem is not None) is refused
    assert problem is None or "ray.dashboard" in problem and "batches.dashboard_url" in problem
    assert local_jobs_problem(check(base(), model_dir)) is None  # no Batch API, nothing to submit


@pytest.mark.parametrize("change, words", [
    ({"pools.online-chat.route_prefix": "/admin"}, "a path of poolserve's router"),
    ({"pools.online-chat.route_prefix": "/healthz"}, "a path of poolserve's router"),
    ({"pools.online-chat.route_prefix": "/v1"}, "a path of poolserve's router"),
    ({"pools.offline-batch.route_prefix": "/online"}, "taken by another pool"),
], ids=["admin", "healthz", "v1", "twice"])
def test_a_pool_cannot_take_the_routers_paths(model_dir, change, words):
    """A pool at /admin took every /admin call (Serve gives the longest prefix to the pool, which
    answers only its own paths): operators could no longer pin a limit."""
    [(path, value)] = change.items()
    with pytest.raises(ConfigError) as info:
        check(set_path(base(), path, value), model_dir)
    assert words in str(info.value)


def test_a_pool_cannot_be_named_control(model_dir):
    """It replaced the control application: no router, no controller, no quota ledger."""
    data = base()
    data["pools"]["control"] = data["pools"].pop("online-chat")
    data["pools"]["offline-batch"]["borrow"]["into"] = "control"
    data["tenants"][0]["pools"] = ["control", "offline-batch"]
    with pytest.raises(ConfigError) as info:
        check(data, model_dir)
    assert "not 'control'" in str(info.value)


def test_no_two_holders_share_a_key(tmp_path, model_dir):
    """The mounted Secret's file `admin` is the admin key: a tenant named admin got the admin's
    powers with its own key; two tenants with one key billed whichever came first."""
    from pydantic import ValidationError

    from router.auth import keys_from_dir, sha256_hex
    from router.config import TenantConfig

    for reserved in ("admin", "hf-token"):
        with pytest.raises(ValidationError, match="names another key's file"):
            TenantConfig(name=reserved, pools=("p",))
    same = set_path(set_path(base(), "router", {"admin_key_sha256": KEY}), "tenants.0.key_sha256", KEY)
    with pytest.raises(ConfigError, match="another tenant or the admin has this key"):
        check(same, model_dir)
    tenants = (TenantConfig(name="a", pools=("p",)), TenantConfig(name="b", pools=("p",)))
    for files in ({"a": "k-one", "b": "k-one"}, {"a": "k-one", "b": "k-two", "admin": "k-two"}):
        folder = tmp_path / "-".join(files.values())
        folder.mkdir()
        for name, key in files.items():
            (folder / name).write_text(key)
        with pytest.raises(ValueError, match="share one key"):
            keys_from_dir(tenants, None, str(folder))
    with pytest.raises(ValueError, match="a, admin share one key"):  # hashes only, no folder
        keys_from_dir((TenantConfig(name="a", pools=("p",), key_sha256=sha256_hex("k-x")),), sha256_hex("k-x"), None)
