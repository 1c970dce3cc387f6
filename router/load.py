"""What one router replica knows of each pool's load, for the borrow and shedding decisions.

Its own counts are exact: requests in flight per pool and tenant (borrowed ones apart),
requests waiting for a pool's verdict per class, and the pool gate's last Retry-After.
The controller's view covers every router replica, but it is only as good as its age:
older than `view_max_age_s` (a controller that stopped answering), it counts as unknown,
and the decisions fall back to what this replica knows for sure.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Callable, Iterator

from pools.control import PoolView
from pools.types import PriorityClass
from router.policy import PoolLoad, PoolRoute, queue_surely_full


class PoolLoads:
    def __init__(self, routes: dict[str, PoolRoute], clock: Callable[[], float], view_max_age_s: float) -> None:
        self._routes = routes
        self._clock = clock
        self._max_age = view_max_age_s
        self._own = collections.Counter[str]()
        self._borrowed = collections.Counter[str]()
        self._tenant = collections.Counter[tuple[str, str]]()
        self._own_seen = {p: float("-inf") for p in routes}  # when a pool last had its own work in flight
        # dispatched, no verdict yet: per pool, class and tenant
        self._waiting = {p: {c: collections.Counter[str]() for c in PriorityClass} for p in routes}
        self._views: dict[str, PoolView] = {}
        self._views_at = float("-inf")
        self.retry_hint = {p: 1.0 for p in routes}  # the pool gate's last Retry-After estimate

    # -- this replica's requests --------------------------------------------------------

    def start(self, pool: str, tenant: str, borrowed: bool) -> None:
        (self._borrowed if borrowed else self._own)[pool] += 1
        self._tenant[pool, tenant] += 1

    def done(self, pool: str, tenant: str, borrowed: bool) -> None:
        (self._borrowed if borrowed else self._own)[pool] -= 1
        self._tenant[pool, tenant] -= 1
        if not borrowed:
            self._own_seen[pool] = self._clock()

    @contextlib.contextmanager
    def waiting(self, pool: str, cls: PriorityClass, tenant: str) -> Iterator[None]:
        self._waiting[pool][cls][tenant] += 1
        try:
            yield
        finally:
            self._waiting[pool][cls][tenant] -= 1
            if not self._waiting[pool][cls][tenant]:
                del self._waiting[pool][cls][tenant]

    def tenant_inflight(self, tenant: str, pools: tuple[str, ...]) -> dict[str, int]:
        """A tenant's own requests in flight through this replica, per pool."""
        return {p: self._tenant[p, tenant] for p in pools}

    def inflight(self, pool: str) -> int:
        return self._own[pool] + self._borrowed[pool]

    # -- the controller's view ----------------------------------------------------------

    def update_views(self, views: dict[str, PoolView]) -> None:
        self._views, self._views_at = views, self._clock()

    def view(self, pool: str) -> PoolView | None:
        """The controller's view of a pool, or None when it is missing, says its replicas stopped
        reporting, or is older than the bound."""
        v = self._views.get(pool)
        if v is None or not v.fresh or self._clock() - self._views_at > self._max_age:
            return None
        return v

    def views_fresh(self) -> dict[str, bool]:
        return {p: self.view(p) is not None for p in self._routes}

    def load(self, pool: str) -> PoolLoad:
        """The pool's load as far as this replica can tell: its own counts, and the view's,
        which also covers the requests that reached the pool by other ways (other router
        replicas, the pool's own HTTP); the view is a report or two old."""
        own, borrowed = self._own[pool], self._borrowed[pool]
        quiet = 0.0 if own else self._clock() - self._own_seen[pool]
        v = self.view(pool)
        if v is None:
            return PoolLoad(self._routes[pool].start_capacity, own, borrowed, quiet_s=quiet)
        seen = v.own_quiet_s + self._clock() - self._views_at
        return PoolLoad(v.capacity, max(own, v.own_requests), max(borrowed, v.borrowed_requests), v.active + v.queued,
                        v.queued, min(quiet, seen))

    def may_borrow(self, home: str, target: str) -> bool:
        """Never without a fresh view of both pools, nor while either is being calibrated,
        nor from a pool that stopped lending."""
        h, t = self.view(home), self.view(target)
        return h is not None and t is not None and not (h.calibrating or t.calibrating or not t.lending)

    def queue_full(self, pool: str, priority: PriorityClass, tenant: str) -> bool:
        """Whether the pool's gates would surely refuse a request of this class (the router
        then answers 429 itself); never when the pool's state is unknown."""
        v = self.view(pool)
        if v is None:
            return False
        route = self._routes[pool]
        return queue_surely_full(self._waiting[pool], priority, tenant, route.queue_slots * v.replicas,
                                 route.max_num_seqs * v.replicas)
