"""Model-based tests of the admission gate: seeded random schedules of offer, release,
cancel, limit changes and clock steps, checked against invariants after every step.

Invariants (the gate's promises):
  * every offered ticket is settled exactly once: admitted then released, or rejected,
    evicted or cancelled; every settlement is reported to the caller (in `Changes`);
  * the gate's counts are the sum of its tickets: sequences (a ticket of n holds n),
    tokens in flight, queued requests and tokens, and the queue stays inside its bounds;
  * nothing is admitted above the current limits or the engine ceiling, except a request
    that runs alone on an idle replica;
  * strict priority: no ticket is admitted while a more important one is left waiting;
  * a full class gives up a tenant's tickets for another's only while the first queues more
    for its weight, and never its first;
  * no free capacity is left unused: outside a wait window, a poll admits nothing new;
  * borrowed work never waits behind the pool's own: outside a wait window, while an own
    request waits for room, no borrowed one is queued (it goes home, `lender_busy`);
  * after everything settles, slots, tokens in flight and queued tokens are back to zero.

A failure names its seed; `POOLSERVE_SEED=<seed>` replays it (tests/unit/model_based.py).
"""

from __future__ import annotations

import asyncio
import collections
import random

from pools.admission import AsyncGate, GateRejected
from pools.gate import AdmissionGate, Ceilings, Changes, QueuePolicy, Rejection, Ticket
from pools.types import PriorityClass as P, SafeRange
from tests.unit.model_based import replayable, schedules

