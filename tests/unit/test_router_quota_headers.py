"""What the router tells a tenant about its quota, as the README says: the remaining requests and
tokens on every answer of a tenant with such a quota (none for a tenant without), the refusal's
`Retry-After`, and a 503 `quota_unavailable` when the quota's ledger does not answer."""

from __future__ import annotations

import asyncio

from router.leases import LedgerService
from router.quota import Quota
from tests.unit import virtual_time
from tests.unit.router_harness import TENANTS, auth, client, make_router

CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


def test_a_tenant_with_a_request_quota_is_told_what_remains_and_when_to_retry():
    async def go():
        router, _ = make_router()
        async with client(router) as c:
            return [await c.post("/p/v1/chat/completions", json=CHAT, headers=auth(t)) for t in ("slow", "slow", "b")]

    first, second, unlimited = virtual_time.run(go)
    assert first.status_code == 200 and first.headers["x-ratelimit-remaining-requests"] == "0"
    assert "x-ratelimit-remaining-tokens" not in first.headers  # tenant slow has no token quota
    assert second.status_code == 429 and second.json()["error"]["code"] == "requests_quota_exceeded"
    assert second.headers["x-ratelimit-remaining-requests"] == "0"
    assert 0 < float(second.headers["retry-after"]) <= 60  # a request a minute comes back within the minute
    assert unlimited.status_code == 200 and not any(h.startswith("x-ratelimit") for h in unlimited.headers)


class SilentLedger(LedgerService):
    """A ledger whose grants never come back (its actor wedged, its node gone)."""

    async def grant(self, *args, **kwargs):
        await asyncio.Event().wait()


def test_a_ledger_that_never_answers_is_a_503_quota_unavailable_with_retry_after():
    async def go():
        router, _ = make_router()
        router._quota._ledger = SilentLedger({t.name: Quota(**t.quota.model_dump()) for t in TENANTS})
        async with client(router) as c:
            r = await c.post("/p/v1/chat/completions", json=CHAT, headers=auth("slow"))
            fine = await c.post("/p/v1/chat/completions", json=CHAT, headers=auth("b"))  # no quota: no ledger
        return r, fine

    r, fine = virtual_time.run(go)
    assert r.status_code == 503 and r.json()["error"]["code"] == "quota_unavailable"
    assert r.headers["retry-after"] == "5"
    assert fine.status_code == 200


def test_requests_behind_a_ledger_that_never_answers_each_get_their_503_within_a_calls_bound():
    """Each waited for the tenant's lock behind the one before, whose grant waited its 10 s
    bound: the 8th of 8 requests at once got its 503 after 80 s, the 100th after 1,000 s (longer
    than the OpenAI SDK waits)."""
    async def go():
        router, _ = make_router()
        router._quota._ledger = SilentLedger({t.name: Quota(**t.quota.model_dump()) for t in TENANTS})
        loop = asyncio.get_running_loop()
        async with client(router) as c:
            async def one():
                r = await c.post("/p/v1/chat/completions", json=CHAT, headers=auth("slow"))
                return r.status_code, r.json()["error"]["code"], loop.time()
            return await asyncio.gather(*(one() for _ in range(8)))

    answers = virtual_time.run(go)
    assert {(status, code) for status, code, _ in answers} == {(503, "quota_unavailable")}
    assert max(at for _, _, at in answers) <= 2 * 10.0, answers  # the lock's bound, then at most a call's
