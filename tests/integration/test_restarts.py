"""Faults on the real stack: pool, router, controller and ledger replicas killed or restarted
mid-work. Every test here kills a replica, so all are marked `disruptive` and run last in the
session; `tests/integration/test_reliability.py` holds the rest of the reliability tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pools import reaper
from tests.integration.conftest import KEYS, wait_for

pytestmark = pytest.mark.integration


def _replica_actor(deployment: str):
    from ray.util.state import list_actors

    from deployments.app import replica_class

    [a] = [a for a in list_actors(filters=[("state", "=", "ALIVE")]) if a.class_name == replica_class(deployment)]
    return a


def _kill(actor) -> None:
    import ray

    ray.kill(ray.get_actor(actor.name, namespace=actor.ray_namespace), no_restart=True)


@pytest.mark.disruptive
def test_pool_replica_killed_mid_stream(stack):
    pool = "offline-batch"
    stack.wait_idle(pool)
    # The router's view lags the pool by a second or so: just after a flood it may still see the
    # offline pool saturated and lend the online one. This test needs the offline replica itself.
    stack.admin_client.set_lending("online-chat", False)
    try:
        _killed_mid_stream(stack, pool)
    finally:
        stack.admin_client.set_lending("online-chat", True)


def _stream(stack, path: str, events: list, started: threading.Event) -> str:
    """Stream a long completion from `path` into `events`; how it ended."""
    try:
        with httpx.stream("POST", f"{stack.base_url}{path}", timeout=120,
                          headers={"Authorization": f"Bearer {KEYS['batch']}"},
                          json={"prompt": "a long story", "max_tokens": 1900, "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200 and r.headers["x-poolserve-pool"] == "offline-batch"
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 3:
                        started.set()
        return "ended"
    except httpx.RemoteProtocolError:
        return "broken"


def _killed_mid_stream(stack, pool: str) -> None:
    """Two streams on the pool's replica when it dies: one the replica answers itself (its
    pool's path), one a router replica relays (the tenant's default pool, `/v1`)."""
    victim = _replica_actor(f"pool-{pool}")
    engines = reaper.engine_children(victim.pid)  # vLLM's engine core, a child of the replica
    assert engines, "no engine process found under the pool replica"
    direct, relayed = [], []
    flowing = [threading.Event(), threading.Event()]
    with ThreadPoolExecutor(2) as ex:
        ends = [ex.submit(_stream, stack, "/offline/v1/completions", direct, flowing[0]),
                ex.submit(_stream, stack, "/v1/completions", relayed, flowing[1])]
        assert all(e.wait(60) for e in flowing), "the streams did not start"
        _kill(victim)
        ended = [f.result() for f in ends]
    # The replica held the client's connection itself: it breaks mid-body (an incomplete chunked
    # response, an error for every HTTP client), or, when the engine process went first, the
    # replica ends the stream with vLLM's error event. Never an end that looks whole.
    if ended[0] == "broken":
        assert "data: [DONE]" not in direct, direct[-2:]
    else:
        assert direct[-1] == "data: [DONE]" and '"error"' in direct[-2], direct[-2:]
    # a router replica relayed the other: it ends the stream with an error event
    assert ended[1] == "ended" and relayed[-1] == "data: [DONE]"
    error = json.loads(relayed[-2][6:])
    assert error["error"]["code"] == "pool_failed" and "incomplete" in error["error"]["message"]
    # the killed replica's engine processes do not outlive it (each holds GBs of KV cache and a core)
    wait_for(lambda: not any(reaper.alive(*e) for e in engines), 30, what="the engine processes to stop")

    # While the replacement starts: through a router replica, a fast refusal with Retry-After;
    # on the pool's own path, Serve's entry holds the request for the replacement (no replica of
    # the pool is there to refuse it), which then answers it: never a hang, never a bare error.
    answers = []

    def served(path: str):
        t0 = time.monotonic()
        # Serve holds a request on the pool's own path (not the router's /v1) until the replacement
        # has started its engine, which takes as long as this machine takes: wait out any start
        held = not path.startswith("/v1/")
        try:
            r = httpx.post(f"{stack.base_url}{path}", headers={"Authorization": f"Bearer {KEYS['batch']}"},
                           json={"prompt": "after the crash", "max_tokens": 4}, timeout=600 if held else 60)
            answers.append((path, r.status_code, r.headers.get("retry-after"), time.monotonic() - t0, r.text[:200]))
            return r.status_code == 200
        except httpx.HTTPError as e:
            answers.append((path, 0, None, time.monotonic() - t0, repr(e)))
            return False
    wait_for(lambda: served("/v1/completions") & served("/offline/v1/completions"), 600, interval=3,
             what="a replacement replica to serve")
    print(f"\nduring the restart: {[(p, s, ra, round(t, 1), x[:80]) for p, s, ra, t, x in answers]}")
    for path, status, retry_after, took, text in answers[:-2]:
        if path == "/offline/v1/completions" and status == 200:
            continue  # held until the replacement answered it
        # 503 once the dead replica's reports are stale; 429 pool_busy in the seconds before that
        assert (status, retry_after is not None) in ((503, True), (429, True)), (path, status, text)
        assert "pool_unavailable" in text or "pool_busy" in text, text
        assert took < stack.resolved.config.router.reach_timeout_s + 10
    assert _replica_actor(f"pool-{pool}").actor_id != victim.actor_id
    assert stack.client("chat").chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "x"}], max_tokens=2).usage.completion_tokens >= 1


@pytest.mark.disruptive
def test_router_replica_killed(stack):
    """The pools answer their own paths: while the router replica is gone, chat goes on; the
    router's own paths come back with its replacement."""
    victim = _replica_actor("router")
    _kill(victim)

    def ask(path: str) -> int:
        try:
            return httpx.post(f"{stack.base_url}{path}", timeout=30, headers={"Authorization": f"Bearer {KEYS['chat']}"},
                              json={"prompt": "x", "max_tokens": 2}).status_code
        except httpx.HTTPError:
            return 0
    assert [ask("/online/v1/completions") for _ in range(3)] == [200] * 3
    wait_for(lambda: ask("/v1/completions") == 200, 180, interval=2, what="a new router replica")
    assert _replica_actor("router").actor_id != victim.actor_id


