"""Quotas: token-bucket math, leases, reconciliation (fake clock, tables)."""

from __future__ import annotations

import asyncio
import math

import pytest

from router.quota import HOLDER_TTL_S, Charge, Grant, LeaseBook, Need, Quota, QuotaLedger, TokenBucket


@pytest.mark.parametrize("take, wait, expect_level, expect_ok", [
    (60, 0, 0, True),  # a full minute's worth at once
    (61, 0, 60, False),  # one more than the capacity
    (30, 0, 30, True),
    (60, 30, 30, False),  # after draining, 30 s refill only 30 units
], ids=["drain", "over", "half", "refilled"])
def test_bucket_take(take, wait, expect_level, expect_ok):
    b = TokenBucket.per_minute(60, now=0.0)
    if wait:
        b.take(60, 0.0)
    ok = b.take(take, float(wait))
    assert ok is expect_ok
    assert b.available(float(wait)) == pytest.approx(expect_level)


@pytest.mark.parametrize("level, need, seconds", [
    (0, 30, 30.0), (10, 30, 20.0), (30, 30, 0.0), (0, 61, math.inf),
])
def test_bucket_time_until_is_exact(level, need, seconds):
    b = TokenBucket(capacity=60, refill_per_s=1.0, level=level, updated=0.0)
    assert b.time_until(need, 0.0) == seconds
    if seconds not in (0.0, math.inf):
        assert not b.take(need, seconds - 0.01) and b.take(need, seconds)


def test_bucket_give_back_caps_at_capacity():
    b = TokenBucket.per_minute(100, 0.0)
    b.take(10, 0.0)
    b.give_back(50, 0.0)
    assert b.available(0.0) == 100


def ledger(**quota) -> QuotaLedger:
    return QuotaLedger({"t": Quota(**quota)}, now=0.0)


def test_grant_is_all_or_nothing_for_the_need_and_best_effort_for_extra():
    led = ledger(tokens_per_min=1000)
    g = led.grant("t", "r1", Need(tokens=300, extra_tokens=500), 0.0)
    assert g.granted and g.tokens == 800
    g = led.grant("t", "r1", Need(tokens=300, extra_tokens=500), 0.0)
    assert not g.granted and g.tokens == 0 and g.limit == "tokens"
    assert g.retry_after_s == pytest.approx((300 - 200) / (1000 / 60))
    g = led.grant("t", "r1", Need(tokens=200, extra_tokens=500), 0.0)
    assert g.granted and g.tokens == 200  # nothing left for the extra


def test_request_larger_than_the_quota_is_refused_as_too_large():
    g = ledger(tokens_per_min=100).grant("t", "r", Need(tokens=101), 0.0)
    assert not g.granted and g.limit == "too_large" and g.retry_after_s == math.inf


def test_concurrency_slots_are_granted_and_returned():
    led = ledger(max_concurrent=2)
    assert led.grant("t", "r1", Need(slots=1, extra_slots=5), 0.0).slots == 2
    refused = led.grant("t", "r2", Need(slots=1), 0.0)
    assert not refused.granted and refused.limit == "concurrency"
    led.settle("t", "r1", 0, 0, 1, 0.0)
    assert led.grant("t", "r2", Need(slots=1), 0.0).slots == 1


def test_slots_of_a_router_that_stopped_syncing_come_back():
    led = QuotaLedger({"t": Quota(max_concurrent=1)}, now=0.0, holder_ttl_s=30)
    assert led.grant("t", "dead", Need(slots=1), 0.0).granted
    assert not led.grant("t", "live", Need(slots=1), 10.0).granted
    assert led.grant("t", "live", Need(slots=1), 31.0).granted


def test_a_replica_syncing_as_seldom_as_the_config_allows_keeps_its_running_slots():
    """`router.lease_ttl_s` had no bound: at 60 s a live replica's running slots went to another
    after the ledger's 30 s without news, and the tenant ran twice its `max_concurrent`."""
    from pydantic import ValidationError

    from router.config import MAX_LEASE_TTL_S, RouterConfig

    with pytest.raises(ValidationError, match="lease_ttl_s"):
        RouterConfig(lease_ttl_s=HOLDER_TTL_S)
    every = RouterConfig(lease_ttl_s=MAX_LEASE_TTL_S).lease_ttl_s
    led = QuotaLedger({"t": Quota(max_concurrent=2)}, now=0.0)
    assert led.grant("t", "a", Need(slots=2), 0.0).slots == 2  # two long streams start on replica a
    now = 0.0
    while now < 5 * HOLDER_TTL_S:
        now += every
        led.settle("t", "a", 0, 0, 2, now)  # its sync: both still run
        assert not led.grant("t", "b", Need(slots=1), now + every - 1e-6).granted, now


