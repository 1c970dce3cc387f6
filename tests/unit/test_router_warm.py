"""The Serve router's constructor warms what a first request would otherwise pay for."""

from __future__ import annotations

import asyncio

from pools.types import PriorityClass
from router.app import PoolRoute, RouterSettings
from router.config import RouterConfig
from router.ingress import make_app, route_class
from tests.unit.test_router_auth import TENANTS, FakeHandle


class CountingCounter:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def chat(self, messages, add_generation_prompt=True) -> int:
        self.calls.append("chat")
        return 3

    def text(self, prompt: str) -> int:
        self.calls.append("text")
        return 2


def test_the_serve_constructor_loads_request_models_and_template_and_starts_the_views():
    routed = route_class(make_app())
    counter = CountingCounter()
    settings = RouterSettings("m", "/nowhere", 64, RouterConfig(), TENANTS,
                              (PoolRoute("p", "p", 4, PriorityClass.STANDARD),))

    async def construct():
        router = routed.__new__(routed)
        await router.__init__(settings, {"p": FakeHandle()}, FakeHandle(), object(), counter=counter)
        started = router._refresher is not None
        router._refresher.cancel()
        return router, started

    router, started = asyncio.run(construct())
    assert set(router._models) == {"chat", "completions"}
    assert counter.calls == ["chat", "text"]
    assert started
