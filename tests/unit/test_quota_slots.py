"""Leases against the ledger: a slot idle in one replica's lease while another replica is
refused, a ledger back from an outage longer than its holders' TTL, a lease in debt (all
found by a review). Every pool replica holds leases of its own, so one tenant's requests to
two pools are two replicas' to the ledger."""

from __future__ import annotations

import asyncio

import pytest

from router.leases import LedgerService, QuotaClient, QuotaExceeded
from router.quota import HOLDER_TTL_S, Need, Quota, QuotaLedger

QUOTAS = {"t": Quota(max_concurrent=1)}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("max_concurrent, running", [(1, 0), (4, 3)])
def test_a_slot_idle_on_one_replica_goes_to_another_that_is_refused(max_concurrent, running):
    """A replica kept a chunk of idle slots at every sync, and the ledger confirmed them while
    the tenant stood under its limit: the other replica's every request was refused with
    nothing running (max_concurrent 1), or at 3 running of 4, for as long as the first synced."""
    async def go():
        clock = Clock()
        quotas = {"t": Quota(max_concurrent=max_concurrent)}
        service = LedgerService(quotas, clock=clock)
        a, b = (QuotaClient(service, quotas, 0.25, clock=clock) for _ in range(2))
        held = [await a.charge("t", 0) for _ in range(running + 1)]
        a.finish(held.pop(), 0)  # one ended: its slot idle in a's lease
        for _ in range(12):  # a minute of syncs, every 5 s
            clock.now += 5
            await a.sync()
            await b.sync()
        with pytest.raises(QuotaExceeded) as refused:
            await b.charge("t", 0)
        assert refused.value.denied.limit == "concurrency"
        clock.now += 5
        await a.sync()
        await b.sync()
        await b.charge("t", 0)  # no more than one sync later: a slot was free all along
        with pytest.raises(QuotaExceeded):
            await a.charge("t", 0)  # and the tenant is at its limit again
    asyncio.run(go())


def test_a_ledger_back_from_a_long_outage_gives_away_no_running_slot():
    """A restored ledger read its holders' last-seen times as saved: after an outage longer
    than HOLDER_TTL_S (a lost node, 40 s), the first replica to ask took every slot of the one
    still running its requests, and the tenant ran at twice its max_concurrent."""
    quota = {"t": Quota(max_concurrent=4)}
    before = QuotaLedger(quota, 1000.0)
    assert before.grant("t", "a", Need(slots=1, extra_slots=3, slots_held=0), 1000.0).slots == 4
    before.settle("t", "a", 0, 0, 4, 1005.0)  # four running on replica a
    after = QuotaLedger(quota, 1046.0)
    after.restore("t", before.export("t"), 1046.0)
    assert not after.grant("t", "b", Need(slots=1, slots_held=0), 1046.0).granted
    assert after.usage("t", 1046.0)["concurrent"] == 4
    quiet = 1046.0 + HOLDER_TTL_S + 1  # replica a never came back: its slots return in time
    assert after.grant("t", "b", Need(slots=1, slots_held=0), quiet).granted


def test_a_lease_in_debt_refuses_a_request_that_fits_for_tokens_not_for_good():
    """A request that used more tokens than it was charged leaves its lease in debt, and the
    next refill asked the ledger for the request and the debt together: more than a minute's
    tokens, so a request well within tokens_per_min was refused as too large for the quota
    ("lower max_tokens"), with no retry, until the next sync (found by a review)."""
    async def go():
        clock = Clock()
        quotas = {"t": Quota(tokens_per_min=1000)}
        client = QuotaClient(LedgerService(quotas, clock=clock), quotas, 0.1, clock=clock)
        first = await client.charge("t", 100)
        client.finish(first, 700)  # used 600 more than charged: the lease owes them
        with pytest.raises(QuotaExceeded) as refused:
            await client.charge("t", 600)  # 800 left at the ledger, 500 of them owed: 300 for it, 18 s short
        refusals = [refused.value.denied]
        while clock.now < 1200:  # a client that retries when told: its debt paid, the request goes through
            clock.now += refusals[-1].retry_after_s
            try:
                return refusals, await client.charge("t", 600)
            except QuotaExceeded as e:
                refusals.append(e.denied)
        return refusals, None

    refusals, charge = asyncio.run(go())
    assert charge is not None and len(refusals) == 1, "the wait it was told counted the debt"
    assert all(d.limit == "tokens" and 0 < d.retry_after_s <= 60 for d in refusals), refusals


def test_a_sync_settles_twice_only_when_its_answer_dropped_idle_slots():
    """While a replica waits for a slot, a sync whose answer drops idle slots reports again at
    once; one that dropped none (its slots all running) settled twice at every sync, doubling
    the ledger's calls and saves for as long as the tenant stayed at its limit (found by a review)."""
    async def go():
        clock = Clock()
        quotas = {"t": Quota(max_concurrent=2)}
        service = LedgerService(quotas, clock=clock)
        settles = []
        settle = service.settle

        async def counted(*args):
            settles.append(args[1])
            return await settle(*args)
        service.settle = counted
        a, b = (QuotaClient(service, quotas, 0.5, clock=clock) for _ in range(2))
        running = [await a.charge("t", 0), await a.charge("t", 0)]
        with pytest.raises(QuotaExceeded):
            await b.charge("t", 0)
        for _ in range(3):
            clock.now += 5
            await a.sync()
        assert settles == [a._holder] * 3, "nothing idle to drop: one settle a sync"
        assert len(running) == 2
    asyncio.run(go())


class HeldSettle:
    """The ledger, its settles held until `go` is set, then failing once if `fail` is set."""

    def __init__(self, service: LedgerService) -> None:
        self.service, self.go, self.fail = service, asyncio.Event(), True

    async def grant(self, *args):
        return await self.service.grant(*args)

    async def settle(self, *args):
        await self.go.wait()
        if self.fail:
            self.fail = False
            raise ConnectionError("reply lost")
        return await self.service.settle(*args)


def test_a_debt_settled_for_a_client_that_left_is_not_lost():
    """A request settles its lease's debt before asking; when its client left meanwhile and the
    ledger call then failed, the debt was put back nowhere: the tenant had its tokens free
    (found by a review). The settle is waited out, and a failure keeps the debt for the next."""
    async def go():
        clock = Clock()
        quotas = {"t": Quota(tokens_per_min=1000)}
        service = LedgerService(quotas, clock=clock)
        ledger = HeldSettle(service)
        client = QuotaClient(ledger, quotas, 0.1, clock=clock)
        client.finish(await client.charge("t", 100), 700)  # 500 owed
        asking = asyncio.get_running_loop().create_task(client.charge("t", 600))
        for _ in range(5):
            await asyncio.sleep(0)
        asking.cancel()
        ledger.go.set()
        with pytest.raises(asyncio.CancelledError):
            await asking
        await client.sync()  # the debt reaches the ledger now
        return service._ledger.usage("t", clock.now)["remaining_tokens"]
    assert asyncio.run(go()) == pytest.approx(300.0)
