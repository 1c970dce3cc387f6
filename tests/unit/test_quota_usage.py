"""`/v1/usage` is charged nothing: its calls to the one quota ledger, which every tenant's grants
go through, must not grow with how often a tenant polls it."""

from __future__ import annotations

import asyncio

import pytest

from router.leases import LedgerService, QuotaClient, QuotaUnavailable
from router.quota import Quota


class Counting(LedgerService):
    def __init__(self, quotas, fail: bool = False) -> None:
        super().__init__(quotas)
        self.calls, self.fail = 0, fail

    async def usage(self, tenant):
        self.calls += 1
        await asyncio.sleep(0.01)
        if self.fail:
            raise RuntimeError("ledger away")
        return await super().usage(tenant)


def test_concurrent_polls_of_usage_share_one_ledger_call_and_later_ones_ask_again():
    async def go():
        quotas = {"t": Quota(tokens_per_min=1000), "u": Quota(tokens_per_min=1000)}
        ledger = Counting(quotas)
        client = QuotaClient(ledger, quotas, 0.1)
        answers = await asyncio.gather(*(client.usage("t") for _ in range(200)))
        first = ledger.calls
        await client.usage("t")  # after the answer: figures as of its own request
        await client.usage("u")  # another tenant's figures are its own
        return answers, first, ledger.calls

    answers, first, total = asyncio.run(go())
    assert (first, total) == (1, 3)
    assert all(a["held_by_this_router"] == answers[0]["held_by_this_router"] for a in answers)
    answers[0]["x"] = 1
    assert "x" not in answers[1], "callers share the ledger's answer, not one dictionary"


def test_a_failed_usage_call_is_not_kept():
    async def go():
        quotas = {"t": Quota(tokens_per_min=1000)}
        ledger = Counting(quotas, fail=True)
        client = QuotaClient(ledger, quotas, 0.1)
        with pytest.raises(QuotaUnavailable):
            await client.usage("t")
        ledger.fail = False
        return await client.usage("t"), ledger.calls

    out, calls = asyncio.run(go())
    assert calls == 2 and "held_by_this_router" in out


def test_a_caller_that_leaves_does_not_cancel_the_others_answer():
    async def go():
        quotas = {"t": Quota(tokens_per_min=1000)}
        client = QuotaClient(Counting(quotas), quotas, 0.1)
        leaving = asyncio.create_task(client.usage("t"))
        staying = asyncio.create_task(client.usage("t"))
        await asyncio.sleep(0)
        leaving.cancel()
        return await staying
    assert "held_by_this_router" in asyncio.run(go())
