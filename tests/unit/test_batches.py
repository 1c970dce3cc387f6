"""The Batch API's files and batches, with a fake job runner that answers like the resumable
batch runner (skipping the ids its output already holds) and a fake clock.

The model test drives seeded random schedules of job crashes, service restarts, polls and
cancels, and checks that a batch always ends, every line answered at most once, and exactly
once when it completes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from infra.batchfile import completed_ids, jsonl_lines, read_input, result_line
from router.batches import TERMINAL, Batches, BatchSettings
from router.errors import ApiError
from router.files import FileStore


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


class FakeRunner:
    """Jobs that run only when told to, answering like `deployments.batch_job`."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict] = {}
        self.stopped: list[str] = []

    down = False  # Ray's job API unreachable: every call raises
    die_after_submit = False  # the service dies once the job started, before its record says so

    def submit(self, name: str, args: list[str]) -> str:
        if self.down:
            raise ConnectionError("job API unreachable")
        if name in self.jobs:  # the runner's promise (`RayJobRunner` asks Ray of a refused name): that job
            return name
        opts = dict(zip(args[::2], args[1::2]))
        self.jobs[name] = {"input": Path(opts["--input"]), "output": Path(opts["--output"]), "state": "RUNNING",
                           "key": Path(opts["--key-file"]).read_text(), "concurrency": int(opts["--concurrency"])}
        if self.die_after_submit:
            raise SystemError("the service died")
        return name

    def status(self, job_id: str) -> str:
        if self.down:
            raise ConnectionError("job API unreachable")
        return self.jobs[job_id]["state"] if job_id in self.jobs else "FAILED"  # as `RayJobRunner` answers a 404

    def stop(self, job_id: str) -> None:
        if self.down:
            raise ConnectionError("job API unreachable")
        self.stopped.append(job_id)
        self.jobs[job_id]["state"] = "STOPPED"

    def logs(self, job_id: str) -> str:
        return f"log of {job_id}"

    def answer(self, job_id: str, n: int | None = None, then: str | None = None, fail_every: int = 0) -> None:
        """Let the job answer `n` more lines (all, when None), then end in state `then`."""
        job = self.jobs[job_id]
        assert job["state"] == "RUNNING", "only a running job answers"
        requests, _ = read_input(jsonl_lines(job["input"].read_bytes()))
        done = completed_ids(job["output"])
        todo = [r for r in requests if r.custom_id not in done][:n]
        with job["output"].open("a") as f:
            for r in todo:
                failed = fail_every and r.line % fail_every == 0
                f.write(result_line(r.custom_id, 429 if failed else 200, {"text": r.custom_id}, "req"))
        if then is not None:
            job["state"] = then


def _line(i: int, url: str = "/v1/completions") -> str:
    return json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url,
                       "body": {"model": "m", "prompt": f"p{i}", "max_tokens": 4}})


@pytest.fixture
def world(tmp_path):
    clock, runner = Clock(), FakeRunner()

    def service(max_attempts: int = 3) -> Batches:
        settings = BatchSettings(tmp_path, "http://router:8000", "offline", concurrency=8,
                                 max_attempts=max_attempts, max_lines=100)
        return Batches(settings, FileStore(tmp_path, clock), runner, clock)

    return clock, runner, service, FileStore(tmp_path, clock)


def _upload(files: FileStore, tenant: str, lines: int) -> str:
    content = "".join(_line(i) + "\n" for i in range(lines)).encode()
    return files.create(tenant, "in.jsonl", "batch", content)["id"]


def _output_rows(files: FileStore, tenant: str, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in files.content_path(tenant, file_id).read_text().splitlines()]