RANGE = SafeRange(ladder=(1, 2, 4, 8), low=1, high=8, tokens_per_seq=500, max_inflight_tokens=4000)
CEILINGS = Ceilings(max_num_seqs=10, max_inflight_tokens=4000)
TERMINAL = ("released", "rejected", "evicted", "cancelled", "returned")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class GateModel:
    """The gate beside a record of what every ticket should be; `check` compares them."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.clock = rng, Clock()
        self.queue = QueuePolicy(max_queued=rng.randint(1, 8), max_queued_tokens=rng.choice([600, 2000, 10**6]),
                                 max_wait_s=rng.choice([0.0, 0.0, 0.5]), min_batch_tokens=rng.choice([0, 300]))
        self.gate = AdmissionGate(RANGE.limits_for(rng.choice(RANGE.ladder)), RANGE, CEILINGS, self.queue,
                                  self.clock)
        self.state: dict[int, str] = {}
        self.tickets: dict[int, Ticket] = {}
        self.settlements: collections.Counter[int] = collections.Counter()
        self.reasons: collections.Counter[str] = collections.Counter()
        self.admissions = 0

    def ids(self, state: str) -> list[int]:
        return [i for i, s in self.state.items() if s == state]

    # -- operations ----------------------------------------------------------------

    def offer(self) -> Changes:
        r = self.rng
        seqs = r.choice([1, 1, 1, 2, 3, 12])
        t = self.gate.new_ticket(r.choice("abc"), r.choice([1.0, 2.0]), r.choice(list(P)),
                                 r.randint(1, 600) * seqs, seqs)
        self.tickets[t.id], self.state[t.id] = t, "queued"
        changes = self.gate.offer(t)
        queues = self.gate._classes[t.priority].queues
        for v in {r.ticket.tenant: r.ticket for r in changes.rejected
                  if r.reason == "evicted" and r.ticket.priority == t.priority}.values():
            # given up for `t`: never a tenant's first, and only while it queued more for its weight
            assert v.tenant != t.tenant and queues.get(v.tenant), (v, t)
            mine = queues.get(t.tenant) or [t]  # a tenant's weight is its first ticket's (a config's, constant)
            assert (len(queues[v.tenant]) + 1) / queues[v.tenant][0].weight > len(queues.get(t.tenant, ())) / \
                mine[0].weight, (v, t)
        return changes

    def release(self) -> Changes | None:
        active = self.ids("active")
        if not active:
            return None
        i = self.rng.choice(active)
        self.settle(i, "released")
        used = self.rng.choice([None, self.rng.randint(0, 2 * self.tickets[i].cost)])
        return self.gate.release(i, used)

    def cancel(self) -> Changes | None:
        live = self.ids("queued") + self.ids("active")
        if not live:
            return None
        i = self.rng.choice(live)
        self.settle(i, "cancelled")
        return self.gate.cancel(i)

    def set_limits(self) -> Changes:
        return self.gate.set_limits(RANGE.limits_for(self.rng.choice(RANGE.ladder)))

    def tick(self) -> Changes:
        self.clock.t += self.rng.choice([0.0, 0.1, 0.3, 0.6])
        return self.gate.poll()

    def step(self) -> None:
        op = self.rng.choices([self.offer, self.release, self.cancel, self.set_limits, self.tick],
                              weights=[5, 3, 1, 1, 1])[0]
        changes = op()
        if changes is not None:
            self.apply(changes)
        self.check(changes or Changes())

    # -- the record ----------------------------------------------------------------

    def settle(self, i: int, how: str) -> None:
        self.state[i] = how
        self.settlements[i] += 1

    def apply(self, changes: Changes) -> None:
        for t in changes.admitted:
            assert self.state[t.id] == "queued", f"ticket {t.id} admitted from state {self.state[t.id]}"
            self.state[t.id] = "active"
            self.admissions += 1
        for r in changes.rejected:
            assert self.state[r.ticket.id] == "queued", f"ticket {r.ticket.id} refused from {self.state[r.ticket.id]}"
            assert r.retry_after_s > 0
            self.settle(r.ticket.id, {"queue_full": "rejected", "lender_busy": "returned"}.get(r.reason, "evicted"))
            self.reasons[r.reason] += 1
            self.reasons["own_refused"] += r.reason != "lender_busy" and r.ticket.priority != P.BORROWED

    def check(self, changes: Changes) -> None:
        g, s = self.gate, self.gate.stats()
        queued, active = self.ids("queued"), self.ids("active")
        assert {i for i in self.state if g.is_queued(i)} == set(queued)
        assert {i for i in self.state if g.is_active(i)} == set(active)
        act = [self.tickets[i] for i in active]
        own = [t for t in act if t.priority != P.BORROWED]
        assert s.active == sum(t.seqs for t in act) and s.active_requests == len(act)
        assert s.inflight_tokens == sum(t.cost for t in act)
        assert s.queued == len(queued) and s.queued_tokens == sum(self.tickets[i].cost for i in queued)
        assert s.queued <= self.queue.max_queued and s.queued_tokens <= self.queue.max_queued_tokens
        assert (s.admitted, s.rejected, s.evicted) == (self.admissions, self.reasons["queue_full"],
                                                      self.reasons["evicted"])
        assert s.own_refused == self.reasons["own_refused"]  # the autoscaler's signal: no borrowed refusal in it
        ended = collections.Counter(self.state.values())  # an admitted ticket cancelled was counted completed too
        assert (s.completed, s.cancelled) == (ended["released"], ended["cancelled"]), s
        lim = g.limits
        alone = len(act) == 1
        if any(t.priority != P.BORROWED for t in changes.admitted) and not alone:
            assert sum(t.seqs for t in own) <= lim.max_active_seqs, (lim, own)
            assert sum(t.cost for t in own) <= lim.max_inflight_tokens, (lim, own)
            assert s.active <= CEILINGS.max_num_seqs and s.inflight_tokens <= CEILINGS.max_inflight_tokens, s
        if any(t.priority == P.BORROWED for t in changes.admitted) and not alone:
            assert s.active <= lim.max_active_seqs and s.inflight_tokens <= lim.max_inflight_tokens
        for a in changes.admitted:
            ahead = [i for i in queued if self.tickets[i].priority < a.priority]
            assert not ahead, f"ticket {a.id} ({a.priority.name}) admitted while {ahead} wait"
        if g.next_deadline() is None:  # not holding for a wait window: no capacity left unused
            assert g.poll().admitted == []
            own_waits = any(self.tickets[i].priority != P.BORROWED for i in queued)
            borrowed_waits = [i for i in queued if self.tickets[i].priority == P.BORROWED]
            assert not (own_waits and borrowed_waits), f"borrowed {borrowed_waits} wait behind the pool's own work"
            if any(t.priority != P.BORROWED for t in changes.admitted):  # own work is back: borrowed goes home
                assert not borrowed_waits, f"borrowed {borrowed_waits} wait at a lender whose own work is back"

    def drain(self) -> None:
        for i in self.ids("queued"):
            self.settle(i, "cancelled")
            self.apply(self.gate.cancel(i))
        while active := self.ids("active"):
            self.settle(active[0], "released")
            self.apply(self.gate.release(active[0]))
            for i in self.ids("queued"):
                self.settle(i, "cancelled")
                self.apply(self.gate.cancel(i))
        s = self.gate.stats()
        assert (s.active, s.active_requests, s.inflight_tokens, s.queued, s.queued_tokens) == (0, 0, 0, 0, 0)
        assert all(self.state[i] in TERMINAL for i in self.state)
        assert set(self.settlements) == set(self.state) and all(n == 1 for n in self.settlements.values())


def test_gate_random_schedules_keep_every_promise():
    for seed in schedules(2000):
        with replayable("test_gate_random_schedules_keep_every_promise", seed):
            rng = random.Random(seed)
            model = GateModel(rng)
            for _ in range(rng.randint(5, 60)):
                model.step()
            model.drain()


# -- the asyncio face: callers that wait, hold, finish or leave at any await ---------------

def _turned_away(r: Rejection) -> str:
    return "returned" if r.reason == "lender_busy" else "rejected"  # the gate counts no work sent home


async def _caller(gate: AsyncGate, rng: random.Random, outcome: dict, i: int) -> None:
    """One request's life as the pool server lives it: offer, wait, hold the slot, release."""
    pending = gate.offer(rng.choice("ab"), 1.0, rng.choice(list(P)), rng.randint(1, 500), rng.choice([1, 1, 2]))
    outcome[i] = "offered"
    try:
        ticket = await pending.wait()
    except GateRejected as e:
        outcome[i] = _turned_away(e.rejection)
        return
    except asyncio.CancelledError:  # turned away in the same turn it left: the gate's verdict stands
        outcome[i] = _turned_away(pending.rejection) if pending.rejection else "left while waiting"
        raise
    done = False
    try:
        for _ in range(rng.randint(0, 3)):
            await asyncio.sleep(0)
        done = True
        outcome[i] = "finished"
    finally:
        if not done:
            outcome[i] = "left while running"
        gate.release(ticket, cancelled=not done)


