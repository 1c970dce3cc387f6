"""The router's bound on reaching a pool replica: a restarting pool answers 503 fast."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pools.types import Admitted, Arrived
from router.errors import ApiError
from tests.unit.test_router_auth import TENANTS, FakeCounter, FakeHandle
from router.app import PoolRoute, Router, RouterSettings
from router.config import RouterConfig
from pools.types import PriorityClass


class Stream:
    """A pool stream whose items come after `delay` seconds each."""

    def __init__(self, items, delay: float) -> None:
        self.items, self.delay, self.cancelled = list(items), delay, False

    async def __anext__(self):
        await asyncio.sleep(self.delay)
        return self.items.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


def _flight() -> SimpleNamespace:
    return SimpleNamespace(never_ran=False, mark=lambda step: None)


def router(reach_s: float) -> Router:
    settings = RouterSettings("m", "/nowhere", 64, RouterConfig(reach_timeout_s=reach_s), TENANTS,
                              (PoolRoute("p", "p", 4, PriorityClass.STANDARD),))
    return Router(settings, {"p": FakeHandle()}, FakeHandle(), object(), counter=FakeCounter())


def test_no_replica_within_the_bound_is_503_with_retry_after():
    stream, flight = Stream([Arrived("r")], delay=5), _flight()
    with pytest.raises(ApiError) as e:
        asyncio.run(router(0.05)._admission(stream, "p", flight, PriorityClass.STANDARD))
    assert e.value.status == 503 and e.value.code == "pool_unavailable" and e.value.retry_after_s > 0
    assert "'p'" in e.value.message and "restarting" in e.value.message
    assert stream.cancelled and flight.never_ran  # the quota charge is refunded


def test_queue_wait_after_arrival_is_not_bounded():
    admitted = Admitted("p", "r", 0.2)
    stream = Stream([Arrived("r"), admitted], delay=0.1)  # each step alone exceeds nothing; together 2x the bound
    got = asyncio.run(router(0.15)._admission(stream, "p", _flight(),
                                               PriorityClass.STANDARD))
    assert got is admitted and not stream.cancelled


def test_a_verdict_decided_at_once_needs_no_arrived_marker():
    admitted = Admitted("p", "r", 0.0)
    stream = Stream([admitted], delay=0.01)
    got = asyncio.run(router(0.15)._admission(stream, "p", _flight(), PriorityClass.STANDARD))
    assert got is admitted and stream.items == []


def test_a_live_but_swamped_pool_is_429_not_503():
    r = router(0.05)
    r._views = {"p": SimpleNamespace(fresh=True, replicas=1)}  # its replicas report: alive
    stream, flight = Stream([Arrived("r")], delay=5), _flight()
    with pytest.raises(ApiError) as e:
        asyncio.run(r._admission(stream, "p", flight, PriorityClass.STANDARD))
    assert e.value.status == 429 and e.value.code == "pool_busy" and e.value.retry_after_s >= 5
    assert stream.cancelled and flight.never_ran

