"""The batch job's pure parts: parsing, validation, resume bookkeeping, retry timing."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deployments.batch_job import Progress, RetryPolicy, retry_after_of, run_one
from infra.batchfile import (BatchRequest, LineProblem, completed_ids, jsonl_lines, parse_line, read_input,
                             result_line)


def line(cid="a", url="/v1/chat/completions", body=None, **extra) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url,
                       "body": body if body is not None else {"messages": [{"role": "user", "content": "x"}]},
                       **extra})


@pytest.mark.parametrize("text, fragment", [
    ("{not json", "not valid JSON"),
    ('{"custom_id": "a', "(Unterminated string starting at column 15)"),
    ("[1]", "must be a JSON object"),
    (line(cid=""), "custom_id must be a non-empty string"),
    (line(cid=7), "custom_id must be a non-empty string"),
    (line(url="/v1/embeddings"), "url '/v1/embeddings'"),
    (line(body="hello"), "body must be a JSON object"),
    (line(method="GET"), "only POST"),
    (line(body={"prompt": "p"}).replace('"p"}', '"p", "temperature": 1e999}'), "too large for a number"),
    # Python's json takes these and httpx sends neither: the job raised on the line and died,
    # every attempt, failing the whole batch (found by a review)
    (line(body={"prompt": "p"}).replace('"p"}', '"p", "temperature": NaN}'), "NaN is not JSON"),
    (line(body={"prompt": "p"}).replace('"p"}', '"p", "top_p": -Infinity}'), "-Infinity is not JSON"),
    (line(cid="\ud800", body={"prompt": "p"}), "lone UTF-16 surrogate"),
    (line(body={"prompt": "p"}).replace('"p"}', '"\\ud800"}'), "lone UTF-16 surrogate"),
])
def test_bad_lines_are_named(text, fragment):
    p = parse_line(3, text)
    assert isinstance(p, LineProblem) and p.line == 3 and fragment in p.message


def test_good_lines_parse():
    r = parse_line(1, line(cid="x1", url="/v1/completions", body={"prompt": "p"}))
    assert r == BatchRequest(1, "x1", "completions", {"prompt": "p"})


def test_read_input_reports_every_problem_with_line_numbers():
    lines = [line("a"), "oops", "", line("b"), line("a")]
    requests, problems = read_input(lines)
    assert [r.custom_id for r in requests] == ["a", "b"]
    assert [str(p) for p in problems] == [
        "line 2: not valid JSON (Expecting value at column 1)",
        "line 5: duplicate custom_id 'a' (first on line 1)",
    ]


@settings(deadline=None)
@given(prompts=st.lists(st.text(), min_size=1, max_size=8), crlf=st.booleans(), last_newline=st.booleans())
def test_any_prompt_written_as_json_lines_reads_back_whole(prompts, crlf, last_newline):
    """JSON may hold U+0085, U+2028 and U+2029 unescaped (`ensure_ascii=False`): they are not line
    ends in JSON Lines, where `str.splitlines` would cut a line in two."""
    end = "\r\n" if crlf else "\n"
    text = end.join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"prompt": p}}, ensure_ascii=False) for i, p in enumerate(prompts))
    requests, problems = read_input(jsonl_lines((text + (end if last_newline else "")).encode()))
    assert problems == []
    assert [r.body["prompt"] for r in requests] == prompts and [r.line for r in requests] == list(
        range(1, len(prompts) + 1))


def test_resume_skips_written_ids_and_cuts_a_partial_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text(result_line("a", 200, {}, None) + result_line("b", 400, {}, None) + '{"id": "batch_req_x", "cus')
    assert completed_ids(out) == {"a", "b"}
    assert out.read_text().endswith("\n") and len(out.read_text().splitlines()) == 2
    assert completed_ids(tmp_path / "missing.jsonl") == set()


def test_result_line_format():
    ok = json.loads(result_line("a", 200, {"usage": {}}, "req-1"))
    assert ok["custom_id"] == "a" and ok["response"] == {"status_code": 200, "request_id": "req-1", "body": {"usage": {}}}
    assert ok["error"] is None and ok["id"].startswith("batch_req_")
    failed = json.loads(result_line("b", None, None, None, {"code": "connection_error", "message": "refused"}))
    assert failed["response"] is None and failed["error"]["code"] == "connection_error"


class FixedRandom(random.Random):
    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


@pytest.mark.parametrize("attempt, retry_after, rnd, expected", [
    (1, 7.0, 0.0, 7.0),  # honours Retry-After exactly at no jitter
    (1, 7.0, 1.0, 8.75),  # plus at most 25%
    (1, None, 0.0, 1.0),  # back-off without a header: 1, 2, 4, ...
    (4, None, 0.0, 8.0),
    (10, None, 0.0, 60.0),  # capped
    (1, 300.0, 0.0, 60.0),
])
def test_retry_delay(attempt, retry_after, rnd, expected):
    assert RetryPolicy().delay(attempt, retry_after, FixedRandom(rnd)) == pytest.approx(expected)


def test_retry_after_header_parsing():
    assert retry_after_of({"retry-after": "3"}) == 3.0
    assert retry_after_of({"retry-after": "soon"}) is None
    assert retry_after_of({}) is None


def _run(responses: list[httpx.Response], policy=RetryPolicy(max_attempts=4), body: dict | None = None):
    """run_one against a fake transport; sleeps recorded instead of slept (a fake clock)."""
    calls, slept = [], []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(json.loads(request.content))
        return responses[len(calls) - 1]

    async def fake_sleep(s):
        slept.append(s)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            progress = Progress(total=1)
            text = await run_one(client, "http://r/offline/v1", "k", BatchRequest(1, "c1", "completions",
                                                                                  body or {"prompt": "p", "stream": True}),
                                 policy, FixedRandom(0.0), progress, sleep=fake_sleep)
            return json.loads(text), progress

    out, progress = asyncio.run(go())
    return out, progress, calls, slept


def test_a_line_asking_a_stream_with_options_is_sent_whole_without_them():
    """The runner asks for whole answers; vLLM refuses stream_options without a stream, so such a
    line (accepted at upload) failed every time."""
    ok = httpx.Response(200, json={"usage": {"total_tokens": 3}})
    out, _, calls, _ = _run([ok], body={"prompt": "p", "stream": True, "stream_options": {"include_usage": True}})
    assert calls == [{"prompt": "p", "stream": False}] and out["response"]["status_code"] == 200


def test_429_then_success_waits_retry_after():
    ok = httpx.Response(200, json={"usage": {"total_tokens": 9}}, headers={"x-request-id": "r1"})
    out, progress, calls, slept = _run([httpx.Response(429, headers={"retry-after": "2"}, json={}), ok])
    assert out["response"]["status_code"] == 200 and slept == [2.0]
    assert progress.done == 1 and progress.retried == 1 and progress.tokens == 9
    assert calls[0]["stream"] is False  # a batch job never streams
    assert calls[1] == calls[0] == {"prompt": "p", "stream": False}, "every attempt sends the line's body"


def test_400_is_an_error_line_without_retry():
    out, progress, calls, slept = _run([httpx.Response(400, json={"error": {"message": "bad"}})])
    assert out["response"]["status_code"] == 400 and slept == [] and progress.failed == 1 and len(calls) == 1


def test_the_tenants_own_quota_is_waited_out_and_never_fails_a_line():
    """Lines refused by the tenant's own limits (a batch concurrency above its max_concurrent, a
    minute's tokens spent) failed for good after eight tries, and a resumed job skipped them as
    answered: the input was lost to the tenant's own pacing."""
    quota = [httpx.Response(429, headers={"retry-after": "3"}, json={"error": {"code": code}})
             for code in ["concurrency_quota_exceeded", "tokens_quota_exceeded", "requests_quota_exceeded"] * 4]
    ok = httpx.Response(200, json={"usage": {"total_tokens": 5}})
    out, progress, calls, slept = _run(quota + [ok])  # 12 waits, with max_attempts 4
    assert out["response"]["status_code"] == 200 and len(calls) == 13 and slept == [3.0] * 12
    assert progress.done == 1 and progress.failed == 0


