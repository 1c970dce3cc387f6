"""AdmissionGate: priority, fairness, bounded queue, cancellation, wait window, limits."""

from __future__ import annotations

import pytest

from pools.gate import AdmissionGate, Ceilings, LimitsRefused, QueuePolicy
from pools.types import BatchLimits, PriorityClass as P, SafeRange


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


RANGE = SafeRange(ladder=(1, 2, 4, 8, 16), low=1, high=16, tokens_per_seq=1000, max_inflight_tokens=100_000)


def make_gate(seqs=1, tokens=None, max_queued=100, max_queued_tokens=1_000_000, wait_s=0.0, min_batch=0,
              clock=None):
    clock = clock or FakeClock()
    limits = BatchLimits(seqs, tokens or seqs * 1000)
    gate = AdmissionGate(limits, RANGE, Ceilings(32, 100_000),
                         QueuePolicy(max_queued, max_queued_tokens, wait_s, min_batch), clock)
    return gate, clock


def offer(gate, tenant="a", prio=P.STANDARD, cost=10, weight=1.0):
    t = gate.new_ticket(tenant, weight, prio, cost)
    return t, gate.offer(t)


@pytest.mark.parametrize("arrivals, expected", [
    ([P.BATCH, P.STANDARD, P.INTERACTIVE], [P.INTERACTIVE, P.STANDARD, P.BATCH]),
    ([P.BORROWED, P.BORROWED], [P.BORROWED, P.BORROWED]),
    ([P.STANDARD, P.STANDARD, P.INTERACTIVE], [P.INTERACTIVE, P.STANDARD, P.STANDARD]),
], ids=["three-classes", "borrowed-fifo", "fifo-inside-class"])
def test_strict_priority_order(arrivals, expected):
    gate, _ = make_gate(seqs=1)
    blocker, ch = offer(gate, "x", P.BATCH)  # holds the only slot
    assert ch.admitted == [blocker]
    tickets = [offer(gate, "t", p)[0] for p in arrivals]
    order = []
    current = blocker
    for _ in tickets:
        admitted = gate.release(current.id).admitted
        assert len(admitted) == 1
        current = admitted[0]
        order.append(current.priority)
    assert order == expected
    same_class = [t.id for t in tickets if t.priority == expected[-1]]
    assert same_class == sorted(same_class)


def test_weighted_token_fairness_two_to_one():
    """Tenant A (weight 2, long prompts) and B (weight 1, short prompts) both flood."""
    gate, _ = make_gate(seqs=4, tokens=100_000, max_queued=3000)
    tokens = {"a": 0, "b": 0}
    active = []
    for _ in range(1000):  # more than are drained below: both queues stay non-empty
        offer(gate, "a", cost=900, weight=2.0)
        offer(gate, "b", cost=120, weight=1.0)
    # drain: admit, complete, repeat, counting tokens admitted per tenant
    for t in list(gate._active.values()):
        active.append(t)
    for _ in range(400):
        t = active.pop(0)
        tokens[t.tenant] += t.cost
        active += gate.release(t.id).admitted
    ratio = tokens["a"] / tokens["b"]
    assert 1.8 <= ratio <= 2.2, tokens


def test_light_tenant_not_starved_by_long_prompts():
    gate, _ = make_gate(seqs=1, tokens=100_000)
    first, _ = offer(gate, "heavy", cost=2000)
    for _ in range(20):
        offer(gate, "heavy", cost=2000)
    light, _ = offer(gate, "light", cost=50)
    # light joins at heavy's counter (no credit for idle time), so it goes within two turns,
    # not after the twenty queued heavy requests
    second = gate.release(first.id).admitted[0]
    third = gate.release(second.id).admitted[0]
    assert light in (second, third)