async def _async_schedule(rng: random.Random) -> None:
    clock = Clock()
    queue = QueuePolicy(max_queued=rng.randint(1, 6), max_queued_tokens=rng.choice([800, 10**6]))
    gate = AsyncGate(AdmissionGate(RANGE.limits_for(rng.choice(RANGE.ladder)), RANGE, CEILINGS, queue, clock))
    outcome: dict[int, str] = {}
    tasks = []
    for i in range(rng.randint(1, 25)):
        tasks.append(asyncio.get_running_loop().create_task(_caller(gate, rng, outcome, i)))
        for _ in range(rng.randint(0, 2)):
            await asyncio.sleep(0)
        if rng.random() < 0.3:  # a client leaves, at whatever await its request is
            rng.choice(tasks).cancel()
        if rng.random() < 0.1:
            gate.set_limits(RANGE.limits_for(rng.choice(RANGE.ladder)))
    await asyncio.gather(*tasks, return_exceptions=True)
    unsettled = {i: o for i, o in outcome.items() if o == "offered"}
    assert not unsettled, f"callers that offered and never learnt their verdict: {unsettled}"
    s = gate.gate.stats()
    assert (s.active, s.inflight_tokens, s.queued, s.queued_tokens) == (0, 0, 0, 0), s
    assert not gate._waiters
    ends = collections.Counter(outcome.values())  # what each caller learnt is what the gate counted
    assert (ends["finished"], ends["rejected"], ends["left while waiting"] + ends["left while running"]) == \
        (s.completed, s.rejected + s.evicted, s.cancelled), (ends, s)


def test_async_gate_callers_leaving_at_any_await_leave_nothing_behind():
    for seed in schedules(500):
        with replayable("test_async_gate_callers_leaving_at_any_await_leave_nothing_behind", seed):
            asyncio.run(_async_schedule(random.Random(seed)))


def test_a_ticket_admitted_after_its_caller_left_costs_its_tenant_nothing():
    """A caller cancelled while its ticket waits withdraws it only when its task next runs; a
    slot freed meanwhile admitted the ticket and released it as a finished request, its whole
    cost left on the tenant's fair-share counter (so served later than its share) and not
    counted as cancelled. The same for a caller that leaves just as its ticket is admitted."""
    async def go(leave_after_admission: bool) -> tuple[AsyncGate, float]:
        gate = AsyncGate(AdmissionGate(RANGE.limits_for(1), RANGE, CEILINGS, QueuePolicy(8, 10**6), Clock()))
        first = await gate.offer("a", 1.0, P.STANDARD, 100).wait()
        pending = gate.offer("b", 1.0, P.STANDARD, 150)
        before = gate.gate._classes[P.STANDARD].counters["b"]
        waiting = asyncio.get_running_loop().create_task(pending.wait())
        await asyncio.sleep(0)
        if leave_after_admission:
            gate.release(first, used_tokens=100)  # admits b; its caller leaves before it resumes
            waiting.cancel()
        else:
            waiting.cancel()  # b's caller leaves; before its task runs, a slot frees
            gate.release(first, used_tokens=100)
        await asyncio.gather(waiting, return_exceptions=True)
        return gate, before

    for leave_after_admission in (False, True):
        gate, before = asyncio.run(go(leave_after_admission))
        s = gate.gate.stats()
        assert (s.active, s.cancelled) == (0, 1), s
        assert gate.gate._classes[P.STANDARD].counters["b"] == before, leave_after_admission


def test_a_request_that_ended_early_with_its_usage_known_is_charged_what_it_used():
    """A request whose usage had come when its client left (a whole response's usage comes before
    the response is handed on) kept its whole estimated cost on its tenant's fair-share counter:
    the usage was dropped for a cancel. One that leaves before its usage keeps the whole cost,
    which never charges a tenant less than it used."""
    gate = AsyncGate(AdmissionGate(RANGE.limits_for(1), RANGE, CEILINGS, QueuePolicy(8, 10**6), Clock()))

    async def go() -> Ticket:
        return await gate.offer("a", 1.0, P.STANDARD, 1_000).wait()

    before = gate.gate._classes[P.STANDARD].counters["a"]
    gate.release(asyncio.run(go()), used_tokens=40, cancelled=True)
    s = gate.gate.stats()
    assert gate.gate._classes[P.STANDARD].counters["a"] == before + 40
    assert (s.cancelled, s.completed) == (1, 0), s
