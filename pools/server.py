"""PoolServer: one pool replica. Its requests pass an admission gate before its engine.

The router calls `generate(PoolCall)` through a Serve handle; the reply is a stream:

    [Arrived]                  # first, only when the call has to queue in the gate
    Admitted | Rejected        # a slot was granted (at once or after queueing), or refused
    Refused | <engine items>   # the engine refused the input (the last item then), or its
                               # output: lists of OpenAI SSE strings, or one whole response
    | Failed                   # or a whole answer failed after the engine's work (the last item)
    Finished(usage, ttft, e2e) # last: the real usage for quota reconciliation

The slot is held for the whole stream and released on completion, error or
cancellation (a client disconnect cancels this generator, which closes the engine
stream, and vLLM aborts the request). The priority class becomes vLLM's request
`priority` (lower runs first), so the engine's own queue agrees with the gate's.

A background loop reports the replica's stats to the autoscale controller every
`report_interval_s` and applies the limits in the reply; a request of the pool's own that
queues into a deep queue sends a report at once. If the controller is away the replica keeps
its last limits. The engine is behind `pools.engine.Engine`: the real one runs vLLM through
ray.serve.llm (`pools.llm`), the unit tests a deterministic fake.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, AsyncGenerator, AsyncIterator

from infra.bounds import within
from infra.logs import configure_logging
from infra.loops import Loops
from infra.metrics import PoolMetrics
from pools import nice, reaper
from pools.admission import AsyncGate, GateRejected
from pools.config import Fingerprint
from pools.control import Describe, LimitsDirective, NiceJson, ReplicaStats
from pools.engine import Engine, hardware_name, pool_dtype, read_hf_config
from pools.gate import AdmissionGate, Ceilings, QueuePolicy
from pools.kv_budget import DTYPE_BYTES, checkpoint_dtype, runs_at
from pools.llm import engine_refusals
from pools.streams import EngineFailed
from pools.types import (Admitted, Arrived, BatchLimits, EngineStats, Failed, Finished, LatencySample, PoolCall,
                         Refused, Rejected, SafeRange, Usage)

log = logging.getLogger("poolserve.pool")


@dataclass(frozen=True)
class PoolSettings:
    """Everything a pool replica needs besides its LLMConfig, resolved by the builder."""

    name: str
    start_seqs: int
    safe_range: SafeRange
    ceilings: Ceilings
    queue: QueuePolicy
    report_interval_s: float
    latency_window_s: float
    stream_batching_ms: float
    fingerprint_base: dict[str, Any]  # model, dtype, quantization, max_model_len, ceilings
    warmup_requests: int = 8
    nice: int = 0  # Linux nice of the replica and its engine processes (pools.nice)
    hardware: str | None = None  # the fingerprint's hardware, when the config overrides what is detected
    model_dtype: str | None = None  # `model.dtype` as configured, decided again on the replica's CPU (`own_dtype`)
    accelerator: str = "cpu"


def _replica_name() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (unit tests)
        return "local"


class _StreamTimer:
    """Timestamps of one streamed response, for TTFT and TPOT at the replica."""

    def __init__(self, arrived: float) -> None:
        self.arrived = arrived
        self.first: float | None = None
        self.last: float | None = None

    def token(self) -> None:
        now = time.monotonic()
        self.first = self.first or now
        self.last = now

    def tpot(self, completion_tokens: int) -> float | None:
        if self.first is None or self.last is None or completion_tokens < 2:
            return None
        return (self.last - self.first) / (completion_tokens - 1)


def _usage_chunk(item: str) -> Usage | None:
    """The final `choices: []` chunk that carries usage (requested by the router)."""
    if '"choices":[]' not in item or '"usage"' not in item:
        return None
    payload = json.loads(item.removeprefix("data: ").strip())
    u = payload.get("usage") or {}
    return Usage(u.get("prompt_tokens", 0), u.get("completion_tokens", 0))


def own_dtype(llm_config: Any, settings: PoolSettings) -> dict[str, Any]:
    """Ask this replica's engine for the dtype its own CPU calls for (`pools.engine.pool_dtype`),
    where that needs no more KV cache per token than the head sized the pool for, and return
    the fingerprint base that names what it asks for. The config was resolved on the head,
    whose CPU may lack bf16 instructions this node has (the head kept a float32 checkpoint at
    float32; this node runs it at bfloat16, in half the KV bytes). The other way round (bf16 on
    the head, none here) the replica keeps the head's choice, and says how to size for float32:
    the KV check and the gate's token budget were made at the head's bytes per token. A replica
    that cannot read the model's config.json keeps the head's choice."""
    base, asked = settings.fingerprint_base, llm_config.engine_kwargs.get("dtype")
    source = llm_config.model_loading_config.model_source
    hf = read_hf_config(Path(source)) if settings.model_dtype is not None and isinstance(source, str) else None
    if hf is None or asked is None:
        return base
    dtype, _ = pool_dtype(settings.model_dtype, settings.accelerator, hf, llm_config.engine_kwargs.get("quantization"))
    if dtype == asked:
        return base
    checkpoint = checkpoint_dtype(hf)
    ours, heads = runs_at(dtype, checkpoint), runs_at(asked, checkpoint)
    if DTYPE_BYTES.get(ours, 4) > DTYPE_BYTES.get(heads, 4):
        log.warning("pool %s: this replica's CPU calls for dtype %s (%s) where the head asked for %s (%s), which "
                    "it keeps: the KV cache check and the token budget were sized at the head's bytes per token. "
                    "Set model.dtype: %s to size the pool for it", settings.name, dtype, ours, asked, heads, ours)
        return base
    log.info("pool %s: this replica's CPU asks its engine for dtype %s (%s), where the head asked for %s (%s)",
             settings.name, dtype, ours, asked, heads)
    llm_config.update_engine_kwargs(dtype=dtype)  # also the engine config Ray LLM built (and cached) on the head
    return {**base, "dtype": dtype}


async def _refusing(stream: AsyncIterator[Any]) -> AsyncGenerator[Any, None]:
    """The engine's stream, where an input error raised before any output (vLLM renders the
    chat template only once the request is admitted) becomes a `Refused` item instead of an
    exception, so the caller gets a 400 that names the problem rather than a 5xx; a whole
    answer that failed after the engine's output for it is a `Failed` item, a 500 charged."""
    started = False
    try:
        async for item in stream:
            started = True
            yield item
    except EngineFailed as e:
        log.warning("engine failed after generating a whole answer: %s", e, exc_info=True)
        yield Failed("engine_failed", f"the engine failed after generating the answer: {e}", e.usage)
    except engine_refusals() as e:
        if started:
            raise
        log.info("engine refused a request: %r", e)
        yield Refused("invalid_request", f"the engine could not process the request: {type(e).__name__}: {e}")


