"""Requests a full gate refuses: which it gives up for which, and the pool's own refusals, apart
from borrowed ones, counted by the gate and summed for the autoscaler."""

from __future__ import annotations

import dataclasses

from autoscale.policy import aggregate
from pools.types import PriorityClass as P
from tests.unit.test_autoscale_controller import stats
from tests.unit.test_gate import make_gate, offer


def test_only_the_pools_own_refusals_count_as_its_own():
    """The autoscaler steps a pool up on its refusals: a borrowed request turned away at a full
    lender is the borrower's, and counted, it made the lender grow for another pool's backlog."""
    gate, _ = make_gate(seqs=1, max_queued=2)
    for _ in range(3):
        offer(gate, prio=P.BORROWED)  # one runs, two wait
    _, full = offer(gate, prio=P.BORROWED)
    s = gate.stats()
    assert [r.reason for r in full.rejected] == ["queue_full"] and (s.rejected, s.own_refused) == (1, 0)
    _, home = offer(gate, prio=P.BATCH)  # runs beside the borrowed one: the borrowed work waiting goes home,
    assert [r.reason for r in home.rejected] == ["lender_busy", "lender_busy"]  # which is no refusal
    offer(gate, prio=P.BATCH)
    offer(gate, prio=P.BATCH)
    reasons = [r.reason for p in (P.INTERACTIVE, P.STANDARD, P.BATCH) for r in offer(gate, prio=p)[1].rejected]
    assert reasons == ["evicted", "evicted", "queue_full"]  # the two batch requests waiting, then a third
    s = gate.stats()
    assert (s.rejected, s.evicted, s.own_refused) == (2, 2, 3)


def test_the_rejection_signal_counts_the_pools_own_refusals_only():
    """A borrowed request turned away at a full lender is the borrower's: it made the lender grow."""
    reports = [stats(replica=r) for r in ("r1", "r2")]
    reports = [dataclasses.replace(s, gate=dataclasses.replace(s.gate, rejected=5, evicted=3, own_refused=n))
               for s, n in zip(reports, (2, 1))]
    assert aggregate(reports).rejected_total == 3


def test_a_full_queue_makes_room_in_a_class_for_the_tenant_queueing_least():
    """One tenant filled the queue at `standard` and every other tenant of the class was refused
    `queue_full`, whatever its weight (found by a review): it gives up its newest instead."""
    gate, _ = make_gate(seqs=1, max_queued=4)
    offer(gate, "hog")  # holds the only slot
    hogs = [offer(gate, "hog")[0] for _ in range(4)]
    light, ch = offer(gate, "light")
    assert [(r.ticket, r.reason) for r in ch.rejected] == [(hogs[-1], "evicted")] and gate.is_queued(light.id)
    second, ch = offer(gate, "light")  # now 3 against 2: one more of the hog's
    assert [r.ticket for r in ch.rejected] == [hogs[-2]]
    third, ch = offer(gate, "light")  # 2 against 3: its own is refused, the hog keeps its share
    assert [(r.ticket, r.reason) for r in ch.rejected] == [(third, "queue_full")]


def test_a_tenant_of_more_weight_keeps_more_of_a_full_queue():
    """Weight is a tenant's share under contention: counted in tickets alone, a tenant of weight
    10 holding four places was cut to two by a tenant of weight 1 (found by a review)."""
    gate, _ = make_gate(seqs=1, max_queued=6)
    offer(gate, "x")  # holds the only slot
    heavy = [offer(gate, "heavy", weight=10.0)[0] for _ in range(4)]
    light = [offer(gate, "light")[0] for _ in range(2)]
    _, ch = offer(gate, "light")  # 3 of light's for its weight 1 against 4 of heavy's for its 10
    assert [(r.ticket.tenant, r.reason) for r in ch.rejected] == [("light", "queue_full")]
    assert all(gate.is_queued(t.id) for t in heavy + light)


def test_tenants_queueing_the_same_for_their_weight_keep_their_places():
    """21 tickets at weight 0.7 are 30 for their weight, as 30 at weight 1 are; in floating point
    21 / 0.7 is 30.000000000000004, and the first gave one up (found by a review)."""
    gate, _ = make_gate(seqs=1, max_queued=50)
    offer(gate, "x")  # holds the only slot
    for _ in range(21):
        offer(gate, "light", weight=0.7)
    for _ in range(29):
        offer(gate, "heavy")
    arrival, ch = offer(gate, "heavy")
    assert [(r.ticket, r.reason) for r in ch.rejected] == [(arrival, "queue_full")]


def test_borrowed_work_waiting_goes_home_once_the_lenders_own_work_is_back():
    """Own requests that overlap one at a time never wait, so the rule that sent borrowed work
    home when own work waited never ran: a borrowed request of n = 2 that the running own one
    kept from fitting waited at the lender for ever (1,000 s here), its home pool idle."""
    gate, clock = make_gate(seqs=2, max_queued=8)
    offer(gate, prio=P.BORROWED)  # runs: the lender is idle
    changes = gate.offer(gate.new_ticket("a", 1.0, P.BORROWED, 10, seqs=2))  # waits for room
    assert not changes.admitted and not changes.rejected
    own, back = offer(gate, prio=P.INTERACTIVE)  # the lender's own work is back, and let in
    assert back.admitted == [own] and [r.reason for r in back.rejected] == ["lender_busy"]
    assert not any(gate.stats().queued_by_class.values())
