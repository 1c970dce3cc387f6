"""The controller around decide(): adopting reported limits, moves over time, restarts, the
operator's pins and dry runs."""

from __future__ import annotations

import pytest

from autoscale.config import AutoscaleConfig
from autoscale.controller import Controller, PoolSpec
from autoscale.policy import PolicyState, aggregate, decide
from pools.control import ReplicaStats
from pools.types import EngineStats, GateStats, LatencySample
from tests.unit.test_autoscale_policy import CFG, NOW, RANGE, snap


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def stats(pool="p", replica="r1", seqs=8, queued=0, ttft=(0.1,) * 20, tpot=(0.01,) * 20, fingerprint=None):
    gate = GateStats(active=seqs, inflight_tokens=0, queued_by_class={"batch": queued}, queued_tokens=queued * 100,
                     oldest_wait_s=0, limits=RANGE.limits_for(seqs), admitted=0, rejected=0, cancelled=0,
                     evicted=0, completed=0)
    return ReplicaStats(pool=pool, replica=replica, time=0, gate=gate, engine=EngineStats(),
                        latency=LatencySample(ttft, tpot), safe_range=RANGE, fingerprint=fingerprint or {})


def controller(**config) -> tuple[Controller, Clock]:
    clock = Clock()
    cfg = AutoscaleConfig(interval_s=5, cooldown_s=30, reversal_cooldown_s=90, queue_persist_ticks=2, **config)
    return Controller({"p": PoolSpec("p", RANGE, 1.0, 0.1, 32)}, cfg, clock, wall_clock=clock), clock


def test_controller_adopts_reported_limits_and_steps_up_under_a_queue():
    """Adopted, not reset; and adoption counts as a change: the one before this controller may
    have just moved the limits, so the first step waits out the cooldown and the latency window."""
    c, clock = controller()
    assert c.report(stats(seqs=4)).limits.max_active_seqs == 4
    for _ in range(6):
        clock.t += 5
        c.report(stats(seqs=4, queued=3))  # 7 running and waiting, 13 with a burst: the top holds them
        c.tick()
    assert c.target("p") == 16
    assert c.report(stats(seqs=4, queued=3)).limits.max_active_seqs == 16
    moves = [d for d in c.decisions() if d.old != d.new]
    assert [d.new for d in moves] == [16] and moves[0].time == 30  # cooldown_s and latency_window_s: 30 s
    assert {d.code for d in c.decisions() if 10 <= d.time < 30} == {"cooldown"}  # the queue persisted from 10 s


def test_the_controller_meets_a_load_step_in_one_move():
    """From the bottom, a queue of 40 waits out the cooldown once and then goes straight to the
    step that holds it, not one step per cooldown."""
    c, clock = controller()
    c.report(stats(seqs=2))
    for _ in range(8):
        clock.t += 5
        c.report(stats(seqs=2, queued=40))
        c.tick()
    moves = [d for d in c.decisions() if d.old != d.new]
    assert [(d.old, d.new) for d in moves] == [(2, 16)]
    assert "to 16, the top of the safe range (42 sequences of its own running and waiting" in moves[0].reason


