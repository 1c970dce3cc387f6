"""Calibration in the background: a pool with no profile for its set-up measures one itself.

Runs in the controller's process, one pool at a time (two sweeps at once would measure each
other). For each step of the pool's sweep ladder it waits until the pool has had no traffic of
its own for `calibration.quiet_s`, pins the pool at the step in calibration mode, and keeps
exactly that many synthetic requests per replica in flight through the pool's deployment
handle: borrowed-class work, which the gate admits only after the pool's own, and the router
does not lend into a calibrating pool. The step runs past its warm-up until the engines'
output rate is steady (or its time cap). Traffic of the pool's own that arrives stops the
step at once: the pin is lifted (the pool serves at its fallback range again) and the step
is measured again later; traffic that arrives as a step ends lifts the step's pin as well.
The rows then go through the knee finder, and the profile is kept in the profile store and
adopted by the controller.

Latency is measured at this end of the handle, one hop from the engine; output throughput
from the engines' own token counters in the replicas' reports.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

from autoscale.calibrate import build_profile
from autoscale.controller import Controller
from autoscale.profile import KneeRule, LadderRow, Percentiles, SLOSpec, TrafficSpec, response_lengths
from autoscale.ranges import RESWEEP_AFTER_S
from infra.results import Result
from infra.stats import Cumulative, counter_rate
from infra.traffic import Lengths, synthetic_lengths, trace_lengths
from pools.control import ReplicaStats
from pools.llm import request_models
from pools.streams import engine_error
from pools.types import (Admitted, Arrived, Failed, Finished, PoolCall, PriorityClass, Refused, Rejected,
                         error_status)

log = logging.getLogger("poolserve.autoscale")

TENANT = "poolserve-calibration"
WAIT_FOR_POOL_S = 120.0  # a pool that does not pause (or has no replica) this long lets the other pools sweep


class Interrupted(Exception):
    """The pool's own traffic arrived during a step."""


class NotNow(Exception):
    """The pool had no replica to measure, or no pause in its own traffic, for `WAIT_FOR_POOL_S`."""


@dataclass
class _Sample:
    t: float
    kv: float
    preemptions: dict[str, tuple[float, int]]  # replica -> when it reported, its engine's count
    own_work: int


class _Counters:
    """Each replica's output-token counter at the times its reports arrived. Rates come from
    these points, not from when the calibrator looked: reports land every `report_interval_s`,
    so a chunk read between two looks held one report's tokens or two (with reports every
    second and 1.5 s chunks, a steady engine looked 33% unsteady)."""

    def __init__(self) -> None:
        self._series: dict[str, list[tuple[float, int]]] = {}
        self._live: set[str] = set()

    def add(self, reports: list[tuple[float, ReplicaStats]]) -> None:
        self._live = {s.replica for _, s in reports}
        for t, s in reports:
            series = self._series.setdefault(s.replica, [])
            if not series or t > series[-1][0]:
                series.append((t, s.engine.generated_tokens))

    def end(self) -> float | None:
        """The latest time every live replica's counter is known at."""
        return min((self._series[r][-1][0] for r in self._live), default=None)

    def rate(self, a: float, b: float) -> float | None:
        """Tokens per second over [a, b], summed over the live replicas; None unless each one's
        reports cover it."""
        rates = [counter_rate(self._series[r], a, b) for r in self._live]
        return None if not rates or None in rates else sum(rates)

    def covered(self, a: float, b: float) -> tuple[float, float]:
        """The part of [a, b] that every live replica's reports cover ([a, b] where none does):
        a step that hit its cap still reports the rate it had."""
        if not self._live:
            return a, b
        lo, hi = max([a] + [self._series[r][0][0] for r in self._live]), min(b, self.end())
        return (lo, hi) if hi > lo else (a, b)


