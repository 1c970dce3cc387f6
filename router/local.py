"""A pool served in this very process, shaped as its Serve handle.

A pool replica answers its own HTTP (`deployments.pool_ingress`): the route runs in the pool's
process and reaches its gate without crossing to another replica. `LocalPool` gives the route
the same face a deployment handle has (`pool.method.remote(...)`), so one route serves both:
`generate` returns the pool's own stream, which `cancel()` closes as Serve cancels a call.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, AsyncGenerator


class LocalStream:
    """One call's stream from the pool in this process. Cancelling closes it: a stream the
    caller was awaiting when its task was cancelled has run its `finally` already; one that
    sits at a `yield` (its caller left between items) is closed in a task of its own."""

    def __init__(self, gen: AsyncGenerator[Any, None]) -> None:
        self._gen = gen
        self._closing: asyncio.Task | None = None

    def __aiter__(self) -> "LocalStream":
        return self

    def __anext__(self):
        return self._gen.__anext__()

    def cancel(self) -> None:
        if self._closing is None and not self._gen.ag_running and self._gen.ag_frame is not None:
            self._closing = asyncio.get_running_loop().create_task(self._gen.aclose())


class _Method:
    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        result = self._fn(*args, **kwargs)
        if inspect.isasyncgen(result):
            return LocalStream(result)
        if inspect.isawaitable(result):
            return result
        return _ready(result)


async def _ready(value: Any) -> Any:
    return value


class LocalPool:
    """`target`'s methods as a handle's: `.remote(...)` returns an awaitable, or a
    `LocalStream` for a generator."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def options(self, **_: Any) -> "LocalPool":
        return self

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(getattr(self._target, name))