def test_a_queue_as_deep_as_the_batch_moves_the_limit_at_the_report_that_shows_it():
    """Ticks come every `interval_s` (5 s by default) and replicas report every second: a queue
    at least as deep as the batch is decided at the report, whose directive carries the new
    limit, and a second one at once if the queue is still that deep at the limit the first set
    (the first was too small), once: the queue is counted at the current limit, not read over
    a latency window. A shallower queue waits for its ticks; cooldowns and pins hold as ever."""
    c, clock = controller(latency_window_s=60)  # longer than the cooldown, as in the benchmark
    c.report(stats(seqs=2))
    clock.t = 100  # past the adoption's cooldown and latency window
    assert c.report(stats(seqs=2, queued=1)).limits.max_active_seqs == 2
    assert c.report(stats(seqs=2, queued=2)).limits.max_active_seqs == 8  # twice the batch; 8 with a burst
    assert [(d.old, d.new, d.code) for d in c.decisions() if d.old != d.new] == [(2, 8, "deep_queue")]
    clock.t = 101
    assert c.report(stats(seqs=8, queued=5)).limits.max_active_seqs == 8  # not deep at 8: the move's cooldown
    assert c.decisions()[-1].new == 8  # a hold waits for the tick to be logged
    assert c.report(stats(seqs=8, queued=8)).limits.max_active_seqs == 16  # deep at 8: too small a move
    assert [(d.new, d.code) for d in c.decisions() if d.old != d.new] == [(8, "deep_queue"), (16, "deep_queue")]
    c.pin("p", 2)
    clock.t += 1000
    assert c.report(stats(seqs=2, queued=40)).limits.max_active_seqs == 2
    c.pin("p", 4)
    c.unpin("p")
    clock.t += 1
    assert c.report(stats(seqs=4, queued=40)).limits.max_active_seqs == 4  # a pin's move is not followed


def test_a_move_made_at_a_report_is_returned_with_the_next_tick():
    """The service counts what `tick()` returns in its metrics: a move made at a report must
    be among them, once."""
    c, clock = controller()
    c.report(stats(seqs=2))
    clock.t = 100
    c.report(stats(seqs=2, queued=2))
    ticked = [(d.old, d.new, d.action) for d in c.tick()]
    assert ticked[0] == (2, 8, "up") and len(ticked) == 2  # the move, then the tick's own decision
    assert [d.action for d in c.tick()] == ["hold"]


def test_a_deep_queue_seen_at_a_report_counts_no_tick():
    """A deep queue held back at a report (latency inside the band) counted as a tick of its
    queue: the next tick's queue of one then stood after that single tick and moved the pool."""
    c, clock = controller()
    c.report(stats(seqs=2))
    clock.t = 100
    c.tick()
    c.report(stats(seqs=2, queued=2, ttft=(0.8,) * 20))  # deep, but P99 TTFT in the hysteresis band
    assert c.target("p") == 2
    clock.t = 105
    c.report(stats(seqs=2, queued=1))
    assert [(d.action, d.code) for d in c.tick()] == [("hold", "idle")] and c.target("p") == 2


def test_a_dry_run_makes_no_decisions_at_reports():
    """Nothing moves in a dry run, so a deep queue stays deep: deciding at every report logged
    one decision per report of every replica, and pushed other pools' out of the log."""
    c, clock = controller(dry_run=True)
    c.report(stats(seqs=4))
    clock.t = 100
    logged = len(c.decisions(1000))
    for _ in range(20):
        clock.t += 0.5
        c.report(stats(seqs=4, queued=20))
    assert len(c.decisions(1000)) == logged
    assert [(d.action, d.applied) for d in c.tick()] == [("up", False)]


def test_a_report_without_a_deep_queue_computes_no_percentiles(monkeypatch):
    """Replicas report every second: the check for a deep queue reads counts, not latencies."""
    import autoscale.controller as controller_module

    calls = []
    monkeypatch.setattr(controller_module, "aggregate", lambda reports: calls.append(1) or aggregate(reports))
    c, clock = controller()
    c.report(stats(seqs=4))
    for _ in range(16):
        clock.t += 1
        c.report(stats(seqs=4, queued=3))
    assert calls == []


