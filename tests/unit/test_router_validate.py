"""Request bodies that once made 500s under fuzzing: each is a 400 that names the problem."""

from __future__ import annotations

import asyncio

import pytest

from pools.llm import PromptError, SamplingError
from router.errors import ApiError
from router.pricing import Pricer
from tests.unit.router_harness import WordCounter

MSG = [{"role": "user", "content": "hi"}]


def pricer() -> Pricer:
    return Pricer("m", 64, WordCounter())


@pytest.mark.parametrize("body, param, fragment", [
    ({"messages": MSG, "structured_outputs": 5}, "structured_outputs", "structured_outputs"),  # a crash of vLLM's
    ({"messages": MSG, "structured_outputs": {"a": 5}}, "structured_outputs", "one kind"),  # an error naming none
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": 5}]}, "messages[0].tool_calls", "list"),
    # vLLM's echo of a non-text part raised KeyError after the whole answer was generated: refunded as a refusal
    ({"messages": [{"role": "user", "content": [{"type": "tool_reference", "name": "x"}, {"type": "text", "text": "a"}]}],
      "echo": True, "add_generation_prompt": False}, "echo", "text"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_reference", "name": "x", "text": "y"}]}],
      "echo": True}, "echo", "text"),  # its "text" is dropped as vLLM reads the part
    ({"messages": MSG, "tool_choice": "required"}, "tool_choice", "tools"),  # VLLMValidationError
    ({"messages": MSG, "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"messages": [{"content": "no role"}]}, "messages[0].role", "role is required"),
    ({"messages": [MSG[0], {"author": {"role": "system"}, "channel": "x"}]}, "messages[1].role", "role"),
    ({"messages": []}, "messages", "non-empty"),
    ({"messages": "hello"}, "messages", "list"),
    ({"messages": MSG, "prompt_embeds": "x"}, "prompt_embeds", "text or token ids"),
    ({"messages": MSG, "n": 17}, "n", "between 1 and 16"),
    # vLLM's beam search sends each step to the engine at priority 0, above every class's
    ({"messages": MSG, "use_beam_search": True}, "use_beam_search", "priority"),
    ({"messages": MSG, "use_beam_search": 1}, "use_beam_search", "priority"),
    # a stream's options not an object, or include_usage not a boolean ("false" read as true)
    ({"messages": MSG, "stream": True, "stream_options": "yes"}, "stream_options", "object"),
    ({"messages": MSG, "stream": True, "stream_options": {"include_usage": "false"}}, "stream_options", "true"),
    ({"messages": MSG, "stream": True, "stream_options": False}, "stream_options", "object"),
])
def test_bad_bodies_are_400_naming_the_problem(body, param, fragment):
    with pytest.raises(ApiError) as e:
        asyncio.run(pricer().price("chat", body))
    assert e.value.status == 400 and e.value.param == param and fragment in e.value.message


WRONG = (5, -1, 1.5, True, "x", [5], {"a": 5}, [{"a": 5}])


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_a_field_of_the_wrong_type_is_a_400_naming_that_field(kind):
    """Every field of vLLM's request models, given each value of the wrong type: a 400 whose
    `param` names that field. vLLM's before-validators crashed on some (an AttributeError, a
    TypeError) or raised errors naming no field, which the 400 passed on without one."""
    from pools.llm import request_models

    model = request_models()[0 if kind == "chat" else 1]
    base = {"messages": MSG} if kind == "chat" else {"prompt": "a b"}
    unnamed = []
    for name in model.model_fields:
        for value in WRONG:
            try:
                asyncio.run(pricer().price(kind, {**base, name: value}))
            except ApiError as e:
                assert e.status == 400 or (name, e.status) == ("model", 404), (name, value, e.status, e.message)
                if (e.param or "").split("[")[0].split(".")[0] != name:
                    unnamed.append((name, value, e.param, e.message[:80]))
    assert not unnamed, unnamed


@pytest.mark.parametrize("last", [
    {"role": "user", "content": [{"type": "tool_reference", "name": "x"}]},  # not echoed: a prompt is added
    {"role": "user", "content": ["a", {"type": "refusal", "refusal": "no"}, {"type": "thinking", "thinking": "t"},
                                 {"type": "text", "text": None}, {"type": "input_text", "text": "b"}]},
])
def test_an_echo_vllm_can_make_is_not_refused(last):
    for extra in ({}, {"add_generation_prompt": False}):
        if extra and last["content"][0] != "a":
            continue
        asyncio.run(pricer().price("chat", {"messages": [last], "echo": True, **extra}))


def test_beam_search_is_refused_on_completions_and_false_is_harmless():
    with pytest.raises(ApiError) as e:
        asyncio.run(pricer().price("completions", {"prompt": "a b", "use_beam_search": True}))
    assert e.value.status == 400 and e.value.param == "use_beam_search"
    assert asyncio.run(pricer().price("completions", {"prompt": "a b", "use_beam_search": False})).max_tokens == 16


def test_a_good_body_passes():
    priced = asyncio.run(pricer().price("chat", {"messages": MSG, "max_tokens": 4, "n": 3}))
    assert priced.body.messages[0]["role"] == "user" and priced.max_tokens == 4
    assert priced.cost == priced.prompt_tokens + 3 * 4  # n sequences of max_tokens each


@pytest.mark.parametrize("kind, body, max_tokens", [
    ("chat", {"messages": MSG}, 64 - 3),  # the rest of the context
    ("chat", {"messages": MSG, "max_tokens": None}, 64 - 3),
    ("completions", {"prompt": "a b"}, 16),  # vLLM's default for completions
    ("completions", {"prompt": "a b", "max_tokens": None}, 16),  # vLLM's model turns an explicit null into 16
])
def test_max_tokens_defaults_are_the_engines(kind, body, max_tokens):
    """The charge holds what the engine may generate, as vLLM's own serving works it out."""
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

    priced = asyncio.run(pricer().price(kind, body))
    assert priced.max_tokens == max_tokens
    assert get_max_tokens(64, priced.body.max_tokens, priced.prompt_tokens, {}) == max_tokens


@pytest.mark.parametrize("error, param", [
    (SamplingError("Requested sample logprobs of 21", "top_logprobs"), "top_logprobs"),
    (SamplingError("min_tokens must be less than or equal to max_tokens=4", None), None),
    (PromptError("the template failed"), "messages"),  # a rendering error is the prompt's
])
def test_the_engines_refusal_names_the_field_it_was_about(error, param):
    """A sampling check that failed named the messages, as a rendering error does."""
    class Refusing(WordCounter):
        async def count(self, kind, body):
            raise error

    with pytest.raises(ApiError) as e:
        asyncio.run(Pricer("m", 64, Refusing()).price("chat", {"messages": MSG, "max_tokens": 4}))
    assert e.value.status == 400 and e.value.param == param and "the engine would refuse" in e.value.message


def test_a_lone_surrogate_is_a_400_and_an_error_repeating_one_still_renders():
    """JSON's \\ud800 parses to a string no encoder takes: a grammar's size check raised on it,
    and an error message of vLLM's that repeats the client's text made Starlette's strict
    encoding raise building the 400; both were 500s (found by a review)."""
    from starlette.requests import Request

    from router.body import BodyLimits, read_json

    def body_of(raw: bytes):
        async def receive():
            return {"type": "http.request", "body": raw, "more_body": False}
        return asyncio.run(read_json(Request({"type": "http", "headers": []}, receive), BodyLimits(1 << 20, 5, 64)))

    with pytest.raises(ApiError) as e:
        body_of(b'{"messages": [], "response_format": {"type": "json_object", "x": "\\ud800"}}')
    assert e.value.status == 400 and "surrogate" in e.value.message
    assert body_of(b'{"prompt": "\\ud83d\\ude00 \\\\ud800"}')["prompt"] == "\U0001F600 \\ud800"  # a pair; an escaped \\
    for raw in (b'{"prompt": "\xed\xa0\x80"}', '{"prompt": "\\ud800"}'.encode("utf-16-le")):
        with pytest.raises(ApiError):  # a surrogate's own bytes, or UTF-16 with no mark: json reads both
            body_of(raw)
    assert pricer().validate("chat", {"messages": MSG, "stream": True, "stream_options": {"include_usage": None}})[1] \
        is False
    echoed = ApiError(400, "invalid_value", "Invalid value for tool_choice: \ud800", "tool_choice").response()
    assert echoed.status_code == 400 and b"\\ud800" in echoed.body