def test_a_batch_runs_as_a_job_under_the_tenants_key_and_splits_its_output(world):
    clock, runner, service, files = world
    batches = service()
    fid = _upload(files, "acme", 10)
    b = batches.create("acme", "sk-acme", fid, "/v1/completions", "24h", {"run": "nightly"})
    assert b["status"] == "in_progress" and b["request_counts"]["total"] == 10
    [job] = runner.jobs.values()
    assert job["key"] == "sk-acme"
    batch_dir = Path(files._dir("acme")).parent / "batches"
    assert "sk-acme" not in next(batch_dir.glob("batch_*.json")).read_text(), "no key in a record"
    assert (batch_dir / b["id"] / "key").stat().st_mode & 0o077 == 0, "the key file is its owner's only"

    runner.answer(next(iter(runner.jobs)), then="SUCCEEDED", fail_every=4)
    clock.now += 5
    batches.poll()
    b = batches.get("acme", b["id"])
    assert b["status"] == "completed" and b["completed_at"] >= b["in_progress_at"]
    assert b["request_counts"] == {"total": 10, "completed": 8, "failed": 2}
    good, bad = _output_rows(files, "acme", b["output_file_id"]), _output_rows(files, "acme", b["error_file_id"])
    assert len(good) == 8 and len(bad) == 2
    assert {r["custom_id"] for r in good + bad} == {f"req-{i}" for i in range(10)}
    assert files.get("acme", b["output_file_id"])["purpose"] == "batch_output"
    assert b["metadata"] == {"run": "nightly"}
    assert not (batch_dir / b["id"] / "key").exists(), "the key goes when the batch ends"


def test_another_tenant_sees_nothing(world):
    _, _, service, files = world
    batches = service()
    fid = _upload(files, "acme", 3)
    b = batches.create("acme", "sk-acme", fid, "/v1/completions", "24h")
    for call in (lambda: batches.get("rival", b["id"]), lambda: batches.cancel("rival", b["id"]),
                 lambda: files.get("rival", fid), lambda: files.content_path("rival", fid),
                 lambda: files.delete("rival", fid),
                 lambda: batches.create("rival", "sk-rival", fid, "/v1/completions", "24h")):
        with pytest.raises(ApiError) as e:
            call()
        assert e.value.status == 404
    assert batches.list("rival")["data"] == [] and files.list("rival")["data"] == []
    assert [x["id"] for x in batches.list("acme")["data"]] == [b["id"]]


def test_a_job_that_dies_is_resumed_and_every_line_is_answered_once(world):
    clock, runner, service, files = world
    batches = service()
    b = batches.create("acme", "sk-acme", _upload(files, "acme", 20), "/v1/completions", "24h")
    first = next(iter(runner.jobs))
    runner.answer(first, 7, then="FAILED")
    batches = service()  # the service restarted too: the key comes from the job before
    batches.poll()
    assert len(runner.jobs) == 2
    second = list(runner.jobs)[1]
    assert runner.jobs[second]["key"] == "sk-acme"
    assert runner.jobs[second]["output"] == runner.jobs[first]["output"]
    assert batches.get("acme", b["id"])["request_counts"]["completed"] == 7
    runner.answer(second, then="SUCCEEDED")
    batches.poll()
    b = batches.get("acme", b["id"])
    rows = _output_rows(files, "acme", b["output_file_id"])
    assert b["status"] == "completed" and sorted(r["custom_id"] for r in rows) == sorted(f"req-{i}" for i in range(20))


def test_a_job_that_keeps_failing_fails_the_batch_with_its_log(world):
    _, runner, service, files = world
    batches = service(max_attempts=2)
    b = batches.create("acme", "sk-acme", _upload(files, "acme", 4), "/v1/completions", "24h")
    for _ in range(2):
        runner.answer(list(runner.jobs)[-1], 1, then="FAILED")
        batches.poll()
    b = batches.get("acme", b["id"])
    assert b["status"] == "failed" and len(runner.jobs) == 2
    assert b["errors"]["data"][0]["code"] == "job_failed" and "log of" in b["errors"]["data"][0]["message"]
    assert len(_output_rows(files, "acme", b["output_file_id"])) == 2, "partial results are kept"