def test_bounded_queue_rejects_with_positive_retry_after():
    gate, clock = make_gate(seqs=1, max_queued=3)
    held, _ = offer(gate)
    for _ in range(3):
        offer(gate)
    # a drain rate has been seen: two admissions 2 s apart
    clock.advance(2)
    held = gate.release(held.id).admitted[0]
    offer(gate)
    t, ch = offer(gate)
    assert ch.admitted == [] and len(ch.rejected) == 1
    r = ch.rejected[0]
    assert r.ticket is t and r.reason == "queue_full" and r.retry_after_s > 0
    assert gate.stats().rejected == 1


def test_queue_token_bound():
    gate, _ = make_gate(seqs=1, max_queued=100, max_queued_tokens=1000)
    offer(gate, cost=10)  # admitted
    offer(gate, cost=900)  # queued
    _, ch = offer(gate, cost=200)
    assert ch.rejected and ch.rejected[0].reason == "queue_full"


def test_full_queue_evicts_less_important_newest_first():
    gate, _ = make_gate(seqs=1, max_queued=2)
    offer(gate, prio=P.BATCH)  # active
    old, _ = offer(gate, prio=P.BATCH)
    new, _ = offer(gate, prio=P.BATCH)
    chat, ch = offer(gate, prio=P.INTERACTIVE)
    assert [r.ticket for r in ch.rejected] == [new]
    assert ch.rejected[0].reason == "evicted"
    assert gate.is_queued(chat.id) and gate.is_queued(old.id)


def test_borrowed_work_goes_home_as_soon_as_the_pools_own_work_waits():
    """Strict priority alone left a borrowed request queued for as long as the lender's own
    traffic kept one request waiting: hours, with its home pool idle."""
    gate, clock = make_gate(seqs=1)
    mine, _ = offer(gate, prio=P.STANDARD)  # active
    borrowed, ch = offer(gate, prio=P.BORROWED)
    assert ch.rejected == [] and gate.is_queued(borrowed.id), "a full lender may still hold it a moment"
    _, ch = offer(gate, prio=P.BATCH)  # the pool's own work now waits for room
    assert [(r.ticket, r.reason) for r in ch.rejected] == [(borrowed, "lender_busy")]
    assert not gate.is_queued(borrowed.id) and ch.rejected[0].retry_after_s > 0
    late, ch = offer(gate, prio=P.BORROWED)  # and any that comes meanwhile
    assert [(r.ticket, r.reason) for r in ch.rejected] == [(late, "lender_busy")]
    s = gate.stats()
    assert (s.rejected, s.evicted) == (0, 0), "going home is no refusal of the pool's own traffic"


def test_equal_priority_never_evicts():
    gate, _ = make_gate(seqs=1, max_queued=1)
    offer(gate, prio=P.BATCH)
    queued, _ = offer(gate, prio=P.BATCH)
    late, ch = offer(gate, prio=P.BATCH)
    assert [r.ticket for r in ch.rejected] == [late] and gate.is_queued(queued.id)


def test_cancelled_waiter_leaves_queue_and_frees_nothing_it_did_not_hold():
    gate, _ = make_gate(seqs=1)
    holder, _ = offer(gate, cost=10)
    waiter, _ = offer(gate, cost=20)
    before = gate.stats()
    ch = gate.cancel(waiter.id)
    after = gate.stats()
    assert ch.admitted == [] and not gate.is_queued(waiter.id)
    assert after.active == before.active == 1
    assert after.inflight_tokens == before.inflight_tokens == 10
    assert after.queued == 0 and after.queued_tokens == 0 and after.cancelled == 1
    assert gate.is_active(holder.id)


def test_cancel_of_admitted_ticket_releases_its_slot():
    gate, _ = make_gate(seqs=1)
    holder, _ = offer(gate)
    waiter, _ = offer(gate)
    ch = gate.cancel(holder.id)
    assert ch.admitted == [waiter]


