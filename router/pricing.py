"""A request body in, a typed request with its token cost out.

The cost is what the engine will hold: every prompt token it renders (counted by vLLM's
own renderer, configured as the engines are: chat template, tools, documents, template
kwargs, tool calls, content parts, truncation) plus `n` x `max_tokens`. Quotas and the
pools' gates are charged this before any work starts; the real usage settles it after.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

from pools.llm import PromptError, PromptTooLong, SamplingError, asked_tokens, request_models, sanitize_chat
from pools.llm import vllm_client_errors
from pools.types import CallKind, CountedPrompt
from router import costs
from router.errors import ApiError
from router.grammar import GrammarLimits, check as check_grammar

# Request fields that belong to the operator, not to a tenant: rejected with a 400.
RESERVED_FIELDS = {
    "priority": "set the class with the x-poolserve-priority header instead",
    "request_id": "the router assigns request ids",
    "kv_transfer_params": "internal to disaggregated serving",
    "ec_transfer_params": "internal to disaggregated serving",
    "chat_template": "the model's own chat template is used",
    "vllm_xargs": "engine extension arguments are not accepted from tenants",
    "media_io_kwargs": "text models only",
    "mm_processor_kwargs": "text models only",
    "prompt_embeds": "send the prompt as text or token ids",
}
MAX_N = 16
COMPLETION_DEFAULT_MAX_TOKENS = 16  # vLLM's default for /completions; chat's is the rest of the context


class PromptCounter(Protocol):
    async def count(self, kind: str, body: Any) -> CountedPrompt: ...


@dataclass(frozen=True)
class PricedRequest:
    kind: CallKind
    body: Any  # the validated OpenAI request model (vLLM's, as ray.serve.llm uses)
    prompt_tokens: int
    max_tokens: int  # per sequence
    n: int
    client_usage: bool  # the client asked for the usage chunk of a stream
    rendered: Any = None  # the counter's rendering, handed to an engine in the same process

    @property
    def stream(self) -> bool:
        return bool(getattr(self.body, "stream", False))

    @property
    def cost(self) -> int:
        return self.prompt_tokens + self.n * self.max_tokens


class Pricer:
    def __init__(self, model_id: str, max_model_len: int, counter: PromptCounter,
                 grammar: GrammarLimits = GrammarLimits()) -> None:
        self._model_id = model_id
        self._limit = max_model_len
        self._counter = counter
        self._grammar = grammar

    async def price(self, kind: CallKind, data: dict) -> PricedRequest:
        body, client_usage = self.validate(kind, data)
        n = getattr(body, "n", None) or 1
        if n < 1 or n > MAX_N:
            raise ApiError(400, "invalid_value", f"n is {n}; it must be between 1 and {MAX_N}", "n")
        if kind == "completions":
            _one_prompt(body.prompt)
        asked, param = asked_tokens(kind, body)
        self._check_asked(asked, param)
        try:
            counted = await self._counter.count(kind, body)
        except PromptTooLong as e:
            at_least = f"at least {e.tokens}" if e.tokens else "more than max_model_len allows of"
            raise ApiError(400, "context_length_exceeded", f"the prompt is {at_least} tokens and {param} is "
                                                           f"{asked or 0}: together above max_model_len {self._limit}; "
                                                           "shorten the prompt", _prompt_param(kind))
        except PromptError as e:
            raise ApiError(400, "invalid_request", f"the engine would refuse this request: {e}",
                           e.parameter if isinstance(e, SamplingError) else _prompt_param(kind))
        prompt = counted.tokens
        return PricedRequest(kind, body, prompt, self._max_tokens(kind, asked, param, prompt), n, client_usage,
                             counted.rendered)

    def validate(self, kind: CallKind, data: dict) -> tuple[Any, bool]:
        """The request model of a body, or a 400 naming the field; and whether the client
        asked for a stream's usage chunk (the pool always gets one, to settle the charge)."""
        for key, why in RESERVED_FIELDS.items():
            if key in data:
                raise ApiError(400, "reserved_field", f"field {key!r} is not accepted: {why}", key)
        if data.get("use_beam_search"):  # vLLM sends each beam step to the engine at priority 0
            raise ApiError(400, "unsupported_field", "field 'use_beam_search' is not accepted: beam search runs "
                                                     "outside the engine's priority order; sample with 'n' instead",
                           "use_beam_search")
        model = data.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError(400, "invalid_type", f"model must be a string, such as {self._model_id!r}", "model")
        if model is not None and model != self._model_id:
            raise ApiError(404, "model_not_found", f"unknown model {model!r}; this service serves "
                                                   f"{self._model_id!r}", "model")
        check_grammar(data, self._grammar)  # before vLLM's models: they convert structural tags
        costs.check(kind, data, self._limit)
        if kind == "chat":
            _check_messages(data)
        elif data.get("prompt") is None:
            raise ApiError(400, "missing_field", "field 'prompt' is required", "prompt")
        client_usage = False
        if data.get("stream"):
            opts = {} if data.get("stream_options") is None else data["stream_options"]
            if not isinstance(opts, dict) or not (opts.get("include_usage") is None
                                                  or isinstance(opts["include_usage"], bool)):
                raise ApiError(400, "invalid_value", "stream_options must be an object such as "
                                                     "{\"include_usage\": true} (true or false)", "stream_options")
            client_usage = opts.get("include_usage") is True
            data = {**data, "stream_options": {**opts, "include_usage": True}}
        return _model(kind, data), client_usage

    def _check_asked(self, asked: int | None, param: str) -> None:
        """Output lengths no prompt can go with are refused before anything is rendered."""
        if asked is None:
            return
        if asked < 1:
            raise ApiError(400, "invalid_value", f"{param} is {asked}; it must be at least 1", param)
        if asked >= self._limit:
            raise ApiError(400, "context_length_exceeded", f"{param} is {asked}: with any prompt above max_model_len "
                                                           f"{self._limit}; ask for at most {self._limit - 1}", param)

    def _max_tokens(self, kind: str, asked: int | None, param: str, prompt: int) -> int:
        limit = self._limit
        if prompt >= limit:
            raise ApiError(400, "context_length_exceeded", f"the prompt is {prompt} tokens; max_model_len is "
                                                           f"{limit}: shorten the prompt", _prompt_param(kind))
        if asked is None:
            return limit - prompt if kind == "chat" else min(COMPLETION_DEFAULT_MAX_TOKENS, limit - prompt)
        if prompt + asked > limit:
            raise ApiError(400, "context_length_exceeded",
                           f"{param} is {asked} and the prompt is {prompt} tokens: together above max_model_len "
                           f"{limit}; ask for at most {limit - prompt}", param)
        return asked


