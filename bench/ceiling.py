"""Where the time and the CPU go: poolserve against the strongest stock set-up at parity under
a batch flood, and every serving path against the bare engine at the ceiling. One run, one Ray.

The parity flood, the same for both set-ups:
  * online: Poisson ONLINE_RATE req/s, streamed completions of ONLINE_LENGTHS tokens, for
    FLOOD_S, from its own process;
  * offline: OFFLINE_OUTSTANDING whole requests of OFFLINE_LENGTHS tokens kept outstanding,
    from its own process, starting RAMP_S before the online load;
  * the online engine on core 0 with ONLINE_SEQS sequences, the offline engine on core 1 held
    at OFFLINE_SEQS sequences with its engine processes at nice OFFLINE_NICE, Ray's workers
    (proxy, replicas) at the embedded default's `ray.worker_niceness`; poolserve's offline
    replica at OFFLINE_NICE too, as it ships (the stock one at that nice lost offline throughput
    in the one round measured, bench/notes.md: the baseline keeps it at the workers').
  poolserve: the embedded default with both pools pinned at those limits (no calibration
  sweeps). stock-two-pools: two LLMConfigs behind one ray.serve.llm OpenAiIngress with those
  engine ceilings, cores, stream batching and nice, and ray.serve.llm's default
  `max_ongoing_requests`, as a user deploys it, its engine cores free or bound (two arms, see
  bench/setups.py). Both stay deployed for the flood rounds and take turns in a shuffled order
  (the seed is recorded); before each round the machine is quiet, and the idle set-up's CPU
  use is measured with the rest.

The ceiling: `vllm bench serve`, random CEILING_LENGTHS tokens, CEILING_PROMPTS prompts at
concurrency CEILING_CONCURRENCY, against one engine on core 1 with 64 sequences, 4,096 batched
tokens and 1 GiB of KV cache: vLLM's offline `LLM.generate` (the raw engine), vLLM's own
OpenAI server, poolserve's offline pool pinned at 64, and stock ray.serve.llm with one
LLMConfig; a batch job (`deployments.batch_job`) through poolserve's offline pool; and TTFT
at concurrency 1 against poolserve's online pool and the bare server; every baseline in both
arms. Every set-up runs on the same Ray, with Serve's HTTP entry as the embedded default sets
it (`ray.haproxy`).

Raw data of every round goes to bench/results/raw/<run>/: each request's timings (the load
generator's JSON lines, `vllm bench serve --save-detailed`), the CPU seconds of every process by
role (from /proc), and for poolserve its pools' reports sampled every half second.

    python -m bench.ceiling [--rounds 3] [--ceiling-rounds 3] [--seed 0] [--only flood|ceiling|c1 ...]

A run of some parts only (`--only`, for development) keeps its result and raw data in
bench/results/quick/, out of the doc.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from bench import procs, verdicts
from bench.common import KEYS, REPO, RESULTS, compress, ray_cluster, write_result
from bench.setups import (
    BOUND,
    CEILING_SEQS,
    OFFLINE_SEQS,
    ONLINE_SEQS,
    VLLM_PORT,
    Target,
    engine_env,
    model,
    pin,
    place_baseline,
    poolserve,
    stock_one_pool,
    stock_two_pools,
    vllm_server,
)
from infra.loadgen import read_raw

ONLINE_RATE = 4.0
ONLINE_LENGTHS = (40, 32)  # prompt, output tokens
OFFLINE_OUTSTANDING = 640
OFFLINE_LENGTHS = (200, 128)
RAMP_S, FLOOD_S, DRAIN_S = 8, 80, 15
ONLINE_SEED = 0  # the same arrivals every round: 305 online requests in FLOOD_S
ONLINE_TIMEOUT_S = 120

CEILING_LENGTHS = (200, 100)
CEILING_PROMPTS, CEILING_CONCURRENCY = 640, 64
C1_PROMPTS = 60  # TTFT at concurrency 1
BUSY_AT_REST = 0.75  # cores
PARTS = ("flood", "ceiling", "c1")


# -- measuring ----------------------------------------------------------------------------------

class PoolSampler:
    """poolserve's pools as their replicas report them, every half second, while open."""

    def __init__(self, stack) -> None:
        self._stack, self.samples, self._stop = stack, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "PoolSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                pools = self._stack.admin.pools()
            except Exception:  # a missed sample
                continue
            self.samples.append({"t": time.monotonic(), **{
                name: [{"active": r.active, "queued": r.queued, "running": r.engine.running,
                        "waiting": r.engine.waiting, "limit": r.limits.max_active_seqs,
                        "generated": r.engine.generated_tokens} for r in p.replicas]
                for name, p in pools.items()}})


