"""A whole answer's refusal is decided by the engine's output, not by the first item: its one
item comes after all of its generation, so a serving layer that fails after the last token
(vLLM joining an echoed message's parts raised KeyError) read as a refusal before any work
and refunded the whole generation. Here vLLM's layers are stood in for as Ray LLM stacks
them (the engine client, its serving layer, Ray's `chat`/`completions`), under the real
`RayLLMEngine`, pool replica and route, over HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from types import SimpleNamespace

import httpx
import pytest

from pools import llm
from pools.streams import _OUTPUT, _Output, mark_output
from pools.llm import RayLLMEngine
from pools.types import Admitted, Failed, PoolCall, PriorityClass, Usage
from tests.unit.router_harness import auth, settles
from tests.unit.test_pool_ingress import http_app, make_ingress

END = object()


def _error(message: str, code: int | str = 400) -> SimpleNamespace:
    return SimpleNamespace(error=SimpleNamespace(message=message, code=code, type="BadRequestError", param=None))


class Client:
    """vLLM's engine client: `generate` streams a request's outputs, a whole answer's as one
    final output (the tokens after some steps); an input it cannot take fails before any
    output; a stream closed or cancelled aborts the request."""

    def __init__(self) -> None:
        self.aborted = 0
        self.steps = 0

    def generate(self, prompt: str, params: object, request_id: str, **kwargs):
        return self._outputs(prompt)

    def shutdown(self) -> None:
        pass

    async def _outputs(self, prompt: str):
        if "before-raise" in prompt:
            raise ValueError("token id 9999999 is out of vocabulary")
        try:
            for _ in range(3):
                await asyncio.sleep(0)
                self.steps += 1
            yield SimpleNamespace(prompt_token_ids=[1, 2], outputs=[SimpleNamespace(token_ids=[7, 8, 9])], text="t2")
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted += 1
            raise


async def _merged(stream):
    """vLLM's `merge_async_iterators`: the outputs are read in a task of their own."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump():
        try:
            async for x in stream:
                queue.put_nowait(x)
        finally:
            queue.put_nowait(END)

    task = asyncio.get_running_loop().create_task(pump())
    try:
        while (x := await queue.get()) is not END:
            yield x
    finally:
        task.cancel()


class Serving:
    """vLLM's serving layer: a whole answer is made after all its outputs, a cancellation of
    it answered with an error, and an error in making it raised; a stream sends an error event."""

    def __init__(self, client: Client, merged: bool) -> None:
        self.engine_client, self.merged, self.streams = client, merged, []
        self.online_renderer = None

    async def create(self, request) -> object:
        prompt = request.prompt if hasattr(request, "prompt") else request.messages[-1]["content"]
        if "before-error" in prompt:
            return _error("the request's model is not served here")
        outputs = self.engine_client.generate(prompt, None, "cmpl-1")
        if self.merged:
            outputs = _merged(outputs)
        if request.stream:
            self.streams.append(outputs)
            return self._stream(outputs)
        final = None
        try:
            async for final in outputs:
                pass
        except asyncio.CancelledError:
            return _error("Client disconnected")
        if "after-raise" in prompt:
            raise KeyError("text")
        if "after-error" in prompt:
            raise ValueError("the echoed message could not be joined")  # Ray's layer answers it as an error
        if "after-crash" in prompt:  # vLLM's GenerationError: a server error, worth a retry
            raise RuntimeError("Internal server error")
        if "after-5xx" in prompt:
            return _error("the engine step failed", 500)
        if "after-503-as-text" in prompt:  # a code as a string: the router reads it as the number it is
            return _error("the engine is overloaded", "503")
        usage = {"prompt_tokens": 3, "completion_tokens": 3}
        return SimpleNamespace(usage=SimpleNamespace(**usage),
                               model_dump=lambda: {"choices": [{"text": final.text}], "usage": usage})

    async def _stream(self, outputs) -> AsyncGenerator[str, None]:
        async for res in outputs:
            yield f'data: {{"choices":[{{"text":"{res.text}"}}]}}\n\n'
        yield 'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":3}}\n\n'
        yield "data: [DONE]\n\n"


