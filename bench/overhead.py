"""Router overhead: the same load through poolserve's router and gate, and straight to an
identical engine behind ray.serve.llm's stock OpenAI ingress, in one run.

The direct engine is the stock two-pool set-up's online engine, deployed beside poolserve:
the online pool's ceilings, core and stream batching. The gate's limit is pinned above the
load, so nothing waits in it. Two measurements:

- latency: one request at a time, the paths alternating request by request (router, direct,
  direct, router, ...), `PAIRS` pairs with short outputs. Added TTFT = router P50 − direct
  P50, and the median of the pairs' differences. The router path's time is split by its
  `Server-Timing` header (router work, reaching a replica, the gate's queue, the engine's
  first output) and the rest: the HTTP proxy both ways and the client. At load, TTFT on two shared cores swings
  by tens of ms from one second to the next; one at a time and interleaved, the router's own
  few ms are what is left.
- throughput: a closed loop of `CONCURRENCY` streams on each path in turn (ABAB...), with
  the same seeded lengths; req/s router / direct, and the percentiles at that load.

    python -m bench.overhead        # about 3 minutes; writes bench/results/overhead.json
"""

from __future__ import annotations

import asyncio

import random
import statistics

from bench.common import KEYS, deploy, local_config, ray_cluster, teardown, write_result
from infra.loadgen import Target, Window, _client, closed_loop, send
from infra.results import summarize
from infra.traffic import make_prompt, synthetic_lengths

CONCURRENCY = 8
ROUNDS = 2
WINDOW = Window(warmup_s=1, measure_s=8)
LENGTHS = synthetic_lengths(prompt=128, output=64)
PAIRS = 50
PAIR_LENGTHS = (128, 8)


async def _pairs(router: Target, direct: Target, n: int = PAIRS) -> dict:
    """TTFT (s) of `n` requests on each path, sent one at a time, alternating (ABBA...)."""
    rng = random.Random(7)
    ttft: dict[str, list[float]] = {"router": [], "direct": []}
    diffs, steps = [], []
    async with _client(1) as rc, _client(1) as dc:
        clients = {"router": (rc, router), "direct": (dc, direct)}
        for i in range(n):
            order = ("router", "direct") if i % 2 == 0 else ("direct", "router")
            got = {}
            for name in order:
                client, target = clients[name]
                res = await send(client, target, make_prompt(PAIR_LENGTHS[0], rng), PAIR_LENGTHS[1])
                if not res.ok or res.ttft is None:
                    raise RuntimeError(f"{name} request failed: {res.status} {res.error}")
                got[name] = res.ttft
                if name == "router":
                    steps.append({**res.server_timing, "outside the router": res.ttft * 1e3 - sum(res.server_timing.values())})
            for name in got:
                ttft[name].append(got[name])
            diffs.append(got["router"] - got["direct"])
    p50 = {k: statistics.median(v) * 1e3 for k, v in ttft.items()}
    return {"pairs": n, "lengths": f"{PAIR_LENGTHS[0]}/{PAIR_LENGTHS[1]}",
            "ttft_p50_ms": p50, "added_ttft_p50_ms": p50["router"] - p50["direct"],
            "median_pair_difference_ms": statistics.median(diffs) * 1e3,
            "router_path_steps_p50_ms": {k: statistics.median(x[k] for x in steps if k in x) for k in steps[0]}}


async def _rounds(router: Target, direct: Target) -> dict:
    runs = {"router": [], "direct": []}
    for i in range(ROUNDS):
        for name, target in (("router", router), ("direct", direct)):
            run = await closed_loop(target, CONCURRENCY, LENGTHS, WINDOW, seed=i)
            runs[name] += run.measured()
    return runs


def run(stack, direct: Target) -> dict:
    """`stack`: poolserve; `direct`: the same engine behind stock ray.serve.llm, deployed beside it."""
    stack.admin.pin("online-chat", stack.resolved.pools["online-chat"].config.engine.max_num_seqs, calibrating=True)
    router = Target("http://127.0.0.1:8000/online/v1", KEYS["chat"])
    try:
        asyncio.run(closed_loop(direct, CONCURRENCY, LENGTHS, Window(0, 6)))  # warm the direct path
        latency = asyncio.run(_pairs(router, direct))
        runs = asyncio.run(_rounds(router, direct))
    finally:
        stack.admin.unpin("online-chat")
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
        "latency_one_at_a_time": latency,
        "router": r, "direct": d, "added_at_load": added,
        "req_per_s_ratio": r["req_per_s"] / d["req_per_s"] if d["req_per_s"] else None,
        "targets": {"added_p50_ms_at_most": 5, "req_per_s_ratio_at_least": 0.9},
    }
    result["met"] = {"added_ttft_p50": latency["added_ttft_p50_ms"] <= 5,
                     "req_per_s_ratio": result["req_per_s_ratio"] >= 0.9}
    return result


def direct_target(stock_url: str) -> Target:
    return Target(stock_url, "unused", model="tiny-llama-online")


def main() -> None:
    from bench.mixed import setup_two_pools

    with ray_cluster():
        stack = deploy(local_config())
        ep = setup_two_pools("/stock")
        result = run(stack, direct_target(ep.online_url))
        teardown("stock")
    write_result("overhead", result)


if __name__ == "__main__":
    main()
