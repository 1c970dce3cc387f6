"""The load generator reads a stream as the SSE format says: lines end at CR, LF or CRLF only.

vLLM writes its chunks with pydantic, which leaves U+0085, U+2028 and U+2029 unescaped; a reader
that splits on every Unicode line break (httpx's `aiter_lines`) cut such a chunk in two and
counted a whole answer as a broken stream. The tiny model's byte-level tokens can spell them."""

import asyncio
import json
import random

import httpx
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from infra import loadgen
from infra.loadgen import Target
from infra.wire import sse_lines


def _body(texts: list[str], crlf: bool) -> bytes:
    end = "\r\n\r\n" if crlf else "\n\n"
    chunks = [{"choices": [{"index": 0, "text": t}]} for t in texts]
    chunks.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": len(texts)}})
    events = "".join(f"data: {json.dumps(c, ensure_ascii=False)}{end}" for c in chunks)
    return (events + f"data: [DONE]{end}").encode()


class _Cut(httpx.AsyncByteStream):
    """`body` written in up to 13 pieces cut at random bytes (inside characters too); none with `seed=None`."""

    def __init__(self, body: bytes, seed: int | None) -> None:
        rng = random.Random(seed)
        n = 0 if seed is None or len(body) < 2 else min(len(body) - 1, rng.randint(0, 12))
        cuts = sorted(rng.sample(range(1, len(body)), n))
        self.pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)])]

    async def __aiter__(self):
        for p in self.pieces:
            yield p


def _send(body: bytes, seed: int | None = None) -> loadgen.Result:
    """`send` against a server that writes `body` cut into pieces."""
    async def go():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, stream=_Cut(body, seed)))
        async with httpx.AsyncClient(transport=transport) as client:
            return await loadgen.send(client, Target("http://x/v1", "k"), "hi", 8)
    return asyncio.run(go())


def test_a_chunk_holding_unicode_line_separators_is_one_line():
    res = _send(_body(["a\u0085b", "\u2028", "c\u2029d"], crlf=False))
    assert res.ok, res.error
    assert res.output_tokens == 3 and res.ttft is not None


@settings(max_examples=200, deadline=None)
@given(texts=st.lists(st.text(min_size=1), min_size=1, max_size=6), crlf=st.booleans(), seed=st.integers(0, 2**32))
def test_any_text_cut_anywhere_arrives_whole(texts, crlf, seed):
    res = _send(_body(texts, crlf), seed)
    assert res.ok, res.error
    assert res.output_tokens == len(texts) and res.prompt_tokens == 3


@settings(max_examples=300, deadline=None)
@given(lines=st.lists(st.text().filter(lambda t: "\r" not in t and "\n" not in t), max_size=6),
       ends=st.lists(st.sampled_from(["\n", "\r\n", "\r"]), min_size=6, max_size=6), seed=st.integers(0, 2**32))
def test_the_lines_do_not_depend_on_where_the_stream_is_cut(lines, ends, seed):
    pairs = list(zip(lines, ends))
    # a CR that ends a line, then an empty line ended by LF, is one CRLF to any reader
    assume(not any(e == "\r" and nxt == "" and nxt_end.startswith("\n")
                   for (_, e), (nxt, nxt_end) in zip(pairs, pairs[1:])))
    body = "".join(line + end for line, end in pairs).encode()

    async def read():
        return [line async for line in sse_lines(httpx.Response(200, stream=_Cut(body, seed)))]
    assert asyncio.run(read()) == lines