def test_only_the_pools_own_work_under_its_limit_makes_a_deep_queue():
    """Borrowed requests (another pool's, which the lender sends home when it needs its slots)
    and sequences still running above a limit just lowered made a queue look deep."""
    import dataclasses

    c, clock = controller()
    c.report(stats(seqs=4))
    clock.t = 100
    lent = stats(seqs=4)
    lent = dataclasses.replace(lent, gate=dataclasses.replace(lent.gate, borrowed_requests=4, borrowed_seqs=4,
                                                              queued_by_class={"borrowed": 4}))
    assert c.report(lent).limits.max_active_seqs == 4
    leaving = stats(seqs=4, queued=1)
    leaving = dataclasses.replace(leaving, gate=dataclasses.replace(leaving.gate, active=16))  # limit 4, 16 running
    assert c.report(leaving).limits.max_active_seqs == 4
    assert c.report(stats(seqs=4, queued=4)).limits.max_active_seqs == 16  # its own: deep


def test_an_up_move_says_which_step_holds_the_demand():
    new, _, reason = decide(snap(queued=10, active=2), PolicyState(2, queue_ticks=1), CFG, NOW)
    assert new == 16 and ("to 16, the top of the safe range (12 sequences of its own running and waiting per "
                          "replica, 19 with a burst)") in reason.text
    new, _, reason = decide(snap(queued=1, active=1), PolicyState(2, queue_ticks=1), CFG, NOW)
    assert new == 8 and ("to 8, which holds the 2 sequences of its own running and waiting per replica and a "
                         "burst (5)") in reason.text
    new, _, reason = decide(snap(queued=1, active=4), PolicyState(8, queue_ticks=1), CFG, NOW)
    assert new == 16 and "holds" not in reason.text  # the next step: nothing more to say


def test_a_restarted_controller_does_not_act_on_latency_from_before_it():
    """P99s over the SLO in the first reports a new controller sees hold the limit until a
    whole latency window has passed since it adopted it (the integration test's failure: a
    restart stepped a pool down on samples from before the last pin)."""
    clock = Clock()
    cfg = AutoscaleConfig(interval_s=2, cooldown_s=6, reversal_cooldown_s=12, latency_window_s=10)
    c = Controller({"p": PoolSpec("p", RANGE, 1.0, 0.1, 32)}, cfg, clock, wall_clock=clock)
    slow = dict(seqs=8, ttft=(5.0,) * 20)
    c.report(stats(**slow))
    for _ in range(4):
        clock.t += 2
        c.report(stats(**slow))
        c.tick()
    assert c.target("p") == 8  # t = 8: inside the window
    clock.t += 2
    c.report(stats(**slow))
    c.tick()
    assert c.target("p") == 4  # the breach outlasted the window: now it counts


def test_controller_restart_resumes_from_reports():
    c, clock = controller()
    c.report(stats(seqs=16))
    fresh, _ = controller()  # a new controller: no state
    assert fresh.report(stats(seqs=16)).limits.max_active_seqs == 16


def test_missing_reports_hold():
    c, clock = controller()
    c.report(stats(seqs=8, queued=50))
    clock.t += 60  # reports stop arriving
    for _ in range(10):
        clock.t += 5
        decisions = c.tick()
    assert c.target("p") == 8 and decisions[-1].code == "stale"


def test_a_report_after_a_stale_gap_is_logged(caplog):
    c, clock = controller(stats_max_age_s=10)
    c.report(stats())
    clock.t += 9
    with caplog.at_level("WARNING", logger="poolserve.autoscale"):
        c.report(stats())  # inside the window: nothing to say
        clock.t += 12.5
        c.report(stats())
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "pool p replica r1: no report for 12.5 s; reports older than 10.0 s count as missing, so the autoscaler "
        "held while it was silent"]


def test_dry_run_decides_but_never_applies():
    c, clock = controller(dry_run=True)
    c.report(stats(seqs=4))
    for _ in range(20):
        clock.t += 5
        c.report(stats(seqs=4, queued=20))
        c.tick()
    assert c.target("p") == 4
    wanted = [d for d in c.decisions() if d.action == "up"]
    assert wanted and not any(d.applied for d in wanted)
    assert c.report(stats(seqs=4, queued=20)).limits.max_active_seqs == 4


