"""Per-tenant quotas: token buckets, a shared ledger, and the leases router replicas hold.

Pure decision code: no Ray, no clock reads; every call takes `now`.

Three limits per tenant, all enforced before work starts:
  * requests per minute and tokens per minute: token buckets that refill continuously
    (capacity = one minute's worth, refill = capacity / 60 per second);
  * concurrent requests: a count of slots.

The `QuotaLedger` owns the buckets and the slot counts for the whole cluster (it runs as
one Ray actor). A router replica does not call it per request: it holds a `Lease`
(some requests, tokens and slots taken from the ledger in advance) and spends locally.
When its balance cannot cover a request it asks for the shortfall plus a chunk; the
ledger grants all of the shortfall or nothing, and says how long until it could.
A request is charged in two steps: one request and one concurrency slot before its body is
read (so a flood of large bodies is paid for before it costs the router anything), then
its tokens once they are counted: every prompt token plus `n` x `max_tokens`. When it ends,
its real usage settles the difference: the unused part is refunded, usage above the charge
is debited (a balance may go below zero; the next grant pays the debt). Unused balances go
back to the ledger at each sync, so other replicas can spend them, and each sync and each
question tells the ledger how many slots the replica holds in all (not a difference), so a
lost call never leaks a slot for good, and idle slots a replica dropped are free at once. While
a replica waits for a slot (refused one within `HOLDER_TTL_S`), grants carry no spare slot and
each sync drops a replica's idle ones and reports at once: the refused replica gets a slot
within a sync round.

A replica the ledger has not heard from for `HOLDER_TTL_S` is taken for dead and its slots go
to others; so a replica alive but cut off spends idle slots only within `LEASE_FRESH_S` of
the ledger's last answer, and never more slots than that answer counted for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from router.buckets import INF, TokenBucket

HOLDER_TTL_S = 30.0  # the ledger takes back the slots of a replica it has not heard from for this long
LEASE_FRESH_S = HOLDER_TTL_S / 2  # a replica spends idle slots only this long after the ledger's answer


@dataclass(frozen=True)
class Quota:
    requests_per_min: int | None = None
    tokens_per_min: int | None = None
    max_concurrent: int | None = None


@dataclass(frozen=True)
class Need:
    """What a router replica asks the ledger for: `requests`/`tokens`/`slots` must all be
    granted or none; `extra_*` are granted as far as available."""

    requests: int = 0
    tokens: int = 0
    slots: int = 0
    extra_requests: int = 0
    extra_tokens: int = 0
    extra_slots: int = 0
    slots_held: int | None = None  # the slots the asking replica holds in all (idle ones it dropped are not)


@dataclass(frozen=True)
class Grant:
    requests: float
    tokens: float
    slots: int
    retry_after_s: float  # 0 when granted; seconds until the need could be met otherwise
    limit: str = ""  # which limit refused: "requests" | "tokens" | "concurrency" | "too_large"
    remaining_requests: float = INF
    remaining_tokens: float = INF
    slots_allowed: int | None = None  # the slots the holder may hold in all, as the ledger counts them

    @property
    def granted(self) -> bool:
        return self.retry_after_s == 0


@dataclass
class _TenantAccount:
    quota: Quota
    requests: TokenBucket | None
    tokens: TokenBucket | None
    slots_out: dict[str, int] = field(default_factory=dict)  # router id -> slots held
    seen: dict[str, float] = field(default_factory=dict)  # router id -> last sync
    short_at: float = -INF  # when a replica was last refused a slot


class QuotaLedger:
    """The cluster-wide truth about every tenant's quota (one instance, one actor)."""

    def __init__(self, quotas: dict[str, Quota], now: float, holder_ttl_s: float = HOLDER_TTL_S) -> None:
        self._holder_ttl_s = holder_ttl_s
        self._accounts = {
            name: _TenantAccount(q, TokenBucket.per_minute(q.requests_per_min, now),
                                 TokenBucket.per_minute(q.tokens_per_min, now))
            for name, q in quotas.items()
        }

    def grant(self, tenant: str, holder: str, need: Need, now: float) -> Grant:
        acct = self._accounts[tenant]
        acct.seen[holder] = now
        self._expire_holders(acct, now)
        if need.slots_held is not None and acct.quota.max_concurrent is not None:
            acct.slots_out[holder] = max(0, need.slots_held)  # as a sync says it, so dropped slots are free
        if need.slots and self._free_slots(acct) < need.slots:
            acct.short_at = now
        refusal = self._refusal(acct, need, now)
        if refusal is not None:
            return replace(refusal, slots_allowed=self._held(acct, holder))
        req = self._take(acct.requests, need.requests, need.extra_requests, now)
        tok = self._take(acct.tokens, need.tokens, need.extra_tokens, now)
        free = self._free_slots(acct)
        extra = 0 if self._contended(acct, now) else need.extra_slots  # no idle slot while others wait for one
        slots = 0 if free == INF else need.slots + min(extra, max(0, int(free) - need.slots))
        if slots:
            acct.slots_out[holder] = acct.slots_out.get(holder, 0) + slots
        return Grant(req, tok, slots, 0.0, "", *self._remaining(acct, now), slots_allowed=self._held(acct, holder))

    def settle(self, tenant: str, holder: str, requests: float, tokens: float, slots_held: int,
               now: float) -> Grant:
        """Take back unused requests and tokens (negative tokens: a debt, debited), record the
        slots the holder holds in all; report what remains and the slots it may keep (fewer
        when the ledger gave its slots away, so that idle ones are not spent twice; none idle
        while another replica waits for a slot: its requests run on, and their slots go back
        at its syncs)."""
        acct = self._accounts[tenant]
        acct.seen[holder] = now
        if acct.requests is not None and requests > 0:
            acct.requests.give_back(requests, now)
        if acct.tokens is not None and tokens > 0:
            acct.tokens.give_back(tokens, now)
        elif acct.tokens is not None and tokens < 0:
            acct.tokens.debit(-tokens, now)
        allowed = None
        if acct.quota.max_concurrent is not None:
            others = sum(n for h, n in acct.slots_out.items() if h != holder)
            allowed = max(0, min(slots_held, acct.quota.max_concurrent - others))
            allowed = 0 if self._contended(acct, now) else allowed
            acct.slots_out[holder] = max(0, slots_held)  # running requests count, over the limit or not
        return Grant(0, 0, 0, 0.0, "", *self._remaining(acct, now), slots_allowed=allowed)

    def export(self, tenant: str) -> dict:
        """A tenant's account as a JSON-able document (bucket levels at their update times,
        slots held by each router replica), to be kept where a restarted ledger finds it."""
        def bucket(b: TokenBucket | None):
            return None if b is None else {"level": b.level, "updated": b.updated}
        a = self._accounts[tenant]
        return {"requests": bucket(a.requests), "tokens": bucket(a.tokens), "slots_out": dict(a.slots_out),
                "seen": dict(a.seen)}

    def restore(self, tenant: str, saved: dict, now: float) -> None:
        """Take back an exported account (times on the same clock); a quota that changed keeps
        its new capacity. Each holder is heard from as of `now`: none could reach the ledger
        while it was down, and read as saved, an outage longer than the holders' TTL gave away
        every live replica's running slots to the first to ask."""
        acct = self._accounts[tenant]
        for bucket, b in ((acct.requests, saved.get("requests")), (acct.tokens, saved.get("tokens"))):
            if bucket is not None and b:
                bucket.level, bucket.updated = min(float(b["level"]), bucket.capacity), float(b["updated"])
        acct.slots_out = {h: int(n) for h, n in saved.get("slots_out", {}).items()}
        acct.seen = {h: max(float(t), now) for h, t in saved.get("seen", {}).items()}

    def usage(self, tenant: str, now: float) -> dict[str, float]:
        acct = self._accounts[tenant]
        rem_req, rem_tok = self._remaining(acct, now)
        return {"remaining_requests": rem_req, "remaining_tokens": rem_tok,
                "concurrent": sum(acct.slots_out.values())}

    # -- internals ---------------------------------------------------------------

    def _refusal(self, acct: _TenantAccount, need: Need, now: float) -> Grant | None:
        waits = []
        for name, bucket, n in (("requests", acct.requests, need.requests), ("tokens", acct.tokens, need.tokens)):
            if bucket is not None and n > 0:
                wait = bucket.time_until(n, now)
                if wait == INF:
                    return Grant(0, 0, 0, INF, "too_large", *self._remaining(acct, now))
                if wait > 0:
                    waits.append((wait, name))
        if need.slots and self._free_slots(acct) < need.slots:
            waits.append((1.0, "concurrency"))  # a slot frees when a request ends; try again soon
        if not waits:
            return None
        wait, name = max(waits)
        return Grant(0, 0, 0, wait, name, *self._remaining(acct, now))

    @staticmethod
    def _take(bucket: TokenBucket | None, n: int, extra: int, now: float) -> float:
        if bucket is None:
            return INF
        bucket.take(n, now)
        bonus = min(extra, max(0.0, bucket.available(now)))
        bucket.take(bonus, now)
        return n + bonus

    @staticmethod
    def _held(acct: _TenantAccount, holder: str) -> int | None:
        """The slots the ledger counts for `holder` (None: no concurrency limit)."""
        return None if acct.quota.max_concurrent is None else acct.slots_out.get(holder, 0)

    def _free_slots(self, acct: _TenantAccount) -> float:
        if acct.quota.max_concurrent is None:
            return INF
        return acct.quota.max_concurrent - sum(acct.slots_out.values())

    def _contended(self, acct: _TenantAccount, now: float) -> bool:
        """A replica was refused a slot lately: a slot idle in another's lease is one it lacks."""
        return acct.quota.max_concurrent is not None and now - acct.short_at <= self._holder_ttl_s

    def _expire_holders(self, acct: _TenantAccount, now: float) -> None:
        """Slots held by a router replica that stopped syncing (it died) come back."""
        for holder, seen in list(acct.seen.items()):
            if now - seen > self._holder_ttl_s:
                acct.slots_out.pop(holder, None)
                del acct.seen[holder]

    @staticmethod
    def _remaining(acct: _TenantAccount, now: float) -> tuple[float, float]:
        return (INF if acct.requests is None else acct.requests.available(now),
                INF if acct.tokens is None else acct.tokens.available(now))


