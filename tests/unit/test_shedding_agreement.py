"""The router sheds a request at a pool's edge only where the pool's gate would refuse it. The two
rules are written apart (`router.policy.queue_surely_full` from the router's counts,
`AdmissionGate` with `FairClass.crowding` from its queue); this keeps them in step on seeded
schedules of one replica's gate, whatever the tenants' weights and the classes."""

from __future__ import annotations

import collections
import random

from pools.gate import AdmissionGate, Ceilings, QueuePolicy
from pools.types import PriorityClass as P, SafeRange
from router.policy import queue_surely_full
from tests.unit.model_based import replayable, schedules

RANGE = SafeRange(ladder=(1, 2, 4), low=1, high=4, tokens_per_seq=1_000, max_inflight_tokens=10**6)
WEIGHTS = {"a": 1.0, "b": 2.0, "c": 0.5}
CLASSES = (P.INTERACTIVE, P.STANDARD, P.BATCH)


def _schedule(rng: random.Random) -> int:
    seats = rng.choice(RANGE.ladder)  # the engine ceiling; the gate's limit at most that
    queue = QueuePolicy(max_queued=rng.randint(1, 6), max_queued_tokens=10**9)
    gate = AdmissionGate(RANGE.limits_for(rng.choice([s for s in RANGE.ladder if s <= seats])), RANGE,
                         Ceilings(seats, 10**9), queue, lambda: 0.0)
    live: dict[int, tuple[P, str]] = {}  # offered, neither refused nor released: admitted or queued
    checked = 0
    for _ in range(60):
        if live and rng.random() < 0.3:
            active = [i for i in live if gate.is_active(i)]
            if active:
                done = rng.choice(active)
                gate.release(done)  # admits what fits from the queue: those stay live, admitted
                live.pop(done)
                continue
        tenant, prio = rng.choice(sorted(WEIGHTS)), rng.choice(CLASSES)
        # the router's counts: every request it dispatched with no verdict yet, admitted ones
        # included (their verdicts may be on their way), or only those still queued
        counts = [collections.defaultdict(collections.Counter) for _ in range(2)]
        for i, (p, t) in live.items():
            counts[0][p][t] += 1
            if gate.is_queued(i):
                counts[1][p][t] += 1
        shed = [queue_surely_full(c, prio, tenant, queue.max_queued, seats) for c in counts]
        ticket = gate.new_ticket(tenant, WEIGHTS[tenant], prio, 10)
        changes = gate.offer(ticket)
        refused = {r.ticket.id for r in changes.rejected}
        if any(shed):
            checked += 1
            assert ticket.id in refused, (f"the router sheds a {prio.label} request of {tenant} that the gate "
                                          f"takes: waiting {dict(counts[0])}, seats {seats}, queue {queue.max_queued}")
        for i in refused:
            live.pop(i, None)
        if ticket.id not in refused:
            live[ticket.id] = (prio, tenant)
    return checked


def test_the_router_never_sheds_what_a_pools_gate_would_take():
    checked = 0
    for seed in schedules(400):
        with replayable("test_the_router_never_sheds_what_a_pools_gate_would_take", seed):
            checked += _schedule(random.Random(seed))
    assert checked > 100, f"only {checked} sheds were checked: the schedules do not reach a full queue"
