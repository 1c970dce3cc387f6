"""The rejection and preemption signals count events, not which replicas happen to be fresh.

Both are cumulative counters in each replica's reports. Summed over the fresh reports alone, a
replica that fell silent and came back (or reported first after a restart of the controller)
added its whole history at once: a pool stepped down for preemptions that were minutes old."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infra.stats import Cumulative
from pools.types import EngineStats
from tests.unit.test_autoscale_controller import controller, stats


def counted(replica: str, preemptions: int = 0, refused: int = 0, **kw):
    s = stats(replica=replica, **kw)
    return dataclasses.replace(s, engine=EngineStats(preemptions=preemptions),
                               gate=dataclasses.replace(s.gate, own_refused=refused))


def moves(c) -> list[tuple[int, int, str]]:
    return [(d.old, d.new, d.code) for d in c.decisions() if d.old != d.new]


def test_a_replica_back_from_silence_adds_no_old_preemptions():
    c, clock = controller()
    c.report(counted("r1"))
    c.report(counted("r2", preemptions=50))
    c.tick()
    for _ in range(8):  # r2 is silent for 40 s: past stats_max_age_s and the cooldown
        clock.t += 5
        c.report(counted("r1"))
        c.tick()
    for _ in range(12):  # r2 is back, nothing new happened on it; past every cooldown
        clock.t += 5
        c.report(counted("r1"))
        c.report(counted("r2", preemptions=50))
        c.tick()
    assert moves(c) == []
    clock.t += 5
    c.report(counted("r2", preemptions=53))  # three new ones
    c.report(counted("r1"))
    c.tick()
    assert moves(c) == [(8, 4, "preemption")]


def test_a_replica_first_seen_late_adds_no_history():
    """A restarted controller hears from its replicas one by one."""
    c, clock = controller()
    for _ in range(8):  # past the cooldown
        clock.t += 5
        c.report(counted("r1"))
        c.tick()
    for _ in range(12):
        clock.t += 5
        c.report(counted("r1"))
        c.report(counted("r2", preemptions=50, refused=40))
        c.tick()
    assert moves(c) == []


@settings(max_examples=60, deadline=None)
@given(history=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 200)), min_size=3, max_size=3),
       schedule=st.lists(st.tuples(st.frozensets(st.sampled_from([0, 1, 2])), st.sampled_from([1.0, 5.0, 15.0])),
                         min_size=1, max_size=40))
def test_counters_that_never_move_never_move_the_limit(history, schedule):
    """Three replicas report counters fixed from the start, any of them silent at any time, for
    any while: no decision reads a preemption or a rejection."""
    c, clock = controller()
    for i, (preempted, refused) in enumerate(history):
        c.report(counted(f"r{i}", preempted, refused))
    c.tick()
    for reporting, wait in schedule:
        clock.t += wait
        for i in sorted(reporting):
            c.report(counted(f"r{i}", *history[i]))
        c.tick()
    assert not [d for d in c.decisions() if d.code in ("preemption", "rejections")]


def test_preemptions_under_a_pin_are_not_answered_after_it():
    """A sweep drives the engine to its ceiling and preempts, on purpose; once it let go, the
    pool stepped down for them (the counters moved on while no decision looked at them)."""
    c, clock = controller()
    c.report(counted("r1"))
    c.tick()
    c.pin("p", 16)
    for k in range(1, 9):
        clock.t += 5
        c.report(counted("r1", preemptions=10 * k))
        c.tick()
    c.unpin("p")
    for _ in range(10):
        clock.t += 5
        c.report(counted("r1", preemptions=80))
        c.tick()
    assert [m for m in moves(c) if m[2] == "preemption"] == []


def test_replicas_long_gone_are_forgotten():
    """Every replica a pool ever had kept its last report and its counters' baseline: under
    churn (restarts, scaling) the controller's memory only grew. A replica silent for
    `forget_after` is forgotten; if it reports again, that report is its new baseline."""
    from autoscale.setups import forget_after

    c, clock = controller()
    for i in range(200):  # replicas that came and went, one report each
        clock.t += 1
        c.report(counted(f"gone{i}", preemptions=7))
    clock.t += forget_after(c._config.stats_max_age_s) + 1
    c.report(counted("r1"))
    pool = c._pools["p"]
    assert set(pool.reports) == {"r1"} and pool.events.preemptions.sources == pool.events.refusals.sources == {"r1"}
    for _ in range(12):  # past every cooldown: gone0 is back, with its old count as its baseline
        clock.t += 5
        c.report(counted("r1"))
        c.report(counted("gone0", preemptions=7))
        c.tick()
    assert [m for m in moves(c) if m[2] == "preemption"] == []


def test_a_report_that_came_late_and_a_restart_count_what_happened():
    """A report older than the last one read (two in flight at once) was taken for a restart and
    the next one counted again from it: 6 preemptions read as 9, and the pool stepped down for 3
    that never happened. A restarted replica's new preemptions counted for nothing until its
    count passed the old one. Calibration's counts had both right and these wrong (two classes)."""
    from autoscale.policy import Events

    events = Events()
    for at, n in [(1.0, 10), (2.0, 15), (1.5, 12), (3.0, 16), (4.0, 2)]:  # 16 -> 2: restarted, 2 since
        events.note(dataclasses.replace(counted("r1", preemptions=n, refused=n), time=at))
    assert (events.preempted, events.refused) == (8, 8)
    for at, n in [(100.0, 10), (40.0, 12), (50.0, 20)]:  # a replica's clock stepped back: held back...
        events.note(dataclasses.replace(counted("r2", preemptions=n), time=at))
    assert events.preempted == 8
    events.note(dataclasses.replace(counted("r2", preemptions=25), time=101.0))
    assert events.preempted == 8 + 15, "...until its clock passes where it was, then counted whole"


