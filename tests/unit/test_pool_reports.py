"""A pool replica's reports to the controller: a deep queue is reported when it forms."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import pytest

from pools.control import LimitsDirective
from pools.server import PoolServer
from pools.types import Finished
from tests.unit.test_pool_server import RANGE, FakeEngine, call, collect, queued, settings, until


class Controller:
    """The controller's side of a report as far as a deep queue goes: when `moves`, the top of
    the range at a report that shows one (as its up move sized on the queue would); `reason`
    as a pin or a sweep would send it."""

    def __init__(self, moves: bool, reason: str = "") -> None:
        self.moves, self.reason, self.seen = moves, reason, []
        self.report = SimpleNamespace(remote=self._report)

    async def _report(self, stats):
        self.seen.append(stats.gate)
        seqs = RANGE.high if self.moves and stats.gate.deep else stats.gate.limits.max_active_seqs
        return LimitsDirective(RANGE.limits_for(seqs), RANGE, len(self.seen), self.reason)


async def reporting_server(controller: Controller, start_seqs: int) -> PoolServer:
    """A server whose periodic report comes once, at its start: any other is one it sent early."""
    server = PoolServer.__new__(PoolServer)
    await server.__init__(settings=replace(settings(), report_interval_s=3600, start_seqs=start_seqs),
                          controller=controller, engine=FakeEngine())
    await until(lambda: len(controller.seen) == 1, "the first periodic report")
    return server


async def queue_one(server, calls: list) -> None:
    """One more call, queued, and any report it sent early answered."""
    waiting = queued(server)
    calls.append(asyncio.create_task(collect(server, call())))
    await until(lambda: queued(server) == waiting + 1, "one more call queued")
    await until(lambda: server._telling is None or server._telling.done(), "its early report answered")


def test_a_request_that_queues_behind_a_batch_it_doubles_is_reported_at_once():
    """At a limit of 1, a second request is a deep queue: the replica reports it when it queues,
    and the controller's move admits it while the first still runs (a report an interval later
    would have come after the running request had ended: bench/notes.md)."""
    async def go():
        FakeEngine.release = asyncio.Event()
        controller = Controller(moves=True)
        server = await reporting_server(controller, start_seqs=1)
        first = asyncio.create_task(collect(server, call()))
        await until(lambda: FakeEngine.held == 1, "the first call running")
        second = asyncio.create_task(collect(server, call()))
        await asyncio.wait_for(until(lambda: FakeEngine.held == 2, "the second call admitted"), 60)
        FakeEngine.release.set()
        results = await asyncio.gather(first, second)
        await server.close()
        return controller.seen, server._gate.gate.limits.max_active_seqs, results

    seen, limit, results = asyncio.run(go())
    assert [(g.limits.max_active_seqs, g.deep) for g in seen] == [(1, False), (1, True)]
    assert limit == RANGE.high and all(isinstance(r[-1], Finished) for r in results)


@pytest.mark.parametrize("start_seqs, reason, early", [(1, "", 1), (RANGE.high, "", 0), (1, "pinned", 0),
                                                       (1, "sweep", 0)])
def test_a_deep_queue_is_reported_early_once_per_limit_and_only_where_it_can_move(start_seqs, reason, early):
    """A controller that holds (its cooldown, the band) hears of a queue that stays deep at the
    same limit once, not at every request that joins it; at the top of the range, or while a
    pin or a sweep holds the limits, there is nowhere to move, so nothing is reported early."""
    async def go():
        FakeEngine.release = asyncio.Event()
        controller = Controller(moves=False, reason=reason)
        server = await reporting_server(controller, start_seqs)
        calls = [asyncio.create_task(collect(server, call())) for _ in range(start_seqs)]
        await until(lambda: FakeEngine.held == start_seqs, "a full batch running")
        for _ in range(start_seqs + 3):  # deep from the batch's size on, then three more
            await queue_one(server, calls)
        deep = server._gate.gate.stats().deep
        FakeEngine.release.set()
        await asyncio.gather(*calls)
        await server.close()
        return len(controller.seen) - 1, deep

    assert asyncio.run(go()) == (early, True)


def test_a_queue_found_shallow_by_a_periodic_report_is_reported_again_when_it_turns_deep():
    async def go():
        controller = Controller(moves=False)
        server = await reporting_server(controller, start_seqs=1)
        counts = []
        for _ in range(2):
            FakeEngine.release = asyncio.Event()
            calls = [asyncio.create_task(collect(server, call()))]
            await until(lambda: FakeEngine.held == 1, "the batch of one running")
            await queue_one(server, calls)
            counts.append(len(controller.seen))
            FakeEngine.release.set()
            await asyncio.gather(*calls)
            await server._report()  # the periodic report, which finds no queue
        await server.close()
        return counts

    assert asyncio.run(go()) == [2, 4]
