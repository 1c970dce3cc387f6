"""How a batch ends: no job left running, and every line in its output or its error file, whatever crashed."""

from __future__ import annotations

import pytest

from tests.unit.test_batches import _output_rows, _upload, world  # noqa: F401 (a fixture)


@pytest.mark.parametrize("end", ["cancel", "expire"])
def test_a_job_started_before_a_crash_kept_its_record_from_naming_it_is_stopped_too(world, end):
    """The job of the next attempt started, and the service died before the batch's record
    named it: a cancel or the window's end saw the old, failed job and ended the batch, and the
    new one ran on under the tenant's key, writing to an output already split."""
    clock, runner, service, files = world
    batches = service()
    b = batches.create("acme", "sk-acme", _upload(files, "acme", 10), "/v1/completions", "24h")
    runner.answer(next(iter(runner.jobs)), 3, then="FAILED")
    runner.die_after_submit = True
    batches.poll()  # the second job starts; the service dies before saving so
    runner.die_after_submit = False
    batches = service()
    assert batches.get("acme", b["id"])["status"] == "in_progress" and len(runner.jobs) == 2
    if end == "cancel":
        batches.cancel("acme", b["id"])
    else:
        clock.now += 24 * 3600
    for _ in range(3):
        batches.poll()
    assert batches.get("acme", b["id"])["status"] == ("cancelled" if end == "cancel" else "expired")
    assert [j for j, x in runner.jobs.items() if x["state"] == "RUNNING"] == []


@pytest.mark.parametrize("end", ["cancelled", "expired", "failed"])
def test_every_line_of_a_batch_that_ends_early_is_accounted_for(world, end):
    """The lines a batch never reached were in neither file, and its counts did not add up to
    its total: they are in the error file with the batch's end (`batch_expired`, as OpenAI's)."""
    clock, runner, service, files = world
    batches = service(max_attempts=1)
    b = batches.create("acme", "sk-acme", _upload(files, "acme", 10), "/v1/completions", "24h")
    job = next(iter(runner.jobs))
    runner.answer(job, 4, fail_every=3)  # lines 0-3: line 3 refused (429)
    if end == "cancelled":
        batches.cancel("acme", b["id"])
    elif end == "expired":
        clock.now += 24 * 3600
    else:
        runner.jobs[job]["state"] = "FAILED"
    for _ in range(3):
        batches.poll()
    b = batches.get("acme", b["id"])
    assert b["status"] == end and b["request_counts"] == {"total": 10, "completed": 3, "failed": 7}
    answered = _output_rows(files, "acme", b["output_file_id"])
    errors = _output_rows(files, "acme", b["error_file_id"])
    assert sorted(r["custom_id"] for r in answered + errors) == sorted(f"req-{i}" for i in range(10))
    missing = [r for r in errors if r["response"] is None]
    assert len(missing) == 6 and {r["error"]["code"] for r in missing} == {f"batch_{end}"}


def test_a_cancel_while_the_job_api_is_down_is_kept(world):
    """A cancel that asked the job API whether a job had started raised while it was down: the
    cancel was never saved, and a poll once it was back submitted the batch."""
    clock, runner, service, files = world
    batches = service()
    runner.down = True
    b = batches.create("acme", "sk-acme", _upload(files, "acme", 3), "/v1/completions", "24h")
    assert b["status"] == "validating" and batches.cancel("acme", b["id"])["status"] == "cancelling"
    batches = service()  # what was saved
    batches.poll()
    runner.down = False
    batches.poll()
    b = batches.get("acme", b["id"])
    assert b["status"] == "cancelled" and runner.jobs == {} and b["request_counts"]["failed"] == 3
