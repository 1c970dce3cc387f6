"""The autoscale controller: replica reports in, limits out, a decision per pool each tick.

`Controller` is the state machine (clock injected, no Ray); `autoscale.service` is the thin
asyncio shell that Serve deploys around it.

Protocol. Every pool replica calls `report(stats)` each `report_interval_s`, and at once when
its own work queues as deep as its own batch, and applies the `LimitsDirective` in the reply.
A report that shows the pool's queue as deep as its target (over all its replicas) is decided
at once. The controller never calls replicas, so a replica that cannot reach it keeps its last
limits and keeps serving. Each change of a pool's limits takes the pool's next epoch; replicas
echo the epoch they applied, so operators and tools know when it is in force (`PoolStatus.applied`).

Restarts. What operators set (pins, SLOs, lending) is kept in a `StateStore` (Ray's GCS key-value
store when deployed) and read back by a restarted controller. The target is not: a new controller
adopts the replicas' limits (a restart moves nothing) and counts that as a change: cooldowns run from it.

Profiles. A pool configured with a profile runs on the profile measured on its own set-up
(model, dtype, context, hardware, vLLM, ceilings: the fingerprint its replicas report): one
kept in the profile store, else the configured one if its fingerprint matches. Without one,
its `calibration.mode` decides: `auto` serves at the fallback range while a sweep measures a
profile in the background (`autoscale.selfcal`), then moves inside the measured range;
`fallback` stays at the fallback range; `strict` runs at the bottom of the configured range.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from autoscale.config import AutoscaleConfig
from autoscale.policy import Events, PolicyConfig, PolicyState, Reason, aggregate, decide, own_load
from autoscale.profile import Fingerprint, Profile, SLOSpec
from autoscale.operators import Operator, restore
from autoscale.ranges import (RESWEEP_AFTER_S, PoolSpec, allowed_range, at_slo, judge_sweep, measured_range,
                              settle)
from autoscale.setups import GONE_AFTER_REPORTS, SetUps, forget_after
from autoscale.store import ProfileStore
from infra.state import MemoryStore, StateStore
from pools.control import (CalibrationJson, DecisionJson, LimitsDirective, PinResult, PoolSnapshot, PoolStatus,
                           PoolView, ReplicaStats, ReplicaStatus, SloJson)
from pools.types import SafeRange, deep_queue

log = logging.getLogger("poolserve.autoscale")


@dataclass
class _PoolState:
    spec: PoolSpec
    operator: Operator = field(default_factory=Operator)
    policy: PolicyState | None = None  # None until the first report is adopted
    reports: dict[str, tuple[float, ReplicaStats]] = field(default_factory=dict)  # replica -> (received, stats)
    events: Events = field(default_factory=Events)
    first_report_at: float | None = None  # of this controller: adoption waits a while for a replica that is current
    restored_epoch: int = field(init=False)  # the epoch the controller before this one left
    calibration: CalibrationJson = field(default_factory=lambda: CalibrationJson(state="unknown"))
    measured: SafeRange | None = None  # the range of the profile the pool runs on, at its SLO
    profile: Profile | None = None  # that profile, as measured (at its sweep's SLO)
    profile_calibration: CalibrationJson | None = None  # the calibration it came with, before the SLO's judgement
    sweep: int | None = None  # a background sweep's pin: never kept across restarts (a new sweep starts)
    fingerprint: Fingerprint | None = None
    last_logged: str = ""
    discarded_sweeps: int = 0  # sweeps of this start that were not evidence (`autoscale.ranges.not_evidence`)
    sweep_after: float = 0.0  # no new sweep before this (after a discarded one)
    set_ups: SetUps = field(default_factory=SetUps)

    def __post_init__(self) -> None:
        self.restored_epoch = self.operator.epoch

    def forget_set_up(self, now: float) -> None:
        """What the old set-up measured says nothing of a new one: its range, and the latency its
        policy saw. Discarded sweeps stay counted (a pool that flips still gives up)."""
        if self.calibration.state != "unknown":
            self.set_ups.other_at = now  # a sweep that started before measured the old set-up
        self.measured = self.profile = self.profile_calibration = None
        self.policy = self.policy.restarted(now) if self.policy is not None else None


def _settles(p: _PoolState, stats: ReplicaStats, fingerprint: Fingerprint | None, now: float, gone_after: float
             ) -> bool:
    """This report settles the pool's profile: its first readable one, or one of a set-up the
    pool's replicas have moved to (for a pool whose range depends on its set-up)."""
    if p.calibration.state == "unknown":
        return fingerprint is not None or not stats.fingerprint
    if p.spec.profile is None and p.spec.calibration.mode != "auto":  # a configured range, whatever runs it
        return False
    return p.set_ups.moved(stats.pool, p.fingerprint, fingerprint, now, gone_after)


