"""Virtual time for tests of timing logic: an event loop whose clock jumps to its next timer
whenever nothing is ready to run. Sleeps and timeouts then last exactly as long on any host,
however slow or busy (on a loaded CI host the real clock's late wake-ups changed what such
tests measured)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace, ModuleType
from typing import Any, Awaitable, Callable


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        super().__init__()
        self._now = 0.0

    def time(self) -> float:
        return self._now

    def _run_once(self) -> None:
        if not self._ready and self._scheduled:
            self._now = max(self._now, self._scheduled[0].when())
        super()._run_once()


def run(main: Callable[[], Awaitable[Any]], monkeypatch=None, *modules: ModuleType) -> Any:
    """`main()` on virtual time; each of `modules` reads the loop's clock as `time.monotonic()`."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        for module in modules:
            monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=runner.get_loop().time))
        return runner.run(main())
