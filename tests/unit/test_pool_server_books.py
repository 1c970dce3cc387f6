"""A pool replica's metrics and its gate's books agree, whatever its callers do: seeded schedules
of calls of two priorities and borrowed calls into a small queue, each caller reading its stream
to the end, leaving at its `Arrived`, at its `Admitted` or after a chunk, or cancelled from
outside at a random turn (inside its wait at the gate too), while the engine's streams are held
and let go at random moments. Every call is counted once by the metrics, as the gate counted it."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections import Counter

import pytest

from pools.types import Admitted, Arrived, Finished, PriorityClass, Rejected
from tests.unit.test_pool_server import FakeEngine, call, make_server

LEAVE = ("never", "arrived", "admitted", "chunk", "cancelled")
REASONS = ("queue_full", "evicted", "lender_busy")  # a rejection's, as the metric labels it


class Books:
    """The metrics a replica sets, counted instead of exported."""

    def __init__(self, server) -> None:
        self.n = Counter[str]()
        m = server._metrics
        m.admitted = lambda tenant, priority, waited_s: self.n.update(["admitted"])
        m.rejected = lambda tenant, priority, reason: self.n.update([reason])
        m.cancelled = lambda tenant, priority: self.n.update(["cancelled"])
        m.left_queued = lambda tenant, priority: self.n.update(["left_queued"])
        m.latency = lambda tenant, priority, ttft, tpot: None


async def caller(server, c, leave: str, seen: Counter) -> None:
    seen["call"] += 1  # a task cancelled before it ran made no call
    stream = server.generate(c)
    try:
        async for item in stream:
            kind = type(item).__name__
            seen[kind] += 1
            if (leave == "arrived" and isinstance(item, Arrived)) or (leave == "admitted" and isinstance(item, Admitted)):
                return
            if leave == "chunk" and isinstance(item, list):
                return
            if isinstance(item, (Rejected, Finished)):
                return
            await asyncio.sleep(0)
    finally:
        await stream.aclose()


async def cancel_after(task: asyncio.Task, turns: int) -> None:
    for _ in range(turns):
        await asyncio.sleep(0)
    task.cancel()


def a_call(rng: random.Random):
    kind = rng.choice(("interactive", "batch", "borrowed"))
    if kind == "borrowed":  # lent only while no own work holds the replica's one slot
        return dataclasses.replace(call(PriorityClass.BORROWED), borrowed=True)
    return call(PriorityClass.INTERACTIVE if kind == "interactive" else PriorityClass.BATCH)


async def schedule(seed: int):
    rng = random.Random(seed)
    FakeEngine.release, FakeEngine.fail_with = asyncio.Event(), None
    server = await make_server(max_queued=rng.choice((1, 2, 3)))
    books, seen, tasks = Books(server), Counter[str](), []
    for _ in range(rng.randint(4, 14)):
        leave = rng.choice(LEAVE)
        tasks.append(asyncio.create_task(caller(server, a_call(rng), leave, seen)))
        if leave == "cancelled":
            tasks.append(asyncio.create_task(cancel_after(tasks[-1], rng.randint(0, 8))))
        for _ in range(rng.randint(0, 4)):
            await asyncio.sleep(0)
        if rng.random() < 0.3:  # the engine lets its held streams go, then holds again
            FakeEngine.release.set()
            for _ in range(rng.randint(0, 6)):
                await asyncio.sleep(0)
            FakeEngine.release = asyncio.Event()
    FakeEngine.release.set()
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
    for _ in range(5):  # a closed stream's slot comes back as its generator finishes
        await asyncio.sleep(0)
    return seen["call"], books.n, seen, server._gate.gate.stats()


@pytest.mark.parametrize("seed", range(150))
def test_every_call_is_counted_once_as_the_gate_counted_it(seed):
    calls, n, seen, gate = asyncio.run(schedule(seed))
    assert n["admitted"] + n["left_queued"] + sum(n[r] for r in REASONS) == calls, (n, gate)
    assert (n["queue_full"], n["evicted"]) == (gate.rejected, gate.evicted), (n, gate)
    assert n["cancelled"] + n["left_queued"] == gate.cancelled, (n, gate)
    assert n["admitted"] == gate.completed + n["cancelled"], (n, gate)
    assert seen["Finished"] == gate.completed and seen["Rejected"] <= sum(n[r] for r in REASONS), (seen, n)
    assert gate.active == 0 and sum(gate.queued_by_class.values()) == 0, gate


def test_the_schedules_reach_every_ending():
    """The schedules above are worth their time only if they make every ending happen."""
    totals = Counter[str]()
    for seed in range(150):
        totals.update(asyncio.run(schedule(seed))[1])
    assert all(totals[k] > 0 for k in ("admitted", "left_queued", "queue_full", "evicted", "cancelled",
                                       "lender_busy")), totals
