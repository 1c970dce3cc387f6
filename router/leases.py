"""The async glue around quotas: the ledger service and each router replica's client.

`LedgerService` is what the builder deploys as the one shared ledger (a Ray actor behind a
Serve handle). `QuotaClient` lives in every router replica: it charges requests from
its `LeaseBook` without awaiting, asks the ledger only when a lease runs short, and
hands unused balances back every `sync_interval_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from router.quota import Charge, Denied, Grant, LeaseBook, Need, Quota, QuotaLedger

log = logging.getLogger("poolserve.router")


class LedgerService:
    def __init__(self, quotas: dict[str, Quota]) -> None:
        self._ledger = QuotaLedger(quotas, time.monotonic())

    async def grant(self, tenant: str, holder: str, need: Need) -> Grant:
        return self._ledger.grant(tenant, holder, need, time.monotonic())

    async def settle(self, tenant: str, holder: str, requests: float, tokens: float, slots: int) -> Grant:
        return self._ledger.settle(tenant, holder, requests, tokens, slots, time.monotonic())

    async def usage(self, tenant: str) -> dict[str, float]:
        return self._ledger.usage(tenant, time.monotonic())


class QuotaExceeded(Exception):
    def __init__(self, denied: Denied) -> None:
        super().__init__(denied.limit)
        self.denied = denied


class QuotaClient:
    def __init__(self, ledger: Any, quotas: dict[str, Quota], lease_fraction: float, sync_interval_s: float) -> None:
        self._ledger = ledger  # a handle to LedgerService (or the object itself in tests)
        self._book = LeaseBook(quotas, lease_fraction)
        self._holder = uuid.uuid4().hex[:12]
        self._locks = {t: asyncio.Lock() for t in quotas}
        self._sync_interval_s = sync_interval_s
        self._syncer: asyncio.Task | None = None

    async def charge(self, tenant: str, tokens: int) -> Charge:
        """Charge one request of `tokens`; raise QuotaExceeded with an honest retry-after."""
        self._ensure_syncer()
        result = self._book.try_charge(tenant, tokens)
        if isinstance(result, Charge):
            return result
        async with self._locks[tenant]:
            result = self._book.try_charge(tenant, tokens)  # another task may have refilled
            if isinstance(result, Charge):
                return result
            grant = await self._remote("grant", tenant, self._holder, result)
            denied = self._book.add(tenant, grant, time.monotonic())
            if denied is not None:
                raise QuotaExceeded(denied)
            result = self._book.try_charge(tenant, tokens)
            if isinstance(result, Need):  # cannot happen: the grant covered the shortfall
                raise RuntimeError(f"lease for {tenant} still short after a grant: {result}")
            return result

    def finish(self, charge: Charge, used_tokens: int | None) -> None:
        self._book.finish(charge, used_tokens)

    def remaining(self, tenant: str) -> tuple[float, float]:
        return self._book.remaining_requests(tenant), self._book.remaining_tokens(tenant)

    async def usage(self, tenant: str) -> dict[str, float]:
        out = await self._remote("usage", tenant)
        lease = self._book.lease(tenant)
        out["held_by_this_router"] = {"requests": lease.requests, "tokens": lease.tokens,
                                      "slots_in_use": lease.slots_used}
        return out

    async def _remote(self, method: str, *args):
        fn = getattr(self._ledger, method)
        return await (fn.remote(*args) if hasattr(fn, "remote") else fn(*args))

    def _ensure_syncer(self) -> None:
        if self._syncer is None:
            self._syncer = asyncio.get_running_loop().create_task(self._sync_loop())

    async def _sync_loop(self) -> None:
        """Hand unused balances back so other router replicas can spend them."""
        while True:
            await asyncio.sleep(self._sync_interval_s)
            for tenant in self._locks:
                async with self._locks[tenant]:
                    req, tok, slots = self._book.surplus(tenant)
                    try:
                        grant = await self._remote("settle", tenant, self._holder, req, tok, slots)
                        self._book.add(tenant, grant, time.monotonic())
                    except Exception as e:  # ledger away: balances are lost, never double-spent
                        log.warning("quota ledger unreachable while settling %s: %s", tenant, e)