def book(**quota) -> LeaseBook:
    return LeaseBook({"t": Quota(**quota)}, lease_fraction=0.1)


def test_lease_book_asks_for_shortfall_plus_a_chunk():
    b = book(requests_per_min=600, tokens_per_min=10_000, max_concurrent=20)
    need = b.try_charge("t", 250)
    assert need == Need(requests=1, tokens=250, slots=1, extra_requests=60, extra_tokens=1000, extra_slots=1,
                        slots_held=0)


def test_lease_book_spends_locally_after_a_grant():
    led = ledger(requests_per_min=600, tokens_per_min=10_000)
    b = book(requests_per_min=600, tokens_per_min=10_000)
    need = b.try_charge("t", 250)
    assert b.add("t", led.grant("t", "r", need, 0.0), 0.0) is None
    charges = [b.try_charge("t", 250) for _ in range(5)]
    assert all(isinstance(c, Charge) for c in charges)  # 1250 tokens granted: five fit, no ledger call
    assert isinstance(b.try_charge("t", 250), Need)


def test_reconciliation_refunds_unused_tokens():
    b = book(tokens_per_min=10_000)
    b.add("t", Grant(0, 1000, 0, 0.0), 0.0)
    c = b.try_charge("t", 800)
    assert b.lease("t").tokens == 200
    b.finish(c, used_tokens=300)  # the request stopped early
    assert b.lease("t").tokens == 700


def test_usage_above_the_charge_is_debited_and_the_debt_goes_to_the_ledger():
    led = ledger(tokens_per_min=10_000)
    b = book(tokens_per_min=10_000)
    b.add("t", led.grant("t", "r", b.try_charge("t", 100), 0.0), 0.0)  # 100 + a chunk of 1000
    c = b.try_charge("t", 100)
    b.finish(c, used_tokens=1500)  # the request saw 1,400 tokens more than it was charged for
    assert b.lease("t").tokens == 1100 - 1500
    need = b.try_charge("t", 10)
    assert isinstance(need, Need) and need.tokens == 410  # the debt is paid by the next grant
    req, tok, held = b.surplus("t")
    led.settle("t", "r", req, tok, held, 0.0)
    assert led.usage("t", 0.0)["remaining_tokens"] == 10_000 - 1500


def test_a_sync_sets_the_slots_held_so_a_lost_grant_is_put_right():
    led = ledger(max_concurrent=4)
    assert led.grant("t", "r", Need(slots=1, extra_slots=3), 0.0).slots == 4  # its reply never arrives
    assert not led.grant("t", "other", Need(slots=1), 0.0).granted
    led.settle("t", "r", 0, 0, 0, 0.0)  # the replica holds none
    assert led.grant("t", "other", Need(slots=1), 0.0).granted


def test_surplus_goes_back_and_keeps_one_chunk_of_slots():
    b = book(tokens_per_min=10_000, max_concurrent=20)
    b.add("t", Grant(0, 900, 6, 0.0), 0.0)
    c = b.try_charge("t", 100)
    req, tok, held = b.surplus("t")
    assert (req, tok, held) == (0, 800, 3)  # held in all: one in use, two idle kept (a chunk)
    assert b.lease("t").tokens == 0 and b.lease("t").slots_free == 2
    b.finish(c, 100)
    assert b.surplus("t") == (0, 0, 2)


def test_denied_grant_reports_retry_after_and_remaining():
    b = book(tokens_per_min=600)
    d = b.add("t", Grant(0, 0, 0, 12.5, "tokens", remaining_requests=math.inf, remaining_tokens=40), 0.0)
    assert d.retry_after_s == 12.5 and d.limit == "tokens" and d.remaining_tokens == 40


def test_honest_retry_after_end_to_end_with_fake_clock():
    """A denial's retry-after is long enough: charging again at exactly that time succeeds."""
    led = ledger(tokens_per_min=1200)
    b = book(tokens_per_min=1200)
    now = 0.0

    def charge(tokens):
        r = b.try_charge("t", tokens)
        if isinstance(r, Charge):
            return r
        return b.add("t", led.grant("t", "r", r, now), now) or b.try_charge("t", tokens)

    assert isinstance(charge(1000), Charge)
    denied = charge(1000)
    assert not isinstance(denied, Charge)
    now += denied.retry_after_s
    assert isinstance(charge(1000), Charge)


