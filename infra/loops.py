"""Background loops, owned and stopped one way.

Each loop runs one step every interval. A step that fails is logged (once when a streak of
failures begins, once when it ends) and the loop goes on: a loop never dies silently and
never floods the log. `stop` cancels every loop of the owner and waits for them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

log = logging.getLogger("poolserve.loops")


class Loops:
    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._tasks: dict[str, asyncio.Task] = {}

    def start(self, name: str, step: Callable[[], Awaitable[None]], interval_s: float,
              first_delay_s: float | None = None) -> None:
        """Run `step` every `interval_s` (first after `first_delay_s`, default: at once)."""
        if name in self._tasks:
            return
        self._tasks[name] = asyncio.get_running_loop().create_task(
            self._run(name, step, interval_s, first_delay_s or 0.0), name=f"{self._owner}: {name}")

    @property
    def running(self) -> list[str]:
        return [n for n, t in self._tasks.items() if not t.done()]

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, name: str, step: Callable[[], Awaitable[None]], interval_s: float, delay_s: float) -> None:
        failing = False
        if delay_s:
            await asyncio.sleep(delay_s)
        while True:
            try:
                await step()
            except asyncio.CancelledError as e:
                if asyncio.current_task().cancelling():
                    raise
                # another task's cancellation, met by the step: a failure like any other
                failing = self._failed(name, e, interval_s, failing)
            except Exception as e:  # noqa: BLE001 - a failed step is logged; the loop goes on
                failing = self._failed(name, e, interval_s, failing)
            else:
                if failing:
                    log.info("%s: %s works again", self._owner, name)
                failing = False
            if asyncio.current_task().cancelling():  # the step swallowed its cancellation (3.11's wait_for can)
                raise asyncio.CancelledError
            await asyncio.sleep(interval_s)

    def _failed(self, name: str, e: BaseException, interval_s: float, failing: bool) -> bool:
        """Log the first failure of a streak; the loop is failing from now on."""
        if not failing:
            log.warning("%s: %s failed (%s: %s); retrying every %gs", self._owner, name, type(e).__name__, e,
                        interval_s, exc_info=not isinstance(e, (TimeoutError, ConnectionError, OSError)))
        return True
