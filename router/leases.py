"""The async glue around quotas: the ledger service and each router replica's client.

`LedgerService` is what the builder deploys as the one shared ledger (a Ray actor behind a
Serve handle). `QuotaClient` lives in every router replica: it charges requests from
its `LeaseBook` without awaiting, asks the ledger only when a lease runs short, and
hands unused balances back at each `sync` (the router's loop calls it every lease TTL).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict

from infra.bounds import Overdue, within
from infra.state import StateStore
from router.quota import Charge, Denied, Grant, LeaseBook, Need, Quota, QuotaLedger

log = logging.getLogger("poolserve.router")


class _Saved(BaseModel):
    """The shape `QuotaLedger.export` saves, checked before a ledger takes it back: NaN (no
    bucket ever refilled, no router's slots ever went) and text are refused."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)


class _Bucket(_Saved):
    level: float
    updated: float


class _Account(_Saved):
    requests: _Bucket | None = None
    tokens: _Bucket | None = None
    slots_out: dict[str, int] = {}
    seen: dict[str, float] = {}


class LedgerService:
    """The one ledger. Each tenant's account is saved to a `StateStore` (Ray's GCS key-value
    store when deployed) before a call that changed it returns, and read back by a ledger
    that starts: a restart keeps the buckets as they were and the slots out, instead of
    failing open, and nothing granted was unsaved. The clock is the wall clock, so saved
    times mean the same to the next process."""

    PREFIX = "quota-ledger/"

    def __init__(self, quotas: dict[str, Quota], clock: Callable[[], float] = time.time,
                 store: StateStore | None = None) -> None:
        self._clock = clock
        self._ledger = QuotaLedger(quotas, clock())
        self._store = store
        restored = 0
        for tenant in quotas if store is not None else ():
            try:
                if saved := store.get(self.PREFIX + tenant):
                    self._ledger.restore(tenant, _Account.model_validate(saved).model_dump(), clock())
                    restored += 1
            except (ValueError, OSError) as e:  # another version's, or damaged (pydantic's errors are ValueErrors)
                log.warning("quota ledger: the saved account %s%s cannot be read, so the tenant starts with its "
                            "full quota: %s", self.PREFIX, tenant, e)
        if restored:
            log.info("quota ledger: restored %d tenants' accounts saved before a restart", restored)

    def _save(self, tenant: str) -> None:
        if self._store is not None:  # a blocking write of one small document: the answer waits for it
            self._store.put(self.PREFIX + tenant, self._ledger.export(tenant))

    async def grant(self, tenant: str, holder: str, need: Need) -> Grant:
        grant = self._ledger.grant(tenant, holder, need, self._clock())
        self._save(tenant)
        return grant

    async def settle(self, tenant: str, holder: str, requests: float, tokens: float, slots_held: int) -> Grant:
        grant = self._ledger.settle(tenant, holder, requests, tokens, slots_held, self._clock())
        self._save(tenant)
        return grant

    async def usage(self, tenant: str) -> dict[str, float]:
        return self._ledger.usage(tenant, self._clock())


class QuotaExceeded(Exception):
    def __init__(self, denied: Denied) -> None:
        super().__init__(denied.limit)
        self.denied = denied


class QuotaUnavailable(Exception):
    """The ledger could not be reached to refill a lease: the request is refused (503)."""


class QuotaClient:
    """A router replica's leases, refilled from the ledger one tenant at a time.

    A refill and the charge it was for happen under the tenant's lock, so a request refused
    is refused for the limit it reached; a client that leaves while the ledger answers does
    not lose what the ledger granted (it stays in the lease for the next request, and goes
    back at the next sync)."""

    MAX_REFILLS = 8  # per charge: requests charging from the lease meanwhile may spend a refill

    def __init__(self, ledger: Any, quotas: dict[str, Quota], lease_fraction: float,
                 clock: Callable[[], float] = time.monotonic, call_timeout_s: float = 10.0) -> None:
        self._ledger = ledger  # a handle to LedgerService (or the object itself in tests)
        # a ledger call is a few dictionary updates: one that takes this long is lost, and a
        # request waiting on it (under its tenant's lock) must end, as a visible 503
        self._call_timeout_s = call_timeout_s
        self._book = LeaseBook(quotas, lease_fraction)
        self._holder = uuid.uuid4().hex[:12]
        self._locks = {t: asyncio.Lock() for t in quotas}
        self._clock = clock
        self._usage: dict[str, asyncio.Future] = {}  # tenant -> the ledger's answer to the last call

    async def charge(self, tenant: str, tokens: int, new_request: bool = True) -> Charge:
        """Charge a request (a request and a slot, when `new_request`) and `tokens`; raise
        QuotaExceeded with an honest retry-after, or QuotaUnavailable."""
        if (too_large := self._book.too_large(tenant, tokens)) is not None:
            raise QuotaExceeded(too_large)
        result = self._book.try_charge(tenant, tokens, new_request, self._clock())
        if isinstance(result, Charge):
            return result
        result = await self._refill_and_charge(tenant, tokens, new_request)
        if isinstance(result, Denied):
            raise QuotaExceeded(result)
        return result

    async def charge_tokens(self, charge: Charge, tokens: int) -> Charge:
        """Add `tokens` to a request already charged; the result is the request's one charge."""
        more = await self.charge(charge.tenant, tokens, new_request=False)
        return Charge(charge.tenant, charge.tokens + more.tokens)

    async def _refill_and_charge(self, tenant: str, tokens: int, new_request: bool) -> Charge | Denied:
        """Ask the ledger for what the lease lacks and charge right after its answer, under the
        tenant's lock: between a grant and its charge no other request or sync can spend it.
        A charge refused after that names the limit that ran short, never a lost race. The wait
        for the lock is bounded as a call is: behind a ledger that does not answer, a tenant's
        k-th request waiting its turn got its 503 after k calls' bounds (80 s for the 8th)."""
        lock = self._locks[tenant]
        try:
            await within(self._call_timeout_s, lock.acquire())
        except Overdue:
            raise QuotaUnavailable(f"tenant {tenant!r}'s requests before this one waited the quota ledger for "
                                   f"{self._call_timeout_s:g}s") from None
        try:
            if self._book.lease(tenant).tokens < 0:  # a debt goes to the ledger first, so its answer's wait counts it
                await self._settle(tenant, wait_out=True)
            for _ in range(self.MAX_REFILLS):
                need = self._book.try_charge(tenant, tokens, new_request, self._clock())
                if isinstance(need, Charge):  # another request's refill covered this one too
                    return need
                sent = self._clock()  # the ledger's word is as fresh as the question, not the answer's arrival
                if (denied := self._book.add(tenant, await self._grant(tenant, need, sent), sent)) is not None:
                    return denied
            result = self._book.try_charge(tenant, tokens, new_request, self._clock())
            return result if isinstance(result, Charge) else self._book.short(tenant, result)
        finally:
            lock.release()

    async def _grant(self, tenant: str, need: Need, sent: float) -> Grant:
        """The ledger's grant. A caller that leaves meanwhile still waits for the answer, under
        the tenant's lock, so that no sync reports this replica's slots without the grant;
        what the ledger granted goes into the lease for the next request."""
        call = asyncio.ensure_future(self._remote("grant", tenant, self._holder, need))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            await _outlast(call)
            if not call.cancelled() and call.exception() is None:
                self._book.add(tenant, call.result(), sent)
            raise
        except Exception as e:
            raise QuotaUnavailable(f"{type(e).__name__}: {e}") from e

    def finish(self, charge: Charge, used_tokens: int | None) -> None:
        self._book.finish(charge, used_tokens)

    def remaining(self, tenant: str) -> tuple[float, float]:
        return self._book.remaining_requests(tenant), self._book.remaining_tokens(tenant)

    async def usage(self, tenant: str) -> dict[str, float]:
        """The ledger's figures for `tenant`: one call at a time per tenant, its answer shared by
        the callers that came while it was out. `/v1/usage` is charged nothing, and a call per
        request let one tenant's concurrent polls load the ledger that every tenant's grants go
        through. A caller after the answer asks again: figures never older than its request."""
        asked = self._usage.get(tenant)
        if asked is None or asked.done():
            asked = asyncio.ensure_future(self._remote("usage", tenant))
            asked.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, whoever left
            self._usage[tenant] = asked
        try:
            out = dict(await asyncio.shield(asked))
        except Exception as e:  # the ledger away: a 503 to the caller, not a 500
            raise QuotaUnavailable(f"{type(e).__name__}: {e}") from e
        lease = self._book.lease(tenant)
        out["held_by_this_router"] = {"requests": lease.requests, "tokens": lease.tokens,
                                      "slots_in_use": lease.slots_used}
        return out

    async def _remote(self, method: str, *args):
        fn = getattr(self._ledger, method)
        return await within(self._call_timeout_s, fn.remote(*args) if hasattr(fn, "remote") else fn(*args))

    async def sync(self) -> None:
        """Hand unused balances back so other router replicas can spend them, and tell the
        ledger how many slots this replica holds. The call is shielded: once the balances
        left the lease they reach the ledger even if the sync is cancelled. A failed call
        loses the requests and tokens it gave back (never double-spends them; the buckets
        refill), keeps a debt it carried for the next sync (which may charge it twice if only
        the reply was lost: the tenant, not the quota, pays for a lost reply), and the next
        sync's slot count puts the slots right."""
        for tenant, lock in self._locks.items():
            async with lock:
                if await self._settle(tenant):  # idle slots dropped: free for others now, not a sync later
                    await self._settle(tenant)

    async def _settle(self, tenant: str, wait_out: bool = False) -> bool:
        """One settle; whether its answer dropped idle slots of the lease. `wait_out`: a caller
        that leaves meanwhile still waits for the answer under the tenant's lock, as a grant's
        does, and takes it in: a request's settle of its debt, left early, lost the debt when the
        call then failed, and its late answer undid a grant made since (slots over the limit)."""
        req, tok, held = self._book.surplus(tenant)
        sent = self._clock()
        call = asyncio.ensure_future(self._remote("settle", tenant, self._holder, req, tok, held))
        try:
            await asyncio.shield(call)
        except asyncio.CancelledError:
            if wait_out:
                await _outlast(call)
                self._settled(tenant, call, tok, sent)
            raise
        except Exception:
            pass
        return self._settled(tenant, call, tok, sent)

    def _settled(self, tenant: str, call: asyncio.Future, tok: float, sent: float) -> bool:
        if call.cancelled() or call.exception() is not None:  # ledger away
            log.warning("quota ledger unreachable while settling %s: %r", tenant,
                        "cancelled" if call.cancelled() else call.exception())
            self._book.owe(tenant, min(0.0, tok))
            return False
        idle = self._book.lease(tenant).slots_free  # (requests charged meanwhile may have spent some)
        self._book.add(tenant, call.result(), sent)
        return self._book.lease(tenant).slots_free < idle


async def _outlast(future: asyncio.Future) -> None:
    """Wait until `future` is done, through any number of cancellations of the waiting task."""
    while not future.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({future})
