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
  3. the head of the chosen queue is admitted only if it fits the limits (active sequences,
     where a request of `n` choices is `n` sequences, and in-flight tokens). A head that
     does not fit blocks everything behind it, so a large request is never starved by
     smaller ones. A request larger than the whole token budget runs alone. Borrowed work
     (another pool's, lent this pool's idle capacity) only fills what the pool's own work
     leaves free, and the pool's own work does not count it: chat that returns gets its
     slots at once, up to the engine ceiling (lenders read when its own work was here last).

The queue is bounded in requests and tokens; the bound counts what still waits after an
arrival was offered the free slots. When an arrival would overfill it, the newest queued
requests less important than the arrival are evicted, least important first, but only when
evicting them makes room; otherwise nobody is evicted and the arrival is rejected. Every
rejection and eviction is returned to the caller, with a retry-after estimated from the
observed drain rate.

The wait window (offline pools): admission holds while fewer than `min_batch_tokens`
are queued and the oldest request has waited less than `max_wait_s`. With a zero
window, or a queue whose sequences already fill the free slots, nothing waits.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import Callable, Literal

from pools.fair import Admissions, FairClass, Ticket
from pools.types import BatchLimits, GateStats, PriorityClass, SafeRange

COUNTS = ("admitted", "rejected", "cancelled", "evicted", "completed", "own_refused")  # GateStats' counters
Ended = Literal["completed", "cancelled"]  # how an admitted ticket ends, as its counts tell


def _refused(kind: str, tickets: list[Ticket]) -> collections.Counter[str]:
    """`kind` for each ticket turned away, and `own_refused` for those of the pool's own: the
    autoscaler's rejection signal, where borrowed work turned away is no reason for a lender to grow."""
    return collections.Counter({kind: len(tickets),
                                "own_refused": sum(t.priority != PriorityClass.BORROWED for t in tickets)})

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


@dataclass(frozen=True)
class Rejection:
    ticket: Ticket
    reason: str  # "queue_full" | "evicted" | "lender_busy" (borrowed work sent home)
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