def test_cancel_stops_the_job_and_keeps_what_it_answered(world):
    _, runner, service, files = world
    batches = service()
    b = batches.create("acme", "sk-acme", _upload(files, "acme", 10), "/v1/completions", "24h")
    job = next(iter(runner.jobs))
    runner.answer(job, 3)
    b = batches.cancel("acme", b["id"])
    assert runner.stopped == [job]
    batches.poll()
    b = batches.get("acme", b["id"])
    assert b["status"] == "cancelled" and b["cancelling_at"] and b["cancelled_at"]
    assert b["request_counts"] == {"total": 10, "completed": 3, "failed": 7}  # 7 never ran
    assert batches.cancel("acme", b["id"])["status"] == "cancelled", "cancelling twice is harmless"


def test_a_finished_batch_cannot_be_cancelled(world):
    _, runner, service, files = world
    batches = service()
    b = batches.create("acme", "sk-acme", _upload(files, "acme", 2), "/v1/completions", "24h")
    runner.answer(next(iter(runner.jobs)), then="SUCCEEDED")
    batches.poll()
    with pytest.raises(ApiError) as e:
        batches.cancel("acme", b["id"])
    assert e.value.status == 409


def test_a_batch_past_its_window_expires_with_its_partial_results(world):
    clock, runner, service, files = world
    batches = service()
    b = batches.create("acme", "sk-acme", _upload(files, "acme", 10), "/v1/completions", "24h")
    runner.answer(next(iter(runner.jobs)), 4)
    clock.now += 24 * 3600
    batches.poll()
    batches.poll()
    b = batches.get("acme", b["id"])
    assert b["status"] == "expired" and b["expired_at"] and len(_output_rows(files, "acme", b["output_file_id"])) == 4


def test_a_create_while_the_job_api_is_down_is_one_batch_submitted_later(world):
    """A 503 here made the SDK's retries create a batch each, all run later."""
    _, runner, service, files = world
    batches = service()
    runner.down = True
    b = batches.create("acme", "sk-acme", _upload(files, "acme", 3), "/v1/completions", "24h")
    assert b["status"] == "validating" and runner.jobs == {}
    batches.poll()
    runner.down = False
    batches.poll()
    assert [x["id"] for x in batches.list("acme")["data"]] == [b["id"]] and len(runner.jobs) == 1
    assert batches.get("acme", b["id"])["status"] == "in_progress"


def test_a_batch_that_never_reached_its_job_expires(world):
    clock, runner, service, files = world
    batches = service()
    runner.down = True
    b = batches.create("acme", "sk-acme", _upload(files, "acme", 3), "/v1/completions", "24h")
    clock.now += 24 * 3600
    batches.poll()  # whether a job started before a crash, only the job API can say
    assert batches.get("acme", b["id"])["status"] == "validating"
    runner.down = False
    batches.poll()
    b = batches.get("acme", b["id"])
    assert b["status"] == "expired" and runner.jobs == {} and b["request_counts"]["failed"] == 3


@pytest.mark.parametrize("end", ["cancel", "expire", "complete"])
def test_a_finalize_that_fails_is_done_again_and_never_runs_the_job_again(world, monkeypatch, end):
    """A cancelled batch whose output could not be written was submitted again and ended completed."""
    clock, runner, service, files = world
    batches = service()
    b = batches.create("acme", "sk-acme", _upload(files, "acme", 10), "/v1/completions", "24h")
    job = next(iter(runner.jobs))
    runner.answer(job, 4, then="SUCCEEDED" if end == "complete" else None)
    if end == "cancel":
        batches.cancel("acme", b["id"])
    elif end == "expire":
        clock.now += 24 * 3600
        batches.poll()  # stops the job
    real, calls = files.create, []

    def failing_once(*args):
        calls.append(args)
        if len(calls) == 1:
            raise OSError("disk full")
        return real(*args)

    monkeypatch.setattr(batches._files, "create", failing_once)
    batches.poll()
    assert batches.get("acme", b["id"])["status"] == "finalizing"
    batches.poll()
    b = batches.get("acme", b["id"])
    assert b["status"] == {"cancel": "cancelled", "expire": "expired", "complete": "completed"}[end]
    assert len(runner.jobs) == 1, "a finalizing batch's job is not run again"
    assert len(_output_rows(files, "acme", b["output_file_id"])) == 4
    written = sorted(f["id"] for f in files.list("acme", purpose="batch_output")["data"])
    assert written == sorted(x for x in (b["output_file_id"], b["error_file_id"]) if x), "each file written once"
    assert len(_output_rows(files, "acme", b["error_file_id"])) == (0 if end == "complete" else 6)


