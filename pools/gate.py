"""AdmissionGate: the runtime batch budget in front of one pool replica's engine.

Pure decision code: no Ray, no vLLM, no asyncio. Time comes from an injected clock.

Admission order:
  1. strict priority classes (interactive < standard < batch < borrowed); a class is
     served only while every more important class is empty;
  2. inside a class, weighted fair sharing of tokens across tenants with virtual token
     counters (VTC, Sheng et al. 2024): each tenant's counter grows by cost / weight when
     one of its requests is admitted (and is corrected by the real usage at release), the
     queued tenant with the smallest counter goes next, and a tenant that becomes active
     is lifted to the smallest active counter so that idle time earns no credit;
  3. the head of the chosen queue is admitted only if it fits the limits (active
     sequences and in-flight tokens). A head that does not fit blocks everything behind
     it, so a large request is never starved by smaller ones. A request larger than the
     whole token budget runs alone. Borrowed work (another pool's, lent this pool's idle
     capacity) only fills what the pool's own work leaves free, and the pool's own work
     does not count it: chat that returns gets its slots at once, up to the engine ceiling.

The queue is bounded in requests and tokens. When it is full, an arrival more important
than the least important queued request evicts the newest such request; otherwise the
arrival is rejected. Both carry a retry-after estimated from the observed drain rate.

The wait window (offline pools): admission holds while fewer than `min_batch_tokens`
are queued and the oldest request has waited less than `max_wait_s`. With a zero
window, or a queue already deeper than the free slots, nothing waits.
"""

from __future__ import annotations

import collections
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable

from pools.types import BatchLimits, GateStats, PriorityClass, SafeRange

Clock = Callable[[], float]


class LimitsRefused(ValueError):
    """A limit change outside the allowed range or above the engine ceilings."""


@dataclass(frozen=True)
class QueuePolicy:
    max_queued: int
    max_queued_tokens: int
    max_wait_s: float = 0.0
    min_batch_tokens: int = 0
    drain_window_s: float = 30.0
    min_retry_after_s: float = 1.0
    max_retry_after_s: float = 60.0


@dataclass(frozen=True)
class Ceilings:
    """The engine's own start-up limits; no runtime limit may exceed them."""

    max_num_seqs: int
    max_inflight_tokens: int


@dataclass
class Ticket:
    id: int
    tenant: str
    weight: float
    priority: PriorityClass
    cost: int
    enqueued_at: float = 0.0
    admitted_at: float | None = None


@dataclass(frozen=True)
class Rejection:
    ticket: Ticket
    reason: str  # "queue_full" | "evicted"
    retry_after_s: float


@dataclass
class Changes:
    """What one gate operation did: tickets now admitted and tickets now rejected."""

    admitted: list[Ticket] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)

    def extend(self, other: "Changes") -> "Changes":
        self.admitted += other.admitted
        self.rejected += other.rejected
        return self


class _FairClass:
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

    def newest(self) -> Ticket | None:
        tickets = [q[-1] for q in self.queues.values()]
        return max(tickets, key=lambda t: t.id) if tickets else None

    def oldest_enqueue(self) -> float | None:
        return min((q[0].enqueued_at for q in self.queues.values()), default=None)