class PoolServer:
    async def __init__(self, llm_config: Any = None, *, settings: PoolSettings, controller: Any = None,
                       engine: Engine | None = None) -> None:
        configure_logging()
        self._settings = settings
        self._controller = controller  # a handle to the autoscale controller; None runs static
        self._replica = _replica_name()
        limits = settings.safe_range.limits_for(settings.start_seqs)
        gate = AdmissionGate(limits, settings.safe_range, settings.ceilings, settings.queue, time.monotonic)
        self._gate = AsyncGate(gate)
        self._metrics = PoolMetrics(settings.name, self._replica)
        self._applied_epoch = 0
        self._loops = Loops(f"pool {settings.name}")
        self._reporting = asyncio.Lock()  # one report at a time: replies are applied in the order they were decided
        self._told_deep: int | None = None  # the limit a deep queue was last reported at, while it stays deep
        self._telling: asyncio.Task | None = None
        self._held = False  # the controller holds the limits (a pin, a sweep): a deep queue moves nothing
        self._fingerprint_base = settings.fingerprint_base
        if engine is None:
            from pools.llm import RayLLMEngine

            self._fingerprint_base = own_dtype(llm_config, settings)
            engine = RayLLMEngine(llm_config, settings.stream_batching_ms)
        self._engine = engine
        await engine.start()
        self._engine_pids = nice.lower_pool(settings.nice, os.getpid())  # describe() shows the values
        if nice.cores_named():
            nice.bind_with_workers(self._engine_pids)
        self._reaper = reaper.watch()  # the engine processes go with this replica, even when it is SIGKILLed
        started = time.monotonic()
        await engine.warm_up(settings.warmup_requests)
        log.info("pool %s: warmed up in %.1fs", settings.name, time.monotonic() - started)
        if controller is not None:
            self._loops.start("report to the controller", self._report, settings.report_interval_s)

    async def close(self) -> None:
        """Stop reporting, then the engine (its processes go with it)."""
        await self._loops.stop()
        self._controller = None  # a request still here must not report a replica that is leaving
        if self._telling is not None:
            self._telling.cancel()
            await asyncio.gather(self._telling, return_exceptions=True)
        await self._engine.shutdown()

    # -- requests ------------------------------------------------------------------

    def _sent_home(self, retry_after_s: float) -> Rejected:
        return Rejected(429, "lender_busy", f"pool {self._settings.name!r} is busy with its own work; the request "
                                            "goes back to its own pool", retry_after_s)

    async def generate(self, call: PoolCall) -> AsyncGenerator[Any, None]:
        arrived = time.monotonic()
        if call.borrowed and not self._lends(call):
            self._metrics.rejected(call.tenant, call.priority, "lender_busy")
            yield self._sent_home(1.0)
            return
        pending = self._gate.offer(call.tenant, call.weight, call.priority, call.cost, call.n)
        try:
            if not pending.decided:  # it waits in the gate's queue: tell the router it got here
                if not call.borrowed:
                    self._tell_deep_queue()
                yield Arrived(self._replica)
            ticket = await pending.wait()
        except GateRejected as e:
            r = e.rejection
            self._metrics.rejected(call.tenant, call.priority, r.reason)
            if r.reason == "lender_busy":  # own work came back while it waited here
                yield self._sent_home(r.retry_after_s)
                return
            what = ("a more important request, or one of a tenant with fewer waiting, took its place"
                    if r.reason == "evicted" else "its queue is full")
            yield Rejected(429, r.reason, f"pool {self._settings.name!r} is overloaded: {what}; "
                                          f"retry after {r.retry_after_s:.0f}s", r.retry_after_s)
            return
        except BaseException:  # the caller left while it waited (GeneratorExit at the yield)
            pending.withdraw()
            if (r := pending.rejection) is not None:  # turned away before it left: counted as if it had read it
                self._metrics.rejected(call.tenant, call.priority, r.reason)
            else:
                self._metrics.left_queued(call.tenant, call.priority)
            raise
        admitted = time.monotonic()
        self._metrics.admitted(call.tenant, call.priority, admitted - arrived)
        usage: Usage | None = None
        done = False
        try:
            yield Admitted(self._settings.name, self._replica, admitted - arrived)
            timer = _StreamTimer(arrived)
            async for item in self._run(call, timer):
                if isinstance(item, Usage):
                    usage = item
                    continue
                yield item
                if isinstance(item, Refused):  # before any work: counted cancelled however the caller reads
                    usage = Usage(0, 0)  # on, and nothing of its estimate stays on the fair-share counter
                    return
                if isinstance(item, Failed):  # after the work: settled at its usage, split off before it
                    return
            tpot = timer.tpot(usage.completion_tokens) if usage else None
            ttft = None if timer.first is None else timer.first - arrived
            self._metrics.latency(call.tenant, call.priority, ttft, tpot)
            done = True
            yield Finished(usage, ttft, time.monotonic() - arrived)
        finally:
            if not done:
                self._metrics.cancelled(call.tenant, call.priority)
            self._gate.release(ticket, usage.total_tokens if usage else None, cancelled=not done)

    def _lends(self, call: PoolCall) -> bool:
        """Whether this replica takes a borrowed call now. The borrower decided from the
        controller's view, a report or two old; here the pool's own work is seen as it is."""
        gate = self._gate.gate
        s, limit = gate.stats(), gate.limits.max_active_seqs
        # borrowed sequences here, this call's included, within the share: at least one, as at small
        # limits the share rounds to none on each replica and the borrower's count over the pool rules
        share = None if call.lend_max_share is None else max(1, int(call.lend_max_share * limit))
        return (s.own_idle_s >= call.lend_after_quiet_s and s.own_work < call.lend_below_utilisation * limit
                and (share is None or gate.borrowed_work() + call.n <= share))

    async def _run(self, call: PoolCall, timer: _StreamTimer) -> AsyncGenerator[Any, None]:
        """The engine's output for one call: the usage split off (a `Usage` item, before a whole
        response or a `Failed` that carries one) and, for a stream, the chunks timed and the
        usage chunk dropped unless the client asked for it."""
        stream = _refusing(self._engine.generate(call))
        if not getattr(call.body, "stream", False):
            async for response in stream:
                u = getattr(response, "usage", None)
                if u is not None:
                    yield Usage(u.prompt_tokens, u.completion_tokens or 0)
                yield response
            return
        usage: Usage | None = None
        async for batch in stream:
            if isinstance(batch, Refused):
                yield batch
                return
            kept = []
            for item in batch:
                if isinstance(item, str):
                    if (u := _usage_chunk(item)) is not None:
                        usage = u
                        if not call.include_usage:
                            continue
                    elif '"delta"' in item or '"text"' in item:
                        timer.token()
                kept.append(item)
            if kept:
                yield kept
        if usage is not None:
            yield usage

    # -- limits and stats ---------------------------------------------------------

    async def set_limits(self, max_active_seqs: int) -> BatchLimits:
        """Set this replica's limit directly (inside its allowed range); the controller's
        next directive wins, so operators go through the controller instead."""
        allowed = self._gate.gate.allowed
        self._gate.set_limits(allowed.limits_for(max_active_seqs))
        return self._gate.gate.limits

    async def stats(self) -> ReplicaStats:
        box, window = self._engine.stats_box, self._settings.latency_window_s
        return ReplicaStats(
            pool=self._settings.name,
            replica=self._replica,
            time=time.time(),
            gate=self._gate.gate.stats(),
            engine=box.snapshot() if box else EngineStats(),
            latency=replace(box.latency(window) if box else LatencySample(), wait_s=self._gate.gate.waits(window)),
            safe_range=self._gate.gate.allowed,
            applied_epoch=self._applied_epoch,
            fingerprint=self.fingerprint().model_dump(mode="json") if self._engine.facts() else {},
        )

    def fingerprint(self) -> Fingerprint:
        facts = self._engine.facts()
        detected = facts.hardware if facts else hardware_name()
        return Fingerprint(**self._fingerprint_base, hardware=self._settings.hardware or detected,
                           vllm_version=facts.vllm_version if facts else "unknown", engine=facts.setup if facts else "")

    async def describe(self) -> Describe:
        """The engine's facts (KV capacity, CUDA-graph sizes) and this replica's fingerprint."""
        facts = self._engine.facts()
        return Describe(pool=self._settings.name, replica=self._replica,
                        fingerprint=self.fingerprint().model_dump(mode="json"),
                        kv_capacity_tokens=facts.kv_capacity_tokens if facts else None,
                        block_size=facts.block_size if facts else None,
                        cudagraph_capture_sizes=facts.cudagraph_capture_sizes if facts else (),
                        nice=NiceJson(replica=nice.niceness(os.getpid()),
                                      engines=tuple(nice.niceness(p) for p in self._engine_pids)),
                        engine_cores=tuple(nice.cores(p) for p in self._engine_pids))

    async def check_health(self) -> None:
        await self._engine.check_health()

    def _apply(self, directive: LimitsDirective) -> None:
        if directive.limits != self._gate.gate.limits or directive.allowed != self._gate.gate.allowed:
            level = logging.DEBUG if directive.reason == "sweep" else logging.INFO  # a sweep's steps: its own log
            log.log(level, "pool %s replica %s: limits -> %s (%s)", self._settings.name, self._replica,
                    directive.limits, directive.reason or "controller")
        self._gate.set_limits(directive.limits, directive.allowed)
        self._applied_epoch = directive.epoch
        self._held = directive.reason in ("pinned", "sweep")

    async def _report(self) -> None:
        async with self._reporting:
            stats = await self.stats()
            if not stats.gate.deep:
                self._told_deep = None
            self._metrics.state(stats.gate, stats.engine, stats.safe_range)
            timeout = max(2.0, self._settings.report_interval_s * 2)
            self._apply(await within(timeout, self._controller.report.remote(stats)))

    def _tell_deep_queue(self) -> None:
        """Report now, not at the next report, when the pool's own work queues as deep as the
        batch: the controller moves on such a report at once, and a batch of one at one request
        a second drained its queue between reports, each waiter sitting out the running request
        (the autoscaler benchmark's low phase, bench/notes.md). Once per limit until a periodic
        report finds the queue shallow: what the controller does not move at once (a cooldown,
        the band) it sees again at the next periodic report. Nothing at the top of the range, or
        while the controller holds the limits: nowhere to go. Checked at every request that
        queues, so the cheap tests come first."""
        gate = self._gate.gate
        limit = gate.limits.max_active_seqs
        if (self._controller is None or self._held or limit >= gate.allowed.high or self._told_deep == limit
                or self._telling is not None and not self._telling.done() or not gate.stats().deep):
            return
        self._told_deep = limit
        self._telling = asyncio.get_running_loop().create_task(self._tell(), name=f"pool {self._settings.name}: "
                                                                                  "report a deep queue")

    async def _tell(self) -> None:
        try:
            await self._report()
        except Exception as e:  # noqa: BLE001 - the periodic report tries again; this one only came early
            log.info("pool %s: reporting a deep queue failed (%s: %s)", self._settings.name, type(e).__name__, e)
