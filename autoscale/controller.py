"""The autoscale controller: replica reports in, limits out, one decision per pool per tick.

`Controller` is the state machine (clock injected, no Ray); `ControllerService` is the
thin asyncio shell that Serve deploys: it ticks every `interval_s` and exports metrics.

Protocol. Every pool replica calls `report(stats)` each `report_interval_s` and applies
the `LimitsDirective` in the reply. The controller never calls replicas, so a replica
that cannot reach it keeps its last limits and keeps serving. A controller that starts
(or restarts) knows no targets: it adopts the limits the replicas report, so a restart
moves nothing. It cannot know when the limits last moved either, so adoption counts as a
change: the cooldown and the latency window run from it.

Stale profiles. A replica whose engine does not match its pool's calibration profile
says so in its report; the pool's range is then pinned to its lowest step.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, replace
from typing import Callable

from autoscale.config import AutoscaleConfig
from autoscale.policy import PolicyConfig, PolicyState, PoolSnapshot, Reason, decide
from pools.kv_budget import percentile
from pools.types import LimitsDirective, ReplicaStats, SafeRange

log = logging.getLogger("poolserve.autoscale")


@dataclass(frozen=True)
class PoolSpec:
    name: str
    safe_range: SafeRange
    ttft_slo_s: float
    tpot_slo_s: float
    max_num_seqs: int


@dataclass(frozen=True)
class Decision:
    time: float  # wall clock (seconds since the epoch), for people and logs
    pool: str
    old: int
    new: int
    action: str
    code: str
    reason: str
    applied: bool


@dataclass(frozen=True)
class PoolView:
    """What the router needs to know about a pool: capacity and load across replicas."""

    pool: str
    replicas: int
    capacity: int
    active: int
    queued: int
    fresh: bool
    calibrating: bool = False  # pinned for a sweep: no borrowing into or out of it
    lending: bool = True  # an operator may stop other pools borrowing this one


@dataclass
class _PoolState:
    spec: PoolSpec
    policy: PolicyState | None = None  # None until the first report is adopted
    reports: dict[str, tuple[float, ReplicaStats]] = None  # replica -> (received, stats)
    pinned: int | None = None
    calibrating: bool = False
    lending: bool = True
    stale_reason: str = ""
    last_logged: str = ""

    def __post_init__(self) -> None:
        self.reports = {}


class Controller:
    def __init__(self, specs: dict[str, PoolSpec], config: AutoscaleConfig, clock: Callable[[], float],
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._config = config
        self._clock = clock
        self._wall = wall_clock
        self._pools = {name: _PoolState(spec) for name, spec in specs.items()}
        self._log: collections.deque[Decision] = collections.deque(maxlen=config.decision_log_size)

    # -- replica protocol --------------------------------------------------------

    def report(self, stats: ReplicaStats) -> LimitsDirective:
        p = self._pools[stats.pool]
        now = self._clock()
        last = p.reports.get(stats.replica)
        if last is not None and now - last[0] > self._config.stats_max_age_s:
            log.warning("pool %s replica %s: no report for %.1f s; reports older than %.1f s count as missing, "
                        "so the autoscaler held while it was silent", stats.pool, stats.replica, now - last[0],
                        self._config.stats_max_age_s)
        p.reports[stats.replica] = (now, stats)
        if stats.profile_stale and not p.stale_reason:
            p.stale_reason = stats.stale_reason or "profile fingerprint differs from the engine"
            log.warning("pool %s: calibration profile is stale (%s); pinned to the bottom of its range",
                        stats.pool, p.stale_reason)
        allowed = self.allowed(stats.pool)
        if p.policy is None:
            adopted = min(max(stats.gate.limits.max_active_seqs, allowed.low), allowed.high)
            # This controller cannot know when the one before it (if any) last moved the limits,
            # and the replicas' P99s may predate that move: count its cooldown and settling from now.
            p.policy = PolicyState(target=adopted, last_change_at=now)
            log.info("pool %s: adopted max_active_seqs=%d from replica %s", stats.pool, adopted, stats.replica)
        target = p.pinned if p.pinned is not None else p.policy.target
        return LimitsDirective(allowed.limits_for(target), allowed, "pinned" if p.pinned is not None else "")

    # -- decisions ---------------------------------------------------------------

    def tick(self) -> list[Decision]:
        return [d for name in self._pools if (d := self._decide(name)) is not None]

    def _decide(self, name: str) -> Decision | None:
        p, now = self._pools[name], self._clock()
        if p.policy is None or p.pinned is not None:
            return None
        snap = self.snapshot(name)
        cfg = self._policy_config(p)
        old = p.policy.target
        new, state, reason = decide(snap, p.policy, cfg, now)
        applied = not self._config.dry_run
        if applied:
            p.policy = state
        else:
            # Dry run: keep the bookkeeping (queue ticks, counters) but never the move.
            p.policy = replace(state, target=old, last_change_at=p.policy.last_change_at,
                               last_direction=p.policy.last_direction)
        decision = Decision(self._wall(), name, old, new, reason.action, reason.code, reason.text, applied)
        self._remember(p, decision, reason)
        return decision

    def _remember(self, p: _PoolState, d: Decision, reason: Reason) -> None:
        key = f"{d.action}:{d.code}"
        if d.old != d.new or key != p.last_logged:
            self._log.append(d)
            p.last_logged = key
            level = logging.INFO if d.old != d.new else logging.DEBUG
            log.log(level, "pool %s: %d -> %d %s%s", d.pool, d.old, d.new, reason,
                    "" if d.applied else " (dry run, not applied)")

    def _policy_config(self, p: _PoolState) -> PolicyConfig:
        c = self._config
        return PolicyConfig(
            safe_range=self.allowed(p.spec.name), ttft_slo_s=p.spec.ttft_slo_s, tpot_slo_s=p.spec.tpot_slo_s,
            cooldown_s=c.cooldown_s, reversal_cooldown_s=c.reversal_cooldown_s, kv_watermark=c.kv_watermark,
            headroom=c.headroom, queue_persist_ticks=c.queue_persist_ticks, min_samples=c.min_samples,
            settle_s=c.latency_window_s, min_step_gain=c.min_step_gain,
        )

    # -- views -------------------------------------------------------------------

    def _fresh(self, name: str) -> list[ReplicaStats]:
        now, max_age = self._clock(), self._config.stats_max_age_s
        return [s for (t, s) in self._pools[name].reports.values() if now - t <= max_age]

    def snapshot(self, name: str) -> PoolSnapshot:
        fresh = self._fresh(name)
        if not fresh:
            return PoolSnapshot(fresh=False)
        ttft = [x for s in fresh for x in s.latency.ttft_s]
        tpot = [x for s in fresh for x in s.latency.tpot_s]
        return PoolSnapshot(
            fresh=True,
            replicas=len(fresh),
            queued=sum(s.gate.queued for s in fresh),
            queued_tokens=sum(s.gate.queued_tokens for s in fresh),
            active=sum(s.gate.active for s in fresh),
            rejected_total=sum(s.gate.rejected + s.gate.evicted for s in fresh),
            preemptions_total=sum(s.engine.preemptions for s in fresh),
            kv_usage=max(s.engine.kv_usage for s in fresh),
            ttft_p99_s=percentile(ttft, 99) if ttft else None,
            tpot_p99_s=percentile(tpot, 99) if tpot else None,
            samples=min(len(ttft), len(tpot)) if tpot else len(ttft),
        )

    def allowed(self, name: str) -> SafeRange:
        p = self._pools[name]
        r = p.spec.safe_range
        if p.calibrating:
            ladder = tuple(range(1, p.spec.max_num_seqs + 1))
            return SafeRange(ladder, 1, p.spec.max_num_seqs, r.tokens_per_seq, r.max_inflight_tokens)
        return r.clamp_to_low() if p.stale_reason else r

    def target(self, name: str) -> int | None:
        p = self._pools[name]
        if p.pinned is not None:
            return p.pinned
        return None if p.policy is None else p.policy.target

    def views(self) -> dict[str, PoolView]:
        out = {}
        for name in self._pools:
            fresh, target = self._fresh(name), self.target(name)
            replicas = max(1, len(fresh))
            seqs = target if target is not None else self.allowed(name).low
            out[name] = PoolView(name, len(fresh), seqs * replicas, sum(s.gate.active for s in fresh),
                                 sum(s.gate.queued for s in fresh), bool(fresh), self._pools[name].calibrating,
                                 self._pools[name].lending)
        return out

    def replica_stats(self, name: str) -> list[ReplicaStats]:
        return self._fresh(name)

    def decisions(self, limit: int = 100) -> list[Decision]:
        return list(self._log)[-limit:]

    def stale_reason(self, name: str) -> str:
        return self._pools[name].stale_reason

    # -- operator actions --------------------------------------------------------

    def pin(self, name: str, seqs: int, calibrating: bool = False) -> LimitsDirective:
        """Hold a pool at `seqs` (the autoscaler stops moving it) until `unpin`.
        `calibrating` widens the allowed range to [1, max_num_seqs] for a sweep."""
        p = self._pools[name]
        previous = p.calibrating
        p.calibrating = calibrating
        allowed = self.allowed(name)
        if not allowed.low <= seqs <= allowed.high or seqs not in allowed.ladder:
            p.calibrating = previous
            raise ValueError(f"max_active_seqs={seqs} is outside pool {name!r}'s allowed range "
                             f"[{allowed.low}, {allowed.high}] (ladder {list(allowed.steps)})"
                             + ("" if calibrating else "; pass calibrating=true to sweep beyond it"))
        p.pinned = seqs
        self._log.append(Decision(self._wall(), name, self.target(name) or seqs, seqs, "pin", "operator",
                                  "pinned by operator" + (" for calibration" if calibrating else ""), True))
        return LimitsDirective(allowed.limits_for(seqs), allowed, "pinned")

    def unpin(self, name: str) -> None:
        p = self._pools[name]
        if p.pinned is not None and p.policy is not None:
            # Resume from the pinned value; the next tick clamps it into the safe range.
            p.policy = replace(p.policy, target=p.pinned, last_change_at=self._clock())
        p.pinned, p.calibrating = None, False

    def set_slo(self, name: str, ttft_p99_ms: float, tpot_p99_ms: float) -> None:
        p = self._pools[name]
        p.spec = replace(p.spec, ttft_slo_s=ttft_p99_ms / 1e3, tpot_slo_s=tpot_p99_ms / 1e3)
        log.info("pool %s: SLO set to P99 TTFT %.0f ms, P99 TPOT %.1f ms", name, ttft_p99_ms, tpot_p99_ms)

    def set_lending(self, name: str, enabled: bool) -> None:
        self._pools[name].lending = enabled
        log.info("pool %s: lending to other pools %s", name, "on" if enabled else "off")

    def spec(self, name: str) -> PoolSpec:
        return self._pools[name].spec


class ControllerService:
    """What Serve deploys: a Controller plus its tick loop and metrics."""

    def __init__(self, specs: dict[str, PoolSpec], config: AutoscaleConfig) -> None:
        from pools.logs import configure_logging
        from pools.metrics import ControllerMetrics

        configure_logging()
        self.controller = Controller(specs, config, time.monotonic)
        self._config = config
        self._metrics = ControllerMetrics()
        self._loop = asyncio.get_event_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._config.interval_s)
            try:
                for d in self.controller.tick():
                    self._metrics.decision(d.pool, d.action, d.code, d.new if d.applied else d.old)
            except Exception:  # a bug in one tick must not stop the loop; it is logged loudly
                log.exception("autoscale tick failed; limits hold")

    async def report(self, stats: ReplicaStats) -> LimitsDirective:
        return self.controller.report(stats)

    async def views(self) -> dict[str, PoolView]:
        return self.controller.views()

    async def status(self) -> dict:
        c = self.controller
        out = {}
        for name in c.views():
            allowed, spec = c.allowed(name), c.spec(name)
            out[name] = {
                "target_max_active_seqs": c.target(name),
                "safe_range": [allowed.low, allowed.high],
                "ladder": list(allowed.steps),
                "slo": {"ttft_p99_ms": spec.ttft_slo_s * 1e3, "tpot_p99_ms": spec.tpot_slo_s * 1e3},
                "profile_stale": c.stale_reason(name),
                "lending": c.views()[name].lending,
                "snapshot": c.snapshot(name).__dict__,
                "replicas": [_replica_json(s) for s in c.replica_stats(name)],
            }
        return out

    async def decisions(self, limit: int = 100) -> list[Decision]:
        return self.controller.decisions(limit)

    async def pin(self, pool: str, seqs: int, calibrating: bool = False) -> LimitsDirective:
        return self.controller.pin(pool, seqs, calibrating)

    async def unpin(self, pool: str) -> None:
        self.controller.unpin(pool)

    async def set_slo(self, pool: str, ttft_p99_ms: float, tpot_p99_ms: float) -> None:
        self.controller.set_slo(pool, ttft_p99_ms, tpot_p99_ms)

    async def set_lending(self, pool: str, enabled: bool) -> None:
        self.controller.set_lending(pool, enabled)


def _replica_json(s: ReplicaStats) -> dict:
    g, e = s.gate, s.engine
    return {
        "replica": s.replica, "reported_at": s.time, "active": g.active, "peak_active": g.peak_active,
        "queued_by_class": g.queued_by_class, "queued_tokens": g.queued_tokens,
        "inflight_tokens": g.inflight_tokens,
        "limits": {"max_active_seqs": g.limits.max_active_seqs, "max_inflight_tokens": g.limits.max_inflight_tokens},
        "admitted": g.admitted, "rejected": g.rejected, "evicted": g.evicted, "cancelled": g.cancelled,
        "completed": g.completed,
        "engine": {"running": e.running, "waiting": e.waiting, "kv_usage": e.kv_usage, "preemptions": e.preemptions,
                   "generated_tokens": e.generated_tokens},
        "profile_stale": s.profile_stale,
    }
