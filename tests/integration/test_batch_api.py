"""The OpenAI Batch API on the real stack, driven by the official `openai` SDK: files up,
batches run as Ray jobs through the offline pool, results down; another tenant's ids are
404; a batch survives its service's restart and its job's, every line answered once."""

from __future__ import annotations

import json

import openai
import pytest

from tests.integration.conftest import KEYS, wait_for

pytestmark = pytest.mark.integration


def batch_file(n: int, max_tokens: int = 8) -> bytes:
    return "".join(json.dumps({"custom_id": f"line-{i:04d}", "method": "POST", "url": "/v1/completions", "body": {
        "model": "tiny-llama", "prompt": f"item {i}", "max_tokens": max_tokens, "ignore_eos": True}}) + "\n"
        for i in range(n)).encode()


def sdk(stack, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=KEYS[tenant], max_retries=0, timeout=60)


def ends(client: openai.OpenAI, batch_id: str, timeout: float = 300):
    return wait_for(lambda: (lambda b: b if b.status in ("completed", "failed", "cancelled", "expired") else None)(
        client.batches.retrieve(batch_id)), timeout, interval=1, what=f"batch {batch_id} to end")


def answers(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_upload_create_poll_download_and_another_tenants_404(stack):
    client, other = sdk(stack, "batch"), sdk(stack, "chat")
    f = client.files.create(file=("eval.jsonl", batch_file(40)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                              metadata={"suite": "integration"})
    assert b.status in ("validating", "in_progress") and b.request_counts.total == 40
    done = ends(client, b.id)
    assert done.status == "completed", done.errors
    assert done.request_counts.completed == 40 and done.request_counts.failed == 0 and done.error_file_id is None
    rows = answers(client, done.output_file_id)
    assert sorted(r["custom_id"] for r in rows) == [f"line-{i:04d}" for i in range(40)]
    assert all(r["response"]["status_code"] == 200 and r["response"]["body"]["usage"]["completion_tokens"] == 8
               for r in rows)
    assert b.id in [x.id for x in client.batches.list()]

    for call in (lambda: other.batches.retrieve(b.id), lambda: other.files.content(done.output_file_id),
                 lambda: other.files.retrieve(f.id), lambda: other.batches.cancel(b.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.PermissionDeniedError):  # its key may not use the batch pool
        other.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("bad.jsonl", batch_file(2) + b"{oops\n"), purpose="batch")
    assert "line 3" in e.value.body["message"]
    assert client.models.retrieve("tiny-llama").id == "tiny-llama"


def test_cancel_keeps_what_was_answered(stack):
    client = sdk(stack, "batch")
    f = client.files.create(file=("long.jsonl", batch_file(200, max_tokens=64)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    wait_for(lambda: client.batches.retrieve(b.id).request_counts.completed >= 5, 120, interval=0.5,
             what="a first part of the answers")
    assert client.batches.cancel(b.id).status in ("cancelling", "cancelled")
    done = ends(client, b.id, timeout=120)
    assert done.status == "cancelled"
    rows = answers(client, done.output_file_id) + answers(client, done.error_file_id)
    ids = [r["custom_id"] for r in rows]
    assert len(ids) == 200 and len(set(ids)) == 200, "every line once: answered, or why not"
    assert 5 <= done.request_counts.completed < 200
    assert done.request_counts.completed + done.request_counts.failed == 200
    assert "batch_cancelled" in {r["error"]["code"] for r in rows if r["response"] is None}, "the lines never run"


def test_a_batch_survives_its_services_restart_and_its_jobs(stack):
    """The batch service's replica is killed and the batch's job stopped mid-batch: Serve
    starts a new service, which reads the batch back and submits the job again; the job
    skips what was answered. Every line is answered exactly once."""
    import ray
    from ray.job_submission import JobSubmissionClient
    from ray.util.state import list_actors

    client = sdk(stack, "batch")
    f = client.files.create(file=("restart.jsonl", batch_file(160, max_tokens=48)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    wait_for(lambda: client.batches.retrieve(b.id).request_counts.completed >= 10, 120, interval=0.5,
             what="a first part of the answers")
    [service] = [a for a in list_actors(address=stack.dashboard_url, filters=[("state", "=", "ALIVE")])
                 if a.class_name == "ServeReplica:poolserve:batch-service"]
    ray.kill(ray.get_actor(service.name, namespace=service.ray_namespace), no_restart=True)
    jobs = JobSubmissionClient(stack.dashboard_url)
    jobs.stop_job(f"poolserve-{b.id}-1")

    def answered():
        try:
            return client.batches.retrieve(b.id)
        except (openai.APIStatusError, openai.APIConnectionError):  # 503 while the service restarts
            return None

    done = wait_for(lambda: (lambda x: x if x and x.status in ("completed", "failed") else None)(answered()),
                    300, interval=1, what="the batch to complete after the restart")
    assert done.status == "completed", done.errors
    ids = [r["custom_id"] for r in answers(client, done.output_file_id)]
    assert sorted(ids) == [f"line-{i:04d}" for i in range(160)], "every line answered exactly once"
    second = jobs.get_job_logs(f"poolserve-{b.id}-2")
    assert "already in" in second, second[-2000:]


def test_a_job_submitted_again_under_its_name_is_that_job(stack):
    """The batch service can die after Ray accepted a batch's job and before the batch's record
    said so; the next service submits the same name again. Ray refuses a second job of one name,
    so that batch's every poll raised and it never moved until it expired, its answers dropped."""
    import uuid

    from ray.job_submission import JobSubmissionClient

    from deployments.batch_cli import RayJobRunner

    runner, name = RayJobRunner(stack.dashboard_url), f"poolserve-test-{uuid.uuid4().hex[:12]}"
    assert runner.submit(name, ["--help"]) == name
    assert runner.submit(name, ["--help"]) == name  # the job it started before, not a second one
    jobs = [j for j in JobSubmissionClient(stack.dashboard_url).list_jobs() if j.submission_id == name]
    assert len(jobs) == 1
    wait_for(lambda: runner.status(name) in ("SUCCEEDED", "FAILED", "STOPPED"), 120, interval=1,
             what="the --help job to end")