def test_unlimited_tenant_never_needs_the_ledger():
    b = LeaseBook({"t": Quota()}, 0.1)
    assert isinstance(b.try_charge("t", 10**6), Charge)


class SlowLedger:
    """The ledger service, each answer held until the test lets it through."""

    def __init__(self, quotas) -> None:
        from router.leases import LedgerService

        self._service = LedgerService(quotas)
        self.gate = None  # an asyncio.Event when calls should wait

    async def grant(self, *args):
        if self.gate is not None:
            await self.gate.wait()
        return await self._service.grant(*args)

    async def settle(self, *args):
        return await self._service.settle(*args)


def test_a_client_leaving_during_a_grant_does_not_leak_the_slot():
    import asyncio

    from router.leases import QuotaClient

    async def go():
        quotas = {"t": Quota(max_concurrent=1)}
        led = SlowLedger(quotas)
        client = QuotaClient(led, quotas, 0.1)
        led.gate = asyncio.Event()
        first = asyncio.create_task(client.charge("t", 10))
        await asyncio.sleep(0.01)
        first.cancel()  # the client hangs up while the ledger grants its slot
        led.gate.set()
        await asyncio.sleep(0.01)
        return await asyncio.wait_for(client.charge("t", 10), 1)  # the slot was not lost

    assert isinstance(asyncio.run(go()), Charge)


def test_a_ledger_that_never_answers_is_a_503_not_a_hang():
    """A ledger call had no bound: a request whose lease ran short waited for as long as the
    ledger did, a client that left could not go (the grant is awaited under the tenant's lock),
    and every other request and sync of the tenant queued behind it."""
    import asyncio

    from router.leases import QuotaClient, QuotaUnavailable

    async def go():
        quotas = {"t": Quota(max_concurrent=4)}
        led = SlowLedger(quotas)
        led.gate = asyncio.Event()  # never set: the ledger never answers
        led.settle = led.grant
        client = QuotaClient(led, quotas, 0.1, call_timeout_s=0.05)
        left = asyncio.create_task(client.charge("t", 10))
        stays = asyncio.create_task(client.charge("t", 10))
        await asyncio.sleep(0.01)
        left.cancel()  # its client hangs up while the ledger does not answer
        led.usage = led.grant
        usage = asyncio.create_task(client.usage("t"))
        done, _ = await asyncio.wait({left, stays, usage, asyncio.create_task(client.sync())}, timeout=30)
        return left, stays, usage, done

    left, stays, usage, done = asyncio.run(go())
    assert len(done) == 4, "every call ends"
    assert left.cancelled()
    assert isinstance(stays.exception(), QuotaUnavailable)
    assert isinstance(usage.exception(), QuotaUnavailable), "/v1/usage answers 503, not 500"


def test_a_lease_spent_by_others_during_a_grant_is_a_refusal_not_a_crash():
    import asyncio

    from router.leases import QuotaClient, QuotaExceeded

    async def go():
        quotas = {"t": Quota(tokens_per_min=300)}  # lease chunks of 30 tokens
        led = SlowLedger(quotas)
        client = QuotaClient(led, quotas, 0.1)
        await client.charge("t", 50)  # granted 50 + 30: 30 left in the lease
        led.gate = asyncio.Event()
        big = asyncio.create_task(client.charge("t", 250))  # asks for the 220 left in the bucket
        await asyncio.sleep(0.01)
        await client.charge("t", 30)  # spends the lease while the grant is on its way
        led.gate.set()
        with pytest.raises(QuotaExceeded):
            await big

    asyncio.run(go())


def test_a_restarted_ledger_keeps_the_buckets_and_the_slots_out():
    import asyncio

    from infra.state import MemoryStore
    from router.leases import LedgerService

    async def go():
        quotas = {"t": Quota(tokens_per_min=6000, max_concurrent=4)}
        store, now = MemoryStore(), [1000.0]
        first = LedgerService(quotas, clock=lambda: now[0], store=store)
        await first.grant("t", "router-1", Need(tokens=5000, slots=3))  # saved before it answered
        del first  # killed right after the answer
        now[0] += 6.0  # the restart takes six seconds: 600 tokens refill meanwhile
        second = LedgerService(quotas, clock=lambda: now[0], store=store)
        return await second.usage("t"), await second.grant("t", "router-2", Need(slots=2))

    usage, refused = asyncio.run(go())
    assert usage["remaining_tokens"] == pytest.approx(1000 + 600) and usage["concurrent"] == 3
    assert not refused.granted and refused.limit == "concurrency"  # 3 of 4 slots are still out


