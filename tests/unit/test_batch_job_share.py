"""Batch jobs share their tenant's concurrent slots without hammering the router for them."""

from __future__ import annotations

import asyncio
import json

import httpx

from deployments import batch_job
from deployments.batch_job import RetryPolicy, run
from infra.batchfile import BatchRequest
from tests.unit import virtual_time

SLOTS, SERVICE_S = 4, 1.0


def _tenant(slots: int):
    """A router's view of one tenant: `slots` concurrent requests, each held `SERVICE_S`; past
    them the router's `concurrency_quota_exceeded`, retry after a second."""
    seen = {"held": 0, "most": 0, "refused": 0, "answered": 0}

    async def handler(request: httpx.Request) -> httpx.Response:
        if seen["held"] >= slots:
            seen["refused"] += 1
            return httpx.Response(429, headers={"retry-after": "1"},
                                  json={"error": {"code": "concurrency_quota_exceeded"}})
        seen["held"] += 1
        seen["most"] = max(seen["most"], seen["held"])
        await asyncio.sleep(SERVICE_S)
        seen["held"] -= 1
        seen["answered"] += 1
        return httpx.Response(200, json={"usage": {"total_tokens": 1}})
    return seen, handler


def _jobs(tmp_path, monkeypatch, jobs: int, lines: int, concurrency: int, slots: int = SLOTS):
    seen, handler = _tenant(slots)
    real = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **k: real(transport=httpx.MockTransport(handler)))

    async def main():
        done = await asyncio.gather(*(
            run([BatchRequest(i + 1, f"j{j}-{i}", "completions", {"prompt": "p"}) for i in range(lines)],
                tmp_path / f"out{j}.jsonl", "http://r/offline/v1", "k", concurrency, RetryPolicy(),
                progress_every_s=3600.0, seed=j)
            for j in range(jobs)))
        return done, asyncio.get_running_loop().time()

    progress, elapsed = virtual_time.run(main, monkeypatch, batch_job)
    outputs = [[json.loads(x) for x in (tmp_path / f"out{j}.jsonl").read_text().splitlines()] for j in range(jobs)]
    return seen, progress, outputs, elapsed


def test_jobs_above_their_tenants_slots_wait_for_their_own_answers_instead_of_retrying_each_second(
        tmp_path, monkeypatch):
    """Eight batches of a tenant of 4 slots each kept 4 requests outstanding: 28 workers were
    refused and came back every second for as long as the batches ran, load on the router and the
    quota ledger that bought nothing. A job refused a slot keeps no more outstanding than it holds,
    and one that holds none sends one probe per Retry-After."""
    seen, progress, outputs, elapsed = _jobs(tmp_path, monkeypatch, jobs=8, lines=12, concurrency=SLOTS)
    assert all(len(o) == 12 and all(x["response"]["status_code"] == 200 for x in o) for o in outputs)
    assert seen["answered"] == 96 and seen["most"] == SLOTS
    # 96 answers in 4 slots take 24 s: at most one probe a second per job, and one refused
    # attempt to grow back per round of a job's limit
    print("SEEN", seen, elapsed)
    assert seen["refused"] <= 8 * 24 + 96 // 2, seen
    assert sum(p.failed for p in progress) == 0


def test_a_job_alone_keeps_every_slot_its_tenant_has_busy(tmp_path, monkeypatch):
    """A job that keeps fewer out than its tenant may have is slower than its quota allows: one
    cut back by refusals grows back while it is answered, and keeps all 4 slots busy."""
    seen, _, _, elapsed = _jobs(tmp_path, monkeypatch, jobs=1, lines=80, concurrency=8)
    assert seen["answered"] == 80 and seen["most"] == SLOTS
    assert seen["refused"] <= elapsed, (seen, elapsed)  # one probe a round to grow back (69 before)
    assert elapsed <= 80 / SLOTS * SERVICE_S + 1.0, elapsed  # 20 s of work, and a second lost to a probe at most
