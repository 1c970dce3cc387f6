"""The set-ups the ceiling benchmark compares, each as a user would deploy it, with the same
engine ceilings, cores, stream batching and CPU priority: poolserve, stock ray.serve.llm (two
pools, or one), vLLM's own OpenAI server. See bench/ceiling.py.

Each baseline runs in two placements of its engine core, measured as two arms: `free`, as vLLM
leaves it (its workers bound, the engine core on every core), and `bound` beside its workers, as
poolserve binds its pools' (`pools.nice.bind_with_workers`). Which serves a baseline better
depends on the load and the host (bench/notes.md), so the verdicts compare poolserve with the
stronger arm of each."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench import procs
from bench.common import KEYS, deploy, local_config, variant
from bench.verdicts import BOUND

ONLINE_SEQS, OFFLINE_SEQS, OFFLINE_NICE = 16, 32, 10
CEILING_SEQS = 64
VLLM_PORT = 8100


def arm(name: str) -> tuple[str, str]:
    """A path or set-up's name as (baseline, placement): `vllm-server-bound` is vLLM's server
    with its engine core bound."""
    return (name[:-len(BOUND)], "bound") if name.endswith(BOUND) else (name, "free")


def engine_processes(parent: int) -> list[int]:
    """vLLM's engine processes under `parent` (a replica, vLLM's server, the raw engine's
    process): engine core, workers, and what runs under them."""
    from pools.reaper import descendants, engine_children

    return descendants([pid for pid, _ in engine_children(parent)])


def place(engines: list[int], placement: str) -> list[tuple[int, ...] | None]:
    """One engine's processes with its engine core bound beside its workers or free on every
    core this process may use; the cores each of them then has."""
    from pools import nice
    from pools.reaper import title

    if placement == "bound":
        assert nice.bind_with_workers(engines), f"nothing to bind in {engines}: no cpu_threads_bind?"
    else:
        nice.bind([p for p in engines if not title(p).startswith(nice.WORKER_PREFIX)], os.sched_getaffinity(0))
    return [nice.cores(p) for p in engines]


def place_baseline(name: str, server: int | None = None) -> tuple[str, str, list]:
    """Before a round of `name` (a set-up or a path, see `arm`): a baseline's engine processes
    placed as its arm says (`server`: vLLM's server's pid; the raw engine places its own);
    poolserve's as they are. The baseline's name, the placement, and the cores of each engine
    process placed, for the round's record."""
    path, placement = arm(name)
    parents = {"stock-two-pools": lambda: [stock_replica(r) for r in STOCK_TWO.values()],
               "stock-one-pool": lambda: [stock_replica(STOCK_ONE)], "vllm-server": lambda: [server]}
    placed = [place(engine_processes(parent), placement) for parent in parents.get(path, list)()]
    return path, placement, [cores for engine in placed for cores in engine]


def stock_replica(role: str) -> int:
    """The pid of the stock replica `role` (as `bench.procs` names it, without "replica ")."""
    [replica] = [pid for pid, r in procs.snapshot().roles.items() if r == f"replica {role}"]
    return replica


@dataclass(frozen=True)
class Target:
    name: str
    online_url: str
    offline_url: str
    online_key: str = "none"
    offline_key: str = "none"
    online_model: str = "tiny-llama"
    offline_model: str = "tiny-llama"


def model() -> str:
    return local_config()["model"]["source"]


def poolserve(**changes):
    """The embedded default (with `changes`, as `bench.common.variant` takes them), without
    calibration sweeps (the bench pins its limits)."""
    cfg = variant(local_config(), **changes)
    for pool in cfg["pools"]:
        cfg = variant(cfg, **{f"pools.{pool}.calibration.mode": "fallback"})
    stack = deploy(cfg)
    target = Target("poolserve", f"{stack.base_url}/online/v1", f"{stack.base_url}/offline/v1",
                    KEYS["chat"], KEYS["batch"])
    return target, stack


def pin(stack, online: int, offline: int) -> None:
    # calibrating=True lets a pin leave the safe range; it also stops borrowing, which the
    # stock set-ups have not
    stack.admin.pin("online-chat", online, calibrating=True)
    stack.admin.pin("offline-batch", offline, calibrating=True)


