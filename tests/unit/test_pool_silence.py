"""A pool that admits a request and then sends nothing (its engine hung, its replica wedged)
must not hold the client, its slot in the gate and its tenant's quota slot for ever: after
`idle_timeout_s` without an item the request fails visibly and its call is cancelled. The
bound is on each wait, not on the whole answer: a slow but steady pool is never cut off."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pools.types import Admitted, Finished, Usage
from tests.unit.router_harness import FakePool, auth, client, make_router

CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


def _item(call):
    if call.body.stream:
        return ['data: {"choices":[{"text":"hi"}]}\n\n']
    return SimpleNamespace(model_dump=lambda: {"choices": [{"text": "hi"}]})


def _silent(after_first: bool):
    async def script(call):
        yield Admitted("p", "r1", 0.0)
        if after_first:
            yield _item(call)
        await asyncio.Event().wait()  # nothing more, ever
        yield Finished(Usage(2, 1), 0.0, 0.0)  # pragma: no cover
    return script


def _steady(items: int, gap_s: float):
    async def script(call):
        yield Admitted("p", "r1", 0.0)
        for _ in range(items):
            await asyncio.sleep(gap_s)
            yield _item(call)
        yield Finished(Usage(2, items), 0.0, 0.0)
    return script


def _run(script, stream: bool, idle_s: float):
    async def go():
        router, pool = make_router(FakePool(script), idle_timeout_s=idle_s)
        statuses = []
        real = router._metrics.request
        router._metrics.request = lambda p, t, status: (statuses.append(status), real(p, t, status))
        async with client(router) as c:
            r = await asyncio.wait_for(c.post("/p/v1/chat/completions", json={**CHAT, "stream": stream},
                                              headers=auth("a")), 60)
        await asyncio.sleep(0)
        return r, statuses, pool, router
    return asyncio.run(go())


@pytest.mark.parametrize("stream, after_first", [(False, False), (False, True), (True, False), (True, True)])
def test_a_pool_silent_after_admitting_fails_the_request_visibly_and_frees_its_slots(stream, after_first):
    r, statuses, pool, router = _run(_silent(after_first), stream, idle_s=0.2)
    if stream and after_first:  # the 200 went out: an error event, then [DONE]
        assert r.status_code == 200 and '"pool_timeout"' in r.text and r.text.endswith("data: [DONE]\n\n"), r.text
    else:
        assert r.status_code == 504 and r.json()["error"]["code"] == "pool_timeout", r.text
        assert "idle" not in r.json()["error"]["message"] and "0.2s" in r.json()["error"]["message"]
    assert statuses == [504]
    assert pool.streams[0].cancelled, "the pool's call was left running, holding its slot in the gate"
    assert router._loads.inflight("p") == 0 and router._quota._book.lease("a").slots_used == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_slow_but_steady_pool_is_never_cut_off(stream):
    # 30 items 0.02 s apart (0.6 s in all) under a 0.4 s bound: the bound is per wait
    r, statuses, pool, router = _run(_steady(30, 0.02), stream, idle_s=0.4)
    assert r.status_code == 200 and "pool_timeout" not in r.text, r.text
    assert statuses == [200] and not pool.streams[0].cancelled
    if stream:
        assert r.text.count('"text":"hi"') == 30 and r.text.endswith("data: [DONE]\n\n")


def _empty(finished: bool):
    """Admitted, then no answer: only the `Finished` (the engine gave nothing), or not even that."""
    async def script(call):
        yield Admitted("p", "r1", 0.0)
        if finished:
            yield Finished(Usage(2, 0), 0.0, 0.0)
    return script


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("finished", [True, False])
def test_a_pool_that_answers_nothing_is_a_502_booked_as_one(stream, finished):
    # a whole request's `Finished` first was handed to the response as the answer: a 500 that the
    # books had already closed as a 200
    r, statuses, pool, router = _run(_empty(finished), stream, idle_s=5)
    assert r.status_code == 502 and r.json()["error"]["code"] == "pool_failed", r.text
    assert statuses == [502]
    assert router._loads.inflight("p") == 0 and router._quota._book.lease("a").slots_used == 0