def test_wait_window_releases_on_tokens():
    gate, _ = make_gate(seqs=8, wait_s=0.2, min_batch=1000)
    _, ch = offer(gate, cost=400)
    assert ch.admitted == []
    _, ch = offer(gate, cost=400)
    assert ch.admitted == []
    _, ch = offer(gate, cost=400)  # 1200 >= 1000 queued: release all three
    assert len(ch.admitted) == 3


def test_wait_window_releases_on_time():
    gate, clock = make_gate(seqs=8, wait_s=0.2, min_batch=1000)
    t, ch = offer(gate, cost=100)
    assert ch.admitted == [] and gate.next_deadline() == pytest.approx(clock() + 0.2)
    clock.advance(0.1)
    assert gate.poll().admitted == []
    clock.advance(0.1)
    assert gate.poll().admitted == [t]
    assert gate.next_deadline() is None


def test_wait_window_skipped_when_queue_deeper_than_free_slots():
    gate, _ = make_gate(seqs=2, wait_s=10, min_batch=10_000)
    offer(gate)
    _, ch = offer(gate)  # 2 queued >= 2 free slots: no waiting
    assert len(ch.admitted) == 2


def test_wait_window_counts_the_sequences_that_wait():
    """Two requests of 4 choices fill 8 free slots, but the window counted them as 2 and held
    them its whole length with the engine idle (found by a review)."""
    gate, _ = make_gate(seqs=8, wait_s=0.2, min_batch=4096)
    gate.offer(gate.new_ticket("a", 1.0, P.STANDARD, 400, seqs=4))
    ch = gate.offer(gate.new_ticket("a", 1.0, P.STANDARD, 400, seqs=4))
    assert len(ch.admitted) == 2 and gate.next_deadline() is None


def test_wait_window_ends_when_the_queue_fills_the_free_tokens():
    """Two requests of 1,500 tokens fill a budget of 2,048 that the window's 4,096 cannot reach:
    it held them its whole length with the engine idle (found by a review)."""
    gate, _ = make_gate(seqs=4, tokens=2048, wait_s=0.2, min_batch=4096)
    first, _ = offer(gate, cost=1500)
    _, ch = offer(gate, cost=1500)
    assert ch.admitted == [first] and gate.next_deadline() is None


def test_zero_window_admits_at_once():
    gate, _ = make_gate(seqs=2, wait_s=0.0, min_batch=10_000)
    _, ch = offer(gate)
    assert len(ch.admitted) == 1


def test_token_budget_blocks_and_oversized_runs_alone():
    gate, _ = make_gate(seqs=4, tokens=1000)
    a, ch = offer(gate, cost=600)
    b, ch = offer(gate, cost=600)  # 1200 > 1000: waits
    assert ch.admitted == []
    assert gate.release(a.id).admitted == [b]
    gate.release(b.id)
    big, ch = offer(gate, cost=5000)  # larger than the budget: runs when alone
    assert ch.admitted == [big]


def test_head_of_line_blocks_smaller_requests_behind_it():
    gate, _ = make_gate(seqs=4, tokens=1000)
    offer(gate, cost=600)
    big, _ = offer(gate, cost=600)
    small, ch = offer(gate, cost=10)
    assert ch.admitted == []  # small would fit, but big is first


@pytest.mark.parametrize("limits, fragment", [
    (BatchLimits(64, 1000), "engine ceilings 32 seqs"),
    (BatchLimits(8, 200_000), "engine ceilings"),
    (BatchLimits(8, 100_000), None),
], ids=["seqs-above-ceiling", "tokens-above-ceiling", "inside"])
def test_limits_outside_ceilings_refused(limits, fragment):
    gate, _ = make_gate()
    if fragment is None:
        gate.set_limits(limits)
        assert gate.limits == limits
    else:
        with pytest.raises(LimitsRefused, match=fragment):
            gate.set_limits(limits)