class AdmissionGate:
    def __init__(self, limits: BatchLimits, allowed: SafeRange, ceilings: Ceilings, queue: QueuePolicy,
                 clock: Clock) -> None:
        self._ceilings, self._queue, self._clock, self._allowed = ceilings, queue, clock, allowed
        self._limits = self._check(limits, allowed)
        self._classes = {p: FairClass() for p in PriorityClass}
        self._active: dict[int, Ticket] = {}
        self._queued: dict[int, Ticket] = {}
        self._active_seqs = self._inflight_tokens = 0
        self._borrowed_requests = self._borrowed_seqs = self._borrowed_tokens = 0  # active borrowed work
        self._queued_tokens = 0
        self._own_seen = float("-inf")  # when the pool's own (not borrowed) work was last here
        self._ids = itertools.count(1)
        self._admissions = Admissions(queue.drain_window_s)
        self._waits: collections.deque[tuple[float, float]] = collections.deque(maxlen=2048)  # (admitted, waited)
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
            self._peak = self._active_seqs
        self._limits, self._allowed = checked, allowed
        return self.poll()

    # -- requests ----------------------------------------------------------------

    def new_ticket(self, tenant: str, weight: float, priority: PriorityClass, cost: int, seqs: int = 1) -> Ticket:
        return Ticket(next(self._ids), tenant, weight, priority, max(1, cost), max(1, seqs))

    def offer(self, t: Ticket) -> Changes:
        """Queue a ticket and admit what fits. Every ticket this settles is in the result:
        `t` itself (admitted or rejected) and any queued ticket evicted to make room for it."""
        t.enqueued_at = self._clock()
        self._queued[t.id] = t
        self._queued_tokens += t.cost
        self._classes[t.priority].push(t)
        changes = self.poll()
        if t.id in self._queued and self._overfull():
            changes.rejected += self._make_room(t)
        return changes

    def release(self, ticket_id: int, used_tokens: int | None = None, ended: Ended = "completed") -> Changes:
        """Free an admitted ticket's slot (completion, error or disconnect); `used_tokens` settles
        its tenant's counter, which keeps the ticket's whole cost when they are not known."""
        t = self._active.pop(ticket_id, None)
        if t is None:
            return Changes()
        self._active_seqs -= t.seqs
        self._inflight_tokens -= t.cost
        self._saw(t)
        if t.priority == PriorityClass.BORROWED:
            self._borrowed_requests -= 1
            self._borrowed_seqs -= t.seqs
            self._borrowed_tokens -= t.cost
        self._counts[ended] += 1
        if used_tokens is not None:
            self._classes[t.priority].counters[t.tenant] += (used_tokens - t.cost) / t.weight
        return self.poll()

    def cancel(self, ticket_id: int, used_tokens: int | None = None) -> Changes:
        """Withdraw a ticket: a queued one leaves the queue; an admitted one is released (as
        `release` settles it: `used_tokens` 0 when nothing ran)."""
        t = self._queued.get(ticket_id)
        if t is not None:
            self._remove_queued(t)
            self._counts["cancelled"] += 1
            return self.poll()
        if ticket_id in self._active:
            return self.release(ticket_id, used_tokens, ended="cancelled")
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
            self._active_seqs += t.seqs
            self._inflight_tokens += t.cost
            if t.priority == PriorityClass.BORROWED:
                self._borrowed_requests += 1
                self._borrowed_seqs += t.seqs
                self._borrowed_tokens += t.cost
            else:
                self._waits.append((t.admitted_at, t.admitted_at - t.enqueued_at))
            self._peak = max(self._peak, self._active_seqs)
            self._classes[t.priority].charge(t, t.cost)
            self._counts["admitted"] += 1
            self._admissions.add(t.admitted_at)
            changes.admitted.append(t)
        # own work is back (it waits, or got in past borrowed work its overlap could hold out for ever)
        if any(x.priority != PriorityClass.BORROWED for x in (*changes.admitted, *([t] if t else []))):
            changes.rejected += self._return_borrowed()
        return changes

    def _return_borrowed(self) -> list[Rejection]:
        """Borrowed work queued here goes home: the lender's own work is back, and stays first."""
        lent = list(self._classes[PriorityClass.BORROWED].newest_first())
        for v in lent:
            self._remove_queued(v)
        return [Rejection(v, "lender_busy", self.retry_after(self._clock())) for v in lent]

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
        ceiling caps the total, in sequences and in tokens: past its KV the engine preempts), so
        borrowed slots are handed back as soon as chat returns."""
        if not self._active:
            return True  # an idle replica always runs one request, however large
        if t.priority == PriorityClass.BORROWED:
            seqs, tokens = self._active_seqs, self._inflight_tokens
        else:
            if (self._active_seqs + t.seqs > self._ceilings.max_num_seqs
                    or self._inflight_tokens + t.cost > self._ceilings.max_inflight_tokens):
                return False
            seqs, tokens = self._active_seqs - self._borrowed_seqs, self._inflight_tokens - self._borrowed_tokens
        return (seqs + t.seqs <= self._limits.max_active_seqs
                and tokens + t.cost <= self._limits.max_inflight_tokens)

    def _holding(self) -> bool:
        q = self._queue
        if q.max_wait_s <= 0 or not self._queued:
            return False
        free_slots = self._limits.max_active_seqs - self._active_seqs
        free_tokens = self._limits.max_inflight_tokens - self._inflight_tokens
        if (self._queued_tokens >= min(q.min_batch_tokens, free_tokens)
                or sum(t.seqs for t in self._queued.values()) >= free_slots):
            return False
        oldest = self._oldest_enqueue()
        return oldest is not None and self._clock() - oldest < q.max_wait_s

    def _oldest_enqueue(self) -> float | None:
        return min((x for c in self._classes.values() if (x := c.oldest_enqueue()) is not None), default=None)

    def _overfull(self, freed: int = 0, freed_tokens: int = 0) -> bool:
        return (len(self._queued) - freed > self._queue.max_queued
                or self._queued_tokens - freed_tokens > self._queue.max_queued_tokens)

    def _make_room(self, t: Ticket) -> list[Rejection]:
        """Evict the newest waiters less important than `t`, least important first, then those its
        class gives up for it (`FairClass.crowding`), if that makes room; else reject `t` alone."""
        now = self._clock()
        victims: list[Ticket] = []
        for p in reversed(PriorityClass):
            if p < t.priority or not self._overfull(len(victims), sum(v.cost for v in victims)):
                break
            for v in self._classes[p].newest_first() if p > t.priority else self._classes[p].crowding(t.tenant):
                victims.append(v)
                if not self._overfull(len(victims), sum(x.cost for x in victims)):
                    break
        if self._overfull(len(victims), sum(v.cost for v in victims)):
            self._remove_queued(t)
            self._counts.update(_refused("rejected", [t]))
            return [Rejection(t, "queue_full", self.retry_after(now))]
        for v in victims:
            self._remove_queued(v)
        self._counts.update(_refused("evicted", victims))
        return [Rejection(v, "evicted", self.retry_after(now)) for v in victims]

    def _saw(self, t: Ticket) -> None:
        self._own_seen = self._clock() if t.priority != PriorityClass.BORROWED else self._own_seen

    def _remove_queued(self, t: Ticket) -> None:
        self._saw(t)
        del self._queued[t.id]
        self._queued_tokens -= t.cost
        self._classes[t.priority].pop(t)

    def retry_after(self, now: float) -> float:
        """Seconds until the queue ahead of a new arrival has likely drained."""
        q = self._queue
        rate = self._admissions.rate(now)
        if rate <= 0:
            return q.min_retry_after_s
        estimate = (len(self._queued) + 1) / rate
        return min(max(estimate, q.min_retry_after_s), q.max_retry_after_s)

    def stats(self) -> GateStats:
        now, oldest, lent = self._clock(), self._oldest_enqueue(), len(self._classes[PriorityClass.BORROWED])
        own = len(self._active) + len(self._queued) - self._borrowed_requests - lent
        return GateStats(
            active=self._active_seqs, active_requests=len(self._active), borrowed_requests=self._borrowed_requests,
            borrowed_seqs=self._borrowed_seqs, inflight_tokens=self._inflight_tokens,
            queued_by_class={p.label: len(self._classes[p]) for p in PriorityClass},
            queued_tokens=self._queued_tokens, oldest_wait_s=0.0 if oldest is None else now - oldest, limits=self._limits,
            **{k: self._counts[k] for k in COUNTS},
            peak_active=self._peak, own_idle_s=0.0 if own else now - self._own_seen)

    def waits(self, window_s: float) -> tuple[float, ...]:
        """How long the pool's own requests waited here over the last `window_s`: those admitted,
        and those still waiting (so far: lower bounds)."""
        now = self._clock()
        queued = (now - t.enqueued_at for t in self._queued.values() if t.priority != PriorityClass.BORROWED)
        return (*(w for at, w in self._waits if at >= now - window_s), *queued)

    def borrowed_work(self) -> int:
        """Sequences of borrowed work here, running or waiting."""
        return self._borrowed_seqs + sum(t.seqs for t in self._queued.values() if t.priority == PriorityClass.BORROWED)

    def is_queued(self, ticket_id: int) -> bool:
        return ticket_id in self._queued

    def is_active(self, ticket_id: int) -> bool:
        return ticket_id in self._active

