"""*Pure.* Request fields whose cost to a pool is not in its token charge, bounded.

A request is charged its prompt tokens plus `n` x `max_tokens`. A few of vLLM's fields make the
pool's event loop or the engine's scheduler work far beyond that, whatever the charge: measured
with vLLM 0.29's own functions on this project's tiny model (bench/notes.md), a request charged
9 to 24 tokens cost seconds. Each is a 400 naming the field and how to ask within the bound.
"""

from __future__ import annotations

from typing import Any

from router.errors import ApiError

MAX_BAD_WORDS, MAX_BAD_WORDS_CHARS = 100, 4096  # vLLM tokenizes each on the event loop, checks each at every step
MAX_PATTERN_SIZE = 128  # repetition_detection scans this many n-gram sizes at every step
PROMPT_CHARS_PER_TOKEN = 16  # more characters than this per context token can only be cut away
MAX_STOP_TOKEN_IDS = 1024  # the engine's scheduler looks each new token up in this list, at every step
MAX_LOGIT_BIAS = 1024  # the engine rebuilds every running request's entries whenever its batch changes


def check(kind: str, data: dict, max_model_len: int) -> None:
    _bad_words(data.get("bad_words"))
    _stop_token_ids(data.get("stop_token_ids"))
    _logit_bias(data.get("logit_bias"))
    _allowed_token_ids(data.get("allowed_token_ids"))
    _repetition_detection(data.get("repetition_detection"))
    _prompt_logprobs(kind, data)
    _truncation(kind, data, max_model_len)
    _parts(data.get("messages") if kind == "chat" else None, max_model_len)


def _bad_words(words: Any) -> None:
    if not isinstance(words, list):
        return
    size = sum(len(w) for w in words if isinstance(w, str))
    if len(words) > MAX_BAD_WORDS or size > MAX_BAD_WORDS_CHARS:
        raise ApiError(400, "too_costly", f"bad_words holds {len(words):,} words of {size:,} characters and at most "
                                          f"{MAX_BAD_WORDS} words of {MAX_BAD_WORDS_CHARS:,} characters are accepted: "
                                          "each word is tokenized before the engine starts and checked at every "
                                          "step", "bad_words")


def _stop_token_ids(ids: Any) -> None:
    """The engine's scheduler looks each new token up in this list, for every choice at every
    step, while every request of the pool waits: 170,000 ids cost 1.6 ms a step (bench/notes.md).
    Stop strings need no bound here: vLLM's request models take at most 4 (VLLM_MAX_STOP_STRINGS)."""
    if isinstance(ids, list) and len(ids) > MAX_STOP_TOKEN_IDS:
        raise ApiError(400, "too_costly", f"stop_token_ids holds {len(ids):,} ids and at most "
                                          f"{MAX_STOP_TOKEN_IDS:,} are accepted: each new token is looked up in "
                                          "them at every step", "stop_token_ids")


def _logit_bias(bias: Any) -> None:
    """95,000 entries (a large vocabulary's, within the body's bound): 51 ms to read on the event
    loop; at n=16, 0.4 s of the engine's step loop each time its batch changes and 16 ms a step."""
    if isinstance(bias, dict) and len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, "too_costly", f"logit_bias holds {len(bias):,} tokens and at most {MAX_LOGIT_BIAS:,} "
                                          "are accepted: to allow only a few tokens, name them in "
                                          "allowed_token_ids", "logit_bias")


def _allowed_token_ids(ids: Any) -> None:
    """Duplicates cost the engine a mask write each, once per choice (520,000 of one id held its
    steps for a second); without them the list is bounded by the vocabulary (vLLM checks each id)."""
    ids = [_int(i) for i in ids] if isinstance(ids, list) else []
    if len(set(ids)) < len(ids):
        raise ApiError(400, "invalid_value", f"allowed_token_ids holds {len(ids) - len(set(ids)):,} duplicate ids; "
                                             "name each id once", "allowed_token_ids")


def _repetition_detection(params: Any) -> None:
    size = _int(params.get("max_pattern_size")) if isinstance(params, dict) else None
    if size is not None and size > MAX_PATTERN_SIZE:
        raise ApiError(400, "too_costly", f"repetition_detection.max_pattern_size is {size:,} and at most "
                                          f"{MAX_PATTERN_SIZE} is accepted: every pattern size up to it is searched "
                                          "for at every step", "repetition_detection")


def _prompt_logprobs(kind: str, data: dict) -> None:
    """Each of `n` choices works out and returns the prompt's logprobs again (16 choices of a
    2,000-token prompt at 20 logprobs: seconds of the pool's event loop and 44 MB of answer)."""
    if kind == "chat":  # chat's top_logprobs defaults to 0: an echo alone asks for prompt logprobs
        echoed = read_true(data.get("echo")) and ("top_logprobs" not in data or data["top_logprobs"] is not None)
    else:
        echoed = read_true(data.get("echo")) and data.get("logprobs") is not None
    n = _int(data.get("n"))
    if (data.get("prompt_logprobs") is not None or echoed) and n is not None and n > 1:
        field = "prompt_logprobs" if data.get("prompt_logprobs") is not None else "echo"
        raise ApiError(400, "too_costly", f"{field} with n={n}: each choice would return the prompt's logprobs "
                                          "again; ask for them with n=1", field)


def _truncation(kind: str, data: dict, max_model_len: int) -> None:
    """With `truncate_prompt_tokens` and no `truncation_side`, vLLM tokenizes the whole prompt
    before it cuts it (a 1 MiB prompt: 1.3 to 4.4 s of the renderer's one thread, which every
    request of the replica waits for); with a side it cuts the text first."""
    if data.get("truncate_prompt_tokens") is None or data.get("truncation_side") is not None:
        return
    chars = _text_length(data.get("messages") if kind == "chat" else data.get("prompt"))
    if chars > PROMPT_CHARS_PER_TOKEN * max_model_len:
        raise ApiError(400, "too_costly", f"the prompt is {chars:,} characters, far beyond max_model_len "
                                          f"{max_model_len}: set truncation_side ('left' keeps its end, as "
                                          "truncate_prompt_tokens does without one) so that it is cut before it "
                                          "is tokenized", "truncation_side")


def _parts(messages: Any, max_model_len: int) -> None:
    """Each message and content part is validated, copied and rendered before any token is
    counted (30,000 in 1 MiB: 0.5 to 1.4 s of the event loop), and each renders to a token at
    least: more than the context holds can only be refused or cut away."""
    if not isinstance(messages, list):
        return
    parts = len(messages) + sum(len(m["content"]) for m in messages
                                if isinstance(m, dict) and isinstance(m.get("content"), list))
    if parts > max_model_len:
        raise ApiError(400, "too_costly", f"messages hold {parts:,} messages and content parts, more than "
                                          f"max_model_len {max_model_len} holds tokens; send fewer", "messages")


def _int(value: Any) -> int | None:
    """A whole number as vLLM's pydantic models read one (16, 16.0, "16"), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("+-").isdecimal() and len(value) < 20:
        return int(value.strip())
    return value if isinstance(value, int) else None


def read_true(value: Any) -> bool:
    """Whether pydantic would read a value as true (any spelling it might accept counts)."""
    return bool(value) and not (isinstance(value, str) and value.strip().lower() in ("false", "0", "no", "off", "f", "n"))


def _text_length(value: Any) -> int:
    """The characters of every string in a prompt or a list of messages."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total
