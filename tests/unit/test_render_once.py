"""A prompt is rendered once on a pool replica: the route's renderer counts it, and the engine
in the same process takes that rendering instead of running the chat template and the
tokenizer again. Another process's engine renders its own, so a call never carries one
across a handle."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import time

from pydantic import BaseModel

from pools.llm import RayLLMEngine, Rendering, _Handover
from pools.types import CountedPrompt, PoolCall, PriorityClass
from tests.unit.router_harness import FakePool, WordCounter, auth, client, make_router


class Body(BaseModel):
    prompt: str
    priority: int = 0
    stream: bool = False
    adjusted: bool = False  # what a tool parser's adjust_request would set while rendering


class ServingRenderer:
    """vLLM's OnlineRenderer as the serving layer calls it: every render is recorded."""

    def __init__(self) -> None:
        self.rendered: list[str] = []
        self.chat_template = "kept"

    async def render_completion(self, request, **kwargs):
        self.rendered.append(request.prompt)
        return [{"type": "token", "prompt_token_ids": [len(request.prompt)], "arrival_time": time.time()}]

    async def render_chat(self, request, **kwargs):
        self.rendered.append(request.prompt)
        return [], [{"type": "token", "prompt_token_ids": [len(request.prompt)], "arrival_time": time.time()}]


class FakeVLLMEngine:
    """Ray LLM's VLLMEngine: one renderer shared by the chat and completion serving layers,
    whose create_* render the request and stream what the engine saw."""

    def __init__(self) -> None:
        renderer = ServingRenderer()
        self._oai_serving_chat = dataclasses.make_dataclass("Chat", ["online_renderer"])(renderer)
        self._oai_serving_completion = dataclasses.make_dataclass("Completion", ["online_renderer"])(renderer)
        self.inner = renderer
        self.fail_before_render = False

    async def completions(self, body, raw_request):
        if self.fail_before_render:  # the serving layer's model check refused it
            yield {"error": "model"}
            return
        inputs = await self._oai_serving_completion.online_renderer.render_completion(body)
        yield {"inputs": inputs, "priority": body.priority, "adjusted": body.adjusted}

    async def chat(self, body, raw_request):
        _, inputs = await self._oai_serving_chat.online_renderer.render_chat(body)
        yield {"inputs": inputs, "priority": body.priority, "adjusted": body.adjusted}


def engine() -> tuple[RayLLMEngine, FakeVLLMEngine]:
    e = RayLLMEngine(llm_config=None, stream_batching_ms=0)
    e._engine = fake = FakeVLLMEngine()
    e._handover = _Handover.install(fake)
    return e, fake


def call(kind="completions", rendered=None, prompt="hello there", stream=False) -> PoolCall:
    return PoolCall(kind, Body(prompt=prompt, stream=stream), "t", 1.0, PriorityClass.BATCH, 2, 4, rendered=rendered)


async def drain(stream) -> list:
    return [x async for x in stream]


def tokens(*ids: int, at: float = 0.0) -> dict:
    return {"type": "token", "prompt_token_ids": list(ids), "arrival_time": at}


def test_the_engine_takes_the_routes_rendering_and_its_adjusted_request():
    e, fake = engine()
    request = Body(prompt="hello there", adjusted=True)
    routed = Rendering(request, [tokens(7, 8, 9)])
    for stream in (False, True):
        out = asyncio.run(drain(e.generate(call(rendered=routed, stream=stream))))
        items = [x for chunk in out for x in (chunk if isinstance(chunk, list) else [chunk])]
        assert [(x["inputs"][0]["prompt_token_ids"], x["priority"], x["adjusted"]) for x in items] == [([7, 8, 9], 2, True)]
    chat = Rendering(request, ([], [tokens(1)]))
    assert asyncio.run(drain(e.generate(call("chat", rendered=chat))))[0]["inputs"][0]["prompt_token_ids"] == [1]
    assert fake.inner.rendered == []  # the serving layer never rendered a prompt
    assert e._handover._held == {}
    assert e._handover.chat_template == "kept"  # the rest of the renderer is the engine's own