ECHOED_TEXT = ("text", "input_text", "output_text", "refusal", "thinking")  # parts vLLM reads as text


def _prompt_param(kind: str) -> str:
    return "messages" if kind == "chat" else "prompt"


def _check_messages(data: dict) -> None:
    """Checked before the model: pydantic's union errors would list every message type."""
    if "messages" not in data:
        raise ApiError(400, "missing_field", "field 'messages' is required: a list of {role, content} messages",
                       "messages")
    messages = data["messages"]
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "invalid_request", "messages must be a non-empty list of {role, content} objects",
                       "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, "invalid_request", f"messages[{i}].role is required: each message is an object "
                                                   "with a 'role' and its 'content'", f"messages[{i}].role")
        if m.get("tool_calls") is not None and not isinstance(m["tool_calls"], list):  # vLLM iterates it first
            raise ApiError(400, "invalid_type", f"messages[{i}].tool_calls must be a list of tool calls",
                           f"messages[{i}].tool_calls")
    _check_echo(data, messages[-1])


def _check_echo(data: dict, last: dict) -> None:
    """vLLM joins an echoed message's parts' text only after generating the whole answer: a part
    of no text raises KeyError then (where the model's chat template takes parts as a list), a
    500 `engine_failed` charged for that work; refused here, it is a 400 before any. vLLM
    echoes the last message when no generation prompt is added, or when it is the assistant's."""
    content = last.get("content")
    if not costs.read_true(data.get("echo")) or not isinstance(content, list):
        return
    if costs.read_true(data.get("add_generation_prompt", True)) and last.get("role") != "assistant":
        return
    if not all(isinstance(p, str) or (isinstance(p, dict) and p.get("type") in ECHOED_TEXT) for p in content):
        raise ApiError(400, "unsupported_value", "echo repeats the last message's text: its content parts must "
                                                 f"all be text ({', '.join(ECHOED_TEXT)})", "echo")


