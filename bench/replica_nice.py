"""Does lowering the offline pool's replica process help the online tail under a flood?

One deployment of poolserve as `bench.ceiling` sets it up for its parity flood; rounds of that
flood with the offline pool's replica process (the route, the gate, the reports) at nice 0, as
shipped, or at nice OFFLINE_NICE like its engine, in a seeded shuffled order. Every thread of
the replica is set before its round (lowering it back to 0 needs root). The raw data of every
round goes to bench/results/raw/<run>-replica-nice/; `--summarize DIR` prints the ratios with
their 95% bootstrap intervals over rounds and requests.

A diagnostic of a product change not made (bench/notes.md), not a target of any issue.

    python -m bench.replica_nice [--rounds 3] [--seed 0] | --summarize DIR
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from bench import intervals, procs
from bench.ceiling import ONLINE_TIMEOUT_S, at_rest, flood_round
from bench.common import RESULTS, ray_cluster
from bench.setups import OFFLINE_NICE, OFFLINE_SEQS, ONLINE_SEQS, pin, poolserve
from infra.loadgen import read_raw
from infra.results import ttfts_with_timeouts

ROLE = "replica poolserve-offline-batch:pool-offline-batch"
ARMS = {"nice0": 0, f"nice{OFFLINE_NICE}": OFFLINE_NICE}


def set_nice(pid: int, nice: int) -> int:
    """Every thread of `pid` at `nice`; the number set."""
    done = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
            done += 1
        except OSError:  # ended meanwhile, or lowering without the privilege
            pass
    return done


def run(rounds: int, seed: int) -> Path:
    raw = RESULTS / "raw" / f"{time.strftime('%Y%m%d-%H%M%S')}-replica-nice"
    raw.mkdir(parents=True)
    started, results = time.monotonic(), []

    def step(what: str) -> None:
        print(f"[{time.monotonic() - started:5.0f}s] {what}", flush=True)

    with ray_cluster():
        step("deploy poolserve")
        target, stack = poolserve()
        pin(stack, ONLINE_SEQS, OFFLINE_SEQS)
        quiet = at_rest(step)
        (pid,) = [p for p, role in procs.snapshot().roles.items() if role == ROLE]
        order = [arm for _ in range(rounds) for arm in ARMS]
        random.Random(seed).shuffle(order)
        step(f"offline replica pid {pid}, order {order}")
        try:
            for i, arm in enumerate(order):
                threads = set_nice(pid, ARMS[arm])
                procs.wait_quiet(quiet)
                step(f"round {i}: {arm} ({threads} threads set)")
                r = flood_round(target, raw / f"flood-{i:02d}-{arm}", stack)
                results.append({"round": i, "arm": arm, **r})
                (raw / "results.json").write_text(json.dumps({"seed": seed, "rounds": results}, indent=1,
                                                             default=str))
                step(f"  TTFT P99 {r['online_ttft_ms']['p99']:.0f} ms, TPOT P99 {r['online_tpot_ms']['p99']:.1f} ms,"
                     f" offline {r['offline_tok_s']:.0f} tok/s")
        finally:
            set_nice(pid, 0)
    return raw


def summarize(raw: Path) -> dict[str, str]:
    """Lowered over shipped: each figure's ratio with its 95% interval."""
    rounds = json.loads((raw / "results.json").read_text())["rounds"]
    low, base = f"nice{OFFLINE_NICE}", "nice0"
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
           **{k: intervals.ratio(v[low], v[base], intervals.mean) for k, v in per_round.items()}}
    return {k: str(v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.replica_nice")
    p.add_argument("--rounds", type=int, default=3, help="flood rounds per arm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--summarize", type=Path, help="a run's raw directory: print its ratios, run nothing")
    a = p.parse_args(argv)
    print(json.dumps(summarize(a.summarize if a.summarize else run(a.rounds, a.seed)), indent=1))


if __name__ == "__main__":
    main()