def _loadgen(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "infra.loadgen", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _done(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{proc.args[:4]} failed: {err[-2000:]}")
    return json.loads(out)


def flood_round(t: Target, raw: Path, stack=None) -> dict:
    """One parity flood against `t`; raw data under the path prefix `raw`."""
    # the flood outlasts the online load's drain, so that its end (640 requests abandoned at
    # once) is not in any online request's way; its throughput counts over the online window
    offline = _loadgen(["--url", t.offline_url, "--key", t.offline_key, "--model", t.offline_model, "--no-stream",
                        "--concurrency", str(OFFLINE_OUTSTANDING), "--prompt", str(OFFLINE_LENGTHS[0]),
                        "--output", str(OFFLINE_LENGTHS[1]), "--warmup", str(RAMP_S),
                        "--duration", str(FLOOD_S + DRAIN_S + 2), "--split", f"{FLOOD_S},{DRAIN_S + 2}",
                        "--abandon", "--raw", f"{raw}-offline.jsonl.gz"])
    time.sleep(RAMP_S)
    online = _loadgen(["--url", t.online_url, "--key", t.online_key, "--model", t.online_model,
                       "--rate", str(ONLINE_RATE), "--seed", str(ONLINE_SEED), "--prompt", str(ONLINE_LENGTHS[0]),
                       "--output", str(ONLINE_LENGTHS[1]), "--warmup", "0", "--duration", str(FLOOD_S),
                       "--drain", str(DRAIN_S), "--timeout", str(ONLINE_TIMEOUT_S),
                       "--raw", f"{raw}-online.jsonl.gz"])
    named = {online.pid: "online load generator", offline.pid: "offline load generator"}
    sampler = PoolSampler(stack) if stack else None
    before, t0 = procs.snapshot(named), time.monotonic()
    if sampler:
        sampler.__enter__()
    time.sleep(FLOOD_S)
    after, t1 = procs.snapshot(named), time.monotonic()
    if sampler:
        sampler.__exit__()
    on, off = _done(online), _done(offline)
    sent = read_raw(f"{raw}-online.jsonl.gz")
    late = sorted(r.start - r.scheduled for r in sent)
    cpu = procs.cpu_by_role(before, after)
    extra = {"cpu_s": cpu, "window_s": t1 - t0}
    if sampler:
        extra["busy"] = {p: verdicts.busy(sampler.samples, p) for p in ("online-chat", "offline-batch")}
        Path(f"{raw}-pools.json").write_text(json.dumps(sampler.samples))
    Path(f"{raw}-cpu.json").write_text(json.dumps(extra, indent=1))
    return {
        "online_scheduled": len(sent), "online_sent_in_window": on["requests"],
        "online_sent_late_s": {"p50": late[len(late) // 2], "max": late[-1]} if late else {},
        "online_ttft_ms": on["ttft_ms_with_timeouts"], "online_tpot_ms": on["tpot_ms"],
        "online_errors": on["error_rate"], "online_server_timing_ms": on.get("server_timing_ms"),
        "offline_tok_s": off["windows"][0]["output_tok_per_s"],
        "loop_lag_ms": {"online": on.get("loop_lag_ms"), "offline": off.get("loop_lag_ms")},
        **extra,
    }


def _vllm_bench(url: str, endpoint: str, key: str, lengths: tuple[int, int], prompts: int, concurrency: int,
                raw: Path, seed: int) -> dict:
    env = {**os.environ, "OPENAI_API_KEY": key}
    cmd = [sys.executable, "-m", "bench.vllm_bench", "--base-url", url, "--endpoint", endpoint,
           "--model", "tiny-llama", "--tokenizer", model(), "--dataset-name", "random",
           "--random-input-len", str(lengths[0]), "--random-output-len", str(lengths[1]), "--ignore-eos",
           "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--seed", str(seed),
           "--save-result", "--save-detailed", "--result-dir", str(raw.parent), "--result-filename", raw.name,
           "--disable-tqdm"]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed: {run.stderr[-2000:]}")
    out = json.loads(raw.read_text())
    if out.get("failed"):
        raise RuntimeError(f"vllm bench serve: {out['failed']} of {prompts} requests failed against {url}{endpoint}")
    return out


def round_seeds(order: list[str]) -> list[int]:
    """The prompts' seed of each round in `order`: the k-th round on every engine (a baseline's
    two arms are one) sends the same prompts, and no engine is sent a round's prompts twice. With
    one seed for all, an engine that stays up between rounds found the prompts of its earlier
    rounds in its prefix cache and skipped their prefill, and the fresh raw engine never did (run
    20261203-134502: vLLM's server and stock one pool 7% and 11% above their first round)."""
    seeds, sent = [], collections.Counter()
    for path in (name.removesuffix(BOUND) for name in order):
        seeds.append(sent[path])
        sent[path] += 1
    return seeds


def ceiling_round(name: str, raw: Path, seed: int, server: int | None = None) -> dict:
    """One ceiling measurement of the path `name` on the prompts of `seed`, with the CPU each
    process used; `server` is vLLM's server's pid, placed as the arm says before its rounds."""
    prompts, conc = CEILING_PROMPTS, CEILING_CONCURRENCY
    path, placement, cores = place_baseline(name, server)
    before, t0 = procs.snapshot(), time.monotonic()
    if path == "raw-engine":
        run = subprocess.run([sys.executable, "-m", "bench.raw_engine", "--model", model(),
                              "--prompts", str(prompts), "--input", str(CEILING_LENGTHS[0]),
                              "--output", str(CEILING_LENGTHS[1]), "--seqs", str(CEILING_SEQS),
                              "--seed", str(seed), "--placement", placement, "--out", str(raw.with_suffix(".json"))],
                             cwd=REPO, env=engine_env("1"), capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"raw engine failed: {run.stderr[-2000:]}")
        out = json.loads(raw.with_suffix(".json").read_text())
        return {k: out[k] for k in ("output_tok_s", "output_tokens", "engine_cores")}
    if name == "batch-job":
        return _batch_job(raw, seed)
    url, endpoint, key = {
        "vllm-server": (f"http://127.0.0.1:{VLLM_PORT}", "/v1/completions", "none"),
        "poolserve": ("http://127.0.0.1:8000", "/offline/v1/completions", KEYS["batch"]),
        "stock-one-pool": ("http://127.0.0.1:8000", "/stock-one/v1/completions", "none"),
    }[path]
    out = _vllm_bench(url, endpoint, key, CEILING_LENGTHS, prompts, conc, raw.with_suffix(".json"), seed)
    cpu = procs.cpu_by_role(before, procs.snapshot())
    seconds = time.monotonic() - t0
    return {"output_tok_s": out["output_throughput"], "output_tokens": out["total_output_tokens"],
            "cpu_s_per_1k_tokens": {k: 1000 * v / out["total_output_tokens"] for k, v in cpu.items()},
            "wall_s": seconds, "engine_cores": cores}


def _batch_job(raw: Path, seed: int) -> dict:
    """The same prompts as a batch job sends them: whole, through the router, at the ceiling's
    concurrency; output tok/s from the job's start to its last answer."""
    from infra.traffic import make_prompt

    rng = random.Random(seed)
    inp, out = raw.with_suffix(".in.jsonl"), raw.with_suffix(".out.jsonl")
    inp.write_text("".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {
        "model": "tiny-llama", "prompt": make_prompt(CEILING_LENGTHS[0], rng), "max_tokens": CEILING_LENGTHS[1],
        "ignore_eos": True}}) + "\n" for i in range(CEILING_PROMPTS)))
    out.unlink(missing_ok=True)
    before, t0 = procs.snapshot(), time.monotonic()
    run = subprocess.run([sys.executable, "-m", "deployments.batch_job", "--input", str(inp), "--output", str(out),
                          "--url", "http://127.0.0.1:8000", "--pool", "offline", "--concurrency",
                          str(CEILING_CONCURRENCY)], cwd=REPO, env={**os.environ, "POOLSERVE_KEY": KEYS["batch"]},
                         capture_output=True, text=True)
    seconds = time.monotonic() - t0
    if run.returncode != 0:
        raise RuntimeError(f"batch job failed: {run.stderr[-2000:]}")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    tokens = sum(r["response"]["body"]["usage"]["completion_tokens"] for r in rows if r["response"])
    cpu = procs.cpu_by_role(before, procs.snapshot())
    return {"output_tok_s": tokens / seconds, "output_tokens": tokens, "answered": len(rows),
            "cpu_s_per_1k_tokens": {k: 1000 * v / tokens for k, v in cpu.items()}, "wall_s": seconds}


def c1_round(name: str, raw: Path, seed: int, server: int | None = None) -> dict:
    path, _, cores = place_baseline(name, server)
    url, endpoint, key = {"vllm-server": (f"http://127.0.0.1:{VLLM_PORT}", "/v1/completions", "none"),
                          "poolserve": ("http://127.0.0.1:8000", "/online/v1/completions", KEYS["chat"])}[path]
    out = _vllm_bench(url, endpoint, key, ONLINE_LENGTHS, C1_PROMPTS, 1, raw.with_suffix(".json"), seed)
    return {"ttft_p50_ms": out["median_ttft_ms"], "ttft_p99_ms": out["p99_ttft_ms"],
            "tpot_p50_ms": out["median_tpot_ms"], "engine_cores": cores}


# -- the run ------------------------------------------------------------------------------------

def _keep(out: dict, raw: Path) -> None:
    """The run so far, beside its raw data: a run that fails later loses no round."""
    (raw / "partial.json").write_text(json.dumps(out, indent=1))


def at_rest(step) -> float:
    """The CPU level below which the machine counts as quiet between rounds."""
    level, by_role = procs.idle_level()
    top = ", ".join(f"{k} {v / 2:.2f}" for k, v in list(by_role.items())[:4])
    step(f"at rest the machine uses {level:.2f} cores ({top})")
    if level > BUSY_AT_REST:  # another workload would share the cores with every round
        raise SystemExit(f"the machine is not at rest ({level:.2f} cores: {top}); stop the other work first")
    return level + 0.25


def run(rounds: int, ceiling_rounds: int, seed: int, parts: tuple[str, ...] = PARTS,
        results: Path = RESULTS) -> dict:
    run_id = time.strftime("%Y%m%d-%H%M%S")
    raw = results / "raw" / run_id
    raw.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    out: dict = {"run": run_id, "seed": seed, "online_timeout_s": ONLINE_TIMEOUT_S, "parts": list(parts),
                 "flood": [], "ceiling": [], "c1": []}
    started = time.monotonic()

    def step(what: str) -> None:
        print(f"[{time.monotonic() - started:5.0f}s] {what}", flush=True)

    with ray_cluster():
        step("deploy poolserve")
        ps, stack = poolserve()
        targets = {"poolserve": ps}
        if "flood" in parts:
            step("deploy the stock two pools")
            targets["stock-two-pools"] = stock_two_pools()
            targets["stock-two-pools" + BOUND] = targets["stock-two-pools"]
            order = [s for _ in range(rounds) for s in targets]
            rng.shuffle(order)
            out["flood_order"] = order
            pin(stack, ONLINE_SEQS, OFFLINE_SEQS)
            quiet = at_rest(step)
            for i, name in enumerate(order):
                procs.wait_quiet(quiet)
                step(f"flood round {i}: {name}")
                cores = place_baseline(name)[2]
                r = flood_round(targets[name], raw / f"flood-{i:02d}-{name}", stack if name == "poolserve" else None)
                out["flood"].append({"round": i, "setup": name, "engine_cores": cores, **r})
                _keep(out, raw)
                step(f"  online TTFT P99 {r['online_ttft_ms']['p99']:.0f} ms, TPOT P99 "
                     f"{r['online_tpot_ms']['p99']:.1f} ms, offline {r['offline_tok_s']:.0f} tok/s")
            from ray import serve

            serve.delete("stock")
        step("deploy stock one pool and start vLLM's server")
        stock_one_pool()
        server = vllm_server(raw / "vllm-server.log")
        quiet = at_rest(step)
        try:
            pin(stack, ONLINE_SEQS, CEILING_SEQS)
            if "ceiling" in parts:
                _ceiling_rounds(out, ceiling_rounds, rng, raw, quiet, step, server.pid)
            c1 = ["vllm-server", "vllm-server" + BOUND, "poolserve"] * ceiling_rounds if "c1" in parts else []
            for i, (name, prompts) in enumerate(zip(c1, round_seeds(c1))):
                procs.wait_quiet(quiet)
                r = c1_round(name, raw / f"c1-{i:02d}-{name}", prompts, server.pid)
                out["c1"].append({"round": i, "path": name, "prompt_seed": prompts, **r})
                _keep(out, raw)
                step(f"concurrency 1, {name}: TTFT P50 {r['ttft_p50_ms']:.1f} ms")
            if "ceiling" in parts:
                _profile_at_ceiling(out, ceiling_rounds, raw, quiet, step)
        finally:
            server.terminate()
            server.wait(60)
    out["wall_s"] = time.monotonic() - started
    out["targets"] = {k: asdict(v) for k, v in targets.items()}
    renamed = compress(raw)
    if "profiles" in out:  # a profile large enough to be compressed is recorded under its new name
        out["profiles"] = {k: renamed.get(v, v) for k, v in out["profiles"].items()}
    return out


def _ceiling_rounds(out: dict, rounds: int, rng: random.Random, raw: Path, quiet: float, step, server: int) -> None:
    baselines = ["raw-engine", "vllm-server", "stock-one-pool"]
    paths = [*baselines, *(b + BOUND for b in baselines), "poolserve", "batch-job"]
    order = [p for _ in range(rounds) for p in paths]
    rng.shuffle(order)
    out["ceiling_order"] = order
    for i, (name, prompts) in enumerate(zip(order, round_seeds(order))):
        procs.wait_quiet(quiet)
        step(f"ceiling round {i}: {name}")
        r = ceiling_round(name, raw / f"ceiling-{i:02d}-{name}", prompts, server)
        out["ceiling"].append({"round": i, "path": name, "prompt_seed": prompts, **r})
        _keep(out, raw)
        step(f"  {r['output_tok_s']:.0f} output tok/s")


def _profile_at_ceiling(out: dict, rounds: int, raw: Path, quiet: float, step) -> None:
    """Where poolserve's serving processes spend their CPU at the ceiling: an extra, unmeasured
    round (the profiler's own sampling costs CPU)."""
    procs.wait_quiet(quiet)
    roles = procs.snapshot().roles
    pids = {role.split(":")[-1]: pid for pid, role in roles.items()
            if role in ("replica poolserve-offline-batch:pool-offline-batch", "HTTP proxy")}
    step(f"profiling {sorted(pids)}")
    with procs.profiling(pids, raw / "profile") as files:
        ceiling_round("poolserve", raw / "profile-run", rounds)  # prompts no round sent
    out["profiles"] = {k: str(v.relative_to(REPO)) for k, v in files.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.ceiling")
    p.add_argument("--rounds", type=int, default=3, help="flood rounds per set-up")
    p.add_argument("--ceiling-rounds", type=int, default=3, help="ceiling rounds per path")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=PARTS, action="append",
                   help="run only this part (repeatable); the result goes to bench/results/quick/, not the doc")
    a = p.parse_args(argv)
    parts = tuple(part for part in PARTS if part in (a.only or PARTS))
    results = RESULTS if parts == PARTS else RESULTS / "quick"
    write_result("ceiling", run(a.rounds, a.ceiling_rounds, a.seed, parts, results), results)


if __name__ == "__main__":
    main()
