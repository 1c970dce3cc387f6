"""The mixed online/offline benchmark: poolserve against single-pool and stock two-pool set-ups,
side by side in one run on the same machine.

Traffic, the same for every set-up:
  * online chat: open-loop Poisson at ONLINE_RATE req/s, streamed, lengths from the Azure
    2023 conversation trace scaled to the model, from its own process;
  * offline: a batch-job-like flood, OFFLINE_OUTSTANDING whole (non-streamed) requests kept
    outstanding (10x the offline engine's 64 slots), from its own process.
Phases per set-up: online alone; online + offline (after a ramp so that queues form);
offline alone (for poolserve four windows, the online pool's lending off, on, off, on, so
that the lift from borrowing is measured in the same run, from the engines' own counts of
generated tokens, with the flood's drift counted against both). Requests still running when a phase ends are cancelled, so a set-up whose
queues never drain cannot stall the run; an online request that gets no first token within
ONLINE_TIMEOUT_S, or by ONLINE_DRAIN_S after its phase, is cut off and counts with its wait
so far as its TTFT, a lower bound.

Set-ups (engines pinned to the machine's two cores in every case):
  * poolserve: both pools, router priorities and quotas, borrowing, autoscaler on, the
    offline pool at nice 10 (deployments/configs/local.yaml);
  * single-priority: one ray.serve.llm pool, one engine on both cores (64 slots, 2 GiB KV),
    scheduling_policy=priority, max_ongoing_requests 256, behind ray.serve.llm's
    OpenAiIngress; online requests at priority 0 and offline at 1 (what a careful user
    tries first);
  * single-fcfs: the same engine with every request at one priority, which vLLM's priority
    scheduler serves in arrival order and preempts latest-first, as its FCFS policy does
    (one engine start instead of two, for `make bench`'s 15-minute budget). Alone, online or
    offline, every request has one priority in both, so the two share those phases;
  * stock-two-pools: the same two engines as poolserve's pools (core 0 / core 1) as two
    LLMConfigs behind one OpenAiIngress, max_ongoing_requests 256, no router or gates.
The contention floor: stock two pools with only FLOOR_STREAMS offline streams (nothing
queues), in the same run. Every set-up runs on one Ray whose workers are at the embedded
default's `ray.worker_niceness`.

    python -m bench.mixed      # about 10 minutes; writes bench/results/mixed.json
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import KEYS, REPO, EngineTokens, deploy, local_config, ray_cluster, teardown, write_result
from deployments.config import RayConfig

ONLINE_RATE = 4.0
OFFLINE_OUTSTANDING = 640
OFFLINE_LENGTHS = ("200", "100")  # prompt, output tokens of a batch item
FLOOR_STREAMS = 48
ALONE_S, RAMP_S, TOGETHER_S, OFFLINE_ALONE_S = 10, 6, 35, 12
FLOOR_S = 25  # the floor's together phase: nothing queues in it, so its P99 settles sooner
ONLINE_TIMEOUT_S = 45  # 50x poolserve's P99 under load is well below it
ONLINE_DRAIN_S = 12  # then what still waits is cut off, counted at its wait so far
SLO = {"ttft_p99_ms": 1000.0, "tpot_p99_ms": 100.0}  # the online-chat pool's


@dataclass(frozen=True)
class Endpoints:
    online_url: str
    offline_url: str
    admin: object = None  # a bench Stack when the set-up is poolserve (to switch lending off)
    online_key: str = "none"
    offline_key: str = "none"
    online_model: str = "tiny-llama"
    offline_model: str = "tiny-llama"
    online_body: str = ""
    offline_body: str = ""


def _loadgen(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "infra.loadgen", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"loadgen failed: {err[-2000:]}")
    return json.loads(out)


def _online(ep: Endpoints, warmup: float, seconds: float, seed: int) -> subprocess.Popen:
    return _loadgen("--url", ep.online_url, "--key", ep.online_key, "--model", ep.online_model, "--chat",
                    "--rate", str(ONLINE_RATE), "--trace", "--warmup", str(warmup), "--duration", str(seconds),
                    "--timeout", str(ONLINE_TIMEOUT_S), "--drain", str(ONLINE_DRAIN_S), "--seed", str(seed),
                    "--body", ep.online_body,
                    "--ttft-slo-ms", str(SLO["ttft_p99_ms"]), "--tpot-slo-ms", str(SLO["tpot_p99_ms"]))


def _offline(ep: Endpoints, outstanding: int, warmup: float, split: tuple[float, ...]) -> subprocess.Popen:
    return _loadgen("--url", ep.offline_url, "--key", ep.offline_key, "--model", ep.offline_model, "--no-stream",
                    "--concurrency", str(outstanding), "--prompt", OFFLINE_LENGTHS[0], "--output", OFFLINE_LENGTHS[1],
                    "--spread", "0.3", "--warmup", str(warmup), "--duration", str(sum(split)),
                    "--split", ",".join(str(s) for s in split), "--abandon", "--body", ep.offline_body)


def _online_figures(r: dict) -> dict:
    return {"requests": r["requests"], "completed": r["completed"], "timeouts": r["timeouts"],
            "server_timing_ms": r.get("server_timing_ms", {}),
            "ttft_p50_ms": r["ttft_ms_with_timeouts"]["p50"], "ttft_p99_ms": r["ttft_ms_with_timeouts"]["p99"],
            "tpot_p50_ms": r["tpot_ms"]["p50"], "tpot_p99_ms": r["tpot_ms"]["p99"],
            "goodput_req_s": r["goodput_req_per_s"], "rejection_rate": r["rejection_rate"],
            "error_rate": r["error_rate"], "borrowed": r["borrowed"]}


def _offline_figures(w: dict) -> dict:
    return {"output_tok_s": w["output_tok_per_s"], "req_s": w["req_per_s"], "rejection_rate": w["rejection_rate"],
            "error_rate": w["error_rate"], "borrowed": w["borrowed"]}


def _lending(stack, enabled: bool) -> None:
    stack.admin.set_lending("online-chat", enabled)


LENDING = (False, True, False, True)  # poolserve's offline-alone windows: lending off and on, alternating


def _mean_window(ws: list[dict]) -> dict:
    """Offline figures of windows of equal length taken as one: rates averaged, borrowed summed."""
    out = {k: sum(w[k] for w in ws) / len(ws) for k in ("output_tok_s", "req_s", "rejection_rate", "error_rate")}
    out["borrowed"] = sum(w["borrowed"] for w in ws)
    rates = [w.get("engine_output_tok_s") for w in ws]
    out["engine_output_tok_s"] = None if None in rates else sum(rates) / len(rates)
    out["windows_engine_output_tok_s"] = rates
    return out


def run_setup(name: str, ep: Endpoints, alone_as: dict | None = None) -> dict:
    """The three phases. For poolserve the offline-alone phase is four windows, the online
    pool's lending off, on, off, on (`LENDING`), by then the online pool long quiet: the
    offline pool alone against borrowing, alternated so that a drift over the flood's life
    counts against both; the engines' own token counts give each window's tok/s.
    `alone_as`: a set-up on the same engine whose online-alone and offline-alone phases this
    one shares (they differ only in how they rank online against offline requests)."""
    if alone_as is None:
        print(f"[{name}] online alone ...", flush=True)
        alone = _result(_online(ep, 3, ALONE_S, seed=1))
    print(f"[{name}] online + offline ({OFFLINE_OUTSTANDING} outstanding) ...", flush=True)
    since = time.time()
    windows = (TOGETHER_S,) if alone_as else (TOGETHER_S,) + (OFFLINE_ALONE_S,) * (len(LENDING) if ep.admin else 1)
    with contextlib.ExitStack() as scope:
        engines = scope.enter_context(EngineTokens(ep.admin)) if ep.admin else None
        flood = _offline(ep, OFFLINE_OUTSTANDING, RAMP_S, windows)
        if ep.admin:
            for i, enabled in enumerate(LENDING):
                switch = threading.Timer(RAMP_S + TOGETHER_S + i * OFFLINE_ALONE_S, _lending, (ep.admin, enabled))
                scope.callback(switch.join)
                switch.start()
        time.sleep(RAMP_S)
        together = _result(_online(ep, 0, TOGETHER_S, seed=2))
        print(f"[{name}] offline alone ...", flush=True)
        off = _result(flood)
    if ep.admin:
        _lending(ep.admin, True)
    out = {"online_alone": alone_as["online_alone"] if alone_as else _online_figures(alone),
           "online_with_offline": _online_figures(together),
           "offline_with_online": _offline_figures(off["windows"][0]),
           "offline_alone": alone_as["offline_alone"] if alone_as else _offline_figures(off["windows"][-1])}
    if ep.admin:
        each = [{**_offline_figures(w), "engine_output_tok_s": engines.rate(w["window_start"], w["duration_s"])}
                for w in off["windows"][1:]]
        for key, lending in (("offline_alone_no_borrowing", False), ("offline_alone", True)):
            out[key] = _mean_window([f for f, on in zip(each, LENDING) if on == lending])
        t = off["windows"][0]
        out["online_with_offline"]["online_limit"] = engines.limit_range("online-chat", t["window_start"], t["duration_s"])
        out["online_with_offline"]["offline_limit"] = engines.limit_range("offline-batch", t["window_start"],
                                                                          t["duration_s"])
        out["autoscaler_moves"] = [d.model_dump(include={"pool", "old", "new", "code", "reason"})
                                   for d in ep.admin.admin.decisions(500) if d.time >= since and d.old != d.new]
    print(f"[{name}] online P99 TTFT alone {out['online_alone']['ttft_p99_ms']:.0f} ms, under load "
          f"{out['online_with_offline']['ttft_p99_ms']:.0f} ms; offline {out['offline_with_online']['output_tok_s']:.0f}"
          f" tok/s with online, {out['offline_alone']['output_tok_s']:.0f} alone", flush=True)
    return out


def contention_floor(ep: Endpoints) -> dict:
    print(f"[floor] online + {FLOOR_STREAMS} offline streams ...", flush=True)
    flood = _offline(ep, FLOOR_STREAMS, RAMP_S / 2, (FLOOR_S,))
    time.sleep(RAMP_S / 2)
    online = _result(_online(ep, 0, FLOOR_S, seed=2))
    off = _result(flood)
    return {"online_with_offline": _online_figures(online), "offline_with_online": _offline_figures(off["windows"][0])}


# -- set-ups ------------------------------------------------------------------------------------

def _model_source() -> str:
    return local_config()["model"]["source"]


def _llm_config(model_id: str, seqs: int, batched: int, kv_gb: float, cores: str, policy: str,
                stream_batching_ms: float):
    """A stock pool as a careful user writes it: the same engine ceilings, cores and stream
    batching as poolserve's pools, and max_ongoing_requests set (the LLM default is 1e9)."""
    from ray.serve.llm import LLMConfig

    from deployments.app import engine_env

    return LLMConfig(
        model_loading_config={"model_id": model_id, "model_source": _model_source()},
        engine_kwargs={"dtype": "float32", "max_model_len": 2048, "max_num_seqs": seqs,
                       "max_num_batched_tokens": batched, "enable_chunked_prefill": True,
                       "scheduling_policy": policy, "kv_cache_memory_bytes": int(kv_gb * (1 << 30))},
        accelerator_config={"kind": "cpu"},
        runtime_env={"env_vars": {**engine_env(), "VLLM_CPU_OMP_THREADS_BIND": cores}},
        deployment_config={"max_ongoing_requests": 256,
                           "autoscaling_config": {"min_replicas": 1, "max_replicas": 1,
                                                  "target_ongoing_requests": 64}},
        experimental_configs={"stream_batching_interval_ms": stream_batching_ms},
    )