class AdmissionGate:
    def __init__(
        self,
        limits: BatchLimits,
        allowed: SafeRange,
        ceilings: Ceilings,
        queue: QueuePolicy,
        clock: Clock,
    ) -> None:
        self._ceilings = ceilings
        self._queue = queue
        self._clock = clock
        self._allowed = allowed
        self._limits = self._check(limits, allowed)
        self._classes = {p: _FairClass() for p in PriorityClass}
        self._active: dict[int, Ticket] = {}
        self._queued: dict[int, Ticket] = {}
        self._inflight_tokens = 0
        self._borrowed = 0  # active borrowed requests and their tokens
        self._borrowed_tokens = 0
        self._queued_tokens = 0
        self._ids = itertools.count(1)
        self._admit_times: collections.deque[float] = collections.deque()
        self._counts = collections.Counter[str]()
        self._peak = 0

    # -- limits ------------------------------------------------------------------

    @property
    def limits(self) -> BatchLimits:
        return self._limits

    @property
    def allowed(self) -> SafeRange:
        return self._allowed

    def _check(self, limits: BatchLimits, allowed: SafeRange) -> BatchLimits:
        c = self._ceilings
        if limits.max_active_seqs > c.max_num_seqs or limits.max_inflight_tokens > c.max_inflight_tokens:
            raise LimitsRefused(
                f"limits {limits.max_active_seqs} seqs / {limits.max_inflight_tokens} tokens exceed the "
                f"engine ceilings {c.max_num_seqs} seqs / {c.max_inflight_tokens} tokens"
            )
        if not allowed.contains(limits):
            raise LimitsRefused(
                f"limits {limits.max_active_seqs} seqs / {limits.max_inflight_tokens} tokens are outside "
                f"the safe range: {allowed.describe()}"
            )
        return limits

    def set_limits(self, limits: BatchLimits, allowed: SafeRange | None = None) -> Changes:
        """Apply new limits (and optionally a new allowed range); admit what now fits."""
        allowed = allowed or self._allowed
        checked = self._check(limits, allowed)
        if checked != self._limits:
            self._peak = len(self._active)
        self._limits, self._allowed = checked, allowed
        return self.poll()

    # -- requests ----------------------------------------------------------------

    def new_ticket(self, tenant: str, weight: float, priority: PriorityClass, cost: int) -> Ticket:
        return Ticket(next(self._ids), tenant, weight, priority, max(1, cost))

    def offer(self, t: Ticket) -> Changes:
        """Queue a ticket and admit what fits. The result names `t` if it was settled."""
        now = self._clock()
        t.enqueued_at = now
        changes = Changes()
        while self._is_full(t.cost):
            victim = self._eviction_candidate(t.priority)
            if victim is None:
                self._counts["rejected"] += 1
                return Changes(rejected=[Rejection(t, "queue_full", self.retry_after(now))])
            self._remove_queued(victim)
            self._counts["evicted"] += 1
            changes.rejected.append(Rejection(victim, "evicted", self.retry_after(now)))
        self._queued[t.id] = t
        self._queued_tokens += t.cost
        self._classes[t.priority].push(t)
        return changes.extend(self.poll())

    def release(self, ticket_id: int, used_tokens: int | None = None) -> Changes:
        """Free an admitted ticket's slot (completion, error or disconnect)."""
        t = self._active.pop(ticket_id, None)
        if t is None:
            return Changes()
        self._inflight_tokens -= t.cost
        if t.priority == PriorityClass.BORROWED:
            self._borrowed -= 1
            self._borrowed_tokens -= t.cost
        self._counts["completed"] += 1
        if used_tokens is not None:
            self._classes[t.priority].counters[t.tenant] += (used_tokens - t.cost) / t.weight
        return self.poll()

    def cancel(self, ticket_id: int) -> Changes:
        """Withdraw a ticket: a queued one leaves the queue; an admitted one is released."""
        t = self._queued.get(ticket_id)
        if t is not None:
            self._remove_queued(t)
            self._counts["cancelled"] += 1
            return self.poll()
        if ticket_id in self._active:
            self._counts["cancelled"] += 1
            return self.release(ticket_id)
        return Changes()

    def poll(self) -> Changes:
        """Admit, in order, every queued ticket that fits now."""
        changes = Changes()
        if self._holding():
            return changes
        while (t := self._next()) is not None and self._fits(t):
            self._remove_queued(t)
            t.admitted_at = self._clock()
            self._active[t.id] = t
            self._inflight_tokens += t.cost
            if t.priority == PriorityClass.BORROWED:
                self._borrowed += 1
                self._borrowed_tokens += t.cost
            self._peak = max(self._peak, len(self._active))
            self._classes[t.priority].charge(t, t.cost)
            self._record_admission(t.admitted_at)
            changes.admitted.append(t)
        return changes

    def next_deadline(self) -> float | None:
        """When the wait window expires, if it is holding admission now."""
        if not self._holding():
            return None
        oldest = self._oldest_enqueue()
        return None if oldest is None else oldest + self._queue.max_wait_s

    # -- internals ---------------------------------------------------------------

    def _next(self) -> Ticket | None:
        for p in PriorityClass:
            head = self._classes[p].head()
            if head is not None:
                return head
        return None

    def _fits(self, t: Ticket) -> bool:
        """Borrowed work only fills free capacity, and never stands in the way of the pool's
        own work: an own request counts only own requests against the limits (the engine
        ceiling caps the total), so borrowed slots are handed back as soon as chat returns."""
        if not self._active:
            return True  # an idle replica always runs one request, however large
        if t.priority == PriorityClass.BORROWED:
            seqs, tokens = len(self._active), self._inflight_tokens
        else:
            if len(self._active) >= self._ceilings.max_num_seqs:
                return False
            seqs, tokens = len(self._active) - self._borrowed, self._inflight_tokens - self._borrowed_tokens
        return seqs < self._limits.max_active_seqs and tokens + t.cost <= self._limits.max_inflight_tokens

    def _holding(self) -> bool:
        q = self._queue
        if q.max_wait_s <= 0 or not self._queued:
            return False
        free_slots = self._limits.max_active_seqs - len(self._active)
        if len(self._queued) >= free_slots or self._queued_tokens >= q.min_batch_tokens:
            return False
        oldest = self._oldest_enqueue()
        return oldest is not None and self._clock() - oldest < q.max_wait_s

    def _oldest_enqueue(self) -> float | None:
        return min((x for c in self._classes.values() if (x := c.oldest_enqueue()) is not None), default=None)

    def _is_full(self, cost: int) -> bool:
        return (len(self._queued) + 1 > self._queue.max_queued
                or self._queued_tokens + cost > self._queue.max_queued_tokens)

    def _eviction_candidate(self, arriving: PriorityClass) -> Ticket | None:
        for p in reversed(PriorityClass):
            if p <= arriving:
                return None
            newest = self._classes[p].newest()
            if newest is not None:
                return newest
        return None

    def _remove_queued(self, t: Ticket) -> None:
        del self._queued[t.id]
        self._queued_tokens -= t.cost
        self._classes[t.priority].pop(t)

    def _record_admission(self, now: float) -> None:
        self._counts["admitted"] += 1
        self._admit_times.append(now)
        horizon = now - self._queue.drain_window_s
        while self._admit_times and self._admit_times[0] < horizon:
            self._admit_times.popleft()

    def drain_rate(self, now: float) -> float:
        """Admissions per second over the drain window (0 when nothing was admitted)."""
        recent = [x for x in self._admit_times if x >= now - self._queue.drain_window_s]
        if len(recent) < 2:
            return 0.0
        span = max(now - recent[0], 1e-3)
        return len(recent) / span

    def retry_after(self, now: float) -> float:
        """Seconds until the queue ahead of a new arrival has likely drained."""
        q = self._queue
        rate = self.drain_rate(now)
        if rate <= 0:
            return q.min_retry_after_s
        estimate = (len(self._queued) + 1) / rate
        return min(max(estimate, q.min_retry_after_s), q.max_retry_after_s)

    def stats(self) -> GateStats:
        now = self._clock()
        oldest = self._oldest_enqueue()
        return GateStats(
            active=len(self._active),
            inflight_tokens=self._inflight_tokens,
            queued_by_class={p.label: len(self._classes[p]) for p in PriorityClass},
            queued_tokens=self._queued_tokens,
            oldest_wait_s=0.0 if oldest is None else now - oldest,
            limits=self._limits,
            admitted=self._counts["admitted"],
            rejected=self._counts["rejected"],
            cancelled=self._counts["cancelled"],
            evicted=self._counts["evicted"],
            completed=self._counts["completed"],
            peak_active=self._peak,
        )

    def is_queued(self, ticket_id: int) -> bool:
        return ticket_id in self._queued

    def is_active(self, ticket_id: int) -> bool:
        return ticket_id in self._active


def ceil_seconds(seconds: float) -> int:
    """A Retry-After header value: whole seconds, at least one."""
    return max(1, math.ceil(seconds))
