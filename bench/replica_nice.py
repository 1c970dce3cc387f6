"""Does lowering the offline pool's replica process help the online tail under a flood?

One deployment of poolserve as `bench.ceiling` sets it up for its parity flood; rounds of that
flood with the offline pool's replica process (the route, the gate, the reports) at nice 0, as
shipped before 2026-12-06, or at nice OFFLINE_NICE like its engine (as shipped since), in a
seeded shuffled order. Every thread of the replica is set before its round (lowering it to 0
needs root). The raw data of every
round goes to bench/results/raw/<run>-replica-nice/; `--summarize DIR` prints the ratios with
their 95% bootstrap intervals over rounds and requests. `--ceiling-rounds` adds rounds of the
ceiling's `vllm bench serve` against the offline pool pinned at its ceiling, the same way.

The diagnostic that led to the change (bench/notes.md), not a target of any issue.

    python -m bench.replica_nice [--rounds 3] [--ceiling-rounds 0] [--seed 0] | --summarize DIR
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from bench import intervals, procs
from bench.ceiling import ONLINE_TIMEOUT_S, at_rest, ceiling_round, flood_round
from bench.common import RESULTS, compress, ray_cluster
from bench.setups import CEILING_SEQS, OFFLINE_NICE, OFFLINE_SEQS, ONLINE_SEQS, pin, poolserve
from infra.loadgen import read_raw
from infra.results import ttfts_with_timeouts

ROLE = "replica poolserve-offline-batch:pool-offline-batch"
ARMS = {"nice0": 0, f"nice{OFFLINE_NICE}": OFFLINE_NICE}


def set_nice(pid: int, nice: int) -> int:
    """Every thread of `pid` at `nice`; the number set. Lowering needs root: a round that
    would run at another nice than its arm's stops the run instead."""
    done = 0
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        if os.getpriority(os.PRIO_PROCESS, tid) != nice:
            raise SystemExit(f"thread {tid} of the offline replica stays at nice {os.getpriority(os.PRIO_PROCESS, tid)}"
                             f", not {nice}: run as root to lower it between rounds")
        done += 1
    return done


def run(rounds: int, ceiling_rounds: int, seed: int) -> Path:
    raw = RESULTS / "raw" / f"{time.strftime('%Y%m%d-%H%M%S')}-replica-nice"
    raw.mkdir(parents=True)
    started, results, ceiling = time.monotonic(), [], []
    rng = random.Random(seed)

    def keep() -> None:
        (raw / "results.json").write_text(json.dumps({"seed": seed, "rounds": results, "ceiling": ceiling}, indent=1,
                                                     default=str))

    def step(what: str) -> None:
        print(f"[{time.monotonic() - started:5.0f}s] {what}", flush=True)

    with ray_cluster():
        step("deploy poolserve")
        target, stack = poolserve()
        pin(stack, ONLINE_SEQS, OFFLINE_SEQS)
        quiet = at_rest(step)
        (pid,) = [p for p, role in procs.snapshot().roles.items() if role == ROLE]
        order = [arm for _ in range(rounds) for arm in ARMS]
        rng.shuffle(order)
        step(f"offline replica pid {pid}, order {order}")
        try:
            for i, arm in enumerate(order):
                threads = set_nice(pid, ARMS[arm])
                procs.wait_quiet(quiet)
                step(f"round {i}: {arm} ({threads} threads set)")
                r = flood_round(target, raw / f"flood-{i:02d}-{arm}", stack)
                results.append({"round": i, "arm": arm, "threads_set": threads, **r})
                keep()
                step(f"  TTFT P99 {r['online_ttft_ms']['p99']:.0f} ms, TPOT P99 {r['online_tpot_ms']['p99']:.1f} ms,"
                     f" offline {r['offline_tok_s']:.0f} tok/s")
            pin(stack, ONLINE_SEQS, CEILING_SEQS)
            order = [arm for _ in range(ceiling_rounds) for arm in ARMS]
            rng.shuffle(order)
            for i, arm in enumerate(order):  # prompts of their own each round: no prefix cache between rounds
                threads = set_nice(pid, ARMS[arm])
                procs.wait_quiet(quiet)
                r = ceiling_round("poolserve", raw / f"ceiling-{i:02d}-{arm}", 1000 + i)
                ceiling.append({"round": i, "arm": arm, "threads_set": threads, **r})
                keep()
                step(f"ceiling round {i}: {arm}: {r['output_tok_s']:.0f} output tok/s")
        finally:
            set_nice(pid, 0)
    compress(raw)  # vllm bench serve's per-request detail runs to megabytes
    return raw


def summarize(raw: Path) -> dict[str, str]:
    """Lowered over shipped: each figure's ratio with its 95% interval."""
    saved = json.loads((raw / "results.json").read_text())
    rounds, low, base = saved["rounds"], f"nice{OFFLINE_NICE}", "nice0"
    ceiling = {arm: [[r["output_tok_s"]] for r in saved.get("ceiling", []) if r["arm"] == arm] for arm in (low, base)}
    found = {"ceiling output tok/s": intervals.ratio(ceiling[low], ceiling[base], intervals.mean)} \
        if all(ceiling.values()) else {}
    if not rounds:
        return {k: str(v) for k, v in found.items()}
    online = {arm: [read_raw(raw / f"flood-{r['round']:02d}-{arm}-online.jsonl.gz") for r in rounds if r["arm"] == arm]
              for arm in (low, base)}
    ttft = {arm: [ttfts_with_timeouts(rs, ONLINE_TIMEOUT_S) for rs in runs] for arm, runs in online.items()}
    tpot = {arm: [[r.tpot for r in rs if r.tpot is not None] for rs in runs] for arm, runs in online.items()}
    per_round = {key: {arm: [[get(r)] for r in rounds if r["arm"] == arm] for arm in (low, base)}
                 for key, get in (("offline tok/s", lambda r: r["offline_tok_s"]),
                                  ("offline engine occupancy", lambda r: r["busy"]["offline-batch"]["occupancy"]))}
    out = {"online P99 TTFT": intervals.ratio(ttft[low], ttft[base], intervals.p99),
           "online P50 TTFT": intervals.ratio(ttft[low], ttft[base], intervals.p50),
           "online P99 TPOT": intervals.ratio(tpot[low], tpot[base], intervals.p99),
           **{k: intervals.ratio(v[low], v[base], intervals.mean) for k, v in per_round.items()}, **found}
    return {k: str(v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.replica_nice")
    p.add_argument("--rounds", type=int, default=3, help="flood rounds per arm")
    p.add_argument("--ceiling-rounds", type=int, default=0, help="ceiling rounds per arm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--summarize", type=Path, help="a run's raw directory: print its ratios, run nothing")
    a = p.parse_args(argv)
    print(json.dumps(summarize(a.summarize if a.summarize else run(a.rounds, a.ceiling_rounds, a.seed)), indent=1))


if __name__ == "__main__":
    main()
