"""Reliability and security on the real stack: fuzzing, overload, faults, tenants.

The long versions are marked `slow` (`make test-slow`); CI runs the short version of each.
Tests that kill replicas are marked `disruptive` and run last in the session.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pools import reaper
from tests.integration.conftest import ADMIN, KEYS, REPO, wait_for

pytestmark = pytest.mark.integration

FUZZ_EXAMPLES = int(os.environ.get("POOLSERVE_FUZZ_EXAMPLES", "25"))


# -- fuzzing -----------------------------------------------------------------------------------

def _fuzz(stack, examples: int) -> dict:
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{stack.base_url}/openapi.json")
    seen = {"requests": 0, "by_status": {}, "problems": []}
    with httpx.Client(base_url=stack.base_url, timeout=120) as client:
        for result in schema.get_all_operations():
            op = result.ok()
            key = ADMIN if op.path.startswith("/admin") else KEYS["chat"]
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck))
                @given(case=op.as_strategy(generation_mode=mode))
                def run(case):
                    if isinstance(case.body, dict):  # keep generations short: the point is the input, not the output
                        for k in ("max_tokens", "max_completion_tokens"):
                            if isinstance(case.body.get(k), int) and case.body[k] > 16:
                                case.body[k] = 16
                    kwargs = case.as_transport_kwargs(base_url=stack.base_url)
                    headers = {**(kwargs.get("headers") or {}), "Authorization": f"Bearer {key}"}
                    r = client.request(kwargs["method"], kwargs["url"], headers=headers,
                                       params=kwargs.get("params"), json=kwargs.get("json"),
                                       content=kwargs.get("content") if "json" not in kwargs else None)
                    seen["requests"] += 1
                    seen["by_status"][r.status_code] = seen["by_status"].get(r.status_code, 0) + 1
                    where = f"{case.method} {case.formatted_path} {str(case.body)[:200]}"
                    if r.status_code >= 500:
                        seen["problems"].append(f"{r.status_code} on {where}: {r.text[:300]}")
                    elif r.status_code >= 400:
                        err = r.json().get("error", {})
                        if not err.get("message") or not err.get("code"):
                            seen["problems"].append(f"{r.status_code} without a clear error on {where}: {r.text[:200]}")
                run()
    return seen


def test_fuzz_openapi_no_5xx_and_clear_errors(stack):
    seen = _fuzz(stack, FUZZ_EXAMPLES)
    print(f"\nfuzzing: {seen['requests']} requests, statuses {seen['by_status']}")
    assert seen["requests"] >= 200
    assert not seen["problems"], "\n".join(seen["problems"][:20])
    assert httpx.post(f"{stack.base_url}/online/v1/completions", headers={"Authorization": f"Bearer {KEYS['chat']}"},
                      json={"prompt": "still fine", "max_tokens": 2}).status_code == 200


# -- overload ----------------------------------------------------------------------------------

PROMPT, OUTPUT = "32", "64"  # long enough that the engine, not per-request overhead, sets the capacity


def _capacity(stack) -> float:
    """Completed requests per second at the pool's current limit, closed loop."""
    run = subprocess.run([sys.executable, "-m", "infra.loadgen", "--url", f"{stack.base_url}/online/v1", "--key",
                          KEYS["chat"], "--concurrency", "16", "--prompt", PROMPT, "--output", OUTPUT, "--warmup", "2",
                          "--duration", "8"], cwd=REPO, capture_output=True, text=True, timeout=120)
    return json.loads(run.stdout)["req_per_s"]


def _ttft_p50(stack, n: int = 8) -> float:
    out = []
    for _ in range(n):
        t0 = time.monotonic()
        with httpx.stream("POST", f"{stack.base_url}/online/v1/completions", timeout=60,
                          headers={"Authorization": f"Bearer {KEYS['chat']}"},
                          json={"prompt": "latency probe", "max_tokens": 8, "stream": True}) as r:
            assert r.status_code == 200, r.read()
            first = None
            for line in r.iter_lines():  # the first token's chunk (its text may be empty: a partial character)
                if first is None and line.startswith("data: {") and '"choices":[{' in line:
                    first = time.monotonic() - t0
        out.append(first)
    return statistics.median(out)