class LaggingLedger:
    """The ledger service behind a connection with seeded random delays both ways."""

    def __init__(self, quotas, rng, clock) -> None:
        from router.leases import LedgerService

        self._service, self._rng = LedgerService(quotas, clock=clock), rng

    async def _call(self, method: str, *args):
        await asyncio.sleep(self._rng.random() * 0.002)
        result = await getattr(self._service, method)(*args)
        await asyncio.sleep(self._rng.random() * 0.002)
        return result

    async def grant(self, *args):
        return await self._call("grant", *args)

    async def settle(self, *args):
        return await self._call("settle", *args)


@pytest.mark.parametrize("seed", range(40))
def test_a_burst_against_one_quota_is_refused_for_the_limit_it_reached(seed):
    """Eight requests of 215 tokens at once against 1,200 tokens, charged as the router charges
    them (the request, then its tokens), with syncs every few milliseconds: five fit, and the
    other three are refused because the tokens ran out, never for losing a race to the others.
    On virtual time: on the real clock a host that stalls long enough refills the bucket."""
    import random

    from router.leases import QuotaClient, QuotaExceeded
    from tests.unit.virtual_time import run

    async def one(client):
        try:
            admission = await client.charge("t", 0)
            await asyncio.sleep(0.001)
            await client.charge_tokens(admission, 215)
            return "ok"
        except QuotaExceeded as e:
            return e.denied.limit

    async def go():
        quotas = {"t": Quota(requests_per_min=600, tokens_per_min=1200, max_concurrent=8)}
        clock = asyncio.get_running_loop().time
        client = QuotaClient(LaggingLedger(quotas, random.Random(seed), clock), quotas, 0.1, clock=clock)

        async def syncs():  # as the router's loop calls it, every few milliseconds here
            while True:
                await asyncio.sleep(0.003)
                await client.sync()
        syncing = asyncio.get_running_loop().create_task(syncs())
        try:
            return await asyncio.gather(*(one(client) for _ in range(8)))
        finally:
            syncing.cancel()

    assert sorted(run(go)) == ["ok"] * 5 + ["tokens"] * 3


def test_a_request_over_the_minutes_tokens_is_too_large_whatever_the_lease_holds():
    """A request of 1,310 tokens against 1,200 a minute can never run. With 120 tokens left in
    the replica's lease, the ledger was asked only for the 1,190 it lacked, which fit: the
    tenant was told to retry in 6 s, and would then have been charged more than a minute's
    tokens. It is refused as too large, before the ledger is asked."""
    import asyncio

    from router.leases import LedgerService, QuotaClient, QuotaExceeded

    async def go():
        quotas = {"t": Quota(tokens_per_min=1200)}
        client = QuotaClient(LedgerService(quotas), quotas, 0.1)
        await client.charge("t", 10)  # 10 tokens, and a chunk more into the lease
        assert client._book.lease("t").tokens == 120
        with pytest.raises(QuotaExceeded) as e:
            await client.charge("t", 1310)
        return e.value.denied

    denied = asyncio.run(go())
    assert denied.limit == "too_large"


def test_idle_slots_a_replica_dropped_are_not_counted_against_it():
    """A lease idle past LEASE_FRESH_S drops its free slots locally; the ledger still counted
    them for the replica, so its next request was refused for concurrency with nothing running
    anywhere, until a sync reported the drop. A grant's question now says what the replica holds."""
    from router.quota import LEASE_FRESH_S

    led, b = ledger(max_concurrent=1), book(max_concurrent=1)
    first = b.try_charge("t", 0, now=0.0)
    assert b.add("t", led.grant("t", "r", first, 0.0), 0.0) is None
    done = b.try_charge("t", 0, now=0.0)
    b.finish(done, 0)  # a request ran and ended: its slot idle in the lease, the ledger counts it
    later = 1.0 + LEASE_FRESH_S  # no sync meanwhile (the ledger was away)
    need = b.try_charge("t", 0, now=later)
    assert isinstance(need, Need) and b.lease("t").slots_free == 0
    assert b.add("t", led.grant("t", "r", need, later), later) is None, "nothing runs: a slot is free"
    assert isinstance(b.try_charge("t", 0, now=later), Charge)
    assert led.usage("t", later)["concurrent"] == 1
