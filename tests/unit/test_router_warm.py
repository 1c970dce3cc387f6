"""The Serve router's constructor warms what a first request would otherwise pay for."""

from __future__ import annotations

import asyncio

from tests.unit.router_harness import WordCounter, make_router


class CountingCounter(WordCounter):
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def count(self, kind, body):
        self.calls.append(kind)
        return await super().count(kind, body)


def test_warming_renders_each_kind_and_starts_the_loops():
    async def go():
        router, _ = make_router()
        counter = router._pricer._counter = CountingCounter()
        await router.warm()
        running = router._loops.running
        await router.close()
        return counter.calls, running, router._loops.running

    calls, running, after = asyncio.run(go())
    assert calls == ["chat", "completions"]
    assert set(running) == {"pool views", "quota sync"} and after == []
