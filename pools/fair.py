"""The gate's queues, pure: one priority class's per-tenant FIFO queues in virtual-token-counter
order (VTC, Sheng et al. 2024), and the admission times a Retry-After is estimated from."""

from __future__ import annotations

import collections
import heapq
from dataclasses import dataclass
from typing import Iterator

from pools.types import PriorityClass


@dataclass
class Ticket:
    """One request at the gate: `seqs` sequences (its `n`) costing `cost` tokens in all."""

    id: int
    tenant: str
    weight: float
    priority: PriorityClass
    cost: int
    seqs: int = 1
    enqueued_at: float = 0.0
    admitted_at: float | None = None


class FairClass:
    """One priority class: per-tenant FIFO queues ordered by virtual token counters."""

    def __init__(self) -> None:
        self.queues: dict[str, collections.deque[Ticket]] = {}
        self.counters: dict[str, float] = collections.defaultdict(float)
        self.last_served = 0.0

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def push(self, t: Ticket) -> None:
        if t.tenant not in self.queues:
            active = [self.counters[x] for x in self.queues]
            floor = min(active) if active else self.last_served
            self.counters[t.tenant] = max(self.counters[t.tenant], floor)
            self.queues[t.tenant] = collections.deque()
        self.queues[t.tenant].append(t)

    def head(self) -> Ticket | None:
        if not self.queues:
            return None
        tenant = min(self.queues, key=lambda x: (self.counters[x], self.queues[x][0].id))
        return self.queues[tenant][0]

    def pop(self, t: Ticket) -> None:
        q = self.queues[t.tenant]
        q.remove(t)
        if not q:
            del self.queues[t.tenant]

    def charge(self, t: Ticket, tokens: float) -> None:
        self.counters[t.tenant] += tokens / t.weight
        self.last_served = self.counters[t.tenant]

    def newest_first(self) -> Iterator[Ticket]:
        """Queued tickets from the newest, lazily (each tenant's queue is in arrival order)."""
        return heapq.merge(*(reversed(q) for q in self.queues.values()), key=lambda t: -t.id)

    def crowding(self, tenant: str) -> Iterator[Ticket]:
        """The tickets a full queue gives up for one more of `tenant`'s in this class, lazily: the
        newest of whichever tenant queues the most here for its weight, while it queues more for
        its weight than `tenant` (whose new ticket is queued already), and never a tenant's first,
        which may be the class's head. First come within a class let one tenant hold the queue,
        and another of the same class, however light, was refused."""
        left = {x: len(q) for x, q in self.queues.items()}
        share = {x: left[x] / q[0].weight for x, q in self.queues.items()}
        while (x := max((x for x in left if x != tenant and left[x] > 1), key=share.__getitem__,
                        default=None)) is not None and share[x] > share.get(tenant, 0.0) * (1 + 1e-9):
            left[x] -= 1
            share[x] = left[x] / self.queues[x][0].weight
            yield self.queues[x][left[x]]

    def oldest_enqueue(self) -> float | None:
        return min((q[0].enqueued_at for q in self.queues.values()), default=None)


class Admissions:
    """Admission times over the drain window, for the drain rate a Retry-After comes from."""

    def __init__(self, window_s: float) -> None:
        self._window = window_s
        self._times: collections.deque[float] = collections.deque()

    def add(self, now: float) -> None:
        self._times.append(now)
        while self._times and self._times[0] < now - self._window:
            self._times.popleft()

    def rate(self, now: float) -> float:
        """Admissions per second over the window (0 with fewer than two)."""
        recent = [x for x in self._times if x >= now - self._window]
        return len(recent) / max(now - recent[0], 1e-3) if len(recent) >= 2 else 0.0
