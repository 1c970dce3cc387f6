"""A pool that admits a request and then sends nothing (its engine hung, its replica wedged)
must not hold the client, its slot in the gate and its tenant's quota slot for ever: after
`idle_timeout_s` without an item the request fails visibly and its call is cancelled. The
bound is on each wait, not on the whole answer: a slow but steady pool is never cut off."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from pools.types import Admitted, Finished, Usage
from tests.unit.router_harness import FakePool, auth, client, make_router, settles

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
        router.settled = settles(router)
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
        assert "retry-after" not in r.headers, "a whole answer past the bound would run and be charged again"
        assert r.headers["x-should-retry"] == "false", "the OpenAI SDK retries any 5xx unless told not to"
        assert "idle" not in r.json()["error"]["message"] and "0.2s" in r.json()["error"]["message"]
    assert statuses == [504] and router.settled == [None], "the engine may have worked: the charge stands"
    assert pool.streams[0].cancelled, "the pool's call was left running, holding its slot in the gate"
    assert router._loads.inflight("p") == 0 and router._quota._book.lease("a").slots_used == 0


def test_a_slow_but_steady_stream_is_never_cut_off():
    # 30 chunks 0.02 s apart (0.6 s in all) under a 0.4 s bound: the bound is per wait (a whole
    # answer is one item: for it the bound is on the whole generation)
    r, statuses, pool, router = _run(_steady(30, 0.02), True, idle_s=0.4)
    assert r.status_code == 200 and "pool_timeout" not in r.text, r.text
    assert statuses == [200] and not pool.streams[0].cancelled
    assert r.text.count('"text":"hi"') == 30 and r.text.endswith("data: [DONE]\n\n")


def _finished_then_silent(call):
    async def script(call):
        yield Admitted("p", "r1", 0.0)
        yield _item(call)
        yield Finished(Usage(2, 1), 0.0, 0.0)
        await asyncio.Event().wait()  # the stream never ends
        yield None  # pragma: no cover
    return script(call)


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_whose_finished_came_is_whole_even_if_the_stream_never_ends(stream):
    r, statuses, pool, router = _run(_finished_then_silent, stream, idle_s=0.2)
    assert r.status_code == 200 and "pool_timeout" not in r.text, r.text
    assert statuses == [200] and pool.streams[0].cancelled
    if stream:
        assert r.text.endswith("data: [DONE]\n\n")


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
    assert r.status_code == 502 and r.json()["error"]["code"] == "pool_failed" and r.headers["retry-after"] == "5", r.text
    assert statuses == [502] and router.settled == [2 if finished else None]
    assert router._loads.inflight("p") == 0 and router._quota._book.lease("a").slots_used == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_hung_engine_in_the_pools_own_process_is_a_504_not_the_clients_leaving(stream):
    """The route in the pool replica reads the engine in-process: vLLM's whole-answer generators
    answer a cancellation with "Client disconnected", which the bound took for an answer (a 400
    that refunded the whole charge) where its expiry was lost."""
    from tests.unit.test_pool_ingress import TickEngine, http_app, make_ingress

    class Hung(TickEngine):
        async def _ticks(self, body):
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                if body.stream:
                    raise
                yield SimpleNamespace(error=SimpleNamespace(message="Client disconnected", code=400, type="BadRequest"))
                return
            yield None  # pragma: no cover

    async def go():
        ingress, engine = await make_ingress(engine=Hung(), idle_timeout_s=0.2)
        settled = settles(ingress.router)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=http_app(ingress)), base_url="http://p") as c:
            r = await asyncio.wait_for(c.post("/v1/completions", headers=auth("b"),
                                              json={"prompt": "a b", "max_tokens": 5, "stream": stream}), 30)
        for _ in range(5):
            await asyncio.sleep(0)
        stats = ingress._gate.gate.stats()
        await ingress.close()
        return r, settled, stats

    r, settled, stats = asyncio.run(go())
    assert r.status_code == 504 and r.json()["error"]["code"] == "pool_timeout", r.text
    assert settled == [None] and stats.active == 0 and stats.cancelled == 1 and not any(stats.queued_by_class.values())


def test_the_openai_sdk_does_not_ask_again_for_a_whole_answer_past_the_bound():
    """The SDK retries every 5xx twice by default, Retry-After or not: each try ran, and was
    charged, for the whole bound (helper-100)."""
    import openai

    async def go():
        router, pool = make_router(FakePool(_silent(False)), idle_timeout_s=0.2)
        settled = settles(router)
        async with client(router) as http:
            sdk = openai.AsyncOpenAI(api_key="key-a", base_url="http://router/p/v1", http_client=http, max_retries=2)
            with pytest.raises(openai.APIStatusError) as e:
                await asyncio.wait_for(sdk.chat.completions.create(model="m", **CHAT), 60)
        return e.value.status_code, pool, settled

    status, pool, settled = asyncio.run(go())
    assert status == 504 and len(pool.streams) == 1 and settled == [None]
