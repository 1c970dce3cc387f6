"""A pool replica answering its own HTTP (`deployments.pool_ingress`): the route runs in the
pool's process and reaches its gate without a handle. The promises of the router hold on this
path too: seeded schedules of clients that leave at any await, checked after each schedule:
every request's books close once, no slot outlives its request, the gate ends empty."""

from __future__ import annotations

import asyncio
import json
import os
import random
from types import SimpleNamespace

import httpx
import pytest

from deployments.pool_ingress import PoolIngress
from pools.control import LimitsDirective
from pools.gate import Ceilings, QueuePolicy
from pools.server import PoolSettings
from pools.types import PriorityClass, SafeRange
from router.app import RouterSettings
from router.config import RouterConfig
from router.ingress import POOL_ROUTES, make_app
from router.leases import LedgerService
from router.local import LocalPool
from router.policy import PoolRoute
from router.quota import Quota
from tests.unit.router_harness import TENANTS, Remote, WordCounter, auth, scope
from tests.unit.test_pool_server import FakeEngine

RANGE = SafeRange((1, 2, 4), 1, 4, 100, 100_000)
SCHEDULES = int(os.environ.get("POOLSERVE_SCHEDULES", "1")) * 200


class TickEngine(FakeEngine):
    """A deterministic engine: `max_tokens` chunks, one per turn of the event loop, then the
    usage chunk; whole responses after as many turns. It never sleeps on the clock, so a
    schedule that cancels a client after k turns replays exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def generate(self, call):
        self.calls += 1
        if getattr(call.body, "prompt", None) == "refuse":
            return self._error()
        return self._ticks(call.body)

    async def _error(self):
        """What vLLM's OpenAI layer answers when it gives up on a request: an error response in
        place of the answer (`RayLLMEngine` reads one after the engine's work as a failure,
        and one made of a cancellation as that cancellation; the route holds for any engine)."""
        await asyncio.sleep(0)
        yield SimpleNamespace(error=SimpleNamespace(message="Client disconnected", code=400, type="BadRequest"))
        await asyncio.sleep(0)

    async def _ticks(self, body):
        for i in range(body.max_tokens):
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                if body.stream:
                    raise
                # vLLM's whole-answer generators catch the cancellation and answer an error
                yield SimpleNamespace(error=SimpleNamespace(message="Client disconnected", code=400, type="BadRequest"))
                return
            if body.stream:
                yield [f'data: {{"choices":[{{"text":"t{i}"}}]}}\n\n']
        usage = SimpleNamespace(prompt_tokens=3, completion_tokens=body.max_tokens)
        if body.stream:
            yield ['data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":%d}}\n\n' % body.max_tokens,
                   "data: [DONE]\n\n"]
        else:
            yield SimpleNamespace(usage=usage, model_dump=lambda: {"choices": [{"text": "x"}], "usage": {
                "prompt_tokens": 3, "completion_tokens": body.max_tokens}})


class Controller:
    """Views and reports as the autoscale controller answers them: limits unchanged."""

    def __init__(self) -> None:
        self.views = Remote(lambda: {})
        self.report = Remote(lambda stats: LimitsDirective(stats.gate.limits, stats.safe_range))


async def make_ingress(max_queued: int = 3, start_seqs: int = 2, engine: TickEngine | None = None,
                       **router_config) -> tuple[PoolIngress, TickEngine]:
    settings = PoolSettings(
        name="p", start_seqs=start_seqs, safe_range=RANGE, ceilings=Ceilings(4, 100_000),
        queue=QueuePolicy(max_queued=max_queued, max_queued_tokens=100_000), report_interval_s=60,
        latency_window_s=10, stream_batching_ms=0,
        fingerprint_base={"model": "m", "dtype": "float32", "quantization": "none", "max_model_len": 64,
                          "max_num_seqs": 4, "max_num_batched_tokens": 64, "kv_cache_gb": 1.0}, warmup_requests=0)
    router = RouterSettings("m", 64, RouterConfig(**router_config), TENANTS,
                            (PoolRoute("p", "p", start_seqs, PriorityClass.STANDARD, queue_slots=max_queued,
                                       max_num_seqs=4),))
    engine = engine or TickEngine()
    ingress = PoolIngress.__new__(PoolIngress)
    await ingress.__init__(settings=settings, router=router, prefix="p", peers={}, controller=Controller(),
                           ledger=LedgerService({t.name: Quota(**t.quota.model_dump()) for t in TENANTS}),
                           engine=engine, counter=WordCounter())
    return ingress, engine


def http_app(ingress: PoolIngress):
    app = make_app()
    for verb, path, name in POOL_ROUTES:
        getattr(app, verb)(path, name=name)(getattr(ingress, name))
    return app


def test_the_route_reaches_the_gate_in_the_same_process():
    async def go():
        ingress, engine = await make_ingress()
        assert isinstance(ingress.router._pools["p"], LocalPool)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=http_app(ingress)), base_url="http://p") as c:
            streamed = await c.post("/v1/completions", headers=auth("b"),
                                    json={"prompt": "a b c", "max_tokens": 3, "stream": True})
            whole = await c.post("/v1/chat/completions", headers=auth("b"),
                                 json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            models = await c.get("/v1/models", headers=auth("b"))
        await ingress.close()
        return streamed, whole, models, ingress, engine

    streamed, whole, models, ingress, engine = asyncio.run(go())
    assert streamed.status_code == 200 and streamed.text.count('"text"') == 3 and streamed.text.endswith(
        "data: [DONE]\n\n")
    assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == 2
    assert streamed.headers["x-poolserve-pool"] == "p" and "queue;dur=" in streamed.headers["server-timing"]
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "m"
    assert engine.calls == 2
    stats = ingress._gate.gate.stats()
    assert stats.active == 0 and stats.admitted == stats.completed == 2


def test_a_refusal_on_this_path_names_the_field():
    async def go():
        ingress, engine = await make_ingress()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=http_app(ingress)), base_url="http://p") as c:
            r = await c.post("/v1/completions", headers=auth("b"), json={"prompt": "a", "max_tokens": 0})
            unknown = await c.post("/v1/completions", headers={"Authorization": "Bearer nope"},
                                   json={"prompt": "a", "max_tokens": 1})
        await ingress.close()
        return r, unknown, engine

    r, unknown, engine = asyncio.run(go())
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    assert unknown.status_code == 401
    assert engine.calls == 0


async def _client(app, body: dict, out: dict) -> None:
    """One HTTP exchange over ASGI; what the server sent goes into `out`."""
    raw, sent = json.dumps(body).encode(), []

    async def receive():
        if sent:
            await asyncio.Event().wait()  # no more body; a disconnect never comes on its own
        sent.append(1)
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message):
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
        elif message["type"] == "http.response.body":
            out["body"] = out.get("body", b"") + message.get("body", b"")
            out["complete"] = not message.get("more_body", False)

    await app(scope("/v1/completions", "b"), receive, send)


async def _schedule(seed: int) -> tuple[PoolIngress, list[dict], list[bool]]:
    """Eight clients at once against a pool of 2 slots and 3 queue places; each may leave after
    a random number of turns of the loop, anywhere on the path (body, count, gate, stream)."""
    rng = random.Random(seed)
    ingress, _ = await make_ingress()
    app = http_app(ingress)
    outs, tasks, leaves = [], [], []
    for _ in range(8):
        body = {"prompt": "x " * rng.randint(1, 5), "max_tokens": rng.randint(1, 6), "stream": rng.random() < 0.5}
        outs.append({})
        tasks.append(asyncio.get_running_loop().create_task(_client(app, body, outs[-1])))
        leaves.append(rng.random() < 0.5)
    after = {i: rng.randint(0, 40) for i, leave in enumerate(leaves) if leave}
    for turn in range(41):
        for i in [i for i, k in after.items() if k == turn]:
            tasks[i].cancel()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks, return_exceptions=True)
    for _ in range(5):  # streams closed in tasks of their own, done callbacks
        await asyncio.sleep(0)
    await ingress.close()
    return ingress, outs, leaves


@pytest.mark.parametrize("block", range(4))
def test_clients_leaving_at_any_await_leave_nothing_behind(block):
    for seed in range(block * SCHEDULES // 4, (block + 1) * SCHEDULES // 4):
        ingress, outs, leaves = asyncio.run(_schedule(seed))
        stats, router = ingress._gate.gate.stats(), ingress.router
        where = f"seed {seed} (POOLSERVE_SEED={seed} replays it)"
        assert stats.active == 0 and stats.queued == 0, where
        # each admitted ticket ended once: finished, or cancelled (as a waiting one may be)
        assert stats.completed <= stats.admitted <= stats.completed + stats.cancelled, where
        assert router._loads.inflight("p") == 0, where
        assert router._quota._book.lease("b").slots_used == 0, where
        for out, left in zip(outs, leaves):
            if not left:  # a client that stayed got a whole answer or a refusal that says why
                assert out.get("complete") and out["status"] in (200, 429), (where, out)
                if out["status"] == 429:
                    assert json.loads(out["body"])["error"]["code"] in ("queue_full", "evicted"), where


def test_a_client_that_leaves_a_whole_answer_mid_generation_keeps_its_charge():
    """vLLM turns the cancellation of a whole answer into an error response, which the route
    took for a refusal before any work: the tenant's tokens were refunded in full, so leaving
    just before the end got answers past the quota."""
    async def go():
        ingress, engine = await make_ingress()
        settled = []
        real = ingress.router._quota.finish
        ingress.router._quota.finish = lambda charge, used: (settled.append(used), real(charge, used))[1]
        out = {}
        task = asyncio.get_running_loop().create_task(_client(http_app(ingress), {"prompt": "a b", "max_tokens": 40},
                                                              out))
        for _ in range(30):  # admitted, and the engine is generating
            await asyncio.sleep(0)
        assert engine.calls == 1 and not task.done()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(5):
            await asyncio.sleep(0)
        stats = ingress._gate.gate.stats()
        await ingress.close()
        return settled, stats

    settled, stats = asyncio.run(go())
    assert settled == [None], "the charge stands: the engine worked for a client that left"
    assert stats.active == 0


def test_a_stream_whose_client_left_before_the_first_byte_frees_its_slot():
    """The route returned its streaming response and the client left before it was sent: the
    pool's stream sits at a `yield` in this very process, and nobody will iterate it again. Its
    slot comes back at once, not when the garbage collector finds the stream (the response is
    still referenced here, as a server's frames may hold it)."""
    from starlette.requests import Request

    async def go():
        ingress, _ = await make_ingress()
        raw = json.dumps({"prompt": "a b", "max_tokens": 5, "stream": True}).encode()

        async def receive():
            return {"type": "http.request", "body": raw, "more_body": False}

        request = Request(scope("/v1/completions", "b"), receive)
        task = asyncio.get_running_loop().create_task(ingress.completions_here(request))
        response = await task  # never sent: its body iterator never runs
        held = ingress._gate.gate.stats().active
        for _ in range(3):
            await asyncio.sleep(0)  # the task's done callback, then the stream's close
        after = ingress._gate.gate.stats()
        await ingress.close()
        return response, held, after, ingress

    response, held, after, ingress = asyncio.run(go())
    assert response.status_code == 200 and held == 1
    assert after.active == 0 and after.admitted == after.cancelled == 1 and after.completed == 0
    assert ingress.router._quota._book.lease("b").slots_used == 0


def test_a_local_stream_is_closed_only_where_closing_is_safe():
    from router.local import LocalStream

    log = []

    async def pool():
        try:
            yield 1
            await asyncio.sleep(3600)
            yield 2
        finally:
            log.append("closed")

    async def go():
        parked = LocalStream(pool())
        assert await parked.__anext__() == 1
        parked.cancel()  # at a yield: closed in a task of its own
        await asyncio.sleep(0)
        first = list(log)
        running = LocalStream(pool())
        await running.__anext__()
        waiting = asyncio.get_running_loop().create_task(running.__anext__())
        await asyncio.sleep(0)
        running.cancel()  # inside an await: its caller's cancellation closes it, not this
        await asyncio.sleep(0)
        second = list(log)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        unstarted = LocalStream(pool())
        unstarted.cancel()  # never started: nothing to run
        await asyncio.sleep(0)
        return first, second, list(log)

    first, second, last = asyncio.run(go())
    assert first == ["closed"] and second == ["closed"] and last == ["closed", "closed"]


def test_an_answer_refused_by_the_engine_frees_its_slot_at_once():
    """The engine's first item was an error (vLLM answers a request it gave up on with one): the
    route answers with it and stops reading the pool's stream, which sits at a `yield` in this
    process. The route closes it: the slot is back at once, not whenever the garbage collector
    finds the stream."""
    async def go():
        ingress, _ = await make_ingress()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=http_app(ingress)), base_url="http://p") as c:
            r = await c.post("/v1/completions", headers=auth("b"), json={"prompt": "refuse", "max_tokens": 3})
        for _ in range(3):
            await asyncio.sleep(0)
        stats = ingress._gate.gate.stats()
        await ingress.close()
        return r, stats

    r, stats = asyncio.run(go())
    assert r.status_code == 400 and "Client disconnected" in r.json()["error"]["message"]
    assert stats.active == 0 and stats.admitted == stats.cancelled == 1 and stats.completed == 0


def test_a_pool_replica_says_whether_its_own_views_are_fresh():
    """It decides borrowing and shedding for the requests it answers from its own views, so its
    health is its own, not the control router's."""
    async def go():
        ingress, _ = await make_ingress()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=http_app(ingress)), base_url="http://p") as c:
            r = await c.get("/healthz")
        views = ingress.router._loads.views_fresh()
        await ingress.close()
        return r, views

    r, views = asyncio.run(go())
    assert r.status_code == 200 and r.json() == {"status": "ok", "pools": views} and "p" in views
