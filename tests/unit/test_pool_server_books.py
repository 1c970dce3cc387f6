"""A pool replica's metrics and its gate's books agree, whatever its callers do: seeded schedules
of calls of two priorities into a small queue, each caller reading its stream to the end or
leaving at its `Arrived`, at its `Admitted` or after a chunk, while the engine's streams are held
and let go at random moments. Every call is counted once by the metrics, as the gate counted it."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from pools.types import Admitted, Arrived, Finished, PriorityClass, Rejected
from tests.unit.test_pool_server import FakeEngine, call, make_server

LEAVE = ("never", "arrived", "admitted", "chunk")


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


async def schedule(seed: int):
    rng = random.Random(seed)
    FakeEngine.release, FakeEngine.fail_with = asyncio.Event(), None
    server = await make_server(max_queued=rng.choice((1, 2, 3)))
    books, seen, tasks = Books(server), Counter[str](), []
    for _ in range(rng.randint(4, 14)):
        prio = rng.choice((PriorityClass.INTERACTIVE, PriorityClass.BATCH))
        tasks.append(asyncio.create_task(caller(server, call(prio), rng.choice(LEAVE), seen)))
        for _ in range(rng.randint(0, 4)):
            await asyncio.sleep(0)
        if rng.random() < 0.3:  # the engine lets its held streams go, then holds again
            FakeEngine.release.set()
            for _ in range(rng.randint(0, 6)):
                await asyncio.sleep(0)
            FakeEngine.release = asyncio.Event()
    FakeEngine.release.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    for _ in range(5):  # a closed stream's slot comes back as its generator finishes
        await asyncio.sleep(0)
    return len(tasks), books.n, seen, server._gate.gate.stats()


@pytest.mark.parametrize("seed", range(150))
def test_every_call_is_counted_once_as_the_gate_counted_it(seed):
    calls, n, seen, gate = asyncio.run(schedule(seed))
    assert n["admitted"] + n["left_queued"] + n["queue_full"] + n["evicted"] == calls, (n, gate)
    assert (n["queue_full"], n["evicted"]) == (gate.rejected, gate.evicted), (n, gate)
    assert n["cancelled"] + n["left_queued"] == gate.cancelled, (n, gate)
    assert n["admitted"] == gate.completed + n["cancelled"], (n, gate)
    assert seen["Finished"] == gate.completed and seen["Rejected"] <= n["queue_full"] + n["evicted"], (seen, n)
    assert gate.active == 0 and sum(gate.queued_by_class.values()) == 0, gate


def test_the_schedules_reach_every_ending():
    """The schedules above are worth their time only if they make every ending happen."""
    totals = Counter[str]()
    for seed in range(150):
        totals.update(asyncio.run(schedule(seed))[1])
    assert all(totals[k] > 0 for k in ("admitted", "left_queued", "queue_full", "evicted", "cancelled")), totals
