"""The autoscale controller: replica reports in, limits out, one decision per pool per tick.

`Controller` is the state machine (clock injected, no Ray); `ControllerService` is the
thin asyncio shell that Serve deploys: it ticks every `interval_s` and exports metrics.

Protocol. Every pool replica calls `report(stats)` each `report_interval_s` and applies
the `LimitsDirective` in the reply. The controller never calls replicas, so a replica
that cannot reach it keeps its last limits and keeps serving. Each change of a pool's
limits takes the pool's next epoch; replicas echo the epoch they applied, so operators
and tools know when a change is in force (`PoolStatus.applied`).

Restarts. What operators set (pins, SLOs, lending) is kept in a `StateStore` (Ray's GCS
key-value store when deployed) and read back by a restarted controller. The target itself
is not: a controller that starts adopts the limits the replicas report, so a restart moves
nothing. It cannot know when the limits last moved either, so adoption counts as a change:
the cooldown and the latency window run from it.

Stale profiles. A replica whose engine does not match its pool's calibration profile
says so in its report; the pool's range is then pinned to its lowest step.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from autoscale.config import AutoscaleConfig
from autoscale.policy import PolicyConfig, PolicyState, Reason, decide
from infra.state import MemoryStore, StateStore
from infra.stats import percentile
from pools.control import (DecisionJson, LimitsDirective, PinResult, PoolSnapshot, PoolStatus, PoolView, ReplicaStats,
                           ReplicaStatus, SloJson)
from pools.types import SafeRange

log = logging.getLogger("poolserve.autoscale")


@dataclass(frozen=True)
class PoolSpec:
    name: str
    safe_range: SafeRange
    ttft_slo_s: float
    tpot_slo_s: float
    max_num_seqs: int


@dataclass(frozen=True)
class Operator:
    """What operators set on a pool: kept across controller restarts."""

    pinned: int | None = None
    calibrating: bool = False
    lending: bool = True
    slo: SloJson | None = None  # None: the config's
    epoch: int = 0  # the highest epoch handed out, so a restarted controller never reuses one


@dataclass
class _PoolState:
    spec: PoolSpec
    operator: Operator = field(default_factory=Operator)
    policy: PolicyState | None = None  # None until the first report is adopted
    reports: dict[str, tuple[float, ReplicaStats]] = field(default_factory=dict)  # replica -> (received, stats)
    stale_reason: str = ""
    last_logged: str = ""


class Controller:
    def __init__(self, specs: dict[str, PoolSpec], config: AutoscaleConfig, clock: Callable[[], float],
                 wall_clock: Callable[[], float] = time.time, store: StateStore | None = None) -> None:
        self._config = config
        self._clock = clock
        self._wall = wall_clock
        self._store = store or MemoryStore()
        self._pools = {name: _PoolState(spec, self._restore(name)) for name, spec in specs.items()}
        self._log: collections.deque[DecisionJson] = collections.deque(maxlen=config.decision_log_size)

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
        if stats.applied_epoch > p.operator.epoch:  # epochs of a controller before this one
            self._set(p, epoch=stats.applied_epoch)
        if stats.profile_stale and not p.stale_reason:
            p.stale_reason = stats.stale_reason or "profile fingerprint differs from the engine"
            self._bump(p)
            log.warning("pool %s: calibration profile is stale (%s); pinned to the bottom of its range",
                        stats.pool, p.stale_reason)
        allowed = self.allowed(stats.pool)
        if p.policy is None:
            adopted = min(max(stats.gate.limits.max_active_seqs, allowed.low), allowed.high)
            # This controller cannot know when the one before it (if any) last moved the limits,
            # and the replicas' P99s may predate that move: count its cooldown and settling from now.
            p.policy = PolicyState(target=adopted, last_change_at=now)
            log.info("pool %s: adopted max_active_seqs=%d from replica %s", stats.pool, adopted, stats.replica)
        target = self.target(stats.pool)
        return LimitsDirective(allowed.limits_for(target), allowed, p.operator.epoch,
                               "pinned" if p.operator.pinned is not None else "")

    # -- decisions ---------------------------------------------------------------

    def tick(self) -> list[DecisionJson]:
        return [d for name in self._pools if (d := self._decide(name)) is not None]

    def _decide(self, name: str) -> DecisionJson | None:
        p, now = self._pools[name], self._clock()
        if p.policy is None or p.operator.pinned is not None:
            return None
        old = p.policy.target
        new, state, reason = decide(self.snapshot(name), p.policy, self._policy_config(p), now)
        applied = not self._config.dry_run
        if applied:
            p.policy = state
            if new != old:
                self._bump(p)
        else:
            # Dry run: keep the bookkeeping (queue ticks, counters) but never the move.
            p.policy = replace(state, target=old, last_change_at=p.policy.last_change_at,
                               last_direction=p.policy.last_direction)
        decision = DecisionJson(time=self._wall(), pool=name, old=old, new=new, action=reason.action,
                                code=reason.code, reason=reason.text, applied=applied)
        self._remember(p, decision, reason)
        return decision

    def _remember(self, p: _PoolState, d: DecisionJson, reason: Reason) -> None:
        key = f"{d.action}:{d.code}"
        if d.old != d.new or key != p.last_logged:
            self._log.append(d)
            p.last_logged = key
            level = logging.INFO if d.old != d.new else logging.DEBUG
            log.log(level, "pool %s: %d -> %d %s%s", d.pool, d.old, d.new, reason,
                    "" if d.applied else " (dry run, not applied)")

    def _policy_config(self, p: _PoolState) -> PolicyConfig:
        c, slo = self._config, self.slo(p.spec.name)
        return PolicyConfig(
            safe_range=self.allowed(p.spec.name), ttft_slo_s=slo.ttft_p99_ms / 1e3, tpot_slo_s=slo.tpot_p99_ms / 1e3,
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
        return self._range(p, p.operator.calibrating)

    def _range(self, p: _PoolState, calibrating: bool) -> SafeRange:
        r = p.spec.safe_range
        if calibrating:
            ladder = tuple(range(1, p.spec.max_num_seqs + 1))
            return SafeRange(ladder, 1, p.spec.max_num_seqs, r.tokens_per_seq, r.max_inflight_tokens)
        return r.clamp_to_low() if p.stale_reason else r

    def slo(self, name: str) -> SloJson:
        p = self._pools[name]
        return p.operator.slo or SloJson(ttft_p99_ms=p.spec.ttft_slo_s * 1e3, tpot_p99_ms=p.spec.tpot_slo_s * 1e3)

    def target(self, name: str) -> int | None:
        p = self._pools[name]
        if p.operator.pinned is not None:
            return p.operator.pinned
        return None if p.policy is None else p.policy.target

    def views(self) -> dict[str, PoolView]:
        out = {}
        for name, p in self._pools.items():
            fresh, target = self._fresh(name), self.target(name)
            seqs = target if target is not None else self.allowed(name).low
            out[name] = PoolView(name, len(fresh), seqs * max(1, len(fresh)), sum(s.gate.active for s in fresh),
                                 sum(s.gate.queued for s in fresh), bool(fresh), p.operator.calibrating,
                                 p.operator.lending)
        return out

    def status(self, name: str) -> PoolStatus:
        p, allowed, snap = self._pools[name], self.allowed(name), self.snapshot(name)
        return PoolStatus(pool=name, target_max_active_seqs=self.target(name), epoch=p.operator.epoch,
                          pinned=p.operator.pinned, calibrating=p.operator.calibrating,
                          safe_range=(allowed.low, allowed.high), ladder=allowed.steps, slo=self.slo(name),
                          profile_stale=p.stale_reason, lending=p.operator.lending,
                          snapshot=snap,
                          replicas=tuple(ReplicaStatus.of(s) for s in self._fresh(name)))

    def decisions(self, limit: int = 100) -> list[DecisionJson]:
        return list(self._log)[-limit:]

    def stale_reason(self, name: str) -> str:
        return self._pools[name].stale_reason

    # -- operator actions --------------------------------------------------------

    def pin(self, name: str, seqs: int, calibrating: bool = False) -> PinResult:
        """Hold a pool at `seqs` (the autoscaler stops moving it) until `unpin`.
        `calibrating` widens the allowed range to [1, max_num_seqs] for a sweep."""
        p = self._pools[name]
        allowed = self._range(p, calibrating)
        if not allowed.low <= seqs <= allowed.high or seqs not in allowed.ladder:
            return PinResult(pool=name, error=(
                f"max_active_seqs={seqs} is outside pool {name!r}'s allowed range [{allowed.low}, {allowed.high}] "
                f"(ladder {list(allowed.steps)})" + ("" if calibrating else "; pass calibrating=true to sweep beyond it")))
        old = self.target(name)
        self._set(p, pinned=seqs, calibrating=calibrating, epoch=p.operator.epoch + 1)
        self._log.append(DecisionJson(time=self._wall(), pool=name, old=old or seqs, new=seqs, action="pin",
                                      code="operator", applied=True,
                                      reason="pinned by operator" + (" for calibration" if calibrating else "")))
        limits = allowed.limits_for(seqs)
        return PinResult(pool=name, pinned=seqs, max_inflight_tokens=limits.max_inflight_tokens,
                         allowed=(allowed.low, allowed.high), epoch=p.operator.epoch)

    def unpin(self, name: str) -> PinResult:
        p = self._pools[name]
        if p.operator.pinned is not None and p.policy is not None:
            # Resume from the pinned value; the next tick clamps it into the safe range.
            p.policy = replace(p.policy, target=p.operator.pinned, last_change_at=self._clock())
        self._set(p, pinned=None, calibrating=False, epoch=p.operator.epoch + 1)
        return PinResult(pool=name, epoch=p.operator.epoch)

    def set_slo(self, name: str, slo: SloJson) -> None:
        self._set(self._pools[name], slo=slo)
        log.info("pool %s: SLO set to P99 TTFT %.0f ms, P99 TPOT %.1f ms", name, slo.ttft_p99_ms, slo.tpot_p99_ms)

    def set_lending(self, name: str, enabled: bool) -> None:
        self._set(self._pools[name], lending=enabled)
        log.info("pool %s: lending to other pools %s", name, "on" if enabled else "off")

    def spec(self, name: str) -> PoolSpec:
        return self._pools[name].spec

    # -- operator state, kept across restarts ------------------------------------------

    def _bump(self, p: _PoolState) -> None:
        self._set(p, epoch=p.operator.epoch + 1)

    def _set(self, p: _PoolState, **changes) -> None:
        p.operator = replace(p.operator, **changes)
        o = p.operator
        self._store.put(f"pool/{p.spec.name}", {"pinned": o.pinned, "calibrating": o.calibrating,
                                                "lending": o.lending, "epoch": o.epoch,
                                                "slo": o.slo.model_dump() if o.slo else None})

    def _restore(self, name: str) -> Operator:
        saved = self._store.get(f"pool/{name}")
        if not saved:
            return Operator()
        op = Operator(pinned=saved.get("pinned"), calibrating=bool(saved.get("calibrating")),
                      lending=bool(saved.get("lending", True)), epoch=int(saved.get("epoch", 0)),
                      slo=SloJson(**saved["slo"]) if saved.get("slo") else None)
        log.info("pool %s: restored operator settings %s", name, op)
        return op


class ControllerService:
    """What Serve deploys: a Controller plus its tick loop and metrics."""

    def __init__(self, specs: dict[str, PoolSpec], config: AutoscaleConfig, store: StateStore | None = None) -> None:
        from infra.logs import configure_logging
        from infra.loops import Loops
        from infra.metrics import ControllerMetrics

        configure_logging()
        self.controller = Controller(specs, config, time.monotonic, store=store)
        self._metrics = ControllerMetrics()
        self._loops = Loops("autoscale controller")
        self._loops.start("tick", self._tick, config.interval_s, first_delay_s=config.interval_s)

    async def _tick(self) -> None:
        for d in self.controller.tick():
            self._metrics.decision(d.pool, d.action, d.code, d.new if d.applied else d.old)

    async def report(self, stats: ReplicaStats) -> LimitsDirective:
        return self.controller.report(stats)

    async def views(self) -> dict[str, PoolView]:
        return self.controller.views()

    async def status(self) -> dict[str, PoolStatus]:
        return {name: self.controller.status(name) for name in self.controller.views()}

    async def decisions(self, limit: int = 100) -> list[DecisionJson]:
        return self.controller.decisions(limit)

    async def pin(self, pool: str, seqs: int, calibrating: bool = False) -> PinResult:
        return self.controller.pin(pool, seqs, calibrating)

    async def unpin(self, pool: str) -> PinResult:
        return self.controller.unpin(pool)

    async def set_slo(self, pool: str, slo: SloJson) -> None:
        self.controller.set_slo(pool, slo)

    async def set_lending(self, pool: str, enabled: bool) -> None:
        self.controller.set_lending(pool, enabled)
