"""Router overhead: the same requests through poolserve's online pool (its router and gate in
the replica) and straight to an identical engine behind stock ray.serve.llm, in one run.

The direct engine is the online pool's (its ceilings, core and stream batching) behind
ray.serve.llm's OpenAI ingress, deployed beside poolserve. Both run with a context of
`MAX_MODEL_LEN` tokens, so that a 4,096-token prompt fits with room to answer (the embedded
default has 2,048; the shipped profiles were measured there, so poolserve runs its pools on
a manual range here, and the online pool is pinned above the load: nothing waits in its gate).

- latency: one request at a time, the two paths alternating (router, direct, direct, router,
  ...), `PAIRS` pairs at each prompt length of `PROMPTS` in each of `ROUNDS` rounds, the
  lengths in a shuffled order each round (the seed is recorded), from a process of its own.
  The figure is the median of the pairs' differences in TTFT, with its 95% bootstrap interval
  over rounds and pairs (`bench.verdicts.overhead_findings`); the router path's own steps come
  from its `Server-Timing` header.
- throughput: a closed loop of `CONCURRENCY` streams on each path in turn, `ROUNDS` rounds
  (ABBA...), each from its own process; req/s through the router over req/s direct, with its
  interval over rounds.

Every request's timings go to bench/results/raw/<run>/.

    python -m bench.overhead [--seed 0]     # about 5 minutes; writes bench/results/overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import random
import subprocess
import sys
import time
from pathlib import Path

from bench import setups
from bench.common import KEYS, REPO, RESULTS, ray_cluster, teardown, write_result
from infra.loadgen import Target, _client, send
from infra.traffic import make_prompt

MAX_MODEL_LEN = 8192
PROMPTS = (128, 1024, 4096)  # prompt tokens of the one-at-a-time pairs
PAIR_OUTPUT = 8
PAIRS = 20  # at each prompt length, in each round
ROUNDS = 3
CONCURRENCY, LOOP_LENGTHS, WARMUP_S, MEASURE_S = 8, (128, 64), 1, 8
PATHS = ("router", "direct")


async def pairs(router: Target, direct: Target, prompt: int, n: int, rng: random.Random) -> list[dict]:
    """`n` pairs of one request on each path, one at a time, the first path alternating; every
    prompt its own words (no prefix-cache hit helps either path)."""
    targets, rows = {"router": router, "direct": direct}, []
    async with _client(router, 1) as rc, _client(direct, 1) as dc:
        clients = {"router": rc, "direct": dc}
        for i in range(n):
            order = PATHS if i % 2 == 0 else PATHS[::-1]
            row: dict = {"prompt": prompt, "first": order[0]}
            for name in order:
                res = await send(clients[name], targets[name], make_prompt(prompt, rng), PAIR_OUTPUT)
                if not res.ok or res.ttft is None:
                    raise RuntimeError(f"{name} request failed: {res.status} {res.error}")
                row[f"{name}_ttft_ms"] = res.ttft * 1e3
                row[f"{name}_prompt_tokens"] = res.prompt_tokens
                if name == "router":
                    row["router_steps_ms"] = res.server_timing
            rows.append(row)
    return rows


async def _latency(router: Target, direct: Target, seed: int, pairs_n: int, rounds: int) -> list[dict]:
    rng, rows = random.Random(seed), []
    for k in range(rounds):
        for prompt in rng.sample(PROMPTS, len(PROMPTS)):
            rows += [{"round": k, **r} for r in await pairs(router, direct, prompt, pairs_n, rng)]
    return rows


def _loop(target: Target, seed: int, raw: Path, measure_s: float = MEASURE_S) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "infra.loadgen", "--url", target.base_url, "--key", target.api_key,
         "--model", target.model, "--concurrency", str(CONCURRENCY), "--prompt", str(LOOP_LENGTHS[0]),
         "--output", str(LOOP_LENGTHS[1]), "--warmup", str(WARMUP_S), "--duration", str(measure_s),
         "--seed", str(seed), "--raw", f"{raw}.jsonl.gz", "--out", f"{raw}.json"],
        cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"load generator failed: {out.stderr[-2000:]}")
    summary = json.loads(Path(f"{raw}.json").read_text())
    if summary["completed"] < summary["requests"] or not summary["completed"]:  # a broken path is no figure
        raise RuntimeError(f"{target.base_url}: {summary['completed']} of {summary['requests']} requests answered "
                           f"({summary['statuses']})")


def run(router: Target, direct: Target, seed: int = 0, pairs_n: int = PAIRS, rounds: int = ROUNDS,
        results: Path = RESULTS) -> dict:
    """Both paths must be up. The pairs run in a process of their own (`main --pairs-only`)."""
    run_id = time.strftime("%Y%m%d-%H%M%S") + "-overhead"
    raw = results / "raw" / run_id
    raw.mkdir(parents=True, exist_ok=True)
    targets = {"router": router, "direct": direct}
    for name, target in targets.items():  # a path's first seconds of load after its start are slower
        _loop(target, 99, raw / f"warm-{name}", measure_s=4)
    subprocess.run([sys.executable, "-m", "bench.overhead", "--pairs-only", json.dumps(
        {"router": router.__dict__, "direct": direct.__dict__, "seed": seed, "pairs": pairs_n, "rounds": rounds,
         "out": str(raw / "pairs.jsonl.gz")})], cwd=REPO, check=True)
    order = [PATHS[(k + (k // 2)) % 2] for k in range(2 * rounds)]  # router, direct, direct, router, ...
    for i, name in enumerate(order):
        _loop(targets[name], i // 2, raw / f"loop-{i:02d}-{name}")
    record = {
        "run": run_id, "seed": seed, "loop_order": order,
        "setup": {"prompts": list(PROMPTS), "pair_output": PAIR_OUTPUT, "pairs": pairs_n, "rounds": rounds,
                  "max_model_len": MAX_MODEL_LEN, "concurrency": CONCURRENCY,
                  "loop_lengths": f"{LOOP_LENGTHS[0]}/{LOOP_LENGTHS[1]}", "measure_s": MEASURE_S,
                  "baseline": "the online pool's engine (same ceilings, core, stream batching) behind "
                              "ray.serve.llm's OpenAI ingress, its deployment options at their defaults"},
    }
    (raw / "record.json").write_text(json.dumps(record, indent=1))
    return record


def _pairs_only(spec: str) -> None:
    s = json.loads(spec)
    rows = asyncio.run(_latency(Target(**s["router"]), Target(**s["direct"]), s["seed"], s["pairs"], s["rounds"]))
    with gzip.open(s["out"], "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def check_model() -> None:
    """The model must take MAX_MODEL_LEN: a tiny model written before its context was raised cannot."""
    config = json.loads((Path(setups.model()) / "config.json").read_text())
    if config.get("max_position_embeddings", 0) < MAX_MODEL_LEN:
        raise SystemExit(f"{setups.model()} takes {config.get('max_position_embeddings')} tokens, the overhead "
                         f"benchmark {MAX_MODEL_LEN}: `make setup` writes the tiny model again")


def deployed() -> tuple[Target, Target]:
    """poolserve with the longer context, its online pool pinned at its ceiling, and the stock
    online engine beside it."""
    check_model()
    changes = {"model.max_model_len": MAX_MODEL_LEN}
    for pool, top in (("online-chat", 32), ("offline-batch", 32)):
        changes[f"pools.{pool}.limits"] = {"range": [1, top], "start": top}
    _, stack = setups.poolserve(**changes)
    stack.admin.pin("online-chat", 32)
    stock = setups.stock_online_pool(MAX_MODEL_LEN)
    return (Target(f"{stack.base_url}/online/v1", KEYS["chat"]),
            Target(stock.online_url, "none", model=stock.online_model))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.overhead")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompt lengths' order and the prompts")
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--pairs-only", help=argparse.SUPPRESS)  # the latency pairs, in their own process
    a = p.parse_args(argv)
    if a.pairs_only:
        return _pairs_only(a.pairs_only)
    with ray_cluster():
        try:
            result = run(*deployed(), seed=a.seed, rounds=a.rounds)
        finally:
            teardown("stock-online")
            teardown("poolserve")
    write_result("overhead", result)


if __name__ == "__main__":
    main()