def _keep(p: _PoolState, stats: ReplicaStats, now: float, max_age: float) -> None:
    """A report kept, its counters noted, and replicas long silent forgotten (`forget_after`)."""
    if (last := p.reports.get(stats.replica)) is not None and now - last[0] > max_age:
        log.warning("pool %s replica %s: no report for %.1f s; reports older than %.1f s count as missing, "
                    "so the autoscaler held while it was silent", stats.pool, stats.replica, now - last[0], max_age)
    p.reports[stats.replica] = (now, stats)
    p.events.note(stats)
    gone = [r for r, (t, _) in p.reports.items() if now - t > forget_after(max_age)]
    for r in gone:
        del p.reports[r]
    p.events.forget(gone)
    p.set_ups.forget(gone)


def _adoptable(p: _PoolState, stats: ReplicaStats, now: float, wait_s: float, max_age: float
               ) -> ReplicaStats | None:
    """The report a controller that starts over adopts the pool's limit from (None: not yet): one
    that applied the last directive; if none came within `wait_s`, the fresh one furthest along.
    A new replica, still at its starting limit, reporting first once sent all the others down to
    it (16 -> 2) under the epoch they had applied."""
    p.first_report_at = now if p.first_report_at is None else p.first_report_at
    if stats.applied_epoch >= p.restored_epoch or _pinned(p) is not None:
        return stats
    if now - p.first_report_at < wait_s:
        return None
    return max((s for t, s in p.reports.values() if now - t <= max_age), key=lambda s: s.applied_epoch)


def _sweepable(p: _PoolState, now: float) -> bool:
    return p.calibration.state == "calibrating" and now >= p.sweep_after and p.operator.pinned is None


def _pinned(p: _PoolState) -> int | None:
    """The operator's pin beats a background sweep's (which lets go, `Calibrator`)."""
    return p.operator.pinned if p.operator.pinned is not None else p.sweep