def _overload(stack, seconds: float) -> dict:
    pool = "online-chat"
    stack.wait_idle(pool)
    before = _ttft_p50(stack)
    capacity = _capacity(stack)
    stack.wait_idle(pool)
    rate = 10 * capacity
    # offer at least twice what the pool can hold at once (its limit and its queue), however
    # low a slow box measured its capacity: a burst that fits in the queue tests nothing
    held = stack.replica(pool)["limits"]["max_active_seqs"] + stack.resolved.pools[pool].config.queue.max_queued
    seconds = max(seconds, 2 * held / rate)
    burst = subprocess.Popen(
        [sys.executable, "-m", "infra.loadgen", "--url", f"{stack.base_url}/online/v1", "--key", KEYS["chat"],
         "--rate", str(rate), "--prompt", PROMPT, "--output", OUTPUT, "--warmup", "0", "--duration", str(seconds),
         "--timeout", "120"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak_queue, peak_tokens, samples = 0, 0, 0
    try:
        while burst.poll() is None:
            try:
                r = stack.replica(pool)
            except (httpx.HTTPError, AssertionError):  # a slow admin answer under the burst: sample again
                continue
            samples += 1
            peak_queue = max(peak_queue, sum(r["queued_by_class"].values()))
            peak_tokens = max(peak_tokens, r["queued_tokens"])
            time.sleep(0.5)
        out, err = burst.communicate()
    finally:
        if burst.poll() is None:  # never leave a burst running into the next test
            burst.kill()
            burst.communicate()
    assert samples >= 3, "the queue was never observed during the burst"
    assert burst.returncode == 0, err[-2000:]
    res = json.loads(out)
    stack.wait_idle(pool)
    after = _ttft_p50(stack)
    figures = {"capacity_req_s": capacity, "offered_req_s": rate, "seconds": seconds, "sent": res["requests"],
               "completed": res["completed"], "statuses": res["statuses"],
               "rejected_without_retry_after": res["rejected_without_retry_after"],
               "peak_queue": peak_queue, "peak_queued_tokens": peak_tokens, "queue_samples": samples,
               "ttft_p50_before_ms": before * 1e3, "ttft_p50_after_ms": after * 1e3}
    print(f"\noverload: {json.dumps(figures)}")
    return figures


def _check_overload(stack, f: dict) -> None:
    q = stack.resolved.pools["online-chat"].config.queue
    accepted = f["statuses"].get("200", 0)
    rejected = f["statuses"].get("429", 0)
    assert set(f["statuses"]) <= {"200", "429"}, f["statuses"]  # nothing else: no 5xx, no timeouts
    assert accepted == f["completed"]  # every accepted request completed
    assert rejected > 0 and f["rejected_without_retry_after"] == 0
    assert f["peak_queue"] <= q.max_queued  # the queue stayed bounded
    assert f["ttft_p50_after_ms"] <= max(3 * f["ttft_p50_before_ms"], f["ttft_p50_before_ms"] + 100)


def test_overload_short(stack):
    _check_overload(stack, _overload(stack, 10))


@pytest.mark.slow
def test_overload_one_minute(stack):
    _check_overload(stack, _overload(stack, 60))


# -- security ----------------------------------------------------------------------------------

def test_admin_endpoints_need_the_admin_key(stack):
    for key in (None, KEYS["chat"], "not-a-key"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        for method, path in (("GET", "/admin/pools"), ("GET", "/admin/decisions"),
                             ("POST", "/admin/pools/online-chat/limits"), ("PUT", "/admin/pools/online-chat/slo")):
            r = httpx.request(method, f"{stack.base_url}{path}", headers=headers, json={})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_key", (key, path, r.text)


def test_a_tenant_sees_only_its_own_usage(stack):
    r = httpx.get(f"{stack.base_url}/v1/usage", headers={"Authorization": f"Bearer {KEYS['limited']}"})
    assert r.status_code == 200 and r.json()["tenant"] == "limited"
    text = r.text
    for other in ("chat", "batch", "other"):
        assert f'"{other}"' not in text
    assert httpx.get(f"{stack.base_url}/v1/usage").status_code == 401


def test_keys_and_prompts_are_not_logged(stack):
    marker = f"secret-prompt-{uuid.uuid4().hex}"
    r = httpx.post(f"{stack.base_url}/online/v1/chat/completions", headers={"Authorization": f"Bearer {KEYS['chat']}"},
                   json={"messages": [{"role": "user", "content": marker}], "max_tokens": 4}, timeout=60)
    assert r.status_code == 200
    completion = r.json()["choices"][0]["message"]["content"]
    time.sleep(2)  # log lines are flushed by the processes that wrote them
    hits = []
    for path in glob.glob("/tmp/ray/session_latest/logs/**/*", recursive=True):
        if os.path.isfile(path):
            with open(path, errors="ignore") as f:
                text = f.read()
            for needle in (marker, KEYS["chat"], ADMIN) + ((completion,) if len(completion) > 12 else ()):
                if needle in text:
                    hits.append((path, needle[:20]))
    assert not hits, hits


def test_router_binds_to_loopback_only(stack):
    addrs = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)} - {"127.0.0.1"}
    addrs |= {ip for ip in subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
              if ":" not in ip}
    assert stack.resolved.config.router.host == "127.0.0.1"
    for ip in addrs - {"127.0.0.1"}:
        with pytest.raises(OSError):
            socket.create_connection((ip, stack.resolved.config.router.port), timeout=2).close()
    socket.create_connection(("127.0.0.1", stack.resolved.config.router.port), timeout=2).close()


# -- faults (disruptive: they run last) -------------------------------------------------------

def _replica_actor(deployment: str):
    from ray.util.state import list_actors

    name = f"ServeReplica:poolserve:{deployment}"
    [a] = [a for a in list_actors(filters=[("state", "=", "ALIVE")]) if a.class_name == name]
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


def _killed_mid_stream(stack, pool: str) -> None:
    victim = _replica_actor(f"pool-{pool}")
    engines = reaper.engine_children(victim.pid)  # vLLM's engine core, a child of the replica
    assert engines, "no engine process found under the pool replica"
    events = []
    with httpx.stream("POST", f"{stack.base_url}/offline/v1/completions", timeout=120,
                      headers={"Authorization": f"Bearer {KEYS['batch']}"},
                      json={"prompt": "a long story", "max_tokens": 1900, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["x-poolserve-pool"] == pool
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
                if len(events) == 3:
                    _kill(victim)
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])
    assert error["error"]["code"] == "pool_failed" and "incomplete" in error["error"]["message"]
    # the killed replica's engine processes do not outlive it (each holds GBs of KV cache and a core)
    wait_for(lambda: not any(reaper.alive(*e) for e in engines), 30, what="the engine processes to stop")

    answers = []  # while the replacement starts, requests get a fast refusal with Retry-After, never a hang

    def served():
        t0 = time.monotonic()
        r = httpx.post(f"{stack.base_url}/offline/v1/completions", headers={"Authorization": f"Bearer {KEYS['batch']}"},
                       json={"prompt": "after the crash", "max_tokens": 4}, timeout=60)
        answers.append((r.status_code, r.headers.get("retry-after"), time.monotonic() - t0, r.text[:200]))
        return r.status_code == 200
    wait_for(served, 300, interval=3, what="a replacement replica to serve")
    print(f"\nduring the restart: {[(s, ra, round(t, 1)) for s, ra, t, _ in answers]}")
    for status, retry_after, took, text in answers[:-1]:
        # 503 once the dead replica's reports are stale; 429 pool_busy in the seconds before that
        assert (status, retry_after is not None) in ((503, True), (429, True)), (status, text)
        assert "pool_unavailable" in text or "pool_busy" in text, text
        assert took < stack.resolved.config.router.reach_timeout_s + 10
    assert _replica_actor(f"pool-{pool}").actor_id != victim.actor_id
    assert stack.client("chat").chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "x"}], max_tokens=2).usage.completion_tokens >= 1


@pytest.mark.disruptive
def test_router_replica_killed(stack):
    victim = _replica_actor("router")
    _kill(victim)

    def served():
        try:
            r = httpx.post(f"{stack.base_url}/online/v1/completions", timeout=30,
                           headers={"Authorization": f"Bearer {KEYS['chat']}"}, json={"prompt": "x", "max_tokens": 2})
            return r.status_code == 200
        except httpx.HTTPError:
            return False
    wait_for(served, 180, interval=2, what="a new router replica")
    assert _replica_actor("router").actor_id != victim.actor_id


def _healthz(stack) -> dict[str, bool]:
    return httpx.get(f"{stack.base_url}/healthz", timeout=10).json()["pools"]


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
            wait_for(lambda: not any(_healthz(stack).values()),
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