def _healthz(stack, prefix: str = "") -> dict[str, bool]:
    return httpx.get(f"{stack.base_url}{prefix}/healthz", timeout=10).json()["pools"]


def _restarted(stack, deployment: str, victim, ready) -> None:
    """Wait until Serve replaced the killed replica and `ready()` holds on the new one."""
    def up():
        try:
            return ready()
        except Exception:  # the old replica's callers see errors until the new one answers
            return False
    wait_for(up, 180, interval=1, what=f"a new {deployment} replica")
    assert _replica_actor(deployment).actor_id != victim.actor_id


@pytest.mark.disruptive
def test_restarted_controller_keeps_operator_state_and_stale_views_stop_borrowing(stack):
    admin = stack.admin_client
    slo = stack.resolved.config.pools["online-chat"].slo
    try:
        admin.pin("offline-batch", 8)
        admin.pin("online-chat", 8)
        admin.set_slo("online-chat", 1400, 140)
        admin.set_lending("offline-batch", False)  # nobody borrows the offline pool: a switch to remember
        before = admin.pools()
        stack.wait_idle("online-chat")

        # a controller that stops answering: every router marks its views stale within the
        # bound, and an offline burst then stays home although the online pool is idle
        victim = _replica_actor("autoscale-controller")
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            # Every router that takes the burst: the offline pool's replica answers it itself, and
            # its views went stale from its own last refresh, not the control router's.
            wait_for(lambda: not any(_healthz(stack).values()) and not any(_healthz(stack, "/offline").values()),
                     stack.resolved.config.router.view_max_age_s + 30, what="routers to mark the views stale")
            with ThreadPoolExecutor(max_workers=32) as ex:
                burst = list(ex.map(lambda _: _offline_request(stack), range(32)))
            assert all(status == 200 for status, _ in burst), burst
            assert {pool for _, pool in burst} == {"offline-batch"}, "borrowed on a stale view"
        finally:
            with contextlib.suppress(ValueError, ProcessLookupError):  # Serve's health check may have been first
                _kill(victim)
                os.kill(victim.pid, signal.SIGCONT)

        _restarted(stack, "autoscale-controller", victim, lambda: all(_healthz(stack).values()))
        after = admin.pools()
        for pool in ("online-chat", "offline-batch"):
            assert (after[pool].pinned, after[pool].slo, after[pool].lending) == \
                (before[pool].pinned, before[pool].slo, before[pool].lending), pool
        assert after["online-chat"].slo.ttft_p99_ms == 1400 and not after["offline-batch"].lending
        assert after["offline-batch"].pinned == after["online-chat"].pinned == 8
    finally:
        admin.set_lending("offline-batch", True)
        admin.set_slo("online-chat", slo.ttft_p99_ms, slo.tpot_p99_ms)
        admin.unpin("online-chat")
        admin.unpin("offline-batch")


