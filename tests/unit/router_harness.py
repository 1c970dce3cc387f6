"""A router with fakes at its edges, for unit tests over ASGI.

The pools, the controller and the ledger are what the router reaches through Serve handles:
here they are objects whose methods have a `.remote` that returns an awaitable, as Serve's
do. The ledger is the real `LedgerService`; the prompt counter counts words.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import httpx

from pools.control import PoolView
from pools.types import Admitted, CountedPrompt, Finished, PriorityClass, Usage
from router.app import RouterSettings
from router.ingress import ROUTES, Endpoints, make_app
from router.config import QuotaConfig, RouterConfig, TenantConfig
from router.leases import LedgerService
from router.policy import PoolRoute
from router.quota import Quota


def sha(k: str) -> str:
    return hashlib.sha256(k.encode()).hexdigest()


class Remote:
    """A handle method: `.remote(*args)` returns an awaitable, as a Serve handle's does."""

    def __init__(self, fn: Callable) -> None:
        self._fn = fn

    def remote(self, *args, **kwargs):
        result = self._fn(*args, **kwargs)
        if asyncio.iscoroutine(result):
            return result

        async def value():
            return result
        return value()


class Stream:
    """A pool's response generator: the items a script yields; `cancel()` as Serve's."""

    def __init__(self, script) -> None:
        self._it = script.__aiter__()
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self._it.__anext__()

    def cancel(self) -> None:
        self.cancelled = True


async def answer(call, hold: asyncio.Event | None = None, fail_after_first: bool = False):
    """A pool's normal answer: admitted, one chunk (or a whole response), finished."""
    yield Admitted("p", "r1", 0.0)
    if hold is not None:
        await hold.wait()
    if call.body.stream:
        yield ['data: {"choices":[{"text":"hi"}]}\n\n']
    else:
        yield SimpleNamespace(model_dump=lambda: {"choices": [{"text": "hi"}], "usage": {"total_tokens": 3}})
    if fail_after_first:
        raise RuntimeError("the replica died")
    yield Finished(Usage(2, 1), 0.01, 0.02)


@dataclass
class FakePool:
    script: Callable = answer
    calls: list = field(default_factory=list)
    streams: list = field(default_factory=list)

    def options(self, **kw):
        return self

    @property
    def generate(self) -> SimpleNamespace:
        def start(call):  # a streaming handle call returns its response generator at once
            self.calls.append(call)
            s = Stream(self.script(call))
            self.streams.append(s)
            return s
        return SimpleNamespace(remote=start)

    @property
    def describe(self) -> Remote:
        return Remote(lambda: {"pool": "p"})


class FakeController:
    def __init__(self, views: dict[str, PoolView] | None = None) -> None:
        self.views_now = views or {}
        self.views = Remote(lambda: self.views_now)


class WordCounter:
    """A prompt's tokens are its words (the real count is vLLM's renderer's)."""

    async def count(self, kind: str, body: Any) -> CountedPrompt:
        if kind == "chat":
            return CountedPrompt(sum(len(str(m.get("content") or "").split()) for m in body.messages) + 2)
        return CountedPrompt(len(body.prompt.split()) if isinstance(body.prompt, str) else len(body.prompt))


TENANTS = (
    TenantConfig(name="a", key_sha256=sha("key-a"), pools=("p",), quota=QuotaConfig(max_concurrent=1)),
    TenantConfig(name="b", key_sha256=sha("key-b"), pools=("p",)),
    TenantConfig(name="slow", key_sha256=sha("key-slow"), pools=("p",), quota=QuotaConfig(requests_per_min=1)),
)


def make_router(pool: FakePool | None = None, views: dict | None = None, **router_config) -> tuple[Endpoints, FakePool]:
    pool = pool or FakePool()
    settings = RouterSettings("m", 64, RouterConfig(**router_config), TENANTS,
                              (PoolRoute("p", "p", 4, PriorityClass.STANDARD, queue_slots=8, max_num_seqs=4),))
    quotas = {t.name: Quota(**t.quota.model_dump()) for t in TENANTS}
    router = Endpoints(settings, {"p": pool}, FakeController(views), LedgerService(quotas), WordCounter())
    return router, pool


def settles(router: Endpoints) -> list:
    """The used tokens each request's charge is settled with (None: unknown, the charge stands)."""
    settled, finish = [], router._quota.finish
    router._quota.finish = lambda charge, used: (settled.append(used), finish(charge, used))[1]
    return settled


def client(router: Endpoints) -> httpx.AsyncClient:
    """An HTTP client of the router's FastAPI app, served in-process over ASGI."""
    app = make_app()
    for verb, path, name in ROUTES:
        getattr(app, verb)(path, name=name)(getattr(router, name))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")


def scope(path: str, tenant: str) -> dict:
    """An ASGI HTTP scope of a POST to `path` with tenant's key, for driving an app by hand."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": [(b"authorization", f"Bearer key-{tenant}".encode()),
                                         (b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1), "server": ("router", 80)}


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer key-{tenant}"}