def _stock(llm_configs: list, prefix: str = "") -> str:
    """Deploy stock ray.serve.llm (OpenAiIngress) at `prefix`; return its /v1 URL."""
    from ray import serve
    from ray.serve.llm import build_openai_app

    serve.run(build_openai_app({"llm_configs": llm_configs}), name="stock", route_prefix=prefix or "/")
    url = f"http://127.0.0.1:8000{prefix}/v1"
    _warm_stock(url, [c.model_id for c in llm_configs])
    return url


def _warm_stock(url: str, models: list[str]) -> None:
    import httpx

    for model in models:
        for i in range(8):
            httpx.post(f"{url}/chat/completions", timeout=120,
                       json={"model": model, "messages": [{"role": "user", "content": "warm " * (1 + 16 * i)}],
                             "max_tokens": 8})


def setup_single(policy: str) -> Endpoints:
    url = _stock([_llm_config("tiny-llama", 64, 4096, 2.0, "0-1", policy, 10)])
    if policy == "priority":
        return Endpoints(url, url, online_body='{"priority": 0}', offline_body='{"priority": 1}')
    return Endpoints(url, url)


def setup_two_pools(prefix: str = "") -> Endpoints:
    url = _stock([_llm_config("tiny-llama-online", 32, 2048, 1.0, "0", "fcfs", 10),
                  _llm_config("tiny-llama-offline", 64, 4096, 1.0, "1", "fcfs", 100)], prefix)
    return Endpoints(url, url, online_model="tiny-llama-online", offline_model="tiny-llama-offline")


