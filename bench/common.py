"""What every benchmark shares: a stack from a config, machine facts, and the JSON record.

Benchmarks are boring on purpose: seeded loads, a warm-up, fixed lengths, one JSON result
in `bench/results/<name>.json` with the machine and versions it was measured on. Compare
set-ups inside one run only; never against a figure from another run.
"""

from __future__ import annotations

import copy
import gzip
import json
import platform
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import yaml


REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
LOCAL = REPO / "deployments" / "configs" / "local.yaml"
ADMIN_KEY = "poolserve-admin-dev"
KEYS = {"chat": "sk-chat-dev", "batch": "sk-batch-dev", "acme": "sk-acme-dev"}


def local_config() -> dict:
    """The embedded default as a dict, with its relative paths made absolute."""
    data = yaml.safe_load(LOCAL.read_text())
    data["model"]["source"] = str((LOCAL.parent / data["model"]["source"]).resolve())
    for pool in data["pools"].values():
        if pool["limits"].get("profile"):
            pool["limits"]["profile"] = str((LOCAL.parent / pool["limits"]["profile"]).resolve())
    return data


def variant(base: dict, **changes: Any) -> dict:
    """A deep copy with dotted keys replaced, e.g. variant(cfg, **{"autoscale.dry_run": True})."""
    out = copy.deepcopy(base)
    for dotted, value in changes.items():
        node = out
        keys = dotted.split(".")
        for k in keys[:-1]:
            node = node[k]
        if value is None:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = value
    return out


def machine() -> dict:
    import ray
    import vllm

    from pools.engine import hardware_name, usable_cores

    return {"hardware": hardware_name(), "cores": usable_cores(), "python": platform.python_version(),
            "ray": ray.__version__, "vllm": vllm.__version__, "when": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def write_result(name: str, result: dict, results: Path = RESULTS) -> Path:
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "machine": machine(), **result}, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return path


@dataclass
class Stack:
    base_url: str
    resolved: Any

    @property
    def admin(self):
        from deployments.admin_client import AdminClient

        return AdminClient(self.base_url, ADMIN_KEY)

    def idle(self, *pools: str) -> bool:
        """Nothing running or queued in these pools (all of them when none are named)."""
        status = self.admin.pools()
        return all(r.active == 0 and r.queued == 0 for name in (pools or status) for r in status[name].replicas)

    @staticmethod
    def wait(cond, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if cond():
                    return
            except (KeyError, IndexError):
                pass
            time.sleep(0.2)
        raise TimeoutError("condition not met")


@contextmanager
def ray_cluster(num_cpus: int = 16, metrics_port: int = 8080) -> Iterator[None]:
    """A local Ray for one benchmark run. `num_cpus` is logical: it must hold poolserve's two
    pools and the stock two pools side by side (each engine's placement group asks for 2);
    the engines are pinned to the real cores by `VLLM_CPU_OMP_THREADS_BIND`."""
    import ray
    from ray import serve

    from deployments.app import start_local_ray
    from deployments.config import RayConfig

    # the embedded default's Ray settings (worker niceness), the same for every set-up
    ray_config = RayConfig(**{**local_config().get("ray", {}), "num_cpus": num_cpus,
                              "metrics_export_port": metrics_port})
    start_local_ray(ray_config, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy(config: dict, name: str = "poolserve") -> Stack:
    """Deploy poolserve from a config dict (paths absolute) into the running cluster."""
    from deployments import app
    from deployments.config import parse, resolve

    resolved = resolve(parse(config), REPO)
    app.deploy(resolved, name)
    stack = Stack("http://127.0.0.1:8000", resolved)
    stack.wait(lambda: all(v.replicas for v in stack.admin.pools().values()), 60)
    warm_up(stack)
    return stack


def teardown(name: str) -> None:
    """Delete the application `name`, with the applications of its pools (`name-<pool>`)."""
    from ray import serve

    for app in serve.status().applications:
        if app == name or app.startswith(f"{name}-"):
            serve.delete(app)
    time.sleep(3)


def warm_up(stack: Stack, requests: int = 8) -> None:
    """A few requests through the router into every pool before anything is measured."""
    import httpx

    from router.auth import sha256_hex

    by_hash = {sha256_hex(k): k for k in KEYS.values()}
    for name, rp in stack.resolved.pools.items():
        tenant = next((t for t in stack.resolved.config.tenants if name in t.pools and t.key_sha256 in by_hash), None)
        if tenant is None:
            continue
        url = f"{stack.base_url}{rp.config.route_prefix}/v1/chat/completions"
        for i in range(requests):
            httpx.post(url, headers={"Authorization": f"Bearer {by_hash[tenant.key_sha256]}"}, timeout=120,
                       json={"messages": [{"role": "user", "content": "warm up " * (1 + 16 * i)}], "max_tokens": 8})


def compress(raw: Path, above: int = 64 * 1024, root: Path = REPO) -> dict[str, str]:
    """Gzip the run's large raw files (per-request detail and profiles run to megabytes); the
    new name of each, both relative to `root`."""
    renamed = {}
    for f in raw.iterdir():
        if f.suffix != ".gz" and f.stat().st_size > above:
            gz = f.with_name(f.name + ".gz")
            gz.write_bytes(gzip.compress(f.read_bytes(), mtime=0))
            f.unlink()
            renamed[str(f.relative_to(root))] = str(gz.relative_to(root))
    return renamed
