"""An await bounded in time, the one way every bound in poolserve is written.

Python 3.11's `asyncio.wait_for` returns a result that completes in the same loop turn as its
caller's cancellation, and drops the cancellation: a route went on for a client that had left.
`asyncio.timeout` keeps the cancellation, but its TimeoutError is also what an awaited call
raises of its own (an OSError of ETIMEDOUT is one); `Overdue` is this bound's alone.
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
    """`awaitable`'s result, or `Overdue` once `seconds` passed."""
    try:
        async with asyncio.timeout(seconds) as bound:
            return await awaitable
    except TimeoutError:
        if not bound.expired():
            raise
        raise Overdue(seconds) from None
