"""Batch files through Ray job submission on the real stack: nothing lost, nothing twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deployments.batch_cli import entrypoint
from tests.integration.conftest import KEYS, wait_for

pytestmark = pytest.mark.integration


def write_input(path: Path, n: int, max_tokens: int = 8) -> None:
    with path.open("w") as f:
        for i in range(n):
            url = "/v1/chat/completions" if i % 2 else "/v1/completions"
            body = ({"model": "tiny-llama", "messages": [{"role": "user", "content": f"item {i}"}]} if i % 2
                    else {"model": "tiny-llama", "prompt": f"item {i}"})
            f.write(json.dumps({"custom_id": f"req-{i:04d}", "method": "POST", "url": url,
                                "body": {**body, "max_tokens": max_tokens, "ignore_eos": True}}) + "\n")


def read_output(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def jobs(stack):
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(stack.dashboard_url)


def submit(jobs, stack, inp: Path, out: Path, concurrency: int = 16) -> str:
    return jobs.submit_job(entrypoint=entrypoint(str(inp), str(out), stack.base_url, "offline", concurrency,
                                                 python=sys.executable),
                           runtime_env={"env_vars": {"POOLSERVE_KEY": KEYS["batch"]}})


def finished(jobs, job_id: str, timeout: float = 300) -> str:
    from ray.job_submission import JobStatus

    return wait_for(lambda: (lambda s: s if s in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED) else None)(
        jobs.get_job_status(job_id)), timeout, interval=1, what=f"job {job_id} to end")


def test_200_requests_through_job_submission(jobs, stack, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp, 200)
    job = submit(jobs, stack, inp, out)
    assert finished(jobs, job) == "SUCCEEDED", jobs.get_job_logs(job)[-3000:]
    rows = read_output(out)
    ids = [r["custom_id"] for r in rows]
    assert len(ids) == 200 and len(set(ids)) == 200
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in rows)
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 8 for r in rows)
    logs = jobs.get_job_logs(job)
    assert "batch summary:" in logs and '"done": 200' in logs and "progress:" in logs


def test_stopped_job_resumes_without_loss_or_duplicates(jobs, stack, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp, 200, max_tokens=48)
    first = submit(jobs, stack, inp, out, concurrency=8)
    wait_for(lambda: out.exists() and len(read_output(out)) >= 30, 120, what="a first part of the results")
    jobs.stop_job(first)
    assert finished(jobs, first) == "STOPPED"
    partial = read_output(out)
    assert 30 <= len(partial) < 200, len(partial)
    second = submit(jobs, stack, inp, out, concurrency=16)
    assert finished(jobs, second) == "SUCCEEDED", jobs.get_job_logs(second)[-3000:]
    ids = [r["custom_id"] for r in read_output(out)]
    assert len(ids) == 200 and len(set(ids)) == 200
    assert f"{len(partial)} already in" in jobs.get_job_logs(second)


CLEAN = {"HOME": os.environ["HOME"], "PATH": "/usr/bin:/bin"}  # a second shell: nothing from this process
CLI = [str(Path(sys.executable).parent / "poolserve"), "batch"]


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=cwd, env=CLEAN, capture_output=True, text=True, timeout=60)


def cli_job_ends(stack, job: str, cwd: Path) -> str:
    return wait_for(lambda: (lambda s: s if "FAILED" in s or "SUCCEEDED" in s else None)(
        cli("status", job, "--address", stack.dashboard_url, cwd=cwd).stdout), 300, interval=1, what="the job to end")


def test_the_cli_submits_watches_and_reads_a_job_from_a_clean_shell(stack, tmp_path):
    """Ray turns token authentication on for a cluster ray.init() starts; the CLI finds the token
    where Ray's own CLI does (~/.ray/auth_token here), with no variable set."""
    import httpx

    assert httpx.get(f"{stack.dashboard_url}/api/jobs/", timeout=10).status_code in (401, 403), "token auth is on"
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp, 12)
    run = cli("submit", str(inp), "--output", str(out), "--tenant-key", KEYS["batch"], "--address",
              stack.dashboard_url, "--url", stack.base_url, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    job = run.stdout.strip().splitlines()[-1]
    assert "SUCCEEDED" in cli_job_ends(stack, job, tmp_path)
    assert '"done": 12' in cli("logs", job, "--address", stack.dashboard_url, cwd=tmp_path).stdout
    assert sorted(r["custom_id"] for r in read_output(out)) == [f"req-{i:04d}" for i in range(12)]


def test_bad_line_and_duplicate_id_are_reported_by_the_cli(stack, tmp_path):
    inp, out = tmp_path / "bad.jsonl", tmp_path / "out.jsonl"
    write_input(inp, 5)
    lines = inp.read_text().splitlines()
    lines.insert(2, "{this is not json")
    lines.append(lines[0])  # a duplicate custom_id
    inp.write_text("\n".join(lines) + "\n")
    run = cli("submit", str(inp), "--output", str(out), "--tenant-key", KEYS["batch"], "--address",
              stack.dashboard_url, "--url", stack.base_url, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    job = run.stdout.strip().splitlines()[-1]
    assert "FAILED" in cli_job_ends(stack, job, tmp_path)
    logs = cli("logs", job, "--address", stack.dashboard_url, cwd=tmp_path).stdout
    assert "line 3: not valid JSON" in logs
    assert "line 7: duplicate custom_id 'req-0000' (first on line 1)" in logs
    assert "nothing sent" in logs and not out.exists()


def test_a_killed_job_resumes_with_every_line_answered_once(stack, tmp_path):
    """Non-ASCII custom_ids, paths with spaces, a SIGKILL while the job writes, a torn last line,
    a second job on the same output, and a resume through `poolserve batch submit`."""
    import signal
    import stat

    folder = tmp_path / "my batches"
    folder.mkdir()
    inp, out = folder / "in put.jsonl", folder / "out put.jsonl"
    ids = [f"résumé №{i} 🚀" for i in range(120)]
    inp.write_text("".join(json.dumps({"custom_id": c, "method": "POST", "url": "/v1/completions", "body": {
        "model": "tiny-llama", "prompt": f"item {c}", "max_tokens": 32, "ignore_eos": True}}) + "\n" for c in ids))
    job = [sys.executable, "-m", "deployments.batch_job", "--input", str(inp), "--output", str(out),
           "--url", stack.base_url, "--pool", "offline", "--concurrency", "4"]
    first = subprocess.Popen(job, env={**CLEAN, "POOLSERVE_KEY": KEYS["batch"]}, cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: out.exists() and len(read_output(out)) >= 10, 120, what="the first results")
        second = subprocess.run(job, env={**CLEAN, "POOLSERVE_KEY": KEYS["batch"]}, cwd=tmp_path,
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 2 and "another job is writing" in second.stderr, second.stderr
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    done = read_output(out)
    assert 10 <= len(done) < 120
    with out.open("a") as f:  # a write torn by the kill
        f.write('{"id": "batch_req_torn", "custom_id": "résumé')
    assert stat.S_IMODE(out.stat().st_mode) == 0o600  # the owner's only

    run = cli("submit", str(inp), "--output", str(out), "--tenant-key", KEYS["batch"], "--address",
              stack.dashboard_url, "--url", stack.base_url, "--concurrency", "8", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    resumed = run.stdout.strip().splitlines()[-1]
    assert "SUCCEEDED" in cli_job_ends(stack, resumed, tmp_path)
    rows = read_output(out)
    assert sorted(r["custom_id"] for r in rows) == sorted(ids)  # every line once: none lost, none twice
    assert all(r["response"]["status_code"] == 200 for r in rows)
    assert f"{len(done)} already in" in cli("logs", resumed, "--address", stack.dashboard_url, cwd=tmp_path).stdout
