"""The router's promises over ASGI, with fake pools: every request's books close once, bad or
slow input is refused before it costs anything, and a tenant sees only its own figures."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from pools.control import PoolView
from router.ingress import make_app
from router.quota import Quota
from tests.unit import virtual_time
from tests.unit.router_harness import TENANTS, FakePool, answer, auth, client, make_router, scope, settles

CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


def books_closed(router) -> bool:
    """No request of this router is in flight, and tenant a's concurrency slot is back."""
    lease = router._quota._book.lease("a")
    return router._loads.inflight("p") == 0 and lease.slots_used == 0


def test_a_stream_whose_client_left_before_the_first_byte_still_settles():
    """The handler returned its streaming response, then the client left before the response
    was sent: the body never started, and the request's task ended. Its books close anyway."""
    async def go():
        router, _ = make_router()
        request = _request({**CHAT, "stream": True}, "a")
        task = asyncio.get_running_loop().create_task(router.route(request, "chat", "p"))
        response = await task  # never sent: its body iterator never runs
        await asyncio.sleep(0)  # the task's done callbacks run
        return router, response

    router, response = asyncio.run(go())
    assert response.status_code == 200 and books_closed(router)


def test_nested_json_is_a_400_naming_the_limit():
    async def go():
        router, _ = make_router(max_json_depth=16)
        async with client(router) as c:
            deep = '{"messages": ' + "[" * 5000 + "]" * 5000 + "}"
            r1 = await c.post("/p/v1/chat/completions", content=deep, headers=auth("b"))
            r2 = await c.post("/p/v1/chat/completions", content=json.dumps({**CHAT, "x": [[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]}),
                              headers=auth("b"))
            return r1, r2, router

    r1, r2, router = asyncio.run(go())
    for r in (r1, r2):
        assert r.status_code == 400 and r.json()["error"]["code"] == "json_too_deep"
        assert "max_json_depth" in r.json()["error"]["message"]
    assert books_closed(router)


def test_a_pool_failing_after_a_whole_answer_began_is_a_503_not_a_500():
    async def go():
        router, _ = make_router(FakePool(lambda call: answer(call, fail_after_first=True)))
        async with client(router) as c:
            r = await c.post("/p/v1/chat/completions", json=CHAT, headers=auth("a"))
        return r, router

    r, router = asyncio.run(go())
    assert r.status_code == 503 and r.json()["error"]["code"] == "pool_failed" and "retry-after" in r.headers
    assert books_closed(router)


def test_a_slow_body_times_out_and_holds_a_concurrency_slot_meanwhile():
    """The body is read after the request's slot is charged: a tenant at max_concurrent 1 that
    uploads slowly cannot start a second request meanwhile; the slow one ends in 408. On virtual
    time: a host slow enough to spend the 0.3 s before the second request was charged let the
    slow one time out first."""
    async def go():
        router, _ = make_router(body_timeout_s=0.3)
        app = make_app()
        app.post("/{prefix}/v1/chat/completions")(router.chat)
        sent = []

        async def receive():
            if not sent:
                sent.append(1)
                return {"type": "http.request", "body": b'{"messages": [', "more_body": True}
            await asyncio.sleep(3600)

        messages = []

        async def send(message):
            messages.append(message)

        asgi_scope = scope("/p/v1/chat/completions", "a")
        slow = asyncio.get_running_loop().create_task(app(asgi_scope, receive, send))
        await asyncio.sleep(0.05)
        async with client(router) as c:
            second = await c.post("/p/v1/chat/completions", json=CHAT, headers=auth("a"))
        await slow
        return messages[0]["status"], second, router

    status, second, router = virtual_time.run(go)
    assert status == 408
    assert second.status_code == 429 and second.json()["error"]["code"] == "concurrency_quota_exceeded"
    assert books_closed(router)


def test_a_tenant_out_of_requests_is_refused_before_its_body_is_read():
    async def go():
        router, _ = make_router()
        async with client(router) as c:
            first = await c.post("/p/v1/chat/completions", json=CHAT, headers=auth("slow"))
            second = await c.post("/p/v1/chat/completions", content=b"not even json", headers=auth("slow"))
        return first, second

    first, second = asyncio.run(go())
    assert first.status_code == 200
    assert second.status_code == 429 and second.json()["error"]["code"] == "requests_quota_exceeded"


def test_usage_shows_a_tenant_only_its_own_requests_in_flight():
    async def go():
        hold = asyncio.Event()
        router, _ = make_router(FakePool(lambda call: answer(call, hold=hold)))
        async with client(router) as c:
            running = asyncio.get_running_loop().create_task(
                c.post("/p/v1/chat/completions", json=CHAT, headers=auth("a")))
            while router._loads.inflight("p") == 0:
                await asyncio.sleep(0.01)
            other = (await c.get("/v1/usage", headers=auth("b"))).json()
            own = (await c.get("/v1/usage", headers=auth("a"))).json()
            hold.set()
            await running
        return other, own

    other, own = asyncio.run(go())
    assert other["inflight"] == {"p": 0} and own["inflight"] == {"p": 1}


def test_borrowing_stops_while_the_controllers_view_is_stale():
    from pools.types import PriorityClass
    from router.policy import BorrowRule, PoolRoute

    class Clock:
        t = 100.0

        def __call__(self):
            return self.t

    from tests.unit import router_harness as h
    from router.app import RouterSettings
    from router.config import RouterConfig
    from router.ingress import Endpoints
    from router.leases import LedgerService
    from router.quota import Quota

    clock = Clock()
    routes = (PoolRoute("off", "off", 2, PriorityClass.BATCH, BorrowRule("on", 0.5, 0.5, 0.0), 8, 4),
              PoolRoute("on", "on", 4, PriorityClass.INTERACTIVE, None, 8, 4))
    settings = RouterSettings("m", 64, RouterConfig(view_max_age_s=5), h.TENANTS, routes)
    router = Endpoints(settings, {"off": FakePool(), "on": FakePool()}, h.FakeController(),
                       LedgerService({t.name: Quota() for t in h.TENANTS}), h.WordCounter(), clock)
    router._loads.update_views({"off": PoolView("off", 1, 2, 2, 10, True), "on": PoolView("on", 1, 4, 0, 0, True)})
    assert router._plan("off", PriorityClass.BATCH, "t")[0].borrowed  # home saturated, lender idle: borrow
    clock.t += 6  # the controller stopped answering
    plan = router._plan("off", PriorityClass.BATCH, "t")
    assert len(plan) == 1 and not plan[0].borrowed


async def _lender_dies(call):
    raise ConnectionError("the lender's replica died")  # before any item, as a RayActorError would
    yield


async def _lender_never_picks_up(call):
    await asyncio.sleep(3600)
    yield


async def _lender_evicts(call):
    from pools.types import Arrived, Rejected

    yield Arrived("r9")
    await asyncio.sleep(0)
    yield Rejected(429, "evicted", "a more important request took its place", 3.0)


@pytest.mark.parametrize("lender", [_lender_dies, _lender_never_picks_up, _lender_evicts])
def test_a_borrowed_attempt_that_fails_goes_home_once(lender):
    """A lender that died or that no replica of picked the call up answered the client with the
    lender's 503 or 429 (a pool its key may not even use); home was never tried."""
    from pools.types import PriorityClass
    from router.app import RouterSettings
    from router.config import RouterConfig
    from router.ingress import Endpoints
    from router.leases import LedgerService
    from router.policy import BorrowRule, PoolRoute
    from starlette.requests import Request
    from tests.unit import router_harness as h

    async def go():
        routes = (PoolRoute("off", "off", 2, PriorityClass.BATCH, BorrowRule("on", 0.5, 0.5, 0.0), 8, 4),
                  PoolRoute("on", "on", 4, PriorityClass.INTERACTIVE, None, 8, 4))
        home, lender_pool = FakePool(), FakePool(lender)
        tenants = tuple(t.model_copy(update={"pools": ("off",)}) for t in h.TENANTS)
        settings = RouterSettings("m", 64, RouterConfig(reach_timeout_s=0.05), tenants, routes)
        r = Endpoints(settings, {"off": home, "on": lender_pool}, h.FakeController(),
                      LedgerService({t.name: Quota() for t in tenants}), h.WordCounter(), lambda: 100.0)
        r._loads.update_views({"off": PoolView("off", 1, 2, 2, 10, True), "on": PoolView("on", 1, 4, 0, 0, True)})
        assert r._plan("off", PriorityClass.BATCH, "t")[0].borrowed  # the clock stands: the views stay fresh
        raw, sent = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode(), []

        async def receive():
            if sent:
                await asyncio.sleep(3600)
            sent.append(1)
            return {"type": "http.request", "body": raw, "more_body": False}

        resp = await r.route(Request(scope("/off/v1/chat/completions", "b"), receive), "chat", "off")
        return resp, home, lender_pool, r

    resp, home, lender_pool, r = asyncio.run(go())
    assert resp.status_code == 200 and resp.headers["x-poolserve-pool"] == "off", resp.body
    assert len(home.calls) == 1 and len(lender_pool.calls) == 1
    assert r._loads.inflight("on") == 0 and r._loads.inflight("off") == 0


def _request(body: dict, tenant: str):
    from starlette.requests import Request

    raw = json.dumps(body).encode()
    done = []

    async def receive():
        if done:
            await asyncio.sleep(3600)
        done.append(1)
        return {"type": "http.request", "body": raw, "more_body": False}

    return Request(scope("/p/v1/chat/completions", tenant), receive)


def test_the_quota_is_synced_by_one_loop():
    """The router's loop syncs the quota every lease TTL; the quota client once started a second
    loop of its own at its first charge, which settled with the ledger twice as often. One loop
    settles each tenant at most once at its start and once per interval after it."""
    from router.leases import LedgerService

    class Counting(LedgerService):
        settles = 0

        async def settle(self, *args):
            Counting.settles += 1
            return await super().settle(*args)

    async def go():
        router, _ = make_router(lease_ttl_s=0.2)
        router._quota._ledger = Counting({t.name: Quota(**t.quota.model_dump()) for t in TENANTS})
        await router.warm()
        started = time.monotonic()
        async with client(router) as c:
            r = await c.post("/p/v1/completions", headers=auth("b"), json={"model": "m", "prompt": "hi", "max_tokens": 1})
            assert r.status_code == 200, r.text
        await asyncio.sleep(1.0)
        await router.close()
        return Counting.settles, time.monotonic() - started

    settles, seconds = asyncio.run(go())
    assert settles <= (1 + int(seconds / 0.2)) * len(TENANTS), (settles, seconds)


def test_an_unreachable_controller_is_a_503_for_operators_and_answers_are_typed():
    from pools.control import LendingResult, SloResult
    from tests.unit.router_harness import Remote, sha

    async def go():
        router, _ = make_router(admin_key_sha256=sha("admin"))
        admin = {"Authorization": "Bearer admin"}
        calls = []
        router.admin._controller.set_lending = Remote(lambda pool, on: calls.append((pool, on)))
        router.admin._controller.set_slo = Remote(lambda pool, slo: calls.append((pool, slo.ttft_p99_ms)))

        def away():
            from ray.exceptions import ActorUnavailableError

            raise ActorUnavailableError("ray::ServeReplica:poolserve:autoscale-controller is restarting", None)
        router.admin._controller.status = Remote(away)
        async with client(router) as c:
            down = await c.get("/admin/pools", headers=admin)
            lending = await c.put("/admin/pools/p/lending", headers=admin, json={"enabled": False})
            slo = await c.put("/admin/pools/p/slo", headers=admin, json={"ttft_p99_ms": 500, "tpot_p99_ms": 50})
            endless = await c.put("/admin/pools/p/slo", headers={**admin, "content-type": "application/json"},
                                  content=b'{"ttft_p99_ms": 1e999, "tpot_p99_ms": 50}')  # JSON's inf
        return down, lending, slo, calls, endless

    down, lending, slo, calls, endless = asyncio.run(go())
    assert endless.status_code == 400 and "ttft_p99_ms" in endless.text, endless.text
    assert down.status_code == 503 and float(down.headers["retry-after"]) > 0, down.text
    assert down.json()["error"]["code"] == "control_plane_unavailable" and "ray::" not in down.text
    assert LendingResult.model_validate(lending.json()) == LendingResult(pool="p", lending=False)
    assert SloResult.model_validate(slo.json()) == SloResult(pool="p", ttft_p99_ms=500, tpot_p99_ms=50)
    assert calls == [("p", False), ("p", 500)]


def test_a_stream_the_engine_refused_is_a_4xx_and_costs_nothing():
    """Ray LLM answers a streamed request that vLLM's serving refused with the error object in
    place of the first chunk: the route sent it as a 200 stream and kept the whole charge."""
    from types import SimpleNamespace

    from pools.types import Admitted, Finished

    err = SimpleNamespace(error=SimpleNamespace(message="the tools are invalid", code=400, type="BadRequestError"),
                          model_dump_json=lambda: '{"error": {"message": "the tools are invalid"}}')

    async def refusing(call):
        yield Admitted("p", "r1", 0.0)
        yield [err]
        yield Finished(None, None, 0.01)

    async def go():
        router, _ = make_router(FakePool(refusing))
        settled = settles(router)
        async with client(router) as c:
            r = await c.post("/p/v1/chat/completions", json={**CHAT, "stream": True}, headers=auth("a"))
        return r, router, settled

    r, router, settled = asyncio.run(go())
    assert r.status_code == 400 and r.json()["error"]["message"] == "the tools are invalid", r.text
    assert settled == [0] and books_closed(router)


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_failure_keeps_the_charge_where_an_input_error_refunds_it(stream):
    """vLLM answers a request whose generation failed (the engine died, a step raised) with a
    5xx error object, streamed or whole: the engine may have worked for it, so its usage is
    unknown and the charge stands. Only a 4xx, an input the engine refused, costs nothing."""
    from types import SimpleNamespace

    from pools.types import Admitted, Finished

    def failing(code):
        err = SimpleNamespace(error=SimpleNamespace(message="engine step failed", code=code, type="InternalError"),
                              model_dump_json=lambda: '{"error": {"message": "engine step failed"}}')

        async def script(call):
            yield Admitted("p", "r1", 0.0)
            yield [err] if stream else err
            yield Finished(None, None, 0.01)
        return script

    async def go(code):
        router, _ = make_router(FakePool(failing(code)))
        settled = settles(router)
        async with client(router) as c:
            r = await c.post("/p/v1/chat/completions", json={**CHAT, "stream": stream}, headers=auth("a"))
        return r, router, settled

    r, router, settled = asyncio.run(go(500))
    assert r.status_code == 500 and r.json()["error"]["message"] == "engine step failed", r.text
    assert settled == [None] and books_closed(router)
    r, router, settled = asyncio.run(go(400))
    assert r.status_code == 400 and settled == [0] and books_closed(router)
