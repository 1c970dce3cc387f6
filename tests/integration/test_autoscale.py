"""The autoscaler on the real stack: it follows a load step, obeys a tightened SLO, and a
killed controller changes nothing until it comes back and resumes from the reports."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.conftest import KEYS, wait_for

pytestmark = pytest.mark.integration

POOL = "online-chat"


class Load:
    """`n` clients sending chat requests back to back until stopped."""

    def __init__(self, stack, n: int, max_tokens: int = 64) -> None:
        self.stack, self.n, self.max_tokens = stack, n, max_tokens
        self.stop = threading.Event()
        self.statuses: list[int] = []
        self._pool = ThreadPoolExecutor(max_workers=n)

    def _client(self) -> None:
        with httpx.Client(timeout=120) as c:
            while not self.stop.is_set():
                r = c.post(f"{self.stack.base_url}/online/v1/chat/completions",
                           headers={"Authorization": f"Bearer {KEYS['chat']}"},
                           json={"model": "tiny-llama", "messages": [{"role": "user", "content": "load"}],
                                 "max_tokens": self.max_tokens, "ignore_eos": True})
                self.statuses.append(r.status_code)

    def __enter__(self):
        for _ in range(self.n):
            self._pool.submit(self._client)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self._pool.shutdown(wait=True)


def _target(stack) -> int:
    return stack.pools()[POOL]["target_max_active_seqs"]


def _start_at(stack, seqs: int) -> None:
    """Put the pool at `seqs` and hand it back to the autoscaler (cooldown starts now)."""
    with stack.pinned(POOL, seqs, calibrating=False):
        pass
    wait_for(lambda: _target(stack) == seqs, 10, what=f"target {seqs}")


def test_limit_rises_under_a_load_step(stack):
    cfg = stack.resolved.config.autoscale
    _start_at(stack, 4)
    stack.wait_idle(POOL)
    with Load(stack, 24) as load:
        started = time.monotonic()
        # 20 waiting at a limit of 4 is a deep queue: one move at the first report after the
        # cooldown since the start (bounded loosely here by the slower path, a tick's)
        expected = cfg.cooldown_s + (cfg.queue_persist_ticks + 2) * cfg.interval_s
        wait_for(lambda: _target(stack) > 4, expected + 10, what="the limit to rise")
        rose_after = time.monotonic() - started
        wait_for(lambda: stack.replica(POOL)["limits"]["max_active_seqs"] > 4, 5, what="the replica to apply it")
    assert all(s == 200 for s in load.statuses)
    ups = [d for d in stack.admin("GET", "/admin/decisions").json() if d["pool"] == POOL and d["action"] == "up"]
    # 24 clients at a limit of 4: one move to the step that holds them and a burst (or the
    # range's top), not one step per cooldown
    top = stack.pools()[POOL]["safe_range"][1]
    assert ups and ups[-1]["code"] in ("deep_queue", "rejections") and ups[-1]["old"] == 4, ups
    assert ups[-1]["code"] == "rejections" or "twice a batch of 4" in ups[-1]["reason"], ups
    assert min(16, top) <= ups[-1]["new"] <= top, ups
    print(f"\nlimit 4 -> {_target(stack)} after {rose_after:.1f}s (expected within {expected:.0f}s)")


def test_limit_falls_when_the_slo_is_tightened(stack):
    slo = stack.resolved.config.pools[POOL].slo
    _start_at(stack, 8)
    with Load(stack, 8):
        wait_for(lambda: stack.pools()[POOL]["snapshot"]["samples"] >= 5, 30, what="latency samples")
        r = stack.admin("PUT", f"/admin/pools/{POOL}/slo", json={"ttft_p99_ms": 1, "tpot_p99_ms": 1})
        assert r.status_code == 200
        try:
            wait_for(lambda: _target(stack) < 8, stack.resolved.config.autoscale.cooldown_s + 15,
                     what="the limit to fall")
        finally:
            stack.admin("PUT", f"/admin/pools/{POOL}/slo",
                        json={"ttft_p99_ms": slo.ttft_p99_ms, "tpot_p99_ms": slo.tpot_p99_ms})
    downs = [d for d in stack.admin("GET", "/admin/decisions").json() if d["pool"] == POOL and d["action"] == "down"]
    assert downs and downs[-1]["code"] in ("slo_ttft", "slo_tpot") and downs[-1]["new"] == 4


def test_killed_controller_changes_nothing_and_resumes_from_reports(stack):
    import ray
    from ray.util.state import list_actors

    _start_at(stack, 8)
    limits_before = {p: stack.replica(p)["limits"]["max_active_seqs"] for p in ("online-chat", "offline-batch")}
    [actor] = [a for a in list_actors(filters=[("state", "=", "ALIVE")])
               if a.class_name == "ServeReplica:poolserve:autoscale-controller"]
    ray.kill(ray.get_actor(actor.name, namespace=actor.ray_namespace), no_restart=True)

    # while it is away (or restarting), requests are served and nothing moves the limits
    client = stack.client("chat")
    for _ in range(5):
        r = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "still here?"}],
                                           max_tokens=8)
        assert r.usage.completion_tokens >= 1
    offline = stack.client("batch", "offline").completions.create(model="tiny-llama", prompt="x", max_tokens=4)
    assert offline.usage.completion_tokens >= 1

    def restarted():
        try:
            return stack.pools()
        except Exception:  # connection errors, or a 503 while the controller is away
            return None

    pools = wait_for(lambda: (lambda p: p if p and all(v["replicas"] for v in p.values()) else None)(restarted()),
                     120, interval=1, what="a new controller with reports")
    new = [a for a in list_actors(filters=[("state", "=", "ALIVE")])
           if a.class_name == "ServeReplica:poolserve:autoscale-controller"]
    assert new and new[0].actor_id != actor.actor_id
    for pool, seqs in limits_before.items():
        # resumed from the replicas' reports
        assert pools[pool]["target_max_active_seqs"] == seqs, (pool, limits_before, pools[pool])
        assert stack.replica(pool)["limits"]["max_active_seqs"] == seqs