def _one_prompt(prompt: Any) -> None:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)) and len(prompt) != 1:
        raise ApiError(400, "invalid_value", f"prompt holds {len(prompt)} prompts; send one prompt per request",
                       "prompt")


def _model(kind: str, data: dict) -> Any:
    from pydantic import ValidationError

    try:
        body = _model_of(kind).model_validate(data)
    except ValidationError as e:
        raise ApiError(400, "invalid_request", _validation_message(e), _first_param(e))
    except RecursionError:
        raise ApiError(400, "json_too_deep", "the request body nests too deeply to validate; flatten it")
    except Exception as e:  # noqa: BLE001 - the body is the only input, so any failure is the body's
        # vLLM's before-validators raise VLLMValidationError, or crash on a field of the wrong
        # type (AttributeError on `structured_outputs: 5`, say) before pydantic checks types.
        if (param := getattr(e, "parameter", None)) is None and (found := _culprit(kind, data)) is not None:
            param, e = found
        if isinstance(e, (ValueError, TypeError, *vllm_client_errors())):
            raise ApiError(400, "invalid_request", f"invalid request: {e}", param)
        raise ApiError(400, "invalid_request", f"invalid request ({type(e).__name__}: {e}); a field has the "
                                               "wrong type: see the schema at /openapi.json", param)
    if kind == "chat":
        try:
            body = sanitize_chat(body)
        except ValueError as e:
            raise ApiError(400, "invalid_request", str(e), "messages")
    return body


def _model_of(kind: str) -> Any:
    return request_models()[0 if kind == "chat" else 1]


def _culprit(kind: str, data: dict) -> tuple[str, Exception] | None:
    """The first field whose value fails on its own, and its error: for a failure of the whole
    body that named no field (one validation of each value, on the error path only)."""
    from pydantic import ValidationError

    fields = _model_of(kind).model_fields
    for name, value in data.items():
        if name not in fields:  # the models ignore it (and the cache holds the models' names alone)
            continue
        try:
            _field_type(kind, name).validate_python(value)
        except ValidationError as e:
            return name, ValueError(_validation_message(e, name).removeprefix("invalid request: "))
        except Exception as e:  # noqa: BLE001 - a validator of vLLM's that crashes on this value alone
            return name, e
    return None


@functools.lru_cache(maxsize=None)
def _field_type(kind: str, name: str) -> Any:
    """A validator of one field of vLLM's request model."""
    from pydantic import TypeAdapter

    field = _model_of(kind).model_fields[name]
    return TypeAdapter(Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation)


def _validation_message(e, field: str | None = None) -> str:
    """pydantic's first errors at their places (inside `field`, for its value validated alone)."""
    parts = []
    for err in e.errors()[:5]:
        loc = [str(x) for x in err.get("loc", ()) if not str(x).startswith("function-")]
        parts.append(f"{'.'.join(([field] if field else []) + loc) or 'body'}: {err.get('msg')}")
    more = len(e.errors()) - 5
    return "invalid request: " + "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def _first_param(e) -> str | None:
    errs = e.errors()
    if not errs or not errs[0].get("loc"):
        return None
    return str(errs[0]["loc"][0])
