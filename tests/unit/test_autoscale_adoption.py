"""A controller that starts over adopts the pool's limit from a replica that applied the last
directive: the first replica to report may be a new one, still at its starting limit."""

from __future__ import annotations

import dataclasses

from autoscale.config import AutoscaleConfig
from autoscale.controller import Controller, PoolSpec
from infra.state import MemoryStore
from tests.unit.test_autoscale_controller import Clock, stats
from tests.unit.test_autoscale_policy import RANGE


def restarted(epoch: int) -> tuple[Controller, Clock]:
    """A controller whose predecessor left the pool's limits at `epoch` in the store."""
    store, clock = MemoryStore(), Clock()
    cfg = AutoscaleConfig(interval_s=5, cooldown_s=30, reversal_cooldown_s=90, queue_persist_ticks=2)
    before = Controller({"p": PoolSpec("p", RANGE, 1.0, 0.1, 32)}, cfg, clock, wall_clock=clock, store=store)
    before.report(stats(seqs=16))
    while before.status("p").epoch < epoch:
        before.pin("p", 16)
        before.unpin("p")
    return Controller({"p": PoolSpec("p", RANGE, 1.0, 0.1, 32)}, cfg, clock, wall_clock=clock, store=store), clock


def at(replica: str, seqs: int, applied: int):
    return dataclasses.replace(stats(replica=replica, seqs=seqs), applied_epoch=applied)


def test_a_new_replica_reporting_first_does_not_set_the_pools_limit():
    """It did: the others were sent its starting limit (16 -> 2 for all) under the epoch they
    had already applied, so the status called the change applied before any replica had it."""
    c, clock = restarted(epoch=4)
    left = c.status("p").epoch
    d = c.report(at("new", 2, 0))
    assert (d.limits.max_active_seqs, d.epoch) == (2, 0), "it keeps its own meanwhile, behind"
    assert c.target("p") is None
    d = c.report(at("old", 16, left))
    assert (d.limits.max_active_seqs, d.epoch) == (16, c.status("p").epoch) and c.target("p") == 16
    d = c.report(at("new", 2, 0))
    assert (d.limits.max_active_seqs, d.epoch) == (16, c.status("p").epoch)


def test_with_no_current_replica_the_first_is_adopted_after_a_while_under_a_new_epoch():
    c, clock = restarted(epoch=4)
    c.report(at("new", 2, 0))
    clock.t += 29  # 3 x stats_max_age_s: the replicas that applied the old limits are gone
    assert c.report(at("new", 2, 0)).epoch == 0
    clock.t += 1
    epoch = c.status("p").epoch
    d = c.report(at("new", 2, 0))
    assert (d.limits.max_active_seqs, d.epoch) == (2, epoch + 1) and c.target("p") == 2
    assert not c.status("p").applied(epoch + 1)
    c.report(at("new", 2, epoch + 1))
    assert c.status("p").applied(epoch + 1)


def test_a_controller_with_nothing_stored_adopts_the_first_report():
    c = Controller({"p": PoolSpec("p", RANGE, 1.0, 0.1, 32)}, AutoscaleConfig(), Clock())
    assert c.report(at("any", 4, 0)).limits.max_active_seqs == 4 and c.target("p") == 4


def test_after_the_wait_the_replica_furthest_along_is_adopted_whichever_reports():
    """Taken from whichever reported when the wait ran out, a new replica's starting limit could
    still win over one that had applied a later directive."""
    c, clock = restarted(epoch=4)
    for _ in range(5):
        c.report(at("lagging", 16, 3))
        c.report(at("new", 2, 0))
        clock.t += 6
    d = c.report(at("new", 2, 0))  # the wait is over at the new replica's report
    assert d.limits.max_active_seqs == 16 and c.target("p") == 16


def test_the_decision_log_answers_the_limit_asked():
    c, clock = restarted(epoch=1)
    for seqs in (2, 4, 8):
        c.pin("p", seqs)
    assert c.decisions(0) == [] and [d.new for d in c.decisions(2)] == [4, 8] and len(c.decisions(100)) == 3
