"""Autoscaler benchmark: one load step (low, high, low) on the online pool, run three ways
in one go: autoscaled, static at the safe range's low end, static at its high end.

Online chat arrives as Poisson streams with the trace's lengths, from its own process, one
process per phase. Per phase and way: goodput under
the pool's SLO and P99 TTFT, plus the limits the pool ran at. The autoscaler runs with the
embedded default's cadence (2 s ticks, 10 s cooldown).

    python -m bench.autoscale       # about 5 minutes; writes bench/results/autoscale.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

from bench.common import KEYS, REPO, deploy, local_config, ray_cluster, write_result

POOL = "online-chat"
PHASES = (("low", 1.0, 6), ("high", 5.0, 20), ("low-again", 1.0, 6))  # (name, req/s, seconds)
TIMEOUT_S = 20  # a request with no answer by then counts as a timeout (the backlog of a limit too low)
DRAIN_S = 8  # what still runs this long after its phase is cut off (counted at its wait so far)


def _phase(rate: float, seconds: float, slo, seed: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "infra.loadgen", "--url", "http://127.0.0.1:8000/online/v1", "--key", KEYS["chat"],
         "--chat", "--rate", str(rate), "--trace", "--warmup", "0", "--duration", str(seconds), "--seed", str(seed),
         "--ttft-slo-ms", str(slo.ttft_p99_ms), "--tpot-slo-ms", str(slo.tpot_p99_ms), "--timeout", str(TIMEOUT_S),
         "--drain", str(DRAIN_S)],
        cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _limits_while(stack, stop: threading.Event, trace: list) -> None:
    while not stop.is_set():
        try:
            trace.append(stack.admin.pool(POOL).replicas[0].limits.max_active_seqs)
        except Exception:  # a missed sample is not a result
            pass
        stop.wait(1.0)


def _way(stack, name: str, seqs: int | None, start: int, slo) -> dict:
    stack.wait(lambda: stack.idle(POOL), 300)  # nothing left over from the way before
    # static ways stay pinned; the autoscaled way starts at the pool's configured start
    stack.admin.pin(POOL, seqs if seqs is not None else start)
    if seqs is None:
        stack.admin.unpin(POOL)
    phases = {}
    for i, (phase, rate, seconds) in enumerate(PHASES):
        stop, trace = threading.Event(), []
        sampler = threading.Thread(target=_limits_while, args=(stack, stop, trace))
        sampler.start()
        r = _phase(rate, seconds, slo, seed=i)
        stop.set()
        sampler.join()
        phases[phase] = {"rate_req_s": rate, "seconds": seconds, "goodput_req_s": r["goodput_req_per_s"],
                         "ttft_p99_ms": r["ttft_ms_with_timeouts"]["p99"],
                         "ttft_p50_ms": r["ttft_ms_with_timeouts"]["p50"], "timeouts": r["timeouts"],
                         "tpot_p99_ms": r["tpot_ms"]["p99"], "completed": r["completed"], "requests": r["requests"],
                         "limit_min": min(trace, default=None), "limit_max": max(trace, default=None)}
        print(f"{name:12} {phase:10} goodput {r['goodput_req_per_s']:.2f} req/s, P99 TTFT "
              f"{phases[phase]['ttft_p99_ms']:.0f} ms, limit {phases[phase]['limit_min']}..{phases[phase]['limit_max']}",
              flush=True)
    stack.admin.unpin(POOL)
    return phases


def run(stack) -> dict:
    rp = stack.resolved.pools[POOL]
    low, high, slo = rp.safe_range.low, rp.safe_range.high, rp.config.slo
    ways = {f"autoscaled-from-{rp.start_seqs}": _way(stack, "autoscaled", None, rp.start_seqs, slo),
            f"static-low-{low}": _way(stack, "static-low", low, low, slo),
            f"static-high-{high}": _way(stack, "static-high", high, low, slo)}
    decisions = [d.model_dump() for d in stack.admin.decisions(500) if d.pool == POOL and d.old != d.new]
    a = stack.resolved.config.autoscale
    return {
        "setup": {"pool": POOL, "safe_range": [low, high], "phases": [list(p) for p in PHASES],
                  "timeout_s": TIMEOUT_S, "drain_s": DRAIN_S,
                  "slo": slo.model_dump(), "lengths": "azure 2023 trace, scaled",
                  "autoscale": {"interval_s": a.interval_s, "cooldown_s": a.cooldown_s,
                                "reversal_cooldown_s": a.reversal_cooldown_s}},
        "ways": ways,
        "autoscaler_moves": [{k: d[k] for k in ("old", "new", "action", "code", "reason")} for d in decisions],
    }


def main() -> None:
    with ray_cluster():
        result = run(deploy(local_config()))
    write_result("autoscale", result)
