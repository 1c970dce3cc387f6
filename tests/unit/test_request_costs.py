"""Fields whose cost to a pool is not in the token charge are bounded before vLLM reads them: a
request charged a few tokens cost the pool's event loop or the engine's steps seconds. Each is a
400 naming the field; the same field within its bound passes to vLLM as before."""

from __future__ import annotations

import asyncio

import pytest

from router.costs import MAX_BAD_WORDS, MAX_BAD_WORDS_CHARS, MAX_LOGIT_BIAS, MAX_PATTERN_SIZE, MAX_STOP_TOKEN_IDS
from router.errors import ApiError
from router.pricing import Pricer
from tests.unit.router_harness import WordCounter

MSG = [{"role": "user", "content": "hi"}]
LIMIT = 64  # the test pricer's max_model_len


class NeverCounted(WordCounter):
    async def count(self, kind, body):
        raise AssertionError("a refused body must not reach vLLM's renderer")


def price(kind: str, body: dict, counter=None):
    return asyncio.run(Pricer("m", LIMIT, counter or WordCounter()).price(kind, {"max_tokens": 4, **body}))


def chat(**kw) -> dict:
    return {"messages": MSG, **kw}


def completion(**kw) -> dict:
    return {"prompt": "a b", **kw}


@pytest.mark.parametrize("kind, body, param", [
    ("chat", chat(bad_words=["a" * (MAX_BAD_WORDS_CHARS + 1)]), "bad_words"),  # one long word: 2.6 s to tokenize
    ("chat", chat(bad_words=["a"] * (MAX_BAD_WORDS + 1)), "bad_words"),
    ("completions", completion(allowed_token_ids=[5] * 1000, temperature=1), "allowed_token_ids"),
    ("chat", chat(repetition_detection={"max_pattern_size": 10 ** 9, "min_count": 2}), "repetition_detection"),
    ("completions", completion(prompt_logprobs=20, n=16), "prompt_logprobs"),
    ("completions", completion(echo=True, logprobs=20, n=2), "echo"),
    ("chat", chat(prompt_logprobs=1, n=2), "prompt_logprobs"),
    ("chat", chat(echo=True, top_logprobs=2, logprobs=True, n=2), "echo"),
    ("completions", completion(prompt="x" * (16 * LIMIT + 1), truncate_prompt_tokens=8), "truncation_side"),
    ("chat", chat(messages=[{"role": "user", "content": [{"type": "text", "text": "x" * 600}] * 2}],
                  truncate_prompt_tokens=8), "truncation_side"),
    ("chat", chat(messages=[{"role": "user", "content": "a"}] * (LIMIT + 1), truncate_prompt_tokens=8), "messages"),
    # numbers as vLLM's models read them: a string or a float passed the checks (found by a review)
    ("completions", completion(prompt_logprobs=5, n="16"), "prompt_logprobs"),
    ("completions", completion(prompt_logprobs=5, n=16.0), "prompt_logprobs"),
    ("completions", completion(allowed_token_ids=[5.0, 5.0, 5], temperature=1), "allowed_token_ids"),
    ("chat", chat(repetition_detection={"max_pattern_size": "100000", "min_count": 2}), "repetition_detection"),
    ("chat", chat(echo=True, n=16), "echo"),  # chat's top_logprobs defaults to 0: prompt logprobs all the same
    ("chat", chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * LIMIT}]), "messages"),
    # looked up or rebuilt at every step, for every choice (170,000 stop token ids: 1.6 ms a step)
    ("chat", chat(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids"),
    ("completions", completion(logit_bias={str(i): -1 for i in range(MAX_LOGIT_BIAS + 1)}, n=16), "logit_bias"),
])
def test_a_field_that_costs_beyond_its_charge_is_refused_by_name(kind, body, param):
    with pytest.raises(ApiError) as e:
        price(kind, body, NeverCounted())
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert e.value.code in ("too_costly", "invalid_value")


@pytest.mark.parametrize("kind, body", [
    ("chat", chat(bad_words=["never", "this"])),
    ("completions", completion(allowed_token_ids=[5, 6, 7], temperature=1)),
    ("chat", chat(repetition_detection={"max_pattern_size": MAX_PATTERN_SIZE, "min_count": 2})),
    ("completions", completion(prompt_logprobs=2)),  # n=1
    ("completions", completion(echo=True, n=2)),  # no logprobs: nothing repeated
    ("completions", completion(prompt="x" * (16 * LIMIT + 1), truncate_prompt_tokens=8, truncation_side="left")),
    ("completions", completion(prompt="a b c", truncate_prompt_tokens=2)),  # short: tokenized whole, cheaply
    ("chat", chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 3}] * 3)),
    ("chat", chat(stop=["a", "b", "c", "d"], stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))),
    ("completions", completion(stop="\n\n", logit_bias={str(i): -1 for i in range(MAX_LOGIT_BIAS)})),
])
def test_the_same_fields_within_bounds_pass(kind, body):
    assert price(kind, body).prompt_tokens > 0


def test_messages_and_parts_up_to_the_context_pass_the_count():
    from router.costs import check

    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}] * (LIMIT - 2)}, {"role": "user"}]
    check("chat", {"messages": parts}, LIMIT)  # LIMIT - 2 parts and 2 messages
    with pytest.raises(ApiError):
        check("chat", {"messages": [*parts, {"role": "user", "content": "a"}]}, LIMIT)
