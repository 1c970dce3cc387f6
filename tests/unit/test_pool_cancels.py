"""A call the pool replica cancels (Ray Serve hands its caller a CancelledError, as when the
replica shuts down) is the pool's failure, visible to the client, not the client's leaving."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pools.types import Admitted, Finished
from tests.unit.router_harness import FakePool, auth, client, make_router

CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


def _cancelling(after_first: bool):
    async def script(call):
        yield Admitted("p", "r1", 0.0)
        if after_first:
            yield ['data: {"choices":[{"text":"hi"}]}\n\n'] if call.body.stream else SimpleNamespace(
                model_dump=lambda: {"choices": [{"text": "hi"}]})
        raise asyncio.CancelledError  # the replica's task was cancelled
        yield Finished(None, None, 0.0)  # pragma: no cover - a generator needs a yield after the raise
    return script


@pytest.mark.parametrize("stream, after_first", [(False, False), (False, True), (True, False), (True, True)])
def test_a_call_the_pool_cancels_is_an_error_the_client_sees(stream, after_first):
    async def go():
        router, pool = make_router(FakePool(_cancelling(after_first)))
        statuses = []
        real = router._metrics.request
        router._metrics.request = lambda p, t, status: (statuses.append(status), real(p, t, status))
        async with client(router) as c:
            r = await c.post("/p/v1/chat/completions", json={**CHAT, "stream": stream}, headers=auth("a"))
        await asyncio.sleep(0)
        return r, statuses, router

    r, statuses, router = asyncio.run(go())
    if after_first and stream:  # the 200 went out: the stream ends with an error event and [DONE]
        assert r.status_code == 200 and '"pool_failed"' in r.text and r.text.endswith("data: [DONE]\n\n"), r.text
    elif after_first:  # the answer is not whole
        assert r.status_code == 503 and r.json()["error"]["code"] == "pool_failed", r.text
    else:
        assert r.status_code == 503 and r.json()["error"]["code"] == "pool_unavailable", r.text
    assert statuses == [503], "booked as the client's leaving (499)"
    assert router._loads.inflight("p") == 0 and router._quota._book.lease("a").slots_used == 0