class Calibrator:
    def __init__(self, controller: Controller, handle: Callable[[str], Any], max_model_len: int,
                 clock: Callable[[], float] = time.monotonic, sleep=asyncio.sleep, seed: int = 0) -> None:
        self._c, self._handle, self._max_model_len = controller, handle, max_model_len
        self._clock, self._sleep, self._seed = clock, sleep, seed
        self.running: str | None = None
        self._busy_at = 0.0  # when the pool being calibrated last had traffic of its own
        self._sent_home = False  # a step's request came back lender_busy: own work came between reports
        self._not_before: dict[str, float] = {}  # pools that could not be measured: their next try

    async def step(self) -> None:
        """One turn of the background loop: calibrate the next pool that needs it, if any."""
        now = self._clock()
        if self.running is None and (waiting := [n for n in self._c.needs_sweep()
                                                 if now >= self._not_before.get(n, now)]):
            await self.calibrate(waiting[0])

    async def calibrate(self, name: str) -> None:
        self.running = name
        self._busy_at = self._clock()  # unknown before: a whole quiet_s before the first step
        request_models()  # vLLM's protocol module takes seconds to import: not inside a step's timing
        fingerprint, started = self._c.fingerprint(name), self._clock()  # the controller's clock too
        try:
            spec, rows = self._c.spec(name), []
            log.info("pool %s: calibrating this set-up in the background, ladder %s", name, list(spec.sweep))
            for i, seqs in enumerate(spec.sweep, 1):
                rows.append(await self._step_until_measured(name, seqs, f"step {i}/{len(spec.sweep)}"))
                log.info("pool %s: calibration step %d/%d at %d sequences: %.0f output tok/s%s", name, i,
                         len(spec.sweep), seqs, rows[-1].output_tok_per_s, "" if rows[-1].steady else " (unsteady)")
            slo = self._c.slo(name)
            profile = build_profile(name, rows, fingerprint, SLOSpec(**slo.model_dump()),
                                    self._traffic(name), KneeRule(), (), time.strftime("%Y-%m-%dT%H:%M:%S%z"))
            self._c.adopt(name, profile, started)
        except NotNow as e:  # the sweeper goes to the other pools; this one starts over later
            self._not_before[name] = self._clock() + RESWEEP_AFTER_S
            log.info("pool %s: calibration waits: %s", name, e)
            self._c.sweep_progress(name, f"{e}; the fallback range, and a sweep again in {RESWEEP_AFTER_S:g} s")
        except Exception as e:  # noqa: BLE001 - a failed sweep leaves the pool at its fallback range
            log.exception("pool %s: calibration failed", name)
            self._c.sweep_failed(name, f"{type(e).__name__}: {e}", fingerprint)
        finally:
            self._c.sweep_pin(name, None)
            self.running = None

    async def _step_until_measured(self, name: str, seqs: int, label: str) -> LadderRow:
        since = self._clock()  # a step its own traffic keeps interrupting waits as long as one it never lets start
        while True:
            self._c.sweep_progress(name, f"{label}: waiting for the pool to be quiet")
            await self._quiet(name, since)
            self._c.sweep_progress(name, f"{label}: measuring at {seqs} sequences")
            try:
                return await self._measure(name, seqs)
            except Interrupted:  # the pool serves its own traffic at its fallback range again
                self._c.sweep_pin(name, None)
                log.info("pool %s: its own traffic arrived during calibration at %d; measuring again later",
                         name, seqs)

    # -- one step --------------------------------------------------------------------------

    async def _quiet(self, name: str, since: float) -> None:
        """Until the pool has had no traffic of its own for `quiet_s` (synthetic requests of the step
        before may still end: they are the sweep's own); `NotNow` if it has not since `since` + `WAIT_FOR_POOL_S`."""
        quiet_s = self._c.spec(name).calibration.quiet_s
        while True:
            self._not_pinned(name)
            now, reports = self._clock(), self._c.replica_stats(name)
            if not reports or any(s.gate.own_work for s in reports):
                self._busy_at = now
                self._c.sweep_pin(name, None)  # between steps: the last step's pin must not hold own work
                if now - since > WAIT_FOR_POOL_S:
                    raise NotNow(f"{'its own traffic did not pause' if reports else 'no replica reported'} for "
                                 f"{WAIT_FOR_POOL_S:g} s")
            elif now - self._busy_at >= quiet_s:
                return
            await self._sleep(0.2)

    def _not_pinned(self, name: str) -> None:
        """An operator's pin holds the pool at its own limit: no step can measure it meanwhile."""
        if (pin := self._c.operator_pin(name)) is not None:
            raise NotNow(f"the operator pinned it at {pin}")

    async def _measure(self, name: str, seqs: int) -> LadderRow:
        cal = self._c.spec(name).calibration
        epoch, since = self._c.sweep_pin(name, seqs), self._clock()
        while not (reports := self._c.replica_stats(name)) or any(s.applied_epoch < epoch for s in reports):
            if self._clock() - since > WAIT_FOR_POOL_S:
                raise NotNow(f"no replica applied the step's limit within {WAIT_FOR_POOL_S:g} s")
            await self._sleep(0.2)
        lengths, results, samples, counters = self._lengths(name), [], [], _Counters()
        start, self._sent_home = self._clock(), False
        workers = [asyncio.get_running_loop().create_task(self._worker(name, lengths, results, i))
                   for i in range(seqs * len(reports))]
        try:
            window, steady = await self._until_steady(name, cal, samples, counters, start)
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        return _row(seqs, results, samples, counters, window, steady)

    async def _until_steady(self, name: str, cal, samples: list[_Sample], counters: _Counters,
                            start: float) -> tuple[tuple, bool]:
        """Sample the reports until the output rate over the last chunks holds within 10%."""
        chunks_needed = max(2, round(cal.min_measure_s / cal.check_s))
        measure_from = start + cal.warmup_s
        while True:
            await self._sleep(min(0.5, cal.check_s / 4))
            self._not_pinned(name)
            now, timed = self._clock(), self._c.replica_reports(name)
            reports = [s for _, s in timed]
            counters.add(timed)
            samples.append(_Sample(now, max((s.engine.kv_usage for s in reports), default=0.0),
                                   {s.replica: (s.time, s.engine.preemptions) for s in reports}, sum(s.gate.own_work for s in reports)))
            if samples[-1].own_work or self._sent_home:
                self._busy_at = now
                raise Interrupted
            end = counters.end()
            if end is None or end < measure_from + chunks_needed * cal.check_s:
                if now - measure_from >= cal.cap_s:
                    return counters.covered(measure_from, now), False
                continue
            edges = [end - k * cal.check_s for k in range(chunks_needed, -1, -1)]
            rates = [counters.rate(a, b) for a, b in zip(edges, edges[1:])]
            if None not in rates:
                mean = sum(rates) / len(rates)
                if mean > 0 and all(abs(r - mean) <= 0.1 * mean for r in rates):
                    return (edges[0], end), True
            if now - measure_from >= cal.cap_s:
                return counters.covered(measure_from, now), False

    async def _worker(self, name: str, lengths: Lengths, results: list[Result], i: int) -> None:
        rng = random.Random(self._seed * 1000 + i)
        stream = self._c.spec(name).calibration.stream
        while True:
            prompt, output = lengths.sample(rng)
            res = Result(start=self._clock())
            results.append(res)
            await self._one(name, prompt, output, stream, res, rng)

    async def _one(self, name: str, prompt: int, output: int, stream: bool, res: Result, rng: random.Random) -> None:
        _, completion_cls = request_models()
        ids = [rng.randrange(100, 1000) for _ in range(prompt)]  # token ids: an exact prompt length
        body = completion_cls(prompt=ids, max_tokens=output, ignore_eos=True, stream=stream,
                              **({"stream_options": {"include_usage": True}} if stream else {}))
        call = PoolCall("completions", body, TENANT, 1.0, PriorityClass.BORROWED, prompt, output, borrowed=True,
                        include_usage=True)
        gen = self._handle(name).generate.remote(call)
        try:
            async for item in gen:
                if isinstance(item, Rejected):
                    res.status, res.error = item.status, item.reason
                    if item.reason == "lender_busy":  # own work came between two reports: no error of
                        res.status, self._sent_home = 0, True  # the step's, which is measured again
                    return
                if isinstance(item, (Arrived, Admitted)):
                    continue
                # the sweep's own request refused or failed: a fault to see, not an answer
                if isinstance(item, (Refused, Failed)):
                    res.status, res.error = (400 if isinstance(item, Refused) else 500), item.code
                    return
                if (err := engine_error(item)) is not None:  # vLLM's error in the answer's place
                    res.status, res.error = error_status(err), str(getattr(err, "type", None) or "engine_error")
                    return
                if isinstance(item, Finished):
                    res.status, res.e2e = 200, self._clock() - res.start
                    if item.usage is not None:
                        res.prompt_tokens, res.output_tokens = item.usage.prompt_tokens, item.usage.completion_tokens
                elif stream and res.ttft is None:
                    res.ttft = self._clock() - res.start
        except asyncio.CancelledError:
            gen.cancel()
            raise

    # -- traffic ---------------------------------------------------------------------------

    def _lengths(self, name: str) -> Lengths:
        spec = self._c.spec(name).calibration.lengths
        if spec == "trace":
            return trace_lengths(self._max_model_len)
        prompt, output = (int(x) for x in spec.split("/"))
        return synthetic_lengths(prompt, output)

    def _traffic(self, name: str) -> TrafficSpec:
        lengths = self._lengths(name)
        return TrafficSpec(source=lengths.source + (", streamed" if self._c.spec(name).calibration.stream else
                                                    ", whole responses"), scale=lengths.scale, seed=self._seed,
                           **lengths.stats())


