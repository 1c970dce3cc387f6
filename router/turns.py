"""Turns at the router's own work, by priority.

Counting a prompt's tokens (vLLM's renderer: the chat template and the tokenizer, on a
thread pool that serves callers first come, first served) is the router's costliest step.
When hundreds of batch requests arrive at once, an interactive request that came a moment
later would otherwise wait behind every one of them before it even reaches its pool's gate.
`Turns` lets at most `width` requests do that work at once and hands each free turn to the
most important waiter (the lower `PriorityClass` value), first come first within a class.

A waiter that leaves is forgotten; one that leaves just after it was handed a turn passes
it on, so no turn is ever lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from typing import AsyncIterator


class Turns:
    def __init__(self, width: int) -> None:
        if width < 1:
            raise ValueError(f"width must be at least 1, got {width}")
        self._width = width
        self._busy = 0
        self._waiting: list[tuple[int, int, asyncio.Future]] = []
        self._order = itertools.count()
        self._left = 0  # waiters that left before their turn since the heap was last swept

    @property
    def busy(self) -> int:
        return self._busy

    @property
    def waiting(self) -> int:
        return sum(not f.done() for _, _, f in self._waiting)

    @contextlib.asynccontextmanager
    async def turn(self, priority: int) -> AsyncIterator[None]:
        if self._busy < self._width:  # a live waiter exists only while every turn is taken
            self._busy += 1
        else:
            handed = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiting, (priority, next(self._order), handed))
            try:
                await handed
            except BaseException:
                if handed.done() and not handed.cancelled():  # handed a turn, then left: pass it on
                    self._next()
                else:
                    handed.cancel()
                    self._forget()
                raise
        try:
            yield
        finally:
            self._next()

    def _forget(self) -> None:
        """A waiter left before its turn. Its entry goes when it reaches the top, or with all
        such entries at once when they outnumber the live ones: clients that give up and retry
        while every turn is taken must not grow the heap without bound."""
        self._left += 1
        if self._left > 64 and 2 * self._left > len(self._waiting):
            self._waiting = [w for w in self._waiting if not w[2].done()]
            heapq.heapify(self._waiting)
            self._left = 0

    def _next(self) -> None:
        """A turn ends: the most important live waiter takes it, or it goes back."""
        while self._waiting:
            _, _, handed = heapq.heappop(self._waiting)
            if handed.done():  # a waiter that left cancelled its future
                continue
            handed.set_result(None)
            return
        self._busy -= 1