class Controller:
    def __init__(self, specs: dict[str, PoolSpec], config: AutoscaleConfig, clock: Callable[[], float],
                 wall_clock: Callable[[], float] = time.time, store: StateStore | None = None,
                 profiles: ProfileStore | None = None) -> None:
        self._config, self._clock, self._wall = config, clock, wall_clock
        self._store = store or MemoryStore()
        self._profiles = profiles or ProfileStore(MemoryStore())
        self._pools = {name: _PoolState(spec, restore(self._store, name)) for name, spec in specs.items()}
        self._log: collections.deque[DecisionJson] = collections.deque(maxlen=config.decision_log_size)
        self._between: list[DecisionJson] = []  # moves made at reports, returned with the next tick's

    # -- replica protocol --------------------------------------------------------

    def report(self, stats: ReplicaStats) -> LimitsDirective:
        p, now = self._pools[stats.pool], self._clock()
        _keep(p, stats, now, self._config.stats_max_age_s)
        if stats.applied_epoch > p.operator.epoch:  # epochs of a controller before this one
            self._set(p, epoch=stats.applied_epoch)
        fingerprint, gone_after = p.set_ups.read(stats), GONE_AFTER_REPORTS * self._config.stats_max_age_s
        if _settles(p, stats, fingerprint, now, gone_after):
            self._settle_profile(p, fingerprint)
        if fingerprint is not None:
            p.set_ups.note(stats.replica, fingerprint, now, p.fingerprint)
        allowed = self.allowed(stats.pool)
        if p.policy is None:
            source = _adoptable(p, stats, now, gone_after, self._config.stats_max_age_s)
            own = min(max((source or stats).gate.limits.max_active_seqs, allowed.low), allowed.high)
            if source is None:  # behind the last directive: it keeps its own limit, and its epoch, meanwhile
                return LimitsDirective(allowed.limits_for(own), allowed, stats.applied_epoch, "")
            # the controller before may have just moved the limits, and P99s predate that: a change now
            p.policy = PolicyState(target=own, last_change_at=now)
            if source.applied_epoch < p.restored_epoch:  # none current came: a change for the others
                self._bump(p)
            log.info("pool %s: adopted max_active_seqs=%d from replica %s", stats.pool, own, source.replica)
        elif (not self._config.dry_run and _pinned(p) is None
              and deep_queue(*own_load(fresh := self.replica_stats(stats.pool)), len(fresh), p.policy.target)
              and (moved := self._decide(stats.pool, at_tick=False)) is not None):
            self._between.append(moved)  # up at once, not at the next tick
        target = min(max(self.target(stats.pool), allowed.low), allowed.high)  # the range may have just moved
        reason = "pinned" if p.operator.pinned is not None else "sweep" if p.sweep is not None else ""
        return LimitsDirective(allowed.limits_for(target), allowed, p.operator.epoch, reason)

    # -- decisions ---------------------------------------------------------------

    def tick(self) -> list[DecisionJson]:
        """This tick's decisions, after the moves made at reports since the last one."""
        between, self._between = self._between, []
        return between + [d for name in self._pools if (d := self._decide(name)) is not None]

    def _decide(self, name: str, at_tick: bool = True) -> DecisionJson | None:
        p, now = self._pools[name], self._clock()
        if p.policy is None or _pinned(p) is not None:  # what a pin or a sweep causes is not the autoscaler's
            p.policy = p.policy and p.policy.seen(p.events)
            return None
        old = p.policy.target
        cfg = PolicyConfig.of(self._config, self.allowed(name), self.slo(name))
        new, state, reason = decide(self.snapshot(name), p.policy, cfg, now, at_tick)
        if not at_tick and reason.action != "up":  # only an up move is made between ticks
            return None
        if applied := not self._config.dry_run:
            p.policy = state
            if new != old:
                self._bump(p)
        else:  # dry run: keep the bookkeeping (queue ticks, counters) but never the move
            p.policy = replace(state, target=old, last_change_at=p.policy.last_change_at,
                               last_direction=p.policy.last_direction, follow_up=p.policy.follow_up)
        decision = DecisionJson(time=self._wall(), pool=name, old=old, new=new, action=reason.action,
                                code=reason.code, reason=reason.text, applied=applied)
        _remember(self._log, p, decision, reason)
        return decision

    # -- views -------------------------------------------------------------------

    def replica_stats(self, name: str) -> list[ReplicaStats]:
        return [s for _, s in self.replica_reports(name)]

    def replica_reports(self, name: str) -> list[tuple[float, ReplicaStats]]:
        """The fresh reports, each with when it arrived (this controller's clock)."""
        now, max_age = self._clock(), self._config.stats_max_age_s
        return [(t, s) for (t, s) in self._pools[name].reports.values() if now - t <= max_age]

    def snapshot(self, name: str) -> PoolSnapshot:
        return aggregate(self.replica_stats(name), self._pools[name].events)

    def allowed(self, name: str) -> SafeRange:
        p = self._pools[name]
        return allowed_range(p.spec, p.calibration.state, p.measured, p.operator.calibrating or p.sweep is not None)

    def slo(self, name: str) -> SloJson:
        p = self._pools[name]
        return p.operator.slo or SloJson(ttft_p99_ms=p.spec.ttft_slo_s * 1e3, tpot_p99_ms=p.spec.tpot_slo_s * 1e3)

    def target(self, name: str) -> int | None:
        p = self._pools[name]
        pinned = _pinned(p)
        return pinned if pinned is not None else p.policy.target if p.policy is not None else None

    def views(self) -> dict[str, PoolView]:
        now, max_age = self._clock(), self._config.stats_max_age_s
        return {name: _view(p, t if (t := self.target(name)) is not None else self.allowed(name).low, now, max_age)
                for name, p in self._pools.items()}

    def status(self, name: str) -> PoolStatus:
        p, allowed, snap = self._pools[name], self.allowed(name), self.snapshot(name)
        serving = allowed_range(p.spec, p.calibration.state, p.measured, False)
        return PoolStatus(pool=name, target_max_active_seqs=self.target(name), epoch=p.operator.epoch,
                          pinned=_pinned(p), calibrating=p.operator.calibrating or p.sweep is not None,
                          safe_range=(allowed.low, allowed.high), ladder=allowed.steps, slo=self.slo(name),
                          serving_range=(serving.low, serving.high),
                          calibration=p.calibration, lending=p.operator.lending, snapshot=snap,
                          replicas=tuple(ReplicaStatus.of(s) for s in self.replica_stats(name)))

    def decisions(self, limit: int = 100) -> list[DecisionJson]:
        return list(self._log)[max(0, len(self._log) - max(0, limit)):]  # [-0:] would be all of it

    def calibration(self, name: str) -> CalibrationJson:
        return self._pools[name].calibration

    def fingerprint(self, name: str) -> Fingerprint | None:
        return self._pools[name].fingerprint

    # -- profiles ------------------------------------------------------------------------

    def _settle_profile(self, p: _PoolState, fingerprint: Fingerprint | None) -> None:
        """Which profile a pool runs on, decided at its first report (its fingerprint is known)
        and again when its replicas have moved to another set-up."""
        calibration, profile = settle(p.spec, fingerprint, self._profiles)  # may raise: settled at the next report
        p.forget_set_up(self._clock())
        p.fingerprint = fingerprint
        self._set_calibration(p, calibration, profile)

    def _set_calibration(self, p: _PoolState, calibration: CalibrationJson, profile: Profile | None) -> None:
        """The pool runs on `profile` (None: keeps its measured range), judged at its SLO, now and when it changes."""
        if profile is not None:
            p.profile, p.profile_calibration = profile, calibration
        p.calibration, profile = at_slo(calibration, profile, SLOSpec(**self.slo(p.spec.name).model_dump()))
        if profile is not None:
            p.measured = measured_range(p.spec, profile)
        self._bump(p)
        level = logging.INFO if calibration.measured else logging.WARNING
        log.log(level, "pool %s: %s; %s; safe range %s", p.spec.name, calibration.source, calibration.detail,
                list(self.allowed(p.spec.name).steps))

    def sweep_pin(self, name: str, seqs: int | None) -> int:
        """A background sweep holds the pool at `seqs` (None: lets go, if it holds it); the epoch that carries it."""
        p = self._pools[name]
        if seqs is None and p.sweep is not None and p.policy is not None:  # its requests stay in the P99s: a change
            p.policy = p.policy.changed(self._clock())
        if seqs is not None or p.sweep is not None:  # letting go of nothing changes nothing
            p.sweep = seqs
            self._bump(p)
        return p.operator.epoch

    def needs_sweep(self) -> list[str]:
        now = self._clock()
        return [n for n, p in self._pools.items() if _sweepable(p, now)]

    def operator_pin(self, name: str) -> int | None:
        return self._pools[name].operator.pinned

    def sweep_progress(self, name: str, detail: str) -> None:
        self._pools[name].calibration = self._pools[name].calibration.model_copy(update={"detail": detail})

    def adopt(self, name: str, profile: Profile, started: float | None = None) -> None:
        """A sweep begun at `started` finished: the pool moves inside its range, or keeps its own and
        sweeps again later (`ranges.judge_sweep`); one of a set-up it no longer runs changes nothing."""
        p = self._pools[name]
        if profile.fingerprint != p.fingerprint:
            log.warning("pool %s: a sweep of a set-up the pool no longer runs is not kept", name)
            return
        mixed = started is not None and p.set_ups.served_since(started)
        calibration, kept = judge_sweep(profile, self._profiles.get(name, profile.fingerprint), p.discarded_sweeps,
                                        p.calibration.source, p.measured,
                                        "replicas of another set-up served during it" if mixed else None)
        if kept is None:
            p.discarded_sweeps += 1
            p.sweep_after = self._clock() + RESWEEP_AFTER_S
        else:
            self._profiles.put(kept)
        self._set_calibration(p, calibration, kept)

    def sweep_failed(self, name: str, reason: str, fingerprint: Fingerprint | None = None) -> None:
        p = self._pools[name]
        if fingerprint is not None and fingerprint != p.fingerprint:  # the pool has settled on its new set-up
            return
        self._set_calibration(p, CalibrationJson(state="failed", source=p.calibration.source,
                                                 detail=f"the sweep failed ({reason}): the fallback range"), None)

    # -- operator actions --------------------------------------------------------

    def pin(self, name: str, seqs: int, calibrating: bool = False) -> PinResult:
        """Hold a pool at `seqs` (the autoscaler stops moving it) until `unpin`.
        `calibrating` widens the allowed range to [1, max_num_seqs] for a sweep."""
        p = self._pools[name]
        allowed = allowed_range(p.spec, p.calibration.state, p.measured, calibrating)
        if not allowed.low <= seqs <= allowed.high or seqs not in allowed.ladder:
            return PinResult(pool=name, error=(
                f"max_active_seqs={seqs} is outside pool {name!r}'s allowed range [{allowed.low}, {allowed.high}] "
                f"(ladder {list(allowed.steps)})" + ("" if calibrating else "; pass calibrating=true to sweep beyond it")))
        old = self.target(name)
        if p.policy is not None and seqs != old:  # a change, but no direction of the autoscaler's to reverse
            p.policy = p.policy.changed(self._clock())
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
            # Resume from the pinned value (the next tick clamps it into the safe range): no change,
            # unless the pin was a sweep's, whose own requests fill the P99s for a latency window.
            p.policy = replace(p.policy, target=p.operator.pinned)
            if p.operator.calibrating:
                p.policy = p.policy.changed(self._clock())
        self._set(p, pinned=None, calibrating=False, epoch=p.operator.epoch + 1)
        return PinResult(pool=name, epoch=p.operator.epoch)

    def set_slo(self, name: str, slo: SloJson) -> None:
        self._set(p := self._pools[name], slo=slo)
        if p.profile is not None:  # the range its rows give at the new SLO
            calibration, judged = at_slo(p.profile_calibration, p.profile, SLOSpec(**slo.model_dump()))
            p.measured = measured_range(p.spec, judged)
            if p.calibration.state == p.profile_calibration.state:  # a failed sweep's detail stays its own
                p.calibration = calibration
            self._bump(p)
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
        self._store.put(f"pool/{p.spec.name}", {"pinned": o.pinned, "calibrating": o.calibrating, "lending": o.lending,
                                                "epoch": o.epoch, "slo": o.slo.model_dump() if o.slo else None})


