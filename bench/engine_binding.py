"""Does binding each pool's engine core beside its workers keep a long stream flowing, and
what does it do to the offline pool's throughput?

One `poolserve serve` of deployments/configs/local.yaml, as a user starts it; rounds of one
1,500-token online stream, with nothing else sent, in a seeded shuffled order of two arms:
`bound` (every thread of each pool's engine core on its workers' cores, as
`pools.nice.bind_with_workers` leaves them) or `free` (on every core, as vLLM leaves them).
Beside each stream a heartbeat process in a session of its own sleeps 20 ms at a time and
records how late it woke: what any other process on the host gets. Each round's arrival time of
every stream line and every heartbeat lateness go to bench/results/raw/<run>-engine-binding/;
`--summarize DIR` prints, per arm, the streams' durations, longest gaps and gaps above 0.3 s,
the heartbeat's worst lateness and the offline tok/s, and free over bound with 95% bootstrap
intervals (over rounds, and for gaps and lateness over the lines and wake-ups inside them too).
Then as many rounds of each arm, shuffled the same way, of the offline pool's throughput: 128
whole completions (a 150-word prompt, 128 tokens each) kept 32 at a time by one asyncio client,
each request's time and tokens saved.

The diagnostic behind the binding (bench/notes.md), not a target of any issue.

    python -m bench.engine_binding [--rounds 4] [--seed 0] | --summarize DIR
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench import intervals, procs
from bench.common import KEYS, REPO, RESULTS
from bench.setups import engine_processes, place

CONFIG = REPO / "deployments" / "configs" / "local.yaml"
BASE = "http://127.0.0.1:8000"
TOKENS = 1500
POOLS = ("online-chat", "offline-batch")
HEARTBEAT = ("import sys, time\nout, end = open(sys.argv[1], 'w', buffering=1), time.monotonic() + float(sys.argv[2])\n"
             "prev = time.monotonic()\nwhile prev < end:\n    time.sleep(0.02)\n    now = time.monotonic()\n"
             "    out.write(f'{now - prev - 0.02:.4f}\\n')\n    prev = now\n")


def serve(log: Path) -> subprocess.Popen:
    """`poolserve serve` of `CONFIG` in a session of its own, once it answers."""
    with open(log, "w") as out:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "poolserve"), "serve", str(CONFIG)],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 1200
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"{BASE}/online/healthz", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(2)
    stop(proc)
    raise SystemExit(f"poolserve serve did not answer (see {log})")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def engines() -> dict[str, list[int]]:
    """Each pool's engine processes (engine core, workers, and what runs under them)."""
    roles = procs.snapshot().roles
    out = {}
    for pool in POOLS:
        (replica,) = [pid for pid, role in roles.items() if role == f"replica poolserve-{pool}:pool-{pool}"]
        out[pool] = engine_processes(replica)
    return out


def set_arm(arm: str, pools: dict[str, list[int]]) -> list[tuple[int, ...] | None]:
    """Each pool's engine core bound beside its workers, or freed to every core; the cores
    each engine process then has."""
    return [cores for pids in pools.values() for cores in place(pids, arm)]


def stream_round(raw: Path) -> dict:
    """One stream, a heartbeat beside it; the lines' arrival times (s from the request) and
    the heartbeat's lateness (s) are saved in `raw`."""
    beats = raw.with_suffix(".heartbeat")
    heart = subprocess.Popen([sys.executable, "-c", HEARTBEAT, str(beats), "600"], start_new_session=True)
    body = {"model": "tiny-llama", "prompt": "hold", "max_tokens": TOKENS, "ignore_eos": True, "stream": True}
    lines, sent = [], time.monotonic()
    try:
        with httpx.stream("POST", f"{BASE}/online/v1/completions", json=body, timeout=300,
                          headers={"Authorization": f"Bearer {KEYS['chat']}"}) as r:
            r.raise_for_status()
            lines = [time.monotonic() - sent for line in r.iter_lines() if line.startswith("data:")]
    finally:
        heart.kill()
        heart.wait()
    late = [float(x) for x in beats.read_text().split()]
    beats.unlink()
    raw.write_text(json.dumps({"lines_s": lines, "heartbeat_late_s": late}))
    return summary(lines, late)


def throughput_round(raw: Path, seed: int, requests: int = 128, concurrency: int = 32) -> dict:
    """The offline pool's output tokens a second over `requests` whole completions kept
    `concurrency` at a time; each request's start, end and tokens saved in `raw`."""
    import asyncio

    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(150)) for _ in range(requests)]

    async def go() -> list[dict]:
        gate, done, t0 = asyncio.Semaphore(concurrency), [], time.monotonic()
        async with httpx.AsyncClient(timeout=300, headers={"Authorization": f"Bearer {KEYS['batch']}"}) as c:
            async def one(prompt: str) -> None:
                async with gate:
                    start = time.monotonic() - t0
                    r = await c.post(f"{BASE}/offline/v1/completions", json={
                        "model": "tiny-llama", "prompt": prompt, "max_tokens": 128, "ignore_eos": True})
                    r.raise_for_status()
                    done.append({"start_s": start, "end_s": time.monotonic() - t0,
                                 "tokens": r.json()["usage"]["completion_tokens"]})
            await asyncio.gather(*(one(p) for p in prompts))
        return done

    done = asyncio.run(go())
    raw.write_text(json.dumps(done))
    return {"requests": len(done), "output_tok_s": sum(d["tokens"] for d in done) / max(d["end_s"] for d in done)}