def test_limits_outside_safe_range_refused_with_the_range():
    gate, _ = make_gate()
    narrow = SafeRange((1, 2, 4, 8), 2, 4, 1000, 100_000)
    with pytest.raises(LimitsRefused, match=r"max_active_seqs in \[2, 4\]"):
        gate.set_limits(BatchLimits(8, 8000), narrow)
    assert gate.limits == BatchLimits(1, 1000)


def test_raising_limits_admits_waiters_and_tracks_peak():
    gate, _ = make_gate(seqs=2)
    for _ in range(10):
        offer(gate)
    assert gate.stats().active == 2 and gate.stats().peak_active == 2
    ch = gate.set_limits(BatchLimits(8, 8000))
    assert len(ch.admitted) == 6 and gate.stats().peak_active == 8


def test_release_corrects_counter_with_real_usage():
    gate, _ = make_gate(seqs=1)
    a, _ = offer(gate, "a", cost=1000)
    gate.release(a.id, used_tokens=100)
    assert gate._classes[P.STANDARD].counters["a"] == pytest.approx(100)


def test_borrowed_work_never_blocks_the_pools_own():
    gate, _ = make_gate(seqs=2, tokens=10_000)
    b1, _ = offer(gate, "off", P.BORROWED)
    b2, _ = offer(gate, "off", P.BORROWED)
    b3, ch = offer(gate, "off", P.BORROWED)
    assert ch.admitted == []  # borrowed work only fills free capacity
    chat, ch = offer(gate, "chat", P.INTERACTIVE)
    assert ch.admitted == [chat]  # own work does not count the borrowed slots
    assert gate.stats().active == 3
    assert gate.stats().own_load == (1, 0)  # what the autoscaler judges a deep queue on: no borrowed work
    c2, ch = offer(gate, "chat", P.INTERACTIVE)
    assert ch.admitted == [c2]
    c3, ch = offer(gate, "chat", P.INTERACTIVE)
    assert ch.admitted == []  # two own requests: the limit
    gate.release(b1.id)
    assert not gate.is_active(b3.id)  # the queued borrowed waits behind queued chat
    assert gate.release(chat.id).admitted == [c3]


def test_engine_ceiling_caps_own_plus_borrowed():
    clock = FakeClock()
    rng = SafeRange(ladder=(1, 2, 4), low=1, high=4, tokens_per_seq=1000, max_inflight_tokens=100_000)
    gate = AdmissionGate(BatchLimits(2, 2000), rng, Ceilings(3, 100_000), QueuePolicy(100, 10**6), clock)
    for _ in range(2):
        offer(gate, "off", P.BORROWED)
    offer(gate, "chat", P.INTERACTIVE)
    _, ch = offer(gate, "chat", P.INTERACTIVE)
    assert ch.admitted == [] and gate.stats().active == 3  # max_num_seqs 3 reached


def test_eviction_that_cannot_make_room_evicts_nobody():
    """Token bound 1000: an interactive 800 and a batch 100 wait; an interactive 300 arrives.
    Evicting the batch ticket would not make room, so it stays and the arrival is refused."""
    gate, _ = make_gate(seqs=1, max_queued=100, max_queued_tokens=1000)
    offer(gate, prio=P.STANDARD, cost=10)  # holds the only slot
    big, _ = offer(gate, prio=P.INTERACTIVE, cost=800)
    small, _ = offer(gate, prio=P.BATCH, cost=100)
    late, ch = offer(gate, prio=P.INTERACTIVE, cost=300)
    assert [(r.ticket, r.reason) for r in ch.rejected] == [(late, "queue_full")]
    assert gate.is_queued(big.id) and gate.is_queued(small.id) and not gate.is_queued(late.id)
    assert gate.stats().evicted == 0 and gate.stats().queued_tokens == 900


