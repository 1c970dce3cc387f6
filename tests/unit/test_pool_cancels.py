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


def _holding(hold: asyncio.Event, first: bool):
    """Admitted, then (with `first`) a first item, then nothing until `hold` is set."""
    async def script(call):
        yield Admitted("p", "r1", 0.0)
        if first:
            yield ['data: {"choices":[{"text":"hi"}]}\n\n'] if call.body.stream else SimpleNamespace(
                model_dump=lambda: {"choices": [{"text": "hi"}]})
        await hold.wait()
        yield Finished(None, None, 0.0)
    return script


@pytest.mark.parametrize("where", ["first", "whole", "relay"])
def test_a_client_that_leaves_is_still_booked_as_leaving(where):
    """The other side of the rule above: the route's own task cancelled (the client left while it
    waited for the first item or the rest of a whole answer) or its stream closed by the server
    (the client left mid-stream) is a 499, with no error event, and the pool's call cancelled."""
    from tests.unit.test_router_flow import _request

    async def go():
        router, pool = make_router(FakePool(_holding(asyncio.Event(), first=where != "first")))
        statuses = []
        real = router._metrics.request
        router._metrics.request = lambda p, t, status: (statuses.append(status), real(p, t, status))
        body = {**CHAT, "stream": where == "relay"}
        task = asyncio.get_running_loop().create_task(router.route(_request(body, "a"), "chat", "p"))
        sent = []
        if where == "relay":
            response = await task
            body_iter = response.body_iterator
            sent.append(await body_iter.__anext__())
            await body_iter.aclose()  # the client went: the server closes the body
        else:
            while not pool.calls:
                await asyncio.sleep(0)
            for _ in range(5):
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await asyncio.sleep(0)
        return statuses, sent, pool, router

    statuses, sent, pool, router = asyncio.run(go())
    assert statuses == [499], statuses
    assert not any("pool_failed" in x for x in sent)
    assert pool.streams[0].cancelled and router._loads.inflight("p") == 0