WORDS = ("alpha", "beta", "queue", "token", "batch", "core")


def summary(lines: list[float], late: list[float]) -> dict:
    gaps = [b - a for a, b in zip(lines, lines[1:])]
    return {"lines": len(lines), "duration_s": lines[-1], "longest_gap_s": max(gaps),
            "gaps_over_300ms": sum(g > 0.3 for g in gaps), "heartbeat_worst_late_s": max(late)}


def run(rounds: int, seed: int) -> Path:
    raw = RESULTS / "raw" / f"{time.strftime('%Y%m%d-%H%M%S')}-engine-binding"
    raw.mkdir(parents=True)
    started, results, throughput = time.monotonic(), [], []
    order = [arm for _ in range(rounds) for arm in ("bound", "free")]
    random.Random(seed).shuffle(order)

    def step(what: str) -> None:
        print(f"[{time.monotonic() - started:5.0f}s] {what}", flush=True)

    step("poolserve serve")
    proc = serve(raw / "serve.log")
    try:
        pools = engines()
        warm = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 16}
        httpx.post(f"{BASE}/online/v1/completions", json=warm, timeout=120,
                   headers={"Authorization": f"Bearer {KEYS['chat']}"}).raise_for_status()
        quiet = procs.idle_level()[0] + 0.3
        step(f"engines {pools}, order {order}")
        for i, arm in enumerate(order):
            cores = set_arm(arm, pools)
            procs.wait_quiet(quiet)
            r = stream_round(raw / f"{i:02d}-{arm}.json")
            results.append({"round": i, "arm": arm, "engine_cores": cores, **r})
            (raw / "results.json").write_text(json.dumps({"seed": seed, "rounds": results}, indent=1))
            step(f"round {i}: {arm}: {r['duration_s']:.1f} s, longest gap {r['longest_gap_s']:.2f} s, "
                 f"heartbeat worst {r['heartbeat_worst_late_s']:.2f} s")
        for i, arm in enumerate(order):
            cores = set_arm(arm, pools)
            procs.wait_quiet(quiet)
            r = throughput_round(raw / f"tput-{i:02d}-{arm}.json", seed + i)
            throughput.append({"round": i, "arm": arm, "engine_cores": cores, **r})
            (raw / "results.json").write_text(json.dumps({"seed": seed, "rounds": results, "throughput": throughput},
                                                         indent=1))
            step(f"throughput round {i}: {arm}: {r['output_tok_s']:.0f} output tok/s")
    finally:
        stop(proc)
    return raw


def summarize(raw: Path) -> dict:
    saved = json.loads((raw / "results.json").read_text())
    rounds = saved["rounds"]
    data = {arm: [json.loads((raw / f"{r['round']:02d}-{arm}.json").read_text()) for r in rounds if r["arm"] == arm]
            for arm in ("bound", "free")}
    per_arm = {arm: {key: [round(r[key], 2) for r in rounds if r["arm"] == arm]
                     for key in ("duration_s", "longest_gap_s", "gaps_over_300ms", "heartbeat_worst_late_s")}
               for arm in data}
    gaps = {arm: [[b - a for a, b in zip(d["lines_s"], d["lines_s"][1:])] for d in ds] for arm, ds in data.items()}
    late = {arm: [d["heartbeat_late_s"] for d in ds] for arm, ds in data.items()}
    ratios = {"stream duration": intervals.ratio([[x] for x in per_arm["free"]["duration_s"]],
                                                 [[x] for x in per_arm["bound"]["duration_s"]], intervals.mean),
              "longest gap between lines": intervals.ratio(gaps["free"], gaps["bound"], max),
              "heartbeat's worst lateness": intervals.ratio(late["free"], late["bound"], max)}
    tput = {arm: [[r["output_tok_s"]] for r in saved.get("throughput", []) if r["arm"] == arm] for arm in data}
    if all(tput.values()):
        ratios["offline output tok/s"] = intervals.ratio(tput["free"], tput["bound"], intervals.mean)
        for arm in data:
            per_arm[arm]["offline_output_tok_s"] = [round(x) for [x] in tput[arm]]
    return {"per_arm": per_arm, "free_over_bound": {k: str(v) for k, v in ratios.items()}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.engine_binding")
    p.add_argument("--rounds", type=int, default=4, help="streams per arm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--summarize", type=Path, help="a run's raw directory: print its summary, run nothing")
    a = p.parse_args(argv)
    print(json.dumps(summarize(a.summarize if a.summarize else run(a.rounds, a.seed)), indent=1))


if __name__ == "__main__":
    main()