def test_eviction_takes_as_many_as_room_needs_least_important_first():
    gate, _ = make_gate(seqs=1, max_queued=100, max_queued_tokens=1000)
    offer(gate, prio=P.STANDARD, cost=10)
    batch_old, _ = offer(gate, prio=P.BATCH, cost=300)
    batch_mid, _ = offer(gate, prio=P.BATCH, cost=200)
    batch_new, _ = offer(gate, prio=P.BATCH, cost=300)
    chat, ch = offer(gate, prio=P.INTERACTIVE, cost=500)  # 1300 queued: 300 must go
    assert [(r.ticket, r.reason) for r in ch.rejected] == [(batch_new, "evicted")]
    chat2, ch = offer(gate, prio=P.INTERACTIVE, cost=400)  # 1400: the two newest batch requests go
    assert [(r.ticket, r.reason) for r in ch.rejected] == [(batch_mid, "evicted"), (batch_old, "evicted")]
    assert gate.is_queued(chat.id) and gate.is_queued(chat2.id)
    assert gate.stats().queued_tokens == 900 and gate.stats().evicted == 3


def test_a_request_of_n_choices_holds_n_sequences():
    gate, _ = make_gate(seqs=4, tokens=100_000)
    one, ch = offer(gate, cost=10)
    assert ch.admitted == [one]
    t = gate.new_ticket("a", 1.0, P.STANDARD, 40, seqs=4)
    assert gate.offer(t).admitted == []  # 1 + 4 > 4
    assert gate.stats().active == 1 and gate.stats().queued == 1
    assert gate.release(one.id).admitted == [t]
    assert gate.stats().active == 4 and gate.stats().active_requests == 1


def test_n_above_the_limit_runs_only_alone():
    gate, _ = make_gate(seqs=1, tokens=100_000)
    first, _ = offer(gate, cost=10)
    wide = gate.new_ticket("a", 1.0, P.STANDARD, 160, seqs=16)
    assert gate.offer(wide).admitted == []  # not while another request runs
    assert gate.release(first.id).admitted == [wide]  # an idle replica runs it alone
    assert gate.stats().active == 16
    _, ch = offer(gate, cost=10)
    assert ch.admitted == []


def test_the_gate_knows_how_long_its_own_work_has_been_away():
    """Borrowed work does not count as the pool's own; own work running or waiting is 0 s away;
    the clock starts when the last own request leaves (done, cancelled or evicted)."""
    gate, clock = make_gate(seqs=2)
    assert gate.stats().own_idle_s == float("inf")  # never had any
    lent, _ = offer(gate, prio=P.BORROWED)
    clock.advance(5)
    assert gate.stats().own_idle_s == float("inf")
    own, _ = offer(gate, prio=P.INTERACTIVE)
    waiting, _ = offer(gate, prio=P.STANDARD)  # queued behind two slots
    assert gate.stats().own_idle_s == 0.0
    gate.release(own.id, 10)
    clock.advance(3)
    assert gate.stats().own_idle_s == 0.0  # the queued one still waits (or runs)
    gate.cancel(waiting.id)
    clock.advance(2)
    gate.release(lent.id, 10)
    assert gate.stats().own_idle_s == 2.0


def test_waits_are_the_pools_own_admitted_and_still_queued_over_the_window():
    gate, clock = make_gate(seqs=1)
    first, _ = offer(gate)  # admitted at once: waited 0
    second, _ = offer(gate)
    lent, _ = offer(gate, tenant="b", prio=P.BORROWED)
    clock.advance(2)
    gate.release(first.id)  # the second waited 2 s
    clock.advance(3)
    assert sorted(gate.waits(10)) == [0.0, 2.0]  # the borrowed one, queued 5 s, is not the pool's own
    third, _ = offer(gate)
    clock.advance(1)
    assert sorted(gate.waits(10)) == [0.0, 1.0, 2.0]  # still waiting: its wait so far
    gate.cancel(third.id)
    gate.cancel(lent.id)
    clock.advance(5)  # 1011: the admission at 1000 is out of a 10-s window, the one at 1002 in
    assert gate.waits(10) == (2.0,)
    clock.advance(2)
    assert gate.waits(10) == ()