class VLLMEngine:
    """Ray LLM's VLLMEngine: `chat`/`completions` turn the serving layer's ValueError into an
    error object, and stream what it streams."""

    def __init__(self, merged: bool = False) -> None:
        self._engine_client = Client()
        self._oai_serving_chat = Serving(self._engine_client, merged)
        self._oai_serving_completion = Serving(self._engine_client, merged)

    async def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    async def _answer(self, serving: Serving, body):
        try:
            response = await serving.create(body)
        except ValueError as e:
            yield _error(str(e))
            return
        if isinstance(response, AsyncGenerator):
            async for x in response:
                yield x
        else:
            yield response

    def chat(self, body, raw):
        return self._answer(self._oai_serving_chat, body)

    def completions(self, body, raw):
        return self._answer(self._oai_serving_completion, body)


async def started(monkeypatch, merged: bool = False) -> RayLLMEngine:
    """A RayLLMEngine started as a replica starts it, on the stand-in engine."""
    fake = VLLMEngine(merged)
    monkeypatch.setattr(llm, "_stat_logging_engine_cls", lambda owner: lambda config: fake)
    monkeypatch.setattr(llm, "needs_node_download", lambda config: True)
    engine = RayLLMEngine(llm_config=None, stream_batching_ms=0)
    await engine.start()
    return engine


def ask(monkeypatch, path: str, body: dict, merged: bool = False):
    async def go():
        engine = await started(monkeypatch, merged)
        ingress, _ = await make_ingress(engine=engine)
        settled = settles(ingress.router)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=http_app(ingress)), base_url="http://p") as c:
            r = await asyncio.wait_for(c.post(path, headers=auth("b"), json=body), 30)
        stats = ingress._gate.gate.stats()
        await ingress.close()
        return r, settled, stats, engine._engine._engine_client

    return asyncio.run(go())


def whole(kind: str, text: str) -> tuple[str, dict]:
    if kind == "chat":
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 3}
    return "/v1/completions", {"prompt": text, "max_tokens": 3}


@pytest.mark.parametrize("merged", [False, True])
@pytest.mark.parametrize("kind", ["chat", "completions"])
@pytest.mark.parametrize("failure", ["after-raise", "after-error"])
def test_a_whole_answer_that_fails_after_its_generation_is_a_500_charged_what_it_used(monkeypatch, failure, kind,
                                                                                       merged):
    r, settled, stats, client = ask(monkeypatch, *whole(kind, f"hello {failure}"), merged=merged)
    assert client.steps == 3  # all of it was generated
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_failed", r.text
    assert "failed after generating" in r.json()["error"]["message"]
    assert "retry-after" not in r.headers and r.headers["x-should-retry"] == "false"  # it would fail again
    assert settled == [5]  # the final output's 2 prompt and 3 generated tokens (it was refunded: [0])
    assert stats.active == 0 and stats.cancelled == 1 and stats.inflight_tokens == 0


def test_the_openai_sdk_does_not_ask_again_for_an_answer_the_engine_failed_on(monkeypatch):
    """The SDK retries every 5xx twice by default: the same failure, generated and charged three times."""
    import openai

    async def go():
        ingress, _ = await make_ingress(engine=await started(monkeypatch))
        settled = settles(ingress.router)
        transport = httpx.ASGITransport(app=http_app(ingress))
        async with httpx.AsyncClient(transport=transport, base_url="http://p") as http:
            sdk = openai.AsyncOpenAI(api_key="key-b", base_url="http://p/v1", http_client=http, max_retries=2)
            with pytest.raises(openai.InternalServerError):
                await asyncio.wait_for(sdk.completions.create(model="m", prompt="hi after-raise", max_tokens=3), 30)
        await ingress.close()
        return settled

    assert asyncio.run(go()) == [5]  # asked once, charged once


@pytest.mark.parametrize("failure, status, used", [("after-crash", 503, None), ("after-5xx", 500, None),
                                                     ("after-503-as-text", 503, None)])
def test_a_server_error_after_the_generation_stays_what_it_was(monkeypatch, failure, status, used):
    """vLLM's GenerationError (an internal error it calls retryable) is the pool's failure, a
    503 the batch job retries; a 5xx error object keeps its status. Only what would read as
    the input's refusal becomes `engine_failed` (helper-99)."""
    r, settled, stats, client = ask(monkeypatch, *whole("chat", f"hello {failure}"))
    assert client.steps == 3 and r.status_code == status, r.text
    assert r.json()["error"]["code"] != "engine_failed" and settled == [used] and stats.active == 0


