"""Metrics on Ray's Prometheus endpoint: the named series exist and move under real load, and
every query of the Grafana dashboard names a metric seen here."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deployments.dashboard import dashboard
from tests.integration.conftest import KEYS, wait_for

pytestmark = pytest.mark.integration

REFUSALS = ["ray_poolserve_rejected_total", "ray_poolserve_shed_total"]  # by the gate, by the router
COUNTERS = ["ray_poolserve_admitted_total", "ray_poolserve_cancelled_total",
            "ray_poolserve_router_requests_total", "ray_poolserve_borrowed_total",
            "ray_poolserve_quota_rejections_total", "ray_poolserve_tenant_tokens_total",
            "ray_poolserve_autoscale_decisions_total", "ray_poolserve_ttft_seconds_count",
            "ray_poolserve_tpot_seconds_count", "ray_poolserve_queue_wait_seconds_count",
            "ray_vllm_generation_tokens_total"]
GAUGES = ["ray_poolserve_queue_depth", "ray_poolserve_queued_tokens", "ray_poolserve_active_seqs",
          "ray_poolserve_inflight_tokens", "ray_poolserve_limit_max_active_seqs",
          "ray_poolserve_limit_max_inflight_tokens", "ray_poolserve_safe_range_low", "ray_poolserve_safe_range_high",
          "ray_poolserve_kv_usage", "ray_poolserve_engine_running", "ray_poolserve_engine_waiting",
          "ray_poolserve_profile_stale", "ray_poolserve_quota_remaining_tokens", "ray_poolserve_autoscale_target_seqs",
          "ray_vllm_num_requests_running", "ray_vllm_kv_cache_usage_perc"]


def scrape(url: str) -> dict[str, list[tuple[dict, float]]]:
    out: dict[str, list[tuple[dict, float]]] = defaultdict(list)
    for family in text_string_to_metric_families(httpx.get(url, timeout=30).text):
        for s in family.samples:
            out[s.name].append((s.labels, s.value))
    return out


def total(m, name: str, **labels) -> float:
    return sum(v for lab, v in m.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def _chat(stack, tenant="chat", max_tokens=8, stream=True):
    return httpx.post(f"{stack.base_url}/online/v1/chat/completions", timeout=120,
                      headers={"Authorization": f"Bearer {KEYS[tenant]}"},
                      json={"messages": [{"role": "user", "content": "metrics"}], "max_tokens": max_tokens,
                            "stream": stream, "ignore_eos": True})


async def _burst(stack, n: int) -> list[int]:
    limits = httpx.Limits(max_connections=n + 8)
    async with httpx.AsyncClient(timeout=300, limits=limits) as c:
        rs = await asyncio.gather(*(c.post(f"{stack.base_url}/online/v1/completions",
                                           headers={"Authorization": f"Bearer {KEYS['chat']}"},
                                           json={"prompt": "burst", "max_tokens": 48, "ignore_eos": True})
                                     for _ in range(n)))
    return [r.status_code for r in rs]


def _offline(stack):
    return httpx.post(f"{stack.base_url}/offline/v1/completions", timeout=120,
                      headers={"Authorization": f"Bearer {KEYS['batch']}"},
                      json={"prompt": "borrow me", "max_tokens": 48, "ignore_eos": True})


def test_named_metrics_exist_and_move(stack):
    before = scrape(stack.metrics_url)
    # plain traffic, one disconnect, quota refusals, borrowing, and a gate overflow
    for _ in range(4):
        assert _chat(stack).status_code == 200
    with httpx.stream("POST", f"{stack.base_url}/online/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {KEYS['chat']}"},
                      json={"messages": [{"role": "user", "content": "bye"}], "max_tokens": 1500, "stream": True,
                            "ignore_eos": True}) as r:
        next(r.iter_lines())
    statuses = [_chat(stack, "limited", max_tokens=300, stream=False).status_code for _ in range(8)]
    assert 429 in statuses
    with stack.pinned("offline-batch", 8, calibrating=False), stack.pinned("online-chat", 8, calibrating=False):
        stack.wait_idle("online-chat")
        time.sleep(1.5)  # borrow.after_quiet_s
        with ThreadPoolExecutor(24) as ex:
            assert all(r.status_code == 200 for r in ex.map(lambda _: _offline(stack), range(24)))
    with stack.pinned("online-chat", 1):
        # A queue held at the gate until the dashboard has shown it: six requests kept outstanding at
        # a limit of one. (A burst's queue lasts seconds, and the export is sampled: it could be missed.)
        stop = threading.Event()

        def keep_queued(_):
            while not stop.is_set():
                assert _chat(stack, max_tokens=32, stream=False).status_code == 200

        with ThreadPoolExecutor(6) as ex:
            keepers = [ex.submit(keep_queued, i) for i in range(6)]
            try:
                wait_for(lambda: sum(stack.replica("online-chat")["queued_by_class"].values()) > 0, 30,
                         what="a queue at the gate")
                wait_for(lambda: total(scrape(stack.metrics_url), "ray_poolserve_queue_depth", pool="online-chat") > 0,
                         120, interval=1, what="the held queue on the dashboard")
            finally:
                stop.set()
            for k in keepers:
                k.result()
        codes = asyncio.run(_burst(stack, 300))
    assert set(codes) == {200, 429} and codes.count(429) >= 30 and codes.count(200) >= 60, \
        {c: codes.count(c) for c in set(codes)}

    def stuck_in(now) -> list[str]:
        stuck = [n for n in COUNTERS if total(now, n) <= total(before, n)]
        # a full queue is refused by the pool's gate or, once the router sees it full, by the router
        refused = [n for n in REFUSALS if total(now, n, pool="online-chat", reason="queue_full")
                   > total(before, n, pool="online-chat", reason="queue_full")]
        return stuck + ([] if refused else ["|".join(REFUSALS) + " (queue_full)"])

    def moved():
        now = scrape(stack.metrics_url)
        return None if stuck_in(now) else now
    try:
        after = wait_for(moved, 45, interval=2, what="every counter to move")
    except AssertionError:
        now = scrape(stack.metrics_url)
        raise AssertionError(f"counters that did not move: {stuck_in(now)}")
    missing = [g for g in GAUGES if g not in after]
    assert not missing, missing
    assert total(after, "ray_poolserve_borrowed_total", pool="offline-batch", into="online-chat") > \
        total(before, "ray_poolserve_borrowed_total", pool="offline-batch", into="online-chat")
    assert total(after, "ray_poolserve_quota_rejections_total", tenant="limited", limit="tokens") > 0
    assert {lab["pool"] for lab, _ in after["ray_poolserve_safe_range_high"]} == {"online-chat", "offline-batch"}

    # every dashboard query names metrics that exist here
    seen = set(after) | {re.sub(r"_(bucket|count|sum)$", "", n) for n in after}
    if seen & set(REFUSALS):  # Ray exports a counter once it counted: one way of refusing may not have happened
        seen |= set(REFUSALS)
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            for name in re.findall(r"\b(ray_[a-z0-9_]+)\b", target["expr"]):
                assert name in seen, f"panel {panel['title']!r} queries {name}, not exported"
    print("\nseries seen:", json.dumps(sorted(n for n in after if n.startswith("ray_poolserve")))[:400])