def test_views_say_how_long_a_pools_own_work_has_been_away():
    """The youngest word of any fresh replica, aged by the time since it reported."""
    import dataclasses

    c, clock = controller()
    assert c.views()["p"].own_quiet_s == float("inf")  # nothing reported
    quiet = stats(seqs=2)
    c.report(dataclasses.replace(quiet, replica="r1", gate=dataclasses.replace(quiet.gate, own_idle_s=7.0)))
    clock.t += 1
    c.report(dataclasses.replace(quiet, replica="r2", gate=dataclasses.replace(quiet.gate, own_idle_s=2.0)))
    clock.t += 0.5
    view = c.views()["p"]
    assert view.own_quiet_s == 2.5 and view.own_requests == 0
    busy = stats(seqs=3)
    c.report(dataclasses.replace(busy, replica="r2", gate=dataclasses.replace(busy.gate, active_requests=3,
                                                                              own_idle_s=0.0)))
    assert c.views()["p"].own_quiet_s == 0.0 and c.views()["p"].own_requests == 3


def test_lending_switch_shows_in_views():
    c, _ = controller()
    assert c.views()["p"].lending
    c.set_lending("p", False)
    assert not c.views()["p"].lending


def _queue_until_a_move(c: Controller, clock: Clock, seqs: int, ticks: int = 8) -> list:
    for _ in range(ticks):
        clock.t += 5
        c.report(stats(seqs=seqs, queued=40))
        c.tick()
    return [d for d in c.decisions() if d.old != d.new and d.action != "pin"]


@pytest.mark.parametrize("before", [2, 8])
def test_unpinning_is_no_change_once_the_pinned_limit_has_held_a_while(before):
    """The limit a pin held is the one the latest P99s were measured at: unpinning restarts no
    cooldown and no latency window (the autoscaler benchmark's first move waited a whole window
    for an unpin at the limit the pool already had). The pin's own change counts from the pin."""
    c, clock = controller()
    c.report(stats(seqs=before))
    clock.t = 40
    c.pin("p", 2)
    clock.t = 100  # the pin has held for longer than the cooldown and the latency window
    c.unpin("p")
    moves = _queue_until_a_move(c, clock, seqs=2)
    assert [(d.old, d.new, d.time) for d in moves] == [(2, 16, 105)]  # the first report: 40 wait for a batch of 2


def test_a_pin_that_moved_the_limit_counts_as_a_change_from_the_pin_not_as_a_reversal():
    c, clock = controller()
    c.report(stats(seqs=8))
    clock.t = 40
    c.pin("p", 2)  # down from 8: the operator's move, not a direction of the autoscaler's
    clock.t = 41
    c.unpin("p")
    moves = _queue_until_a_move(c, clock, seqs=2)
    # The cooldown and latency window (30 s) run from the pin at 40; the first tick after 70 is 71.
    assert [(d.old, d.new, d.time) for d in moves] == [(2, 16, 71)]


def test_an_unpin_ending_a_calibration_counts_as_a_change_as_a_sweep_letting_go_does():
    """`poolserve calibrate` ends with an unpin: the P99s of the next latency window are its
    synthetic steps', not the pool's, and the limit does not step down on them."""
    c, clock = controller()
    c.report(stats(seqs=16))
    clock.t = 100
    c.pin("p", 16, calibrating=True)
    slow = (1.5,) * 20  # above the 1 s TTFT SLO
    for _ in range(10):
        clock.t += 5
        c.report(stats(seqs=16, ttft=slow))
    c.unpin("p")
    released = clock.t
    for _ in range(8):
        clock.t += 5
        c.report(stats(seqs=16, ttft=slow))
        c.tick()
    moves = [d for d in c.decisions() if d.old != d.new and d.action != "pin"]
    assert [(d.old, d.new, d.time - released) for d in moves] == [(16, 8, 30)]  # latency_window_s after it