def _remember(decisions: collections.deque[DecisionJson], p: _PoolState, d: DecisionJson, reason: Reason) -> None:
    """Into the decision log: every move, and a hold when its reason differs from the last one logged."""
    key = f"{d.action}:{d.code}"
    if d.old != d.new or key != p.last_logged:
        decisions.append(d)
        p.last_logged = key
        level = logging.INFO if d.old != d.new else logging.DEBUG
        log.log(level, "pool %s: %d -> %d %s%s", d.pool, d.old, d.new, reason,
                "" if d.applied else " (dry run, not applied)")


def _view(p: _PoolState, seqs: int, now: float, max_age: float) -> PoolView:
    """What routers see of a pool: its fresh replicas' load, and since when any of them last
    had the pool's own traffic (what the replica saw when it reported, plus the report's age)."""
    recent = [(t, s) for t, s in p.reports.values() if now - t <= max_age]
    fresh = [s for _, s in recent]
    sweeping = p.operator.calibrating or p.calibration.state == "calibrating"  # no borrowing in or out
    return PoolView(p.spec.name, len(fresh), seqs * max(1, len(fresh)), sum(s.gate.active for s in fresh),
                    sum(s.gate.queued for s in fresh), bool(fresh), sweeping, p.operator.lending,
                    own_requests=sum(s.gate.own_work for s in fresh),
                    borrowed_requests=sum(s.gate.borrowed_requests for s in fresh),
                    own_quiet_s=min((s.gate.own_idle_s + now - t for t, s in recent), default=float("inf")))