@pytest.mark.parametrize("readings, most", [
    ([(10, 100), (12, 5), (11, 102), (13, 7)], 9),  # the run before's report comes after the restart's
    ([(10, 100), (20, 5), (30, 3), (15, 110)], 18),  # from two runs back
    ([(10, 100), (20, 5), (15, 150), (21, 160)], 160),  # the clock stepped back after a restart
    ([(10, 100), (20, 5), (20, 102), (21, 7)], 9),  # the run before's, at the restart's own time
    ([(20, 5), (10, 100), (21, 7)], 2),  # the first reading is a new run's, then a late one of the run before
    ([(10, 100), (20, 5), (15, 9), (16, 2), (21, 4)], 13),
])
def test_late_reports_and_restarts_never_count_more_than_happened(readings, most):
    """Read against the wrong run, a late report added the old run's whole history (109 for 9,
    113 for 18, 210 for 160), and the pool stepped down for preemptions that never happened."""
    counted_ = Cumulative()
    for at, n in readings:
        counted_.read("r", at, n)
    # never more; fewer by the late reports' own events at most (the run before's are not told
    # apart from a stepped-back clock's)
    assert most - 10 <= counted_.total <= most, counted_.total


@settings(max_examples=300, deadline=None)
@given(runs=st.lists(st.lists(st.integers(0, 20), min_size=1, max_size=6), min_size=1, max_size=4),
       late=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 5)), max_size=6))
def test_a_replicas_reports_in_any_arrival_order_never_count_more_than_happened(runs, late):
    """A replica's runs (a restart begins each after the first), each a few reports of its count
    growing by the drawn steps, made one second apart; some of them arrive late, after the next
    few. After every reading, the count is at most what happened between the first reading to
    arrive and the newest read; in order, and with every restart's count below the run
    before's, it is exact."""
    reports, steps_at, at, drops = [], {}, 0, True
    for i, steps in enumerate(runs):
        count = 1_000 if i == 0 else 0
        drops &= i == 0 or steps[0] < reports[-1][1]  # a restart the count can tell
        for step in steps:
            count += step
            at += 1
            reports.append((at, count))
            steps_at[at] = step  # the events that happened in the second before this report

    def happened(since: int, until: int) -> int:
        return sum(n for t, n in steps_at.items() if since < t <= until)

    arrival = list(reports)
    for which, by in late:  # report `which` arrives `by` places later
        if which < len(arrival):
            item = arrival.pop(which)
            arrival.insert(min(len(arrival), which + by), item)
    for order in (reports, arrival):
        c = Cumulative()
        for k, (t, n) in enumerate(order):
            c.read("r", t, n)
            bound = happened(order[0][0], max(x for x, _ in order[:k + 1]))
            assert c.total <= bound, (order[:k + 1], c.total, bound)
    if drops:
        c = Cumulative()
        for t, n in reports:
            c.read("r", t, n)
        assert c.total == happened(reports[0][0], reports[-1][0]), (reports, c.total)