def test_a_sweep_letting_go_of_a_pool_it_does_not_hold_changes_nothing():
    """The self-calibrator lets go whenever the pool's own traffic shows, up to five times a
    second for two minutes: that must not move the epoch, the store or the cooldown each time."""
    c, clock = controller()
    c.report(stats(seqs=8))
    clock.t = 50
    before, policy = c.status("p").epoch, c._pools["p"].policy
    assert c.sweep_pin("p", None) == before
    assert c.status("p").epoch == before and c._pools["p"].policy == policy


def test_pin_and_unpin():
    c, clock = controller()
    c.report(stats(seqs=8))
    refused = c.pin("p", 32)
    assert refused.pinned is None and "[2, 16]" in refused.error  # an answer, not an exception across Ray
    d = c.pin("p", 32, calibrating=True)
    assert d.pinned == 32 and d.error is None and c.views()["p"].calibrating
    assert c.report(stats(seqs=8)).limits.max_active_seqs == 32
    clock.t += 5
    assert c.tick() == []  # a pinned pool is not decided
    c.unpin("p")
    clock.t += 5
    c.report(stats(seqs=32))
    c.tick()
    assert c.target("p") == 16  # clamped back into the safe range


@pytest.mark.parametrize("saved", [
    [1], {"pinned": "8"}, {"pinned": True}, {"epoch": None}, {"lending": "false"},
    {"slo": {"ttft_p99_ms": 500}}, {"slo": {"ttft_p99_ms": float("nan"), "tpot_p99_ms": 50}},
    {"slo": {"ttft_p99_ms": float("inf"), "tpot_p99_ms": 50}}, {"pinned": None, "calibrating": True},
], ids=["not a mapping", "pin text", "pin bool", "epoch null", "lending text", "slo field missing", "slo nan",
        "slo inf", "calibrating unpinned"])
def test_operator_settings_that_no_longer_read_are_dropped_not_fatal(saved, caplog):
    """Operator settings outlive a controller, and a version of it: a saved record of another
    shape made the controller's constructor raise (no control app at all) or, for a pin that
    is not a number, every report of the pool raise; an infinite SLO (which the admin API took)
    made every report raise, and a sweep's flag without its pin opened the engine's whole range
    to the autoscaler (found by a review). The pool starts from the config's settings."""
    from infra.state import MemoryStore

    store = MemoryStore()
    store.put("pool/p", saved)
    with caplog.at_level("WARNING", logger="poolserve.autoscale"):
        c = Controller({"p": PoolSpec("p", RANGE, 1.0, 0.1, 32)}, AutoscaleConfig(), Clock(), store=store)
    assert c.report(stats(seqs=8)).limits.max_active_seqs == 8
    assert c.status("p").pinned is None and c.views()["p"].lending
    assert c.status("p").safe_range == (2, 16) and not c.status("p").calibrating
    assert any("pool/p" in r.getMessage() and "cannot be read" in r.getMessage() for r in caplog.records)


def test_a_sweep_letting_go_counts_as_a_change_its_requests_are_not_the_pools_latency():
    """For a latency window after a sweep, the P99s hold the sweep's own requests, measured at its
    steps: the limit does not step down on them (a just-calibrated pool at rest stepped 16 -> 8 on
    its sweep's P99 TTFT). What the pool measures after the window counts."""
    c, clock = controller()
    c.report(stats(seqs=16))
    clock.t = 100
    c.sweep_pin("p", 32)
    slow = (1.5,) * 20  # above the 1 s TTFT SLO
    for _ in range(10):
        clock.t += 5
        c.report(stats(seqs=32, ttft=slow))
        c.tick()
    c.sweep_pin("p", None)
    released = clock.t
    for _ in range(8):
        clock.t += 5
        c.report(stats(seqs=16, ttft=slow))
        c.tick()
    moves = [d for d in c.decisions() if d.old != d.new]
    assert [(d.old, d.new, d.time - released) for d in moves] == [(16, 8, 30)]  # latency_window_s after it
