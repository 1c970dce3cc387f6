"""Routing policy: priority clamping, pool choice and the borrow decision, as tables."""

from __future__ import annotations

import pytest

from pools.types import PriorityClass as P
from router.errors import ApiError
from router.policy import BorrowRule, PoolLoad, borrow_decision, choose_pool, resolve_priority


@pytest.mark.parametrize("default, ceiling, asked, expected", [
    (P.STANDARD, P.STANDARD, None, P.STANDARD),
    (P.STANDARD, P.STANDARD, "interactive", P.STANDARD),  # clamped to the ceiling
    (P.STANDARD, P.INTERACTIVE, "interactive", P.INTERACTIVE),
    (P.STANDARD, P.INTERACTIVE, "batch", P.BATCH),  # asking for less is always allowed
    (P.BATCH, P.STANDARD, "INTERACTIVE", P.STANDARD),
    (P.INTERACTIVE, P.INTERACTIVE, "", P.INTERACTIVE),
])
def test_resolve_priority(default, ceiling, asked, expected):
    assert resolve_priority(default, ceiling, asked) == expected


@pytest.mark.parametrize("asked", ["urgent", "borrowed"])
def test_bad_priority_names_the_header(asked):
    with pytest.raises(ApiError) as e:
        resolve_priority(P.STANDARD, P.STANDARD, asked)
    assert e.value.status == 400 and "x-poolserve-priority" in e.value.message


@pytest.mark.parametrize("path_pool, allowed, expected", [
    (None, ("a", "b"), "b"),  # the tenant's home pool
    ("a", ("a", "b"), "a"),
    ("c", ("a",), 404),
    ("b", ("a",), 403),
])
def test_choose_pool(path_pool, allowed, expected):
    if isinstance(expected, int):
        with pytest.raises(ApiError) as e:
            choose_pool(path_pool, allowed, home="b" if "b" in allowed else "a", known=("a", "b"))
        assert e.value.status == expected
    else:
        assert choose_pool(path_pool, allowed, home="b", known=("a", "b")) == expected


RULE = BorrowRule(into="online", max_share=0.25, while_below_utilisation=0.5)


@pytest.mark.parametrize("home, target, expected, why", [
    (PoolLoad(16, 16), PoolLoad(16, 0), True, "home saturated"),
    (PoolLoad(16, 4), PoolLoad(16, 0), False, "home pool has room"),
    (PoolLoad(16, 2, cluster_load=20), PoolLoad(16, 0), True, "home saturated"),  # other routers filled it
    (PoolLoad(16, 20), PoolLoad(16, 8), False, "utilisation 0.50"),  # chat came back
    (PoolLoad(16, 20), PoolLoad(16, 0, borrowed_inflight=4), False, "borrowed share at its cap"),
    (PoolLoad(16, 20), PoolLoad(16, 0, borrowed_inflight=3), True, "home saturated"),
    (PoolLoad(16, 20), PoolLoad(16, 1, queued=2), False, "target pool is queueing"),
], ids=["idle-target", "home-room", "cluster-full", "chat-back", "share-cap", "under-cap", "target-queue"])
def test_borrow_decision(home, target, expected, why):
    ok, reason = borrow_decision(home, target, RULE)
    assert ok is expected and why in reason


QUIET = BorrowRule(into="online", max_share=0.25, while_below_utilisation=0.5, after_quiet_s=5)


@pytest.mark.parametrize("target, expected, why", [
    (PoolLoad(16, 0, quiet_s=6.0), True, "home saturated"),
    (PoolLoad(16, 0, quiet_s=2.0), False, "own traffic 2.0s ago"),  # light chat between two requests
    (PoolLoad(16, 1, quiet_s=0.0), False, "own traffic 0.0s ago"),  # a chat in flight
    (PoolLoad(16, 0), True, "home saturated"),  # never had traffic of its own
])
def test_borrowing_waits_for_the_target_to_be_quiet(target, expected, why):
    ok, reason = borrow_decision(PoolLoad(16, 20), target, QUIET)
    assert ok is expected and why in reason


def test_queue_surely_full_counts_only_requests_at_least_as_important():
    from router.policy import queue_surely_full

    I, S, B, BR = P.INTERACTIVE, P.STANDARD, P.BATCH, P.BORROWED
    waiting = {I: {"t": 1}, S: {"t": 2}, B: {"t": 5}, BR: {"t": 4}}
    assert queue_surely_full(waiting, B, "t", 8, 0)  # 1 + 2 + 5 ahead of or beside a batch request
    assert not queue_surely_full(waiting, S, "t", 8, 0)  # it would evict queued batch work: let the gate decide
    assert not queue_surely_full(waiting, I, "t", 2, 0)
    assert queue_surely_full(waiting, BR, "t", 12, 0)
    assert not queue_surely_full(waiting, B, "t", 0, 0)  # no queue known: never shed at the router


