"""Router overhead: the same load through poolserve's router and gate, and straight to an
identical engine behind ray.serve.llm's stock OpenAI ingress, in one run.

The direct engine is the stock two-pool set-up's online engine, deployed beside poolserve:
the online pool's ceilings, core and stream batching. The two paths are loaded in turn
(ABAB...), never together, with the same seeded lengths and a closed
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
WINDOW = Window(warmup_s=2, measure_s=10)
LENGTHS = synthetic_lengths(prompt=128, output=64)


async def _rounds(router: Target, direct: Target) -> dict:
    runs = {"router": [], "direct": []}
    for i in range(ROUNDS):
        for name, target in (("router", router), ("direct", direct)):
            run = await closed_loop(target, CONCURRENCY, LENGTHS, WINDOW, seed=i)
            runs[name] += run.measured()
    return runs


def run(stack, direct: Target) -> dict:
    """`stack`: poolserve; `direct`: the same engine behind stock ray.serve.llm, deployed beside it."""
    stack.pin("online-chat", stack.resolved.pools["online-chat"].config.engine.max_num_seqs)
    router = Target("http://127.0.0.1:8000/online/v1", KEYS["chat"])
    try:
        asyncio.run(closed_loop(direct, CONCURRENCY, LENGTHS, Window(0, 6)))  # warm the direct path
        runs = asyncio.run(_rounds(router, direct))
    finally:
        stack.admin("DELETE", "/admin/pools/online-chat/limits")
    duration = WINDOW.measure_s * ROUNDS
    summary = {k: summarize(v, duration).to_json() for k, v in runs.items()}
    r, d = summary["router"], summary["direct"]
    added = {f"{metric}_{p}_ms": r[f"{metric}_ms"][p] - d[f"{metric}_ms"][p]
             for metric in ("ttft", "e2e") for p in ("p50", "p99")}
    result = {
        "setup": {"concurrency": CONCURRENCY, "rounds": ROUNDS, "measure_s_per_round": WINDOW.measure_s,
                  "lengths": LENGTHS.source,
                  "baseline": "the online pool's engine (same ceilings, core, stream batching) behind "
                              "ray.serve.llm's OpenAiIngress"},
        "router": r, "direct": d, "added": added,
        "req_per_s_ratio": r["req_per_s"] / d["req_per_s"] if d["req_per_s"] else None,
        "targets": {"added_p50_ms_at_most": 5, "req_per_s_ratio_at_least": 0.9},
    }
    result["met"] = {"added_ttft_p50": added["ttft_p50_ms"] <= 5, "req_per_s_ratio": result["req_per_s_ratio"] >= 0.9}
    return result


def direct_target(stock_url: str) -> Target:
    return Target(stock_url, "unused", model="tiny-llama-online")


def main() -> None:
    from bench.mixed import _teardown, setup_two_pools

    with ray_cluster():
        stack = deploy(local_config())
        ep = setup_two_pools("/stock")
        result = run(stack, direct_target(ep.online_url))
        _teardown("stock")
    write_result("overhead", result)


if __name__ == "__main__":
    main()
