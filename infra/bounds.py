"""An await bounded in time, the one way every bound in poolserve is written.

Python 3.11's `asyncio.wait_for` returns a result that completes in the same loop turn as its
caller's cancellation, and drops the cancellation: a route went on for a client that had left.
`asyncio.timeout` keeps the cancellation, but its TimeoutError is also what an awaited call
raises of its own (an OSError of ETIMEDOUT is one), and it hands back the value that work which
swallows its cancellation answers with (vLLM's whole answers: "Client disconnected") as if in
time. `Overdue` is this bound's alone, whatever the work made of its cancellation.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

T = TypeVar("T")


class Overdue(TimeoutError):
    """The bound passed first; the awaited work was cancelled."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"not done within {seconds:g} s")
        self.seconds = seconds


async def within(seconds: float, awaitable: Awaitable[T]) -> T:
    """`awaitable`'s result, or `Overdue` once `seconds` passed: one wait of an `Idle` bound."""
    bound = Idle(seconds)
    try:
        return await bound.wait(awaitable)
    finally:
        bound.close()


class Idle:
    """A bound on each of a task's waits in a loop (a stream's next item) with one timer, re-armed
    only when it finds the wait it would end younger than the bound: a timer per wait
    (`asyncio.timeout`) cost a relayed stream about 7 µs a chunk. `close()` it when the loop
    ends (a pending timer keeps it alive)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._since: float | None = None  # when the current wait began; None between waits
        self._task: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._fired = False

    async def wait(self, awaitable: Awaitable[T]) -> T:
        """`awaitable`'s result, or `Overdue` once it waited `seconds`."""
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        self._task, self._since, self._fired = task, loop.time(), False
        if self._timer is None:
            self._timer = loop.call_at(self._since + self.seconds, self._due)
        cancelling = task.cancelling()
        try:
            result = await awaitable
        except BaseException as e:
            # after the bound fired, whatever the work made of its cancellation (raised it, or
            # another error) is Overdue, unless the task's own cancellation (its client left) came
            # with it, as asyncio.timeout tells
            if not self._fired:
                raise
            if task.uncancel() > cancelling:
                raise asyncio.CancelledError from (None if isinstance(e, asyncio.CancelledError) else e)
            raise Overdue(self.seconds) from (None if isinstance(e, asyncio.CancelledError) else e)
        finally:
            self._since = None
        if self._fired:  # the work answered its cancellation with a value (vLLM's "Client disconnected")
            if task.uncancel() <= cancelling:
                raise Overdue(self.seconds)
            raise asyncio.CancelledError  # the task's own cancellation, swallowed with ours
        return result

    def _due(self) -> None:
        self._timer = None
        if self._since is None:  # between waits: the next one arms it
            return
        loop = asyncio.get_running_loop()
        if (due := self._since + self.seconds) > loop.time():
            self._timer = loop.call_at(due, self._due)
            return
        self._fired = True
        self._task.cancel()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
