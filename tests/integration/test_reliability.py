"""Reliability and security on the real stack: fuzzing, overload, tenants, secrets.

The long versions are marked `slow` (`make test-slow`); CI runs the short version of each.
The tests that kill replicas are in `test_restarts.py` (they run last in the session).
"""

from __future__ import annotations

import glob
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from tests.integration.conftest import ADMIN, KEYS, REPO

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
               "completed": res["completed"], "statuses": res["statuses"], "errors": res["errors"],
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
    assert accepted == f["completed"], f["errors"]  # every accepted request completed
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
    from router.ingress import ROUTES

    admin = [(verb.upper(), path.replace("{pool}", "online-chat")) for verb, path, _ in ROUTES
             if path.startswith("/admin")]  # every one, as served (four of seven were tried)
    assert len(admin) >= 7
    for key in (None, KEYS["chat"], "not-a-key"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        for method, path in admin:
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