POOLSERVE = Endpoints("http://127.0.0.1:8000/online/v1", "http://127.0.0.1:8000/offline/v1",
                      online_key=KEYS["chat"], offline_key=KEYS["batch"])


# -- the report -----------------------------------------------------------------------------------

def ratios(results: dict, floor: dict) -> dict:
    ps = results["poolserve"]
    out = {}
    for base in ("single-fcfs", "single-priority", "stock-two-pools"):
        b = results[base]
        out[f"online_ttft_p99_vs_{base}"] = _div(ps["online_with_offline"]["ttft_p99_ms"],
                                                 b["online_with_offline"]["ttft_p99_ms"])
        out[f"online_tpot_p99_vs_{base}"] = _div(ps["online_with_offline"]["tpot_p99_ms"],
                                                 b["online_with_offline"]["tpot_p99_ms"])
        out[f"offline_tok_s_vs_{base}"] = _div(ps["offline_with_online"]["output_tok_s"],
                                               b["offline_with_online"]["output_tok_s"])
    out["online_ttft_p99_vs_floor"] = _div(ps["online_with_offline"]["ttft_p99_ms"],
                                           floor["online_with_offline"]["ttft_p99_ms"])
    out["online_ttft_p99_under_load_vs_idle"] = _div(ps["online_with_offline"]["ttft_p99_ms"],
                                                     ps["online_alone"]["ttft_p99_ms"])
    return out