def test_a_request_too_large_for_the_quota_is_not_retried():
    too_large = httpx.Response(429, json={"error": {"code": "request_too_large_for_quota", "message": "m"}})
    out, progress, calls, slept = _run([too_large])
    assert out["response"]["status_code"] == 429 and len(calls) == 1 and slept == [] and progress.failed == 1


@pytest.mark.parametrize("status", [502, 503])  # 502: the router's "retry it" of a pool that answered nothing
def test_502_and_503_are_retried_up_to_max_attempts_and_500_and_504_are_not(status):
    busy = [httpx.Response(status, json={"error": {}}) for _ in range(4)]
    out, progress, calls, slept = _run(busy)
    assert len(calls) == 4 and slept == [1.0, 2.0, 4.0] and out["response"]["status_code"] == status
    for code, failed in ((504, "pool_timeout"), (500, "engine_failed")):  # engine time, charged: not asked again
        out, _, calls, _ = _run([httpx.Response(code, json={"error": {"code": failed}})])
        assert out["response"]["status_code"] == code and len(calls) == 1
    assert progress.failed == 1 and progress.retried == 3


def test_a_live_pools_back_pressure_paces_the_job_and_fails_no_line():
    """A pool's queue full, an eviction by more important work, no replica free to pick the
    request up: each counted as an attempt, and eight of them failed the line for good (a
    resumed job skips it as answered) while the pool was only busy (found by a review)."""
    busy = [httpx.Response(429, headers={"retry-after": "2"}, json={"error": {"code": code}})
            for code in ["queue_full", "evicted", "pool_busy"] * 3]
    out, progress, calls, _ = _run(busy + [httpx.Response(200, json={"usage": {"total_tokens": 5}})])
    assert out["response"]["status_code"] == 200 and len(calls) == 10 and progress.failed == 0
    # ...but not for ever: a pool that answers back-pressure for good (a wedged engine whose
    # replica still reports) held a job with no batch window for ever
    out, progress, calls, slept = _run(busy, RetryPolicy(max_attempts=4, max_paced_s=5.0))
    assert out["response"]["status_code"] == 429 and progress.failed == 1 and len(calls) == 4 and sum(slept) == 6.0


