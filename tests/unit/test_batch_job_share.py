"""Batch jobs share their tenant's concurrent slots without hammering the router for them."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from deployments import batch_job
from deployments.batch_job import RetryPolicy, run
from infra.batchfile import BatchRequest
from tests.unit import virtual_time

SLOTS, SERVICE_S = 4, 1.0


def _tenant(slots: int, status: int):
    """A router's view of one tenant: `slots` concurrent requests, each held `SERVICE_S` and
    answered `status`; past them the router's `concurrency_quota_exceeded`, retry after a second.
    `seen["others"]` are slots its other clients hold."""
    seen = {"held": 0, "others": 0, "refused": 0, "answered": 0}

    async def handler(request: httpx.Request) -> httpx.Response:
        if seen["held"] + seen["others"] >= slots:
            seen["refused"] += 1
            return httpx.Response(429, headers={"retry-after": "1"},
                                  json={"error": {"code": "concurrency_quota_exceeded"}})
        seen["held"] += 1
        await asyncio.sleep(SERVICE_S)
        seen["held"] -= 1
        seen["answered"] += 1
        return httpx.Response(status, json={"usage": {"total_tokens": 1}} if status == 200 else {"error": {}})
    return seen, handler


def _jobs(tmp_path, monkeypatch, jobs: int, lines: int, concurrency: int, status: int = 200,
          others: int = 0, others_for_s: float = float("inf"), policy: RetryPolicy = RetryPolicy()):
    seen, handler = _tenant(SLOTS, status)
    seen["others"] = others
    real = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **k: real(transport=httpx.MockTransport(handler)))

    async def main():
        if others_for_s != float("inf"):
            asyncio.get_running_loop().call_later(others_for_s, seen.update, {"others": 0})
        done = await asyncio.gather(*(
            run([BatchRequest(i + 1, f"j{j}-{i}", "completions", {"prompt": "p"}) for i in range(lines)],
                tmp_path / f"out{j}.jsonl", "http://r/offline/v1", "k", concurrency, policy,
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
    quota ledger that bought nothing. A job refused a slot keeps no more out than its others out,
    and one with none out sends one probe per Retry-After."""
    seen, progress, outputs, elapsed = _jobs(tmp_path, monkeypatch, jobs=8, lines=12, concurrency=SLOTS)
    assert all(len(o) == 12 and all(x["response"]["status_code"] == 200 for x in o) for o in outputs)
    assert seen["answered"] == 96 and sum(p.failed for p in progress) == 0
    # refusals bounded by the jobs, not their workers: one a second per job at most, on average
    # (385 in 25 s before)
    assert seen["refused"] <= 8 * elapsed, (seen, elapsed)


def test_a_job_alone_keeps_every_slot_its_tenant_has_busy(tmp_path, monkeypatch):
    """A job that keeps fewer out than its tenant may have is slower than its quota allows."""
    seen, _, _, elapsed = _jobs(tmp_path, monkeypatch, jobs=1, lines=80, concurrency=8)
    assert seen["answered"] == 80
    assert seen["refused"] <= elapsed, (seen, elapsed)  # one probe a round to grow back (69 before)
    assert elapsed <= 80 / SLOTS * SERVICE_S + 1.0, elapsed  # 20 s of work, and a second lost to a probe at most


@pytest.mark.parametrize("status", [200, 400])
def test_a_job_cut_back_by_its_tenants_other_clients_grows_back_once_they_leave(tmp_path, monkeypatch, status):
    """Other clients hold 3 of the tenant's 4 slots for 3 s, then leave: the job, cut back to 1,
    lets one more out each time as many as it lets out are answered, whatever their answers (a
    job that grew on 200s alone stayed at 2 for good on lines the engine refused)."""
    seen, _, outputs, elapsed = _jobs(tmp_path, monkeypatch, jobs=1, lines=40, concurrency=SLOTS, status=status,
                                      others=3, others_for_s=3.0)
    assert seen["answered"] == 40 and [x["response"]["status_code"] for x in outputs[0]] == [status] * 40
    # 3 s at one slot, about 3 s more growing to 4 (answers 1, 2 and 3 apart), then 4 at a time:
    # 3 + 3 + (40 - 3 - 6) / 4 = 13.75 s (40 s had it stayed at 1)
    assert elapsed <= 16, elapsed


def test_waiting_for_its_turn_counts_as_pacing(tmp_path, monkeypatch):
    """A tenant whose slots its other clients hold for good: each line paced `max_paced_s` in
    all fails with its last answer. Waiting for another line's turn was not counted, so the
    lines waited one after another: 83 s for 8 lines paced 10 s."""
    seen, progress, outputs, elapsed = _jobs(tmp_path, monkeypatch, jobs=1, lines=8, concurrency=8, others=SLOTS,
                                             policy=RetryPolicy(max_paced_s=10.0))
    assert [x["response"]["status_code"] for x in outputs[0]] == [429] * 8 and progress[0].failed == 8
    assert elapsed <= 2 * 10.0, elapsed


def test_a_job_answered_all_along_fails_no_line_for_its_wait(tmp_path, monkeypatch):
    """The tenant's other clients hold 3 of its 4 slots for good: the job runs one line at a time,
    answered every second. Lines refused at its start waited behind lines not yet sent, their
    wait counted as pacing, and 15 of 300 failed while the job was answered all along."""
    seen, progress, outputs, elapsed = _jobs(tmp_path, monkeypatch, jobs=1, lines=60, concurrency=8, others=3,
                                             policy=RetryPolicy(max_paced_s=10.0))
    assert [x["response"]["status_code"] for x in outputs[0]] == [200] * 60 and progress[0].failed == 0
    assert elapsed <= 60 * SERVICE_S + 2, elapsed