@pytest.mark.parametrize("body, field, words", [
    ({"endpoint": "/v1/embeddings"}, "endpoint", "use one of"),
    ({"completion_window": "1h"}, "completion_window", "'24h'"),
    ({"metadata": {"k": 1}}, "metadata", "strings"),
    ({"input_file_id": 7}, "input_file_id", "uploaded file"),
])
def test_bad_create_fields_are_named(world, body, field, words):
    _, runner, service, files = world
    args = {"input_file_id": _upload(files, "acme", 1), "endpoint": "/v1/completions", "completion_window": "24h",
            "metadata": None, **body}
    with pytest.raises(ApiError) as e:
        service().create("acme", "sk", **args)
    assert e.value.status == 400 and e.value.param == field and words in e.value.message
    assert runner.jobs == {}


def test_lines_for_another_endpoint_fail_the_batch_naming_them(world):
    _, runner, service, files = world
    content = (_line(0) + "\n" + _line(1, "/v1/chat/completions") + "\n").encode()
    fid = files.create("acme", "in.jsonl", "batch", content)["id"]
    b = service().create("acme", "sk", fid, "/v1/completions", "24h")
    assert b["status"] == "failed" and runner.jobs == {}
    assert b["errors"]["data"][0]["line"] == 2 and "/v1/chat/completions" in b["errors"]["data"][0]["message"]


def test_a_prompt_holding_a_unicode_line_separator_is_one_request(world):
    _, runner, service, files = world
    line = json.dumps({"custom_id": "req-0", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "m", "prompt": "a\u2028b\u0085c", "max_tokens": 4}}, ensure_ascii=False)
    fid = files.create("acme", "in.jsonl", "batch", (line + "\n" + _line(1) + "\n").encode())["id"]
    b = service().create("acme", "sk", fid, "/v1/completions", "24h")
    assert b["status"] == "in_progress" and b["request_counts"]["total"] == 2 and len(runner.jobs) == 1


def test_an_output_file_cannot_be_a_batchs_input(world):
    _, _, service, files = world
    fid = files.create("acme", "out.jsonl", "batch_output", b"{}\n")["id"]
    with pytest.raises(ApiError) as e:
        service().create("acme", "sk", fid, "/v1/completions", "24h")
    assert e.value.status == 400 and "purpose" in e.value.message