@pytest.mark.parametrize("flag", ["--concurrency", "--max-attempts"])
def test_a_count_below_one_is_refused(flag, tmp_path, capsys):
    """--concurrency 0 started no worker and the job succeeded with no line answered;
    --max-attempts 0 retried a failing line for ever (found by a review)."""
    from deployments.batch_job import main

    with pytest.raises(SystemExit) as e:
        main(["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"), flag, "0"])
    assert e.value.code == 2 and "1 or more" in capsys.readouterr().err


def test_a_line_the_job_cannot_send_is_answered_with_its_error_and_the_others_go_on(tmp_path):
    """One line whose sending raised (not an HTTP error) ended the job, dropping the lines in
    flight and failing every attempt of the batch (found by a review)."""
    from deployments.batch_job import run

    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content)["prompt"])
        return httpx.Response(200, json={"usage": {"total_tokens": 1}})

    real = httpx.AsyncClient
    lines = [BatchRequest(1, "a", "completions", {"prompt": "a"}),
             BatchRequest(2, "b", "completions", {"prompt": "b", "temperature": float("nan")}),
             BatchRequest(3, "c", "completions", {"prompt": "c"})]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(httpx, "AsyncClient", lambda **k: real(transport=httpx.MockTransport(handler)))
        progress = asyncio.run(run(lines, tmp_path / "out.jsonl", "http://r/offline/v1", "k", 1, RetryPolicy()))
    rows = {r["custom_id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert sorted(sent) == ["a", "c"] and progress.failed == 1 and progress.done == 2
    assert rows["b"]["error"]["code"] == "request_failed" and "ValueError" in rows["b"]["error"]["message"]


def test_an_entrypoint_keeps_paths_whole_and_runs_nothing_in_them():
    import shlex

    from deployments.batch_cli import entrypoint

    crafted = "/data/my batch; touch /tmp/owned.jsonl"
    cmd = entrypoint(crafted, "/data/out put.jsonl", "http://r", "offline", 8)
    args = shlex.split(cmd)
    assert args[args.index("--input") + 1] == crafted and args[args.index("--output") + 1] == "/data/out put.jsonl"
    assert "touch" not in args  # the whole path is one argument, never a command


def test_a_job_ray_no_longer_knows_ends_failed_and_stopping_it_is_done(monkeypatch):
    """Ray answers 404 for a job it lost (a head restarted without its GCS): the batch stayed
    in_progress for good and could not be cancelled. A failed job is resumed by a new one; the
    last attempt's lost logs raised, and its batch waited out its window instead of failing."""
    from deployments import batch_cli

    class Lost:
        def _gone(self, job_id):
            raise RuntimeError(f"Request failed with status code 404: Job {job_id} does not exist.")

        get_job_status = stop_job = get_job_logs = _gone

    class Down:
        def get_job_status(self, job_id):
            raise RuntimeError("Request failed with status code 503: unavailable.")

    monkeypatch.setattr(batch_cli, "_client", lambda address: Lost())
    runner = batch_cli.RayJobRunner("http://head:8265")
    assert runner.status("poolserve-batch_1-1") == "FAILED"
    runner.stop("poolserve-batch_1-1")  # nothing left to stop
    assert "no longer knows" in runner.logs("poolserve-batch_1-1")  # its batch's last attempt can fail
    monkeypatch.setattr(batch_cli, "_client", lambda address: Down())
    with pytest.raises(RuntimeError, match="503"):  # not knowing is not "gone": the poll asks again
        batch_cli.RayJobRunner("http://head:8265").status("poolserve-batch_1-1")


def test_the_job_runner_keeps_its_client_while_the_job_api_answers(monkeypatch):
    """A client was made for every call: each asked the job API its version first, and on
    KubeRay (RAY_ADDRESS set) the GCS where the API is, two calls more per batch at every poll."""
    from types import SimpleNamespace

    from deployments import batch_cli

    made, answers = [], iter([SimpleNamespace(value="RUNNING"), ConnectionError("head restarted"),
                              SimpleNamespace(value="SUCCEEDED")])

    class Jobs:
        def get_job_status(self, job_id):
            answer = next(answers)
            if isinstance(answer, Exception):
                raise answer
            return answer
    monkeypatch.setattr(batch_cli, "_client", lambda address: made.append(address) or Jobs())
    runner = batch_cli.RayJobRunner("http://head:8265")
    assert runner.status("j") == "RUNNING" and len(made) == 1
    with pytest.raises(ConnectionError):
        runner.status("j")
    assert runner.status("j") == "SUCCEEDED" and len(made) == 2, "made anew after a failure"
    older = batch_cli.RayJobRunner.__new__(batch_cli.RayJobRunner)
    older.__dict__.update(_address="http://head:8265")  # as a version before pickled it
    answers = iter([SimpleNamespace(value="RUNNING")])
    assert older.status("j") == "RUNNING"


@pytest.mark.parametrize("known", [False, True], ids=["new", "submitted before"])
def test_a_job_name_submitted_again_is_the_job_it_names(monkeypatch, known):
    """The batch service can die after Ray took a batch's job and before its record said so;
    the next one submits the name again, Ray refuses it, and the batch's every poll raised.
    A refusal for a name Ray knows is that job; any other refusal stands."""
    from types import SimpleNamespace

    from deployments import batch_cli

    class Jobs:
        def submit_job(self, entrypoint, submission_id, metadata):
            if known:
                raise RuntimeError(f"Request failed with status code 500: Job with submission_id {submission_id} "
                                   "already exists. Please use a different submission_id.")
            raise RuntimeError("Request failed with status code 503: unavailable.")

        def get_job_info(self, job_id):
            if not known:
                raise RuntimeError(f"Request failed with status code 404: Job {job_id} does not exist.")
            return SimpleNamespace(submission_id=job_id)

    monkeypatch.setattr(batch_cli, "_client", lambda address: Jobs())
    runner = batch_cli.RayJobRunner("http://head:8265")
    if known:
        assert runner.submit("poolserve-batch_1-1", ["--input", "x"]) == "poolserve-batch_1-1"
    else:
        with pytest.raises(RuntimeError, match="503"):
            runner.submit("poolserve-batch_1-1", ["--input", "x"])


@pytest.mark.parametrize("custom_id", ["plain-1", "résumé №7", "emoji 🚀", "line\nbreak"])
def test_any_custom_id_makes_a_valid_header(custom_id):
    from urllib.parse import unquote

    from deployments.batch_job import request_id

    value = request_id(custom_id)
    httpx.Headers({"x-request-id": value})  # raises on a value HTTP cannot carry
    assert value.isascii() and unquote(value) == custom_id


def test_long_custom_ids_get_distinct_request_ids_with_whole_escapes():
    from urllib.parse import unquote

    from deployments.batch_job import request_id

    ids = ["é" * 200 + "a", "é" * 200 + "b", "x" * 300, "x" * 299 + "é"]
    values = [request_id(c) for c in ids]
    assert len(set(values)) == len(ids)
    for c, v in zip(ids, values):
        httpx.Headers({"x-request-id": v})
        assert v.isascii() and len(v) <= 256
        assert c.startswith(unquote(v.rsplit("~", 1)[0]))  # a whole prefix: no escape cut in half


def test_the_output_is_held_by_one_job_and_readable_by_its_owner_only(tmp_path):
    import os
    import stat

    from deployments.batch_job import Output, OutputBusy

    out = tmp_path / "out.jsonl"
    out.write_text("")
    os.chmod(out, 0o644)  # left readable by an older job
    first = Output(out)
    with pytest.raises(OutputBusy, match="another job is writing"):
        Output(out, wait_s=0)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    first.write(result_line("a", 200, {}, None))
    first.close()
    Output(out).close()  # free again once the first job ended


def test_a_job_waits_out_a_probe_of_its_output(tmp_path, monkeypatch):
    """The batch service probes an output's lock for an instant to learn whether a job still
    writes it (router.batch_records.output_held): a job starting then was refused as if another
    job wrote its output, and lost an attempt."""
    import fcntl
    import os
    import time

    from deployments.batch_job import Output
    from router.batch_records import output_held

    out = tmp_path / "out.jsonl"
    out.write_text("")
    probe = os.open(out, os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    waits = []
    monkeypatch.setattr(time, "sleep", lambda s: (waits.append(s), waits[1:] or os.close(probe)))  # probe ends
    Output(out).close()
    assert len(waits) == 1, "refused at the first try, taken at the next"
    assert not output_held(out)