def _div(a, b):
    return None if a is None or not b else a / b


def targets(results: dict, r: dict) -> dict:
    ps = results["poolserve"]
    return {
        "ttft_p99_at_most_1/50_of_single_fcfs": _le(r["online_ttft_p99_vs_single-fcfs"], 1 / 50),
        "ttft_p99_at_most_1/50_of_single_priority": _le(r["online_ttft_p99_vs_single-priority"], 1 / 50),
        "ttft_p99_at_most_0.8x_stock_two_pools": _le(r["online_ttft_p99_vs_stock-two-pools"], 0.8),
        "ttft_p99_within_1.25x_of_floor": _le(r["online_ttft_p99_vs_floor"], 1.25),
        "tpot_p99_at_most_single_priority": _le(r["online_tpot_p99_vs_single-priority"], 1.0),
        "offline_tok_s_at_least_0.8x_stock_two_pools": (r["offline_tok_s_vs_stock-two-pools"] or 0) >= 0.8,
        "borrowing_lifts_offline_alone_above_offline_pool_alone":
            ps["offline_alone"]["borrowed"] > 0
            and (ps["offline_alone"].get("engine_output_tok_s") or 0)
            > (ps["offline_alone_no_borrowing"].get("engine_output_tok_s") or float("inf")),
    }


def _le(x, bound) -> bool:
    return x is not None and x <= bound


