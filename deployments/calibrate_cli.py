"""`poolserve calibrate`: sweep a running pool's limit up a ladder and write its profile.

The stack must be running (`make serve`). For each step the pool is pinned through the
admin API (calibration mode: any step up to the engine's max_num_seqs; the autoscaler and
borrowing leave a calibrating pool alone), a closed loop of exactly that many streams
runs with the pool's traffic shape (`calibration.lengths` and `.stream`: trace-shaped chat, or
batch work of fixed lengths sent whole) until output throughput is steady (or a time cap).
Throughput, KV usage and preemptions come from the engines' own counters in the replicas'
reports. Then the knee finder picks the safe range, and the profile YAML, a PNG and a
markdown table are written.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from pathlib import Path

from pydantic import ValidationError

from autoscale.calibrate import build_profile, markdown_table, plot, sweep
from autoscale.profile import (Fingerprint, KneeRule, LadderRow, Percentiles, SLOSpec, TrafficSpec, dump_profile,
                               load_profile, response_lengths)
from deployments.admin_client import AdminClient
from infra.loadgen import Target, closed_loop_until_steady
from infra.results import Result, Summary
from infra.stats import Cumulative, counter_rate
from infra.wire import http_url
from infra.traffic import synthetic_lengths, trace_lengths


class EngineSampler:
    """Samples the pool's replicas every `every_s`: their engines' generated tokens (so a step's
    throughput is the engines' own count, not lumps of completed responses), peak KV usage and
    preemptions. Each count is placed at the time its replica reported it, not when it was read
    (reports arrive every report interval and the admin API answers late under load); a count
    reaches this process at most `lag_s` after it was made. A failed sample is logged and
    skipped: the next one fills the gap."""

    def __init__(self, admin: AdminClient, pool: str, lag_s: float, every_s: float = 0.5) -> None:
        self._admin, self._pool, self.lag_s, self._every = admin, pool, lag_s, every_s
        self.kv_max, self._stop = 0.0, threading.Event()
        self.tokens: dict[str, list[tuple[float, int]]] = {}  # replica -> (time.monotonic(), generated tokens)
        self._preempted = Cumulative()
        self._preempted.read_all(self._preemptions())
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _replicas(self):
        return self._admin.pool(self._pool).replicas

    def _preemptions(self, replicas=None) -> dict[str, tuple[float, int]]:
        return {r.replica: (r.reported_at, r.engine.preemptions) for r in replicas or self._replicas()}

    def _sample(self) -> None:
        replicas = self._replicas()
        monotonic_minus_wall = time.monotonic() - time.time()
        for r in replicas:
            series = self.tokens.setdefault(r.replica, [])
            at = r.reported_at + monotonic_minus_wall
            if not series or at > series[-1][0]:
                series.append((at, r.engine.generated_tokens))
        self.kv_max = max([self.kv_max] + [r.engine.kv_usage for r in replicas])
        self._preempted.read_all(self._preemptions(replicas))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._sample()
            except Exception as e:  # noqa: BLE001 - the admin API is briefly unreachable, say
                print(f"  (a sample of the pool's reports failed: {type(e).__name__}: {e})", file=sys.stderr)
            self._stop.wait(self._every)

    def rate(self, a: float, b: float) -> float | None:
        """The engines' output tokens per second over [a, b], summed over the replicas whose
        reports cover it; None while a live replica's reports have not reached `b` yet. A
        replica silent for longer than the lag (gone, or replaced) no longer counts."""
        now, total, covered = time.monotonic(), 0.0, False
        for series in list(self.tokens.values()):
            points = list(series)
            if (r := counter_rate(points, a, b)) is not None:
                total, covered = total + r, True
            elif points and points[-1][0] < b and now - points[-1][0] <= 2 * self.lag_s:
                return None  # its next report will cover the window
        return total if covered else None

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.wait(self._every * 2)  # a last sample or two past the window's end
        self._stop.set()
        self._thread.join()
        try:
            self._preempted.read_all(self._preemptions())
            self.preemptions = self._preempted.total
        except Exception as e:  # noqa: BLE001 - the step's figures stand without it
            print(f"  (preemptions unknown: {type(e).__name__}: {e})", file=sys.stderr)
            self.preemptions = 0


def _pct(d: dict) -> Percentiles:
    return Percentiles(p50=d["p50"] or 0.0, p95=d["p95"] or 0.0, p99=d["p99"] or 0.0)


def measure_step(args, admin: AdminClient, target: Target, lengths, slo: SLOSpec, seqs: int,
                 report_interval_s: float) -> LadderRow:
    lag_s = 2 * report_interval_s + 2.0  # a report's interval, the admin call under load, a sample's
    with EngineSampler(admin, args.pool, lag_s) as sampler:
        run = asyncio.run(closed_loop_until_steady(target, seqs, lengths, args.warmup, args.check, args.min_measure,
                                                   args.cap, seed=args.seed, output_rate=sampler.rate,
                                                   rate_lag_s=lag_s))
    s = run.summary(slo.ttft_p99_ms / 1e3, slo.tpot_p99_ms / 1e3)
    engine_rate = sampler.rate(run.measure_from, run.measure_from + run.measure_s)
    if engine_rate is None:
        print(f"  (no engine token count covers the step at {seqs}: its throughput is counted from completed "
              "responses)", file=sys.stderr)
    return step_row(seqs, s, run.steady, run.completed_in_window(), engine_rate, sampler.kv_max, sampler.preemptions)


def step_row(seqs: int, s: Summary, steady: bool, done: list[Result], engine_rate: float | None, kv_max: float,
             preemptions: int) -> LadderRow:
    """A step's row. `requests` counts the answered ones, as the background sweep's rows do: the
    knee rule's error rate is errors over answered plus errors, and a step where every request
    failed must show no TTFT rather than switch the whole ladder to end-to-end latency."""
    return LadderRow(
        max_active_seqs=seqs, requests=s.completed, duration_s=round(s.duration_s, 2), steady=steady,
        req_per_s=s.req_per_s, input_tok_per_s=s.input_tok_per_s,
        output_tok_per_s=s.output_tok_per_s if engine_rate is None else engine_rate,
        goodput_req_per_s=s.goodput_req_per_s or 0.0, ttft_ms=_pct(s.ttft_ms), tpot_ms=_pct(s.tpot_ms),
        e2e_ms=_pct(s.e2e_ms), kv_usage_max=kv_max, preemptions=preemptions,
        errors=round(s.error_rate * s.requests), rejections=round(s.rejection_rate * s.requests),
        **response_lengths([(r.output_tokens, r.e2e) for r in done if r.e2e is not None]))


def _write(profile, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    dump_profile(profile, out / f"{profile.pool}.yaml")
    table = markdown_table(profile)
    (out / f"{profile.pool}.md").write_text(f"# Calibration of {profile.pool}\n\n![sweep]({profile.pool}.png)\n\n{table}")
    plot(profile, str(out / f"{profile.pool}.png"))
    print("\n" + table)
    print(f"wrote {out / (profile.pool + '.yaml')}, .md and .png; CUDA graphs: {profile.cudagraph.note}")


_RULE_FLAGS = {"min_gain_pct": "min_gain", "max_p99_growth_pct": "max_growth",
               "max_growth_per_gain": "max_growth_per_gain", "kv_watermark": "kv_watermark",
               "headroom_steps": "headroom_steps"}


def _rule(args) -> KneeRule:
    try:
        return KneeRule(**{field: getattr(args, flag) for field, flag in _RULE_FLAGS.items()})
    except ValidationError as e:
        bad = e.errors()[0]
        hint = " (a fraction: 0.9, not 90)" if bad["loc"][0] == "kv_watermark" else ""
        raise SystemExit(f"--{_RULE_FLAGS[bad['loc'][0]].replace('_', '-')} {bad['input']}: {bad['msg']}{hint}") from None


def _cmd_rerank(args) -> int:
    """Apply another knee rule to a profile's measured rows, without measuring again."""
    old = load_profile(args.from_rows)
    profile = build_profile(old.pool, old.rows, old.fingerprint, old.slo, old.traffic, _rule(args),
                            old.cudagraph.captured, old.created_at)
    _write(profile, Path(args.out))
    return 0


def _cmd_calibrate(args) -> int:
    from deployments.cli import load_or_report

    if args.from_rows:
        return _cmd_rerank(args)
    if not args.config or not args.pool:
        raise SystemExit("calibrate needs --config and --pool (or --from-rows PROFILE)")
    resolved = load_or_report(args.config)
    if resolved is None:
        return 1
    if args.pool not in resolved.pools:
        raise SystemExit(f"--pool {args.pool!r}: pools are {sorted(resolved.pools)}")
    rp = resolved.pools[args.pool]
    cfg = resolved.config
    url = args.url or http_url(cfg.router.host, cfg.router.port)
    admin = AdminClient(url, args.admin_key or os.environ.get("POOLSERVE_ADMIN_KEY", ""))
    key = args.key or os.environ.get("POOLSERVE_KEY", "")
    ladder = [int(x) for x in args.ladder.split(",")]
    if ladder != sorted(set(ladder)) or ladder[-1] > rp.config.engine.max_num_seqs:
        raise SystemExit(f"--ladder {args.ladder}: ascending steps up to max_num_seqs "
                         f"{rp.config.engine.max_num_seqs}")
    shape = args.lengths or rp.config.calibration.lengths  # the pool's own traffic shape unless told
    stream = rp.config.calibration.stream if args.stream is None else args.stream
    if shape == "trace":
        lengths = trace_lengths(cfg.model.max_model_len)
    else:
        p, o = (int(x) for x in shape.split("/"))
        lengths = synthetic_lengths(p, o)
    slo = SLOSpec(ttft_p99_ms=rp.config.slo.ttft_p99_ms, tpot_p99_ms=rp.config.slo.tpot_p99_ms)
    rule = _rule(args)
    described = admin.describe(args.pool)
    prefix = rp.config.route_prefix
    target = Target(f"{url}{prefix}/v1", key, model=cfg.model.id, stream=stream)
    print(f"calibrating pool {args.pool} at {url}{prefix} on {described.fingerprint['hardware']}, "
          f"ladder {ladder}, lengths {lengths.source}", flush=True)
    try:
        rows = sweep(ladder, lambda seqs: admin.pin(args.pool, seqs, calibrating=True),
                     lambda seqs: measure_step(args, admin, target, lengths, slo, seqs,
                                               cfg.autoscale.report_interval_s),
                     lambda line: print(line, flush=True))
    finally:
        admin.unpin(args.pool)
    stats = lengths.stats()
    traffic = TrafficSpec(source=f"{lengths.source}, {'streamed' if stream else 'whole responses'}",
                          scale=lengths.scale, seed=args.seed, **stats)
    profile = build_profile(args.pool, rows, Fingerprint(**described.fingerprint), slo, traffic, rule,
                            described.cudagraph_capture_sizes, time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    _write(profile, Path(args.out))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="sweep a running pool's limit and write its safe-range profile")
    p.add_argument("--config")
    p.add_argument("--pool")
    p.add_argument("--ladder", default="1,2,4,8,16,32")
    p.add_argument("--url", help="the running router (default: the config's host and port)")
    p.add_argument("--key", help="a tenant key allowed on the pool (or POOLSERVE_KEY)")
    p.add_argument("--admin-key", help="the admin key (or POOLSERVE_ADMIN_KEY)")
    p.add_argument("--lengths", help="'trace' (Azure 2023, scaled) or PROMPT/OUTPUT tokens (default: the pool's "
                                     "calibration.lengths)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="streamed requests or whole responses (default: the pool's calibration.stream)")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of warm-up per step")
    p.add_argument("--check", type=float, default=5.0, help="seconds per steadiness check")
    p.add_argument("--min-measure", type=float, default=15.0, help="seconds measured at least")
    p.add_argument("--cap", type=float, default=45.0, help="seconds measured at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-gain", type=float, default=KneeRule().min_gain_pct)
    p.add_argument("--max-growth", type=float, default=KneeRule().max_p99_growth_pct)
    p.add_argument("--max-growth-per-gain", type=float, default=KneeRule().max_growth_per_gain)
    p.add_argument("--kv-watermark", type=float, default=KneeRule().kv_watermark)
    p.add_argument("--headroom-steps", type=int, default=0)
    p.add_argument("--out", default="deployments/configs/profiles")
    p.add_argument("--from-rows", metavar="PROFILE", help="re-pick the range of a written profile under the rule "
                                                         "given here (no new measurement); --config/--pool unused")
    p.set_defaults(fn=_cmd_calibrate)
