"""AsyncGate: the asyncio face of the AdmissionGate, one per pool replica.

`offer` hands the gate a ticket and returns at once with a `Pending` verdict, decided
already when a slot was free (or the queue full); `Pending.wait` parks the caller on a
future until the gate admits or rejects its ticket. A caller
that is cancelled while waiting (client disconnect) withdraws its ticket, and a caller
cancelled just after admission gives its slot back. The wait window is driven by
one loop timer set to the gate's next deadline, never by polling.
"""

from __future__ import annotations

import asyncio

from pools.gate import AdmissionGate, Changes, Rejection, Ticket
from pools.types import BatchLimits, PriorityClass, SafeRange


class GateRejected(Exception):
    def __init__(self, rejection: Rejection) -> None:
        super().__init__(rejection.reason)
        self.rejection = rejection


class AsyncGate:
    def __init__(self, gate: AdmissionGate) -> None:
        self.gate = gate
        self._waiters: dict[int, Pending] = {}
        self._timer: asyncio.TimerHandle | None = None

    def offer(self, tenant: str, weight: float, priority: PriorityClass, cost: int, seqs: int = 1) -> "Pending":
        ticket = self.gate.new_ticket(tenant, weight, priority, cost, seqs)
        pending = self._waiters[ticket.id] = Pending(self, ticket.id, asyncio.get_running_loop().create_future())
        self._apply(self.gate.offer(ticket))
        return pending

    def release(self, ticket: Ticket, used_tokens: int | None = None, cancelled: bool = False) -> None:
        """Free a slot; `cancelled` when the request did not finish (client gone, error)."""
        changes = self.gate.cancel(ticket.id, used_tokens) if cancelled else self.gate.release(ticket.id, used_tokens)
        self._apply(changes)

    def set_limits(self, limits: BatchLimits, allowed: SafeRange | None = None) -> None:
        self._apply(self.gate.set_limits(limits, allowed))

    def _apply(self, changes: Changes) -> None:
        for t in changes.admitted:
            pending = self._waiters.get(t.id)
            if pending is not None and not pending._waiter.done():
                pending._waiter.set_result(t)
            elif pending is None or pending._waiter.cancelled():
                # Its caller is gone: the slot straight back, and nothing ran to charge the tenant for.
                self._apply(self.gate.cancel(t.id, used_tokens=0))
        for r in changes.rejected:
            pending = self._waiters.get(r.ticket.id)
            if pending is not None:  # its caller may be leaving in this very turn: kept for its counts
                pending.rejection = r
                if not pending._waiter.done():
                    pending._waiter.set_result(r)  # a result, not an exception nobody may read
        self._arm_timer()

    def _arm_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        deadline = self.gate.next_deadline()
        if deadline is not None:
            delay = max(0.0, deadline - self.gate._clock())
            self._timer = asyncio.get_running_loop().call_later(delay, self._on_deadline)

    def _on_deadline(self) -> None:
        self._timer = None
        self._apply(self.gate.poll())


class Pending:
    """A ticket the gate holds: `decided` once admitted or rejected; `wait` for the verdict
    (a Ticket, or GateRejected); `withdraw` if its caller leaves before waiting. `rejection` is
    how the gate turned it away, if it did: a caller that left in the same turn never reads it
    from `wait`, and still owes it to its counts."""

    def __init__(self, gate: AsyncGate, ticket_id: int, waiter: "asyncio.Future[Ticket | Rejection]") -> None:
        self._gate, self._id, self._waiter = gate, ticket_id, waiter
        self.rejection: Rejection | None = None

    @property
    def decided(self) -> bool:
        return self._waiter.done()

    async def wait(self) -> Ticket:
        try:
            verdict = await self._waiter
        except asyncio.CancelledError:
            self.withdraw()
            raise
        finally:
            self._gate._waiters.pop(self._id, None)
        if isinstance(verdict, Rejection):
            raise GateRejected(verdict)
        return verdict

    def withdraw(self) -> None:
        """Take the ticket back: out of the queue, or its slot returned if already admitted."""
        if self._gate._waiters.pop(self._id, None) is None:
            return
        if not self._waiter.done():
            self._waiter.cancel()
        self._gate._apply(self._gate.gate.cancel(self._id, used_tokens=0))  # admitted maybe, but nothing ran