def plot(results: dict, floor: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    idle = [results[n]["online_alone"]["ttft_p99_ms"] for n in names]
    load = [results[n]["online_with_offline"]["ttft_p99_ms"] for n in names]
    x = range(len(names))
    a.bar([i - 0.2 for i in x], idle, 0.4, label="online alone")
    a.bar([i + 0.2 for i in x], load, 0.4, label=f"with {OFFLINE_OUTSTANDING} offline outstanding")
    a.axhline(floor["online_with_offline"]["ttft_p99_ms"], color="k", linestyle=":",
              label=f"contention floor ({FLOOR_STREAMS} offline streams)")
    a.set_yscale("log")
    a.set_xticks(list(x), names, rotation=15)
    a.set_ylabel("online P99 TTFT (ms, log)")
    a.legend(fontsize=8)
    a.set_title("Online tail latency")
    b.bar([i - 0.2 for i in x], [results[n]["offline_with_online"]["output_tok_s"] for n in names], 0.4,
          label="with online")
    b.bar([i + 0.2 for i in x], [results[n]["offline_alone"]["output_tok_s"] for n in names], 0.4,
          label="offline alone")
    b.set_xticks(list(x), names, rotation=15)
    b.set_ylabel("offline output tokens/s")
    b.legend(fontsize=8)
    b.set_title("Offline throughput")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_two_pools(ep: Endpoints) -> tuple[dict, dict]:
    result = run_setup("stock-two-pools", ep)
    floor = contention_floor(ep)
    teardown("stock")
    return result, floor


def run_single_pools() -> dict:
    priority = setup_single("priority")
    results = {"single-fcfs": run_setup("single-fcfs", Endpoints(priority.online_url, priority.offline_url))}
    time.sleep(5)  # the abandoned flood's requests are aborted
    # alone, online or offline, every request has one priority: the same load as single-fcfs's
    results["single-priority"] = run_setup("single-priority", priority, alone_as=results["single-fcfs"])
    teardown("stock")
    return results


def _cpu_priority() -> str:
    c = local_config()
    workers = RayConfig(**c.get("ray", {})).worker_niceness
    pools = ", ".join(f"{name} at {p.get('replicas', {}).get('nice', 0)}" for name, p in c["pools"].items())
    return (f"every set-up's Ray workers (proxy, replicas, engines) at nice {workers}; poolserve's pools "
            f"(replicas.nice): {pools}; the load generators at nice 0")


def report(results: dict, floor: dict, wall_s: float) -> dict:
    r = ratios(results, floor)
    plot(results, floor, REPO / "docs" / "images" / "bench-mixed.png")
    return {
        "setup": {"online": f"Poisson {ONLINE_RATE} req/s, chat, streamed, Azure 2023 trace lengths scaled",
                  "offline": f"{OFFLINE_OUTSTANDING} whole requests outstanding, {OFFLINE_LENGTHS[0]} prompt / "
                             f"{OFFLINE_LENGTHS[1]} output tokens (lognormal sigma 0.3)",
                  "phases_s": {"online_alone": ALONE_S, "ramp": RAMP_S, "together": TOGETHER_S,
                               "offline_alone": OFFLINE_ALONE_S, "floor_together": FLOOR_S},
                  "online_timeout_s": ONLINE_TIMEOUT_S, "online_drain_s": ONLINE_DRAIN_S, "slo": SLO,
                  "floor_streams": FLOOR_STREAMS,
                  "single_pools": "one engine with scheduling_policy=priority; single-priority sends online at "
                                  "priority 0 and offline at 1, single-fcfs every request at one priority, which "
                                  "that scheduler serves in arrival order (and preempts latest-first), as FCFS does; "
                                  "the two share the online-alone and offline-alone phases (one priority each: "
                                  "the same load), measured once as single-fcfs",
                  "cpu_priority": _cpu_priority()},
        "results": results, "contention_floor": floor, "ratios": r, "targets_met": targets(results, r),
        "wall_s": round(wall_s),
    }


def main() -> None:
    started = time.monotonic()
    with ray_cluster():
        stack = deploy(local_config())
        results = {"poolserve": run_setup("poolserve", Endpoints(**{**POOLSERVE.__dict__, "admin": stack}))}
        teardown("poolserve")
        results["stock-two-pools"], floor = run_two_pools(setup_two_pools())
        results.update(run_single_pools())
    write_result("mixed", report(results, floor, time.monotonic() - started))


if __name__ == "__main__":
    main()
