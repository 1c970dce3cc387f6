"""The router's bound on reaching a pool replica: a restarting pool answers 503 fast."""

from __future__ import annotations

import asyncio

import pytest

from pools.control import PoolView
from pools.types import Admitted, Arrived, PriorityClass
from router.errors import ApiError
from router.stream import PoolStream
from tests.unit import virtual_time
from tests.unit.router_harness import make_router


class Slow:
    """A pool stream whose items come after `delay` seconds each."""

    def __init__(self, items, delay: float) -> None:
        self.items, self.delay, self.cancelled = list(items), delay, False

    async def __anext__(self):
        await asyncio.sleep(self.delay)
        return self.items.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


def verdict(items, delay: float, reach_s: float, views=None):
    async def go():
        router, _ = make_router(views=views)
        if views:
            router._loads.update_views(views)
        settlement = router._settlement(router._s.tenants[1], await router._charge(router._s.tenants[1], 0), 0.0)
        settlement.dispatch("p", False)
        stream = Slow(items, delay)
        try:
            got = await PoolStream(stream, "p", settlement, 600.0).verdict(router._loads, PriorityClass.STANDARD, reach_s)
        except ApiError as e:
            got = e
        never_ran = settlement.never_ran
        settlement.close()
        return got, stream, never_ran
    return virtual_time.run(go)  # the items' delays and the bound are exact, however busy the host


def test_no_replica_within_the_bound_is_503_with_retry_after():
    e, stream, s = verdict([Arrived("r")], delay=5, reach_s=0.05)
    assert e.status == 503 and e.code == "pool_unavailable" and e.retry_after_s > 0
    assert "'p'" in e.message and "restarting" in e.message
    assert stream.cancelled and s  # the quota charge is refunded


def test_queue_wait_after_arrival_is_not_bounded():
    admitted = Admitted("p", "r", 0.2)
    got, stream, s = verdict([Arrived("r"), admitted], delay=0.1, reach_s=0.15)  # together 2x the bound
    assert got is admitted and not stream.cancelled and not s


def test_a_verdict_decided_at_once_needs_no_arrived_marker():
    admitted = Admitted("p", "r", 0.0)
    got, stream, _ = verdict([admitted], delay=0.01, reach_s=0.15)
    assert got is admitted and stream.items == []


def test_a_live_but_swamped_pool_is_429_not_503():
    views = {"p": PoolView("p", 1, 4, 4, 8, True)}  # its replicas report: alive
    e, stream, s = verdict([Arrived("r")], delay=5, reach_s=0.05, views=views)
    assert e.status == 429 and e.code == "pool_busy" and e.retry_after_s >= 5
    assert stream.cancelled and s


@pytest.mark.parametrize("first", ["a string", ["a list"]])
def test_an_engine_item_before_the_verdict_breaks_the_protocol(first):
    with pytest.raises(RuntimeError, match="protocol"):
        got, _, _ = verdict([first], delay=0.0, reach_s=1)
        raise got if isinstance(got, Exception) else AssertionError(got)


class LeftAsItArrives(Slow):
    """A pool stream whose client leaves just as its first item arrives: the route's task is
    cancelled in the same turn of the loop that hands it the item."""

    async def __anext__(self):
        if len(self.items) == 2:
            asyncio.get_running_loop().call_soon(self.route.cancel)
        return await super().__anext__()


def test_a_client_that_leaves_as_the_replica_answers_is_not_waited_for():
    """3.11's wait_for returns the item and swallows the cancellation that came with it: the
    route went on to wait in the gate's queue for a client long gone, took a slot and paid for
    its prefill (found by a review)."""
    async def go():
        router, _ = make_router()
        settlement = router._settlement(router._s.tenants[1], await router._charge(router._s.tenants[1], 0), 0.0)
        settlement.dispatch("p", False)
        stream = LeftAsItArrives([Arrived("r"), Admitted("p", "r", 0.2)], 0.0)
        pool = PoolStream(stream, "p", settlement, 600.0)
        stream.route = asyncio.current_task()
        with pytest.raises(asyncio.CancelledError):
            await pool.verdict(router._loads, PriorityClass.STANDARD, 5.0)
        assert stream.items, "its verdict was never awaited"
        settlement.close()
    asyncio.run(go())
