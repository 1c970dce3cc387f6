"""A batch that ends leaves no job running, whatever crashed on the way."""

from __future__ import annotations

import pytest

from tests.unit.test_batches import _upload, world  # noqa: F401 (a fixture)


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
