"""A pool whose replicas move to another set-up (a node pool of another machine type, a new
vLLM) runs on that set-up's profile, not on the one it settled at its first report."""

from __future__ import annotations

import pytest

from autoscale.calibrate import build_profile
from autoscale.config import AutoscaleConfig
from autoscale.controller import Controller
from autoscale.setups import GONE_AFTER_REPORTS
from autoscale.profile import Fingerprint, KneeRule, SLOSpec
from autoscale.store import ProfileStore
from infra.state import MemoryStore
from pools.control import ReplicaStats
from pools.types import EngineStats, GateStats, LatencySample
from tests.unit.knee_fixtures import batching
from tests.unit.test_selfcal import ELSEWHERE, FALLBACK, FP, TRAFFIC, configured_profile, spec

MAX_AGE = AutoscaleConfig().stats_max_age_s
GONE = GONE_AFTER_REPORTS * MAX_AGE  # a set-up silent this long has left the pool


class Pool:
    """A controller on a hand-moved clock, and replicas that report on a set-up of their own."""

    def __init__(self, store: ProfileStore | None = None, mode: str = "auto") -> None:
        self.now = 1000.0
        self.c = Controller({"p": spec(mode)}, AutoscaleConfig(), lambda: self.now,
                            profiles=store or ProfileStore(MemoryStore()))

    def report(self, replica: str, fp: dict, seqs: int | None = None):
        allowed = self.c.allowed("p") if self.c.calibration("p").state != "unknown" else FALLBACK
        limits = allowed.limits_for(seqs or allowed.low)
        gate = GateStats(active=0, inflight_tokens=0, queued_by_class={}, queued_tokens=0, oldest_wait_s=0,
                         limits=limits, admitted=0, rejected=0, cancelled=0, evicted=0, completed=0)
        return self.c.report(ReplicaStats("p", replica, self.now, gate, EngineStats(), LatencySample(), allowed,
                                          applied_epoch=self.c.status("p").epoch, fingerprint=fp))

    def serve(self, seconds: float, *replicas: tuple[str, dict]) -> None:
        """`seconds` go by while `replicas` report every 5 s."""
        for _ in range(int(seconds // 5) + 1):
            self.now += 5
            for replica, fp in replicas:
                self.report(replica, fp)

    def range(self) -> tuple[int, int]:
        return self.c.allowed("p").low, self.c.allowed("p").high


def measured_on(fp: dict, created: str = "2026-12-05"):
    return build_profile("p", batching()[:3], Fingerprint(**fp), SLOSpec(ttft_p99_ms=1000, tpot_p99_ms=100), TRAFFIC,
                         KneeRule(), (), created)


def test_replicas_on_another_set_up_are_run_on_its_calibration_once_the_old_ones_are_gone():
    """The configured profile was measured on ELSEWHERE, and the pool ran in its range (1-8).
    Its replicas then came back on FP, a set-up nobody measured: the controller kept the
    profile of the machine they left, for as long as it ran."""
    pool = Pool()
    pool.report("r1", ELSEWHERE)
    assert pool.c.calibration("p").state == "profile" and pool.range() == (1, 8)
    pool.serve(GONE, ("r1", ELSEWHERE), ("r2", FP))  # a replica on the new set-up beside r1: r1's range holds
    assert pool.c.calibration("p").state == "profile" and pool.c.fingerprint("p") == Fingerprint(**ELSEWHERE)
    pool.serve(GONE - 5, ("r2", FP))  # r1 has left: not yet long enough to be gone for good
    assert pool.c.fingerprint("p") == Fingerprint(**ELSEWHERE)
    pool.now += 5
    directive = pool.report("r2", FP)
    calibration = pool.c.calibration("p")
    assert calibration.state == "calibrating" and pool.c.needs_sweep() == ["p"]
    assert "hardware" in calibration.source  # which part of the set-up changed
    assert pool.range() == (FALLBACK.low, FALLBACK.high) == (directive.allowed.low, directive.allowed.high)
    assert pool.c.fingerprint("p") == Fingerprint(**FP)
    assert directive.epoch > 0 and pool.c.status("p").serving_range == (1, 16)


def test_a_set_up_measured_before_is_run_on_its_stored_profile_at_once():
    store = ProfileStore(MemoryStore())
    store.put(measured_on(FP))
    pool = Pool(store)
    pool.report("r1", ELSEWHERE)
    before = pool.c.status("p").epoch
    pool.serve(GONE, ("r2", FP))
    assert pool.c.calibration("p").state == "profile" and "profile store" in pool.c.calibration("p").source
    assert pool.range() == (1, measured_on(FP).range[1]) and pool.c.status("p").epoch > before
    assert pool.c.needs_sweep() == []


def test_a_sweep_of_a_set_up_that_left_during_it_is_not_kept():
    """Its rows measured the machines that left, or a mix: stored under the new set-up's
    fingerprint, they would be that set-up's safe range on every later start."""
    store = ProfileStore(MemoryStore())
    pool = Pool(store)
    pool.report("r1", FP)
    assert pool.c.needs_sweep() == ["p"]
    started = pool.now
    pool.c.sweep_pin("p", 1)
    other = {**FP, "vllm_version": "0.30.0"}
    pool.serve(GONE, ("r2", other))  # the pool's replicas were upgraded in the middle of the sweep
    pool.c.adopt("p", measured_on(FP), started)  # the sweep ends, measured (mostly) on FP
    pool.c.sweep_pin("p", None)
    assert store.get("p", Fingerprint(**other)) is None
    assert pool.c.calibration("p").state == "calibrating" and pool.c.needs_sweep() == ["p"]


def test_replicas_that_report_no_set_up_change_nothing():
    pool = Pool()
    pool.report("r1", ELSEWHERE)
    pool.serve(GONE, ("r2", {}))  # an older replica that sends no fingerprint
    assert pool.c.calibration("p").state == "profile" and pool.c.fingerprint("p") == Fingerprint(**ELSEWHERE)


@pytest.mark.parametrize("mode, state", [("fallback", "fallback"), ("strict", "strict")])
def test_a_new_set_up_without_a_profile_follows_the_calibration_mode(mode, state):
    pool = Pool(mode=mode)
    pool.report("r1", ELSEWHERE)
    assert pool.c.calibration("p").state == "profile"
    pool.serve(GONE, ("r2", FP))
    assert pool.c.calibration("p").state == state and pool.c.needs_sweep() == []


def test_the_change_starts_the_pools_latency_state_over_it_was_measured_on_the_old_set_up():
    """A step down for a breach measured on the old machines held the new ones to that breach's
    P99 (the policy holds while a step down seems not to have helped)."""
    import dataclasses

    pool = Pool()
    pool.report("r1", ELSEWHERE, seqs=8)
    p = pool.c._pools["p"]
    p.policy = dataclasses.replace(p.policy, down_code="ttft_p99", down_level=0.9, last_direction=-1, queue_ticks=3)
    r1_last = pool.now
    pool.serve(GONE, ("r2", FP))
    assert r1_last + GONE < p.policy.last_change_at <= pool.now  # the cooldown counts from the move
    assert (p.policy.down_code, p.policy.down_level, p.policy.last_direction, p.policy.queue_ticks) == ("", 0.0, 0, 0)
    assert p.policy.target == 8


def test_the_configured_profile_is_still_found_when_the_pool_comes_back_to_its_set_up():
    pool = Pool()
    pool.report("r1", ELSEWHERE)
    pool.serve(GONE, ("r2", FP))
    pool.serve(GONE, ("r3", ELSEWHERE))
    assert pool.c.calibration("p").state == "profile" and pool.range() == (1, 8)
    assert configured_profile().fingerprint == Fingerprint(**ELSEWHERE)


def test_a_background_sweep_names_the_set_up_it_started_on():
    """The sweep stamped its profile with the pool's fingerprint when it ended: replicas that
    moved during it had the old machines' rows kept as the new machines' profile."""
    import asyncio

    from autoscale.selfcal import Calibrator
    from tests.unit.test_selfcal import FakePool, report
    from tests.unit.virtual_time import run

    moved = {**FP, "hardware": "cpu:the next node pool"}

    class MovingPool(FakePool):
        async def report_forever(self) -> None:
            for i in range(10**9):
                await asyncio.sleep(self.every)
                b = self.active
                self.tokens += self.every * (1000 * b / (20 + b))
                report(self.c, FP if i < 40 else moved, active=b, tokens=int(self.tokens), borrowed=b)

    store = ProfileStore(MemoryStore())

    async def go():
        clock = asyncio.get_running_loop().time
        c = Controller({"p": spec(sweep=(1, 4, 16))}, AutoscaleConfig(), clock, profiles=store)
        pool = MovingPool(c)
        report(c, FP)
        reporter = asyncio.get_running_loop().create_task(pool.report_forever())
        try:
            await asyncio.wait_for(Calibrator(c, pool.handle, max_model_len=2048, clock=clock).step(), 600)
        finally:
            reporter.cancel()
        return c

    c = run(go)
    assert store.get("p", Fingerprint(**moved)) is None and store.get("p", Fingerprint(**FP)) is None
    assert c.fingerprint("p") == Fingerprint(**moved)
    assert c.calibration("p").state == "calibrating" and c.needs_sweep() == ["p"]


def test_set_ups_that_report_in_turns_do_not_flip_the_pool():
    """Replicas of two set-ups whose reports come late in turns (a stalled host) flipped the pool
    between their profiles at every report: the old set-up must be silent for `GONE` first."""
    pool = Pool()
    pool.report("r1", ELSEWHERE)
    epoch = pool.c.status("p").epoch
    for i in range(12):
        pool.now += MAX_AGE + 1
        pool.report("r2" if i % 2 == 0 else "r1", FP if i % 2 == 0 else ELSEWHERE)
    assert pool.c.fingerprint("p") == Fingerprint(**ELSEWHERE) and pool.c.status("p").epoch == epoch


def test_a_fingerprint_this_version_cannot_read_settles_nothing_and_breaks_no_report(caplog):
    """A newer replica's fingerprint with a field this version lacks raised in every report
    that compared against it, the other replicas' included."""
    pool = Pool()
    newer = {**FP, "attention_backend": "flash"}
    pool.report("r0", newer)
    assert pool.c.calibration("p").state == "unknown"  # the fallback range until a readable one reports
    pool.report("r1", ELSEWHERE)
    assert pool.c.calibration("p").state == "profile"
    pool.serve(GONE, ("r0", newer), ("r2", FP))
    assert pool.c.fingerprint("p") == Fingerprint(**FP)  # r2's set-up, once r1's had left
    assert sum("cannot be read" in r.message for r in caplog.records) == 1  # once per replica


def test_a_replica_whose_set_up_changes_under_its_name_is_read_again():
    """The controller keeps each replica's last fingerprint read (one a second per replica);
    a replica that reports another set-up under the same name (its engine restarted on an
    upgraded vLLM) must be read anew, even if its report reuses the dict it sent before."""
    pool = Pool()
    reported = dict(ELSEWHERE)
    pool.report("r1", reported)
    assert pool.c.fingerprint("p") == Fingerprint(**ELSEWHERE)
    reported.update(FP)
    pool.serve(GONE + 5, ("r1", reported))
    assert pool.c.fingerprint("p") == Fingerprint(**FP)


def test_a_sweep_that_replicas_of_another_set_up_served_is_discarded():
    """The pool runs on FP, unmeasured; a replica of the set-up it left comes back during the
    sweep, which then measures the mix: kept, it would be FP's profile on every later start."""
    store = ProfileStore(MemoryStore())
    pool = Pool(store)
    pool.report("r1", ELSEWHERE)
    pool.serve(GONE, ("r2", FP))
    assert pool.c.needs_sweep() == ["p"]
    started = pool.now
    pool.serve(20, ("r2", FP), ("r1", ELSEWHERE))  # r1 is back while the sweep runs
    pool.c.adopt("p", measured_on(FP), started)
    assert store.get("p", Fingerprint(**FP)) is None
    calibration = pool.c.calibration("p")
    assert calibration.state == "calibrating" and "another set-up served during it" in calibration.detail
    assert pool.range() == (FALLBACK.low, FALLBACK.high)
    pool.now += 5
    later = pool.now
    pool.serve(GONE, ("r2", FP))  # r1 left again: the next sweep is of FP alone
    pool.c.adopt("p", measured_on(FP), later + GONE)
    assert pool.c.calibration("p").state == "profile" and store.get("p", Fingerprint(**FP)) is not None


def test_a_sweep_that_fails_after_the_pool_moved_does_not_fail_the_new_set_up():
    pool = Pool()
    pool.report("r1", FP)
    assert pool.c.needs_sweep() == ["p"]
    other = {**FP, "hardware": "cpu:the next node pool"}
    pool.serve(GONE, ("r2", other))
    pool.c.sweep_failed("p", "TimeoutError: the old replicas left", Fingerprint(**FP))
    assert pool.c.calibration("p").state == "calibrating" and pool.c.needs_sweep() == ["p"]