@pytest.mark.parametrize("seed", range(30))
def test_random_crashes_restarts_and_cancels_never_lose_or_repeat_a_line(world, seed):
    """Seeded schedules: jobs answer some lines and crash, the service restarts (or dies between
    starting a job and saving that it did), polls come at any time, a cancel may come. Once the
    faults end and the jobs run to their end, the batch ends, failed only by its jobs; no line is
    answered twice; a completed batch answered every line. After each poll, a marker exists
    exactly while the batch is unfinished, and a batch in progress counts its output's lines."""
    clock, runner, service, files = world
    rng = random.Random(seed)
    lines = rng.randint(1, 30)
    attempts = 3 + seed % 4  # some schedules use every attempt up
    batches = service(max_attempts=attempts)
    real_create, disk = files.create, {"full": False}

    def create_file(*args):
        if disk["full"]:
            raise OSError("disk full")
        return real_create(*args)

    runner.down = rng.random() < 0.3
    b = batches.create("acme", "sk-acme", _upload(files, "acme", lines), "/v1/completions", "24h")
    batch_dir = Path(files._dir("acme")).parent / "batches"
    cancelled_with_jobs = None  # how many jobs there were when a cancel was accepted
    for _ in range(300):
        record = batches.get("acme", b["id"])
        if record["status"] in TERMINAL:
            running = [j for j, x in runner.jobs.items() if x["state"] == "RUNNING"]
            assert not running, f"seed {seed}: the batch is {record['status']} and job {running} still runs"
            break
        batches._files.create = create_file
        move = rng.random()
        job = list(runner.jobs)[-1] if runner.jobs else None
        if move < 0.4 and job and runner.jobs[job]["state"] == "RUNNING":
            then = rng.choice([None, None, "FAILED", "SUCCEEDED"])
            runner.answer(job, None if then == "SUCCEEDED" else rng.randint(0, 5), then=then)
        elif move < 0.5:
            batches = service(max_attempts=attempts)
        elif move < 0.53:
            batches.cancel("acme", b["id"])  # accepted even with the job API down: a poll ends it
            cancelled_with_jobs = len(runner.jobs) if cancelled_with_jobs is None else cancelled_with_jobs
        elif move < 0.6:
            runner.down = not runner.down
        elif move < 0.65:
            disk["full"] = not disk["full"]
        elif move < 0.7:
            runner.die_after_submit = not runner.die_after_submit
        clock.now += rng.randint(0, 30) if rng.random() < 0.99 else 24 * 3600
        was = batches.get("acme", b["id"])["status"]
        batches.poll()
        now = batches.get("acme", b["id"])
        assert (batch_dir / "open" / b["id"]).exists() == (now["status"] not in TERMINAL), f"seed {seed}: marker"
        if was == now["status"] == "in_progress" and not (runner.down or runner.die_after_submit):  # counted on
            out = batch_dir / b["id"] / "output.jsonl"
            rows = [x for x in out.read_text().split("\n")[:-1] if x.strip()] if out.exists() else []
            assert now["request_counts"]["completed"] + now["request_counts"]["failed"] == len(rows), f"seed {seed}"
    runner.down, disk["full"], runner.die_after_submit = False, False, False
    for _ in range(6):  # the faults end and jobs run to their end: the batch must end too
        job = list(runner.jobs)[-1] if runner.jobs else None
        if job and runner.jobs[job]["state"] == "RUNNING":
            runner.answer(job, then="SUCCEEDED")
        batches.poll()
    record = batches.get("acme", b["id"])
    assert record["status"] in TERMINAL, f"seed {seed}: still {record['status']}"
    if record["status"] == "failed":  # only its jobs' failures fail it (its input is good)
        assert record["errors"]["data"][0]["code"] == "job_failed", f"seed {seed}: {record['errors']}"
    assert [x["id"] for x in batches.list("acme")["data"]] == [b["id"]], "one create, one batch"
    if cancelled_with_jobs is not None:
        assert len(runner.jobs) == cancelled_with_jobs, f"seed {seed}: a job submitted after the cancel was accepted"
        assert record["status"] == "cancelled", f"seed {seed}: an accepted cancel ended {record['status']}"
    rows = _output_rows(files, "acme", record["output_file_id"]) + _output_rows(files, "acme", record["error_file_id"])
    ids = [r["custom_id"] for r in rows]
    assert len(ids) == len(set(ids)), f"seed {seed}: a line answered twice"
    assert record["request_counts"]["completed"] + record["request_counts"]["failed"] == len(ids)
    if record["status"] == "completed":
        assert sorted(ids) == sorted(f"req-{i}" for i in range(lines))