def _offline_request(stack) -> tuple[int, str | None]:
    r = httpx.post(f"{stack.base_url}/offline/v1/completions", timeout=120,
                   headers={"Authorization": f"Bearer {KEYS['batch']}"},
                   json={"prompt": "summarise the queue", "max_tokens": 64, "ignore_eos": True})
    return r.status_code, r.headers.get("x-poolserve-pool")


@pytest.mark.disruptive
def test_restarted_ledger_keeps_the_buckets(stack):
    """`limited` may spend 1,200 tokens a minute (20 a second). A ledger that restarted with
    full buckets would let it spend the minute's quota again; this one carries on from where
    it was. (Slots out need no check here: each router's sync reports the slots it holds.)"""
    headers = {"Authorization": f"Bearer {KEYS['limited']}"}
    url = f"{stack.base_url}/online/v1/chat/completions"
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
            "ignore_eos": True}
    with ThreadPoolExecutor(max_workers=8) as ex:  # at once, so the bucket cannot refill meanwhile
        answers = list(ex.map(lambda _: httpx.post(url, headers=headers, json=body, timeout=120), range(8)))
    assert 429 in {r.status_code for r in answers}, [r.status_code for r in answers]

    def usage() -> tuple[float, float, dict]:
        t0 = time.time()
        r = httpx.get(f"{stack.base_url}/v1/usage", headers=headers, timeout=10)
        assert r.status_code == 200, r.text
        return t0, time.time(), r.json()

    rate = 1200 / 60  # a fresh ledger would say 1200
    sync_s = stack.resolved.config.router.lease_ttl_s

    def settled():
        """The ledger's figures once the router handed its lease back (its sync every
        `router.lease_ttl_s`): then the ledger holds the whole balance."""
        t0, t1, u = usage()
        return (t0, t1, u) if u["held_by_this_router"]["tokens"] == 0 else None

    def steady():
        """Settled twice, a sync apart, and nothing but the refill in between: no refund of a
        request that finished late is still on its way to the ledger."""
        first = wait_for(settled, 30, what="the router's lease to go back to the ledger")
        time.sleep(sync_s + 0.5)  # one sync of the router's later (a condition checked below)
        second = wait_for(settled, 30, what="the router's lease to go back to the ledger")
        was, now = first[2]["remaining_tokens"], second[2]["remaining_tokens"]
        low, high = (min(1200, was + rate * (second[0] - first[1])), min(1200, was + rate * (second[1] - first[0])))
        return second if low - 1 <= now <= high + 1 else None

    asked, answered, before = wait_for(steady, 60, interval=0, what="the ledger's figures to hold still")
    assert before["remaining_tokens"] < 600
    victim = _replica_actor("quota-ledger")
    _kill(victim)
    _restarted(stack, "quota-ledger", victim, lambda: usage()[2])
    asked_after, answered_after, after = wait_for(settled, 30, what="the lease to go back to the new ledger")
    low = min(1200, before["remaining_tokens"] + rate * (asked_after - answered))
    high = min(1200, before["remaining_tokens"] + rate * (answered_after - asked))
    assert low - 1 <= after["remaining_tokens"] <= high + 1, (before, after, answered_after - asked)
    r = httpx.post(url, headers=headers, json=body, timeout=120)  # still limited, still served once it refills
    assert r.status_code in (200, 429) and ("error" in r.json()) == (r.status_code == 429)
