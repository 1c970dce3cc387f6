"""A pool replica that answers its own HTTP: its `PoolServer` and a `Router` in one process.

A request to a pool's prefix (`/online/v1/...`) reaches one of that pool's replicas directly:
the route (authentication, quota, pricing, borrowing, shedding) runs in the pool's process
and hands the call to its gate in-process, with no router replica and no second actor hop
between the client and the engine (bench/notes.md measured what those hops cost). The pools
never share a process, so a flood of batch requests parses, counts and waits in the offline
pool's replicas, not in front of chat. Calls from elsewhere still come by handle: borrowed
work from another pool's route, the control application's `/v1/...` requests for a tenant's
default pool, and calibration sweeps.
"""

from __future__ import annotations

from typing import Any

from infra.handles import resolve
from pools.server import PoolServer, PoolSettings
from router.app import Router, RouterSettings
from router.ingress import PoolEndpoints
from router.local import LocalPool


class PoolIngress(PoolEndpoints, PoolServer):
    async def __init__(self, llm_config: Any = None, *, settings: PoolSettings, router: RouterSettings,
                       prefix: str, peers: dict[str, Any], controller: Any = None, ledger: Any = None,
                       engine: Any = None, counter: Any = None) -> None:
        """`peers`: the other pools (handles or `Lookup`s); `counter`: the prompt counter
        (vLLM's renderer for the pool's model unless a test passes one)."""
        controller = resolve(controller)
        await PoolServer.__init__(self, llm_config, settings=settings, controller=controller, engine=engine)
        if counter is None:
            from pools.llm import PromptRenderer

            counter = PromptRenderer(llm_config)
        pools = {name: resolve(p) for name, p in peers.items()} | {settings.name: LocalPool(self)}
        self.prefix = prefix
        self.router = Router(router, pools, controller, resolve(ledger), counter)
        await self.router.warm()

    async def close(self) -> None:
        try:
            if (router := self.__dict__.get("router")) is not None:
                await router.close()
        finally:
            await PoolServer.close(self)