def _added(readings: list[dict[str, tuple[float, int]]]) -> int:
    counted = Cumulative()
    for counts in readings:
        counted.read_all(counts)
    return counted.total


def _pcts(seconds: list[float]) -> Percentiles:
    return Percentiles.of([x * 1e3 for x in seconds])


def _row(seqs: int, results: list[Result], samples: list[_Sample], counters: _Counters,
         window: tuple[float, float], steady: bool) -> LadderRow:
    a, b = window
    seconds = max(b - a, 1e-6)
    # latencies of the requests that completed in the window: in a steady closed loop they are
    # distributed as those that started in it, and a long request still counts in a short window
    done = [r for r in results if r.ok and r.e2e is not None and a <= r.start + r.e2e < b]
    inside = [s for s in samples if a <= s.t <= b]
    return LadderRow(
        max_active_seqs=seqs, requests=len(done), duration_s=round(seconds, 2), steady=steady and bool(done),
        req_per_s=len(done) / seconds, input_tok_per_s=sum(r.prompt_tokens for r in done) / seconds,
        output_tok_per_s=counters.rate(a, b) or 0.0, goodput_req_per_s=len(done) / seconds,
        ttft_ms=_pcts([r.ttft for r in done if r.ttft is not None]),
        tpot_ms=_pcts([r.tpot for r in done if r.tpot is not None]),
        e2e_ms=_pcts([r.e2e for r in done]),
        kv_usage_max=max((s.kv for s in inside), default=0.0),
        preemptions=_added([s.preemptions for s in inside]),
        errors=sum(1 for r in results if a <= r.start < b and r.status not in (0, 200)), rejections=0,
        **response_lengths([(r.output_tokens, r.e2e) for r in done]))
