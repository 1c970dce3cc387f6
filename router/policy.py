"""Routing policy: priority clamping, pool choice and borrowing (pure).

Borrowing lets offline work use the online pool while chat is quiet, and gives the
capacity back at once when chat returns:
  * only when the home pool is saturated (work would wait there anyway);
  * only once the target has had no request of its own for `after_quiet_s`: chat at a few
    requests a second leaves most slots free, but borrowed requests in its batch slow
    every decode step of it (the mixed benchmark's figures are in bench/notes.md);
  * only while the target's own utilisation (its own traffic, borrowed work excluded)
    is below `while_below_utilisation`;
  * at most `max_share` of the target's capacity is ever lent;
  * borrowed requests run in the lowest class (BORROWED) on the target's gate, so any
    target request is admitted first, a full queue evicts borrowed work first, and borrowed
    work waiting there goes home as soon as a target request has to wait.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from pools.types import PriorityClass
from router.errors import ApiError


def resolve_priority(default: PriorityClass, ceiling: PriorityClass, requested: str | None) -> PriorityClass:
    """The tenant's class, or the requested one clamped so it is never above the ceiling."""
    if requested is None or requested == "":
        return default
    try:
        asked = PriorityClass.parse(requested)
    except ValueError as e:
        raise ApiError(400, "invalid_priority", f"header x-poolserve-priority: {e}", "x-poolserve-priority")
    if asked is PriorityClass.BORROWED:
        raise ApiError(400, "invalid_priority", "header x-poolserve-priority: 'borrowed' is internal; "
                          "use interactive, standard or batch", "x-poolserve-priority")
    return max(asked, ceiling)  # a larger value is less important


def choose_pool(path_pool: str | None, allowed: tuple[str, ...], home: str, known: tuple[str, ...]) -> str:
    pool = path_pool or home
    if pool not in known:
        raise ApiError(404, "pool_not_found", f"unknown pool {pool!r}; pools are {', '.join(known)}")
    if pool not in allowed:
        raise ApiError(403, "pool_not_allowed",
                          f"this API key may not use pool {pool!r}; it may use {', '.join(allowed)}")
    return pool


@dataclass(frozen=True)
class PoolLoad:
    """One pool's load as a router replica sees it: capacity across replicas, its own
    in-flight requests (borrowed ones apart), and the cluster-wide active + queued count
    from the controller's last view (covers other router replicas; a second or so old)."""

    capacity: int
    own_inflight: int
    borrowed_inflight: int = 0
    cluster_load: int = 0
    queued: int = 0
    quiet_s: float = float("inf")  # since this router last had a request of the pool's own in flight

    @property
    def utilisation(self) -> float:
        return self.own_inflight / self.capacity if self.capacity > 0 else 1.0

    @property
    def saturated(self) -> bool:
        return max(self.own_inflight + self.borrowed_inflight, self.cluster_load) >= self.capacity


@dataclass(frozen=True)
class BorrowRule:
    into: str
    max_share: float
    while_below_utilisation: float
    after_quiet_s: float = 0.0


def borrow_decision(home: PoolLoad, target: PoolLoad, rule: BorrowRule) -> tuple[bool, str]:
    """Whether to send one more request of the home pool to `rule.into`, and why."""
    if not home.saturated:
        return False, "home pool has room"
    if target.quiet_s < rule.after_quiet_s:
        return False, f"target had its own traffic {target.quiet_s:.1f}s ago (< {rule.after_quiet_s:.0f}s)"
    if target.queued > 0:
        return False, "target pool is queueing"
    if target.utilisation >= rule.while_below_utilisation:
        return False, f"target utilisation {target.utilisation:.2f} >= {rule.while_below_utilisation}"
    if target.borrowed_inflight + 1 > int(rule.max_share * target.capacity):
        return False, f"borrowed share at its cap ({rule.max_share:.0%} of {target.capacity})"
    return True, "home saturated, target idle"


def queue_surely_full(waiting: dict[PriorityClass, Mapping[str, int]], priority: PriorityClass, tenant: str,
                      queue_slots: int, seats: int) -> bool:
    """Whether a pool's queue is certain to refuse a request of class `priority` from `tenant`,
    judged from this router's own requests that wait there (`waiting`: per class and tenant,
    dispatched, no verdict yet).

    A gate evicts a strictly less important queued request for a more important one, and in a
    class the newest of a tenant that queues more than this one's (`FairClass.crowding`), so
    only these count: the more important classes', the tenant's own in its class, and one of
    each other tenant's in its class (a gate keeps at least one of each; more would count what
    other replicas' gates hold, each against its own queue, and requests already admitted whose
    verdicts are on their way, as this router cannot tell them apart). Up to `seats` of them (the
    pool's engine ceiling across its replicas) may be admitted to free slots rather than
    queued. So the queue is surely full only when those requests fill both the seats and the
    queue. Each count is a lower bound on the gate's (other router replicas add to it), so
    this never sheds what the gates would admit; it only spares a pool replica the round trip
    of a refusal under overload.
    """
    if queue_slots <= 0:
        return False
    own = waiting.get(priority, {}).get(tenant, 0)
    ahead = sum(sum(by_tenant.values()) for cls, by_tenant in waiting.items() if cls < priority)
    ahead += own + sum(min(n, 1) for t, n in waiting.get(priority, {}).items() if t != tenant)
    return ahead >= queue_slots + seats


@dataclass(frozen=True)
class PoolRoute:
    """A pool as the router knows it from the config."""

    name: str
    prefix: str  # the path segment, e.g. "online" for /online/v1/...
    start_capacity: int
    default_priority: PriorityClass
    borrow: BorrowRule | None = None
    queue_slots: int = 0  # the pool's gate queue per replica (`queue.max_queued`); 0: never shed here
    max_num_seqs: int = 0  # the engine ceiling per replica: the most a gate can admit at once


@dataclass(frozen=True)
class Attempt:
    pool: str
    borrowed: bool


def dispatch_plan(home: str, priority: PriorityClass, rule: BorrowRule | None, home_load: PoolLoad,
                  target_load: PoolLoad | None, may_borrow: bool, target_full: bool) -> tuple[Attempt, ...]:
    """Where to send a request, in order. Borrowing first when it pays (never interactive work,
    never into a target whose queue would refuse it), then home: a lender that is busy again
    by the time the request reaches it refuses it, and the request goes home."""
    home_only = (Attempt(home, False),)
    if rule is None or target_load is None or priority == PriorityClass.INTERACTIVE or not may_borrow \
            or target_full:
        return home_only
    ok, _why = borrow_decision(home_load, target_load, rule)
    return (Attempt(rule.into, True), Attempt(home, False)) if ok else home_only