def test_a_handed_rendering_arrives_when_it_is_handed_over():
    """vLLM stamps an input's arrival when it renders it and measures the engine's TTFT from it:
    the route's rendering was made before the gate, and kept that stamp, so the engine's TTFT
    (the autoscaler's signal) held the whole wait in the gate's queue."""
    e, _ = engine()
    routed = Rendering(Body(prompt="p"), [tokens(7, at=1.0)])
    chat = Rendering(Body(prompt="p"), ([], [tokens(7, at=1.0)]))
    before = time.time()
    seen = [asyncio.run(drain(e.generate(call(kind, rendered=r))))[0]["inputs"][0]["arrival_time"]
            for kind, r in (("completions", routed), ("chat", chat))]
    assert all(t >= before for t in seen)
    assert routed.result[0]["arrival_time"] == chat.result[1][0]["arrival_time"] == 1.0  # the route's own left as it was


def test_a_call_without_a_rendering_is_rendered_by_the_engine_as_before():
    e, fake = engine()
    out = asyncio.run(drain(e.generate(call())))
    assert out[0]["inputs"][0]["prompt_token_ids"] == [len("hello there")] and fake.inner.rendered == ["hello there"]


def test_what_cannot_be_handed_over_is_rendered_by_the_engine_from_the_clients_request():
    """An image's rendering never reached the engine's multimodal cache; an engine whose serving
    layers share no renderer takes no rendering. Either renders the request as the client sent
    it, not the one the route's tool parser already adjusted."""
    e, fake = engine()
    image = Rendering(Body(prompt="p", adjusted=True), [{"type": "multimodal", "prompt_token_ids": [1]}])
    out = asyncio.run(drain(e.generate(call(rendered=image))))
    assert fake.inner.rendered == ["hello there"] and out[0]["adjusted"] is False
    e._handover = None
    out = asyncio.run(drain(e.generate(call(rendered=Rendering(Body(prompt="p", adjusted=True), [tokens(1)])))))
    assert fake.inner.rendered == ["hello there"] * 2 and out[0]["adjusted"] is False


def test_a_rendering_serves_only_its_own_request_and_only_once():
    """Held by identity: an equal request of another call renders itself; and a rendering the
    serving layer never asked for (it refused the request first) is not left behind."""
    async def go():
        e, fake = engine()
        request = Body(prompt="same words")
        handover = e._handover
        held = [tokens(42)]
        with handover.holding(request, held):
            assert (await handover.render_completion(Body(prompt="same words")))[0]["prompt_token_ids"] != [42]
            assert (await handover.render_completion(request))[0]["prompt_token_ids"] == [42]
            assert (await handover.render_completion(request))[0]["prompt_token_ids"] != [42]  # used once
        fake.fail_before_render = True
        assert await drain(e.generate(call(rendered=Rendering(request, [tokens(43)])))) == [{"error": "model"}]
        return handover._held, fake.inner.rendered

    held, rendered = asyncio.run(go())
    assert held == {} and rendered == ["same words", "same words"]


def test_a_client_that_leaves_mid_stream_leaves_nothing_held():
    async def go():
        e, _ = engine()
        stream = e.generate(call(rendered=Rendering(Body(prompt="x"), [tokens(1)])))
        await stream.__anext__()
        await stream.aclose()
        return e._handover._held

    assert asyncio.run(go()) == {}


def test_a_call_never_carries_a_rendering_to_another_process():
    routed = call(rendered=Rendering(Body(prompt="p"), [tokens(1)]))
    moved = pickle.loads(pickle.dumps(routed))
    assert moved.rendered is None and moved == routed and moved.body == routed.body
    assert dataclasses.replace(routed, borrowed=True).rendered is routed.rendered  # in-process copies keep it


class RenderingCounter(WordCounter):
    async def count(self, kind, body):
        counted = await super().count(kind, body)
        return CountedPrompt(counted.tokens, rendered=("rendering of", body.prompt))


def test_the_route_hands_the_counters_rendering_to_the_pool():
    async def go():
        router, pool = make_router(FakePool())
        router._pricer._counter = RenderingCounter()
        async with client(router) as c:
            r = await c.post("/p/v1/completions", json={"prompt": "one two", "max_tokens": 2}, headers=auth("b"))
        return r.status_code, pool.calls

    status, calls = asyncio.run(go())
    assert status == 200 and [c.rendered for c in calls] == [("rendering of", "one two")]
