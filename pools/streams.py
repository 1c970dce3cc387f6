"""The engine's streams as a pool replica reads them: a stream's chunks sent on in lists
(`batched`), a whole answer whose failure after the engine's work is told from the input's
refusal (`mark_output`, `whole_answer`), and the error an engine item carries in an answer's
place (`engine_error`, for the route and the calibration sweep). No vLLM import: the engine's
client and its outputs are read by their attributes."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
from types import SimpleNamespace
from typing import Any, AsyncIterator

from pools.types import Usage, error_status


class EngineFailed(Exception):
    """A whole answer the serving layer failed on as it fails on a bad input, after the engine
    had generated it (`whole_answer`): no refusal, whose charge is refunded, but a failure,
    charged what the engine did (`usage`, as its output counted it)."""

    def __init__(self, message: str, usage: Usage | None) -> None:
        super().__init__(message)
        self.usage = usage


class _Output:
    """The engine's last output for one whole answer (vLLM's `RequestOutput`), None until one
    came. A whole answer asks for its final output only, which counts every token."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: Any = None

    def usage(self) -> Usage | None:
        out = self.last
        try:
            prompt = len(out.prompt_token_ids or ()) + len(getattr(out, "encoder_prompt_token_ids", None) or ())
            return Usage(prompt, sum(len(o.token_ids) for o in out.outputs))
        except (AttributeError, TypeError):
            return None


_OUTPUT: contextvars.ContextVar[_Output | None] = contextvars.ContextVar("poolserve_engine_output", default=None)


def mark_output(client: Any) -> None:
    """Make `client.generate` (the engine client vLLM's serving layers call) keep, for a whole
    answer read through `whole_answer` in the same task, the engine's output for it. A whole
    answer's one item comes after all of its generation, so "no item yet" is not "no work
    yet": vLLM's serving layer can fail after the last token (joining an echoed message's
    parts raised KeyError), which read as a refusal and refunded the generation."""
    generate = client.generate

    def marking(*args: Any, **kwargs: Any) -> Any:
        stream = generate(*args, **kwargs)
        seen = _OUTPUT.get()
        return stream if seen is None else _marked(stream, seen)

    client.generate = marking


async def _marked(stream: Any, seen: _Output) -> AsyncIterator[Any]:
    async with contextlib.aclosing(stream):  # closed with this one: vLLM aborts the request then
        async for output in stream:
            seen.last = output
            yield output


async def whole_answer(stream: AsyncIterator[Any], refusals: tuple[type[BaseException], ...]) -> AsyncIterator[Any]:
    """A whole answer's stream from the serving layer. What would read as the input's refusal
    (one of `refusals` raised, or an error object of a 4xx in the answer's place) is
    `EngineFailed` once the engine produced output for it; a server error stays what it was
    (a 503 the client may retry). An error the serving layer made of this task's cancellation
    ("Client disconnected") is that cancellation, not an answer."""
    seen = _Output()
    _OUTPUT.set(seen)  # read by `mark_output`'s wrapper, which the serving layer calls in this task
    try:
        async for item in stream:
            if (error := engine_error(item)) is not None:
                if (task := asyncio.current_task()) is not None and task.cancelling():
                    raise asyncio.CancelledError
                if seen.last is not None and error_status(error) < 500:
                    raise EngineFailed(error.message, seen.usage())
            yield item
    except refusals as e:
        if seen.last is None:
            raise  # before any output: the input's refusal (`pools.server`)
        raise EngineFailed(f"{type(e).__name__}: {e}", seen.usage()) from e
    finally:
        _OUTPUT.set(None)


def engine_error(item: Any) -> Any:
    """The error an engine item carries in an answer's place, else None: an error object of
    Ray LLM's serving layer, or the SSE error event vLLM's stream generator sends for what the
    engine raised as it took the request (first in the item's list)."""
    head = item[0] if isinstance(item, list) and item else item
    err = _error_event(head) if isinstance(head, str) else getattr(head, "error", None)
    return err if err is not None and hasattr(err, "message") else None


def _error_event(text: str) -> Any:
    """The error of an SSE error event (`data: {"error": {...}}`), else None."""
    if not text.startswith("data: {") or '"error"' not in text[:16]:
        return None
    try:
        err = json.loads(text[len("data: "):]).get("error")
    except ValueError:
        return None
    return SimpleNamespace(**{k: err.get(k) for k in ("message", "type", "param", "code")}) if isinstance(
        err, dict) and isinstance(err.get("message"), str) else None


async def batched(items: AsyncIterator[Any], interval_s: float) -> AsyncIterator[list[Any]]:
    """Stream items in lists: the first at once (it decides the time to first token), then
    whatever arrived in each `interval_s` (fewer, larger messages between replicas)."""
    if interval_s <= 0:
        async for item in items:
            yield [item]
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump() -> None:
        try:
            async for item in items:
                queue.put_nowait(item)
        except BaseException as e:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait(e)
        queue.put_nowait(end)

    reader = asyncio.get_running_loop().create_task(pump())
    try:
        first = True
        while True:
            batch = [await queue.get()]
            if not first:
                await asyncio.sleep(interval_s)
            first = False
            while not queue.empty():
                batch.append(queue.get_nowait())
            done = batch[-1] is end
            batch = [x for x in batch if x is not end]
            failed = next((i for i, x in enumerate(batch) if isinstance(x, BaseException)), None)
            if failed is not None:
                if failed:
                    yield batch[:failed]
                raise batch[failed]
            if batch:
                yield batch
            if done:
                return
    finally:
        reader.cancel()
