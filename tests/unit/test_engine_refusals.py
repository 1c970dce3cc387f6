"""A request vLLM's serving refuses once the engine has it is a 4xx that costs nothing, in every
shape it comes in, and names the field vLLM names."""

from __future__ import annotations

import asyncio
import json

import pytest

from pools.types import Admitted, Finished
from tests.unit.router_harness import FakePool, auth, client, make_router, settles

ERROR = {"error": {"message": "Token id 99999 is out of vocabulary", "type": "BadRequestError",
                   "param": "prompt", "code": 400}}


@pytest.mark.parametrize("chunks", [
    [f"data: {json.dumps(ERROR)}\n\n"],
    [f"data: {json.dumps(ERROR, separators=(',', ':'))}\n\n", "data: [DONE]\n\n"],
    [f"data: {json.dumps({'error': {**ERROR['error'], 'code': 'bad_request'}})}\n\n"],  # a code no number
    [f"data: {json.dumps({'error': {**ERROR['error'], 'code': float('inf')}})}\n\n"],  # nor a finite one
])
def test_a_stream_vllm_answered_with_an_error_event_is_a_400_and_refunded(chunks):
    """vLLM's stream generators catch what the engine raises when it takes the request (a token
    id out of the vocabulary, an empty prompt) and send it as an SSE error event, then `[DONE]`:
    the route answered 200 with the event as its body and kept the whole charge."""
    async def refusing(call):
        yield Admitted("p", "r1", 0.0)
        yield chunks
        yield Finished(None, None, 0.01)

    async def go():
        router, _ = make_router(FakePool(refusing))
        settled = settles(router)
        async with client(router) as c:
            r = await c.post("/p/v1/completions", json={"prompt": [99999], "max_tokens": 40, "stream": True},
                             headers=auth("b"))
        return r, settled

    r, settled = asyncio.run(go())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "Token id 99999 is out of vocabulary"
    assert r.json()["error"]["param"] == "prompt"
    assert settled == [0]