def test_queue_surely_full_leaves_a_tenant_room_another_of_its_class_crowds():
    """A gate gives up, in a class, the newest of a tenant queueing more than the arriving
    request's: the router shed that request as if the queue were first come."""
    from router.policy import queue_surely_full

    waiting = {P.STANDARD: {"hog": 8}}
    assert queue_surely_full(waiting, P.STANDARD, "hog", 8, 0)
    assert not queue_surely_full(waiting, P.STANDARD, "light", 8, 0)  # 0 of its own and 1 of the hog's count
    assert queue_surely_full({P.STANDARD: {"hog": 8, "light": 7}}, P.STANDARD, "light", 8, 0)  # 7 + 1 >= 8
    # two replicas, each gate weighing its own queue: the hog's 3 on one, the light's 3 on the
    # other; the light's next is queued on the first, which gives up the hog's newest. Crediting
    # the hog as many as the light's own and one shed it (found by a review)
    assert not queue_surely_full({P.STANDARD: {"hog": 3, "light": 3}}, P.STANDARD, "light", 4, 2)


@pytest.mark.parametrize("waiting, queue, seats, full", [
    (8, 8, 4, False),  # four of the eight may take free seats rather than queue
    (11, 8, 4, False),
    (12, 8, 4, True),  # seats and queue both full
    (3, 1, 2, True),
], ids=["seats-free", "one-short", "both-full", "small"])
def test_requests_that_free_seats_would_admit_are_never_shed(waiting, queue, seats, full):
    from router.policy import queue_surely_full

    assert queue_surely_full({P.STANDARD: {"t": waiting}}, P.STANDARD, "t", queue, seats) is full


def _tenant(**kw):
    from router.config import TenantConfig

    return TenantConfig(name="t", key_sha256="0" * 64, pools=("p",), **kw)


@pytest.mark.parametrize("tenant, pool_default, asked, expected", [
    (dict(max_priority="standard"), P.INTERACTIVE, None, P.STANDARD),  # the pool's default is clamped too
    (dict(max_priority="standard"), P.INTERACTIVE, "interactive", P.STANDARD),
    (dict(max_priority="standard"), P.BATCH, None, P.BATCH),
    (dict(max_priority="standard"), P.BATCH, "standard", P.STANDARD),
    (dict(max_priority="standard"), P.BATCH, "interactive", P.STANDARD),
    (dict(priority="batch", max_priority="standard"), P.INTERACTIVE, None, P.BATCH),
    (dict(priority="batch", max_priority="standard"), P.INTERACTIVE, "interactive", P.STANDARD),
    (dict(), P.INTERACTIVE, None, P.INTERACTIVE),  # no ceiling set: the default is the ceiling
    (dict(), P.BATCH, "interactive", P.BATCH),
    (dict(priority="standard"), P.INTERACTIVE, "interactive", P.STANDARD),
], ids=["pool-default-clamped", "asked-clamped", "pool-default-below", "asked-up-to-ceiling", "asked-above",
        "own-default", "own-default-asked", "no-ceiling", "no-ceiling-asked", "own-default-is-ceiling"])
def test_a_tenant_never_gets_above_its_ceiling(tenant, pool_default, asked, expected):
    t = _tenant(**tenant)
    assert resolve_priority(t.default_class(pool_default), t.ceiling(pool_default), asked) == expected


def test_a_lender_busy_in_the_controllers_view_is_not_borrowed():
    """Chat reaches the online pool's replicas directly, never through the offline pool's
    route: what that route knows of the online pool's own traffic comes from the view."""
    from pools.control import PoolView
    from router.load import PoolLoads
    from router.policy import PoolRoute

    now = [100.0]
    routes = {p: PoolRoute(p, p, 8, P.STANDARD) for p in ("online", "offline")}
    loads = PoolLoads(routes, lambda: now[0], view_max_age_s=5)
    rule = BorrowRule("online", 0.25, 0.5, after_quiet_s=1.0)
    saturated = PoolView("offline", 1, 8, 8, 20, True)
    for own, quiet, expected in ((3, 0.0, False), (0, 0.3, False), (0, 2.0, True)):
        loads.update_views({"offline": saturated, "online": PoolView("online", 1, 8, own, 0, True, own_requests=own,
                                                                    own_quiet_s=quiet)})
        now[0] += 0.5  # the view is half a second old: chat was that much longer ago
        ok, why = borrow_decision(loads.load("offline"), loads.load("online"), rule)
        assert ok is expected, (own, quiet, why)