@dataclass
class Lease:
    """One router replica's local balance for one tenant."""

    requests: float = 0.0
    tokens: float = 0.0
    slots_free: int = 0
    slots_used: int = 0
    remaining_requests: float = INF  # the ledger's figure at the last exchange
    remaining_tokens: float = INF
    synced_at: float = -INF
    slots_cap: float = INF  # the slots the ledger last said this replica may hold in all


@dataclass(frozen=True)
class Charge:
    tenant: str
    tokens: int


@dataclass(frozen=True)
class Denied:
    limit: str
    retry_after_s: float
    remaining_requests: float
    remaining_tokens: float


class LeaseBook:
    """A router replica's leases. `try_charge` is the hot path and never awaits.

    When it returns a `Need`, the caller asks the ledger, passes the `Grant` to `add`,
    and tries again once.
    """

    def __init__(self, quotas: dict[str, Quota], lease_fraction: float) -> None:
        self._quotas = quotas
        self._fraction = lease_fraction
        self._leases = {t: Lease() for t in quotas}

    def lease(self, tenant: str) -> Lease:
        return self._leases[tenant]

    def need(self, tenant: str, tokens: int, new_request: bool = True) -> Need | None:
        """What the ledger must grant before `try_charge` can succeed (None: nothing)."""
        q, lease = self._quotas[tenant], self._leases[tenant]
        short_req = new_request and q.requests_per_min is not None and lease.requests < 1
        short_tok = q.tokens_per_min is not None and tokens > 0 and lease.tokens < tokens
        short_slot = new_request and q.max_concurrent is not None and lease.slots_free < 1
        if not (short_req or short_tok or short_slot):
            return None
        # never more than a minute's: a lease in debt (which the quota client settles before
        # asking, unless the ledger is away) asked for more, refused for good as too large
        short = min(math.ceil(tokens - lease.tokens), q.tokens_per_min) if short_tok else 0
        return Need(requests=int(short_req), tokens=max(0, short),
                    slots=int(short_slot), extra_requests=self._chunk(q.requests_per_min),
                    extra_tokens=self._chunk(q.tokens_per_min),
                    extra_slots=self._chunk(q.max_concurrent) - 1 if q.max_concurrent else 0,
                    slots_held=lease.slots_used + lease.slots_free if q.max_concurrent is not None else None)

    def try_charge(self, tenant: str, tokens: int, new_request: bool = True,
                   now: float | None = None) -> Charge | Need:
        """Charge from the lease: one request and one slot (`new_request`) and `tokens`; with
        `now`, idle slots older than `LEASE_FRESH_S` are dropped first (given away, maybe)."""
        lease = self._leases[tenant]
        if now is not None and lease.slots_free and now - lease.synced_at > LEASE_FRESH_S:
            lease.slots_free = 0
        need = self.need(tenant, tokens, new_request)
        if need is not None:
            return need
        q, lease = self._quotas[tenant], self._leases[tenant]
        if new_request and q.requests_per_min is not None:
            lease.requests -= 1
        if q.tokens_per_min is not None:
            lease.tokens -= tokens
        if new_request and q.max_concurrent is not None:
            lease.slots_free -= 1
            lease.slots_used += 1
        return Charge(tenant, tokens)

    def add(self, tenant: str, grant: Grant, asked_at: float) -> Denied | None:
        """The ledger's answer to a question asked at `asked_at` (fresh from then, however late)."""
        lease = self._leases[tenant]
        lease.remaining_requests, lease.remaining_tokens = grant.remaining_requests, grant.remaining_tokens
        lease.synced_at = asked_at
        q = self._quotas[tenant]
        if grant.granted:
            if q.requests_per_min is not None:
                lease.requests += grant.requests
            if q.tokens_per_min is not None:
                lease.tokens += grant.tokens
            lease.slots_free += grant.slots
        if grant.slots_allowed is not None:  # slots the ledger gave away are not spent here
            lease.slots_cap = grant.slots_allowed
            lease.slots_free = min(lease.slots_free, max(0, grant.slots_allowed - lease.slots_used))
        if not grant.granted:
            return Denied(grant.limit, grant.retry_after_s, self.remaining_requests(tenant),
                          self.remaining_tokens(tenant))
        return None

    def finish(self, charge: Charge, used_tokens: int | None) -> None:
        """A request ended: free its slot and settle its tokens against the real usage, the
        unused part refunded, usage above the charge debited. `None`: usage unknown, the
        charge stands."""
        q, lease = self._quotas[charge.tenant], self._leases[charge.tenant]
        if q.max_concurrent is not None:
            lease.slots_used -= 1
            if lease.slots_used + lease.slots_free < lease.slots_cap:  # else it goes back at the next sync
                lease.slots_free += 1
        if q.tokens_per_min is not None and used_tokens is not None:
            lease.tokens += charge.tokens - used_tokens

    def too_large(self, tenant: str, tokens: int) -> Denied | None:
        """A refusal for good when `tokens` exceed a minute's worth: whatever the lease holds,
        the ledger is asked only for the shortfall, which may fit when the whole never will."""
        per_min = self._quotas[tenant].tokens_per_min
        if per_min is None or tokens <= per_min:
            return None
        return Denied("too_large", INF, self.remaining_requests(tenant), self.remaining_tokens(tenant))

    def short(self, tenant: str, need: Need) -> Denied:
        """A refusal naming what the lease still lacks after the ledger's grants."""
        limit = "concurrency" if need.slots else "tokens" if need.tokens else "requests"
        return Denied(limit, 1.0, self.remaining_requests(tenant), self.remaining_tokens(tenant))

    def surplus(self, tenant: str) -> tuple[float, float, int]:
        """What a sync hands back: unused requests and tokens (negative tokens: a debt) and
        the slots this replica then holds in all (in use, plus idle ones up to a chunk).
        The request and token balances are zeroed, idle slots beyond a chunk dropped."""
        q, lease = self._quotas[tenant], self._leases[tenant]
        req = lease.requests if q.requests_per_min is not None else 0
        tok = lease.tokens if q.tokens_per_min is not None else 0
        keep = self._chunk(q.max_concurrent) if q.max_concurrent else 0
        lease.requests -= req
        lease.tokens -= tok
        lease.slots_free = min(lease.slots_free, keep)
        return req, tok, lease.slots_used + lease.slots_free

    def owe(self, tenant: str, debt: float) -> None:
        """Put back a debt (negative tokens) that did not reach the ledger."""
        self._leases[tenant].tokens += debt

    def remaining_requests(self, tenant: str) -> float:
        lease = self._leases[tenant]
        return lease.remaining_requests + max(0.0, lease.requests)

    def remaining_tokens(self, tenant: str) -> float:
        lease = self._leases[tenant]
        return lease.remaining_tokens + max(0.0, lease.tokens)

    def _chunk(self, per_min: int | None) -> int:
        return 0 if per_min is None else max(1, int(per_min * self._fraction))