def _llm_config(model_id: str, seqs: int, batched: int, core: str, stream_batching_ms: float,
                max_model_len: int = 2048):
    """A stock pool with poolserve's engine ceilings, cores and stream batching; the
    deployment options are ray.serve.llm's defaults."""
    from ray.serve.llm import LLMConfig

    from deployments.app import engine_env

    return LLMConfig(
        model_loading_config={"model_id": model_id, "model_source": model()},
        engine_kwargs={"dtype": "float32", "max_model_len": max_model_len, "max_num_seqs": seqs,
                       "max_num_batched_tokens": batched, "enable_chunked_prefill": True,
                       "kv_cache_memory_bytes": 1 << 30},
        accelerator_config={"kind": "cpu"},
        runtime_env={"env_vars": {**engine_env(), "VLLM_CPU_OMP_THREADS_BIND": core}},
        experimental_configs={"stream_batching_interval_ms": stream_batching_ms},
    )


def _deploy_stock(name: str, configs: list) -> str:
    from ray import serve
    from ray.serve.llm import build_openai_app

    serve.run(build_openai_app({"llm_configs": configs}), name=name, route_prefix=f"/{name}")
    url = f"http://127.0.0.1:8000/{name}/v1"
    for c in configs:
        _warm(url, c.model_id, "none")
    return url


STOCK_TWO = {"online": "stock:LLMServer:tiny-llama-online", "offline": "stock:LLMServer:tiny-llama-offline"}
STOCK_ONE = "stock-one:LLMServer:tiny-llama"


def stock_two_pools() -> Target:
    from pools.nice import renice

    cfg = local_config()["pools"]
    url = _deploy_stock("stock", [
        _llm_config("tiny-llama-online", ONLINE_SEQS, 2048, "0", cfg["online-chat"]["stream_batching_ms"]),
        _llm_config("tiny-llama-offline", OFFLINE_SEQS, 4096, "1", cfg["offline-batch"]["stream_batching_ms"])])
    engines = engine_processes(stock_replica(STOCK_TWO["offline"]))
    assert engines and renice(engines, OFFLINE_NICE), "no stock offline engine processes to renice"
    return Target("stock-two-pools", url, url, online_model="tiny-llama-online", offline_model="tiny-llama-offline")


def stock_online_pool(max_model_len: int) -> Target:
    """The online pool's engine (its ceilings, core and stream batching) alone behind stock
    ray.serve.llm."""
    e = local_config()["pools"]["online-chat"]
    url = _deploy_stock("stock-online", [_llm_config(
        "tiny-llama-online", e["engine"]["max_num_seqs"], e["engine"]["max_num_batched_tokens"],
        e["engine"]["cpu_threads_bind"], e["stream_batching_ms"], max_model_len)])
    return Target("stock-online-pool", url, url, online_model="tiny-llama-online")


def stock_one_pool() -> str:
    cfg = local_config()["pools"]["offline-batch"]
    return _deploy_stock("stock-one", [_llm_config("tiny-llama", CEILING_SEQS, 4096, "1", cfg["stream_batching_ms"])])


def engine_env(core: str) -> dict:
    from deployments.app import engine_env
    from pools.engine import drop_engine_overrides

    shell = dict(os.environ)
    drop_engine_overrides(shell)  # the baselines' engines are sized by their own settings too
    return {**shell, **engine_env(), "VLLM_CPU_OMP_THREADS_BIND": core}


def vllm_server(log: Path) -> subprocess.Popen:
    """vLLM's own OpenAI server with the same engine, on core 1, its output in `log`."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model(),
             "--served-model-name", "tiny-llama", "--host", "127.0.0.1", "--port", str(VLLM_PORT),
             "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", str(CEILING_SEQS),
             "--max-num-batched-tokens", "4096", "--enable-chunked-prefill", "--kv-cache-memory-bytes",
             str(1 << 30), "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"],
            env=engine_env("1"), stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{VLLM_PORT}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"vLLM's server did not start: {log.read_text()[-2000:]}")
        time.sleep(1)
    _warm(f"http://127.0.0.1:{VLLM_PORT}/v1", "tiny-llama", "none")
    return proc


def _warm(url: str, model: str, key: str) -> None:
    for i in range(8):
        r = httpx.post(f"{url}/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                       json={"model": model, "prompt": "warm " * (1 + 16 * i), "max_tokens": 8})
        r.raise_for_status()