@pytest.mark.parametrize("kind", ["chat", "completions"])
@pytest.mark.parametrize("failure", ["before-raise", "before-error"])
def test_an_input_the_engine_refuses_before_any_output_still_costs_nothing(monkeypatch, failure, kind):
    r, settled, stats, client = ask(monkeypatch, *whole(kind, f"hello {failure}"))
    assert client.steps == 0
    assert r.status_code == 400, r.text
    assert settled == [0] and stats.active == 0


def test_a_whole_answer_that_succeeds_is_answered_and_charged_its_usage(monkeypatch):
    r, settled, stats, client = ask(monkeypatch, *whole("chat", "hello"))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "t2", r.text
    assert settled == [6] and stats.completed == 1


def call(body) -> SimpleNamespace:
    return SimpleNamespace(kind="completions", body=body, rendered=None, priority=0)


def test_the_pool_replica_ends_a_failed_answer_with_its_usage_and_no_finished(monkeypatch):
    """Read to its end (a replica in a Serve process runs on whatever the route does)."""
    from tests.unit.test_pool_server import make_server

    async def go():
        engine = await started(monkeypatch)
        server = await make_server()
        server._engine = engine
        body = llm.request_models()[1](prompt="hello after-raise", max_tokens=3)
        c = PoolCall("completions", body, "t", 1.0, PriorityClass.BATCH, 2, 30)  # estimated at 32 tokens
        items = [x async for x in server.generate(c)]
        gate = server._gate.gate
        return items, gate.stats(), dict(gate._classes[PriorityClass.BATCH].counters)

    items, stats, counters = asyncio.run(go())
    assert isinstance(items[0], Admitted) and isinstance(items[-1], Failed) and len(items) == 2
    assert items[-1].usage == Usage(2, 3) and "KeyError" in items[-1].message
    assert (stats.completed, stats.cancelled, stats.active, stats.inflight_tokens) == (0, 1, 0, 0)
    assert counters == {"t": 5.0}  # the fair-share counter holds what the engine did, not the estimate


def test_a_whole_answer_cancelled_while_it_generates_is_a_cancellation_not_an_answer(monkeypatch):
    """vLLM answers a whole answer's cancellation with a "Client disconnected" error: handed on
    as the answer, the replica counted the call completed, its cancellation lost."""
    async def go():
        engine = await started(monkeypatch)
        items = []

        async def read():
            async for x in engine.generate(call(llm.request_models()[1](prompt="hello", max_tokens=3))):
                items.append(x)

        task = asyncio.get_running_loop().create_task(read())
        while engine._engine._engine_client.steps == 0:
            await asyncio.sleep(0)
        task.cancel()
        done = await asyncio.gather(task, return_exceptions=True)
        return done[0], items, engine._engine._engine_client

    outcome, items, client = asyncio.run(go())
    assert isinstance(outcome, asyncio.CancelledError) and items == []
    assert client.aborted == 1 and client.steps < 3


def test_the_engines_stream_closed_early_aborts_its_request():
    """The serving layer may close what it reads from (vLLM's merge does, on its way out): the
    engine's own stream is closed with it, which is what makes vLLM abort the request."""
    async def go():
        client = Client()
        mark_output(client)
        token = _OUTPUT.set(_Output())
        try:
            outputs = client.generate("hello", None, "r")
        finally:
            _OUTPUT.reset(token)
        step = asyncio.get_running_loop().create_task(outputs.__anext__())
        while client.steps == 0:
            await asyncio.sleep(0)
        step.cancel()
        await asyncio.gather(step, return_exceptions=True)
        await outputs.aclose()
        return client, outputs

    client, outputs = asyncio.run(go())
    assert client.aborted == 1 and outputs.ag_code is not Client._outputs.__code__  # it was marked


def test_a_stream_reads_the_engines_outputs_as_they_are(monkeypatch):
    """Nothing is added per token on a stream (its first chunk follows the engine's first
    output, so a chunk already says the engine worked), even after a whole answer in the same
    task."""
    async def go():
        engine = await started(monkeypatch)
        models = llm.request_models()
        for stream in (False, True):
            out = [x async for x in engine.generate(call(models[1](prompt="hi", max_tokens=3, stream=stream)))]
        return out, engine._engine._oai_serving_completion.streams

    out, streams = asyncio.run(go())
    assert len(out) == 3 and len(streams) == 1  # one output's chunk, the usage, [DONE]
    assert streams[0].ag_code is Client._outputs.__code__  # the client's own generator, not a wrapper
