"""Router overhead: the same load through poolserve's router and gate, and straight to an
identical engine behind ray.serve.llm's stock OpenAI ingress, in one run.

Both engines have the online pool's ceilings and are pinned to the same core; the two
paths are loaded in turn (ABAB...), never together, with the same seeded lengths and a closed
loop of `CONCURRENCY` streams; the gate's limit is pinned above that, so nothing waits in
it. Added latency = router path - direct path, per percentile, for TTFT and E2E.

    python -m bench.overhead        # about 3 minutes; writes bench/results/overhead.json
"""

from __future__ import annotations

import asyncio

from bench.common import KEYS, deploy, local_config, ray_cluster, write_result
from bench.loadgen import Target, Window, closed_loop, summarize, synthetic_lengths

CONCURRENCY = 8
ROUNDS = 3
WINDOW = Window(warmup_s=2, measure_s=12)
LENGTHS = synthetic_lengths(prompt=128, output=64)


def _deploy_direct(stack) -> None:
    from ray import serve
    from ray.serve.llm import build_openai_app

    from deployments.app import llm_config

    rp = stack.resolved.pools["online-chat"]
    cfg = llm_config(stack.resolved, rp)
    engine = cfg.engine_kwargs
    from ray.serve.llm import LLMConfig

    direct = LLMConfig(
        model_loading_config=cfg.model_loading_config.model_dump(),
        engine_kwargs=engine,
        accelerator_config={"kind": "cpu"},
        runtime_env={"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": rp.config.engine.cpu_threads_bind or "0"}},
        deployment_config={"max_ongoing_requests": 256, "autoscaling_config": {"min_replicas": 1, "max_replicas": 1,
                                                                              "target_ongoing_requests": 64}},
        experimental_configs={"stream_batching_interval_ms": rp.config.stream_batching_ms},
    )
    serve.run(build_openai_app({"llm_configs": [direct]}), name="direct", route_prefix="/direct")


async def _rounds(router: Target, direct: Target) -> dict:
    runs = {"router": [], "direct": []}
    for i in range(ROUNDS):
        for name, target in (("router", router), ("direct", direct)):
            run = await closed_loop(target, CONCURRENCY, LENGTHS, WINDOW, seed=i)
            runs[name] += run.measured()
    return runs


def run(stack) -> dict:
    """Needs a stack whose online pool is up; deploys the direct app beside it and removes it."""
    from ray import serve

    _deploy_direct(stack)
    stack.pin("online-chat", stack.resolved.pools["online-chat"].config.engine.max_num_seqs)
    router = Target("http://127.0.0.1:8000/online/v1", KEYS["chat"])
    direct = Target("http://127.0.0.1:8000/direct/v1", "unused")
    try:
        asyncio.run(closed_loop(direct, CONCURRENCY, LENGTHS, Window(0, 8)))  # warm the direct engine
        runs = asyncio.run(_rounds(router, direct))
    finally:
        stack.admin("DELETE", "/admin/pools/online-chat/limits")
        serve.delete("direct")
    duration = WINDOW.measure_s * ROUNDS
    summary = {k: summarize(v, duration).to_json() for k, v in runs.items()}
    r, d = summary["router"], summary["direct"]
    added = {f"{metric}_{p}_ms": r[f"{metric}_ms"][p] - d[f"{metric}_ms"][p]
             for metric in ("ttft", "e2e") for p in ("p50", "p99")}
    result = {
        "setup": {"concurrency": CONCURRENCY, "rounds": ROUNDS, "measure_s_per_round": WINDOW.measure_s,
                  "lengths": LENGTHS.source, "baseline": "same engine behind ray.serve.llm OpenAiIngress"},
        "router": r, "direct": d, "added": added,
        "req_per_s_ratio": r["req_per_s"] / d["req_per_s"] if d["req_per_s"] else None,
        "targets": {"added_p50_ms_at_most": 5, "req_per_s_ratio_at_least": 0.9},
    }
    result["met"] = {"added_ttft_p50": added["ttft_p50_ms"] <= 5, "req_per_s_ratio": result["req_per_s_ratio"] >= 0.9}
    return result


def main() -> None:
    with ray_cluster():
        result = run(deploy(local_config()))
    write_result("overhead", result)


if __name__ == "__main__":
    main()
