"""A batch's job keeps no more requests outstanding than its tenant may have."""

from __future__ import annotations

from router.batches import Batches, BatchSettings
from router.files import FileStore
from tests.unit.test_batches import Clock, FakeRunner, _upload


def test_a_job_keeps_no_more_requests_outstanding_than_its_tenants_max_concurrent(tmp_path):
    """A tenant of 4 slots had 64 workers, 60 of them refused (429) and retrying every second:
    load on the router and the ledger that bought nothing (found by a review)."""
    clock, runner = Clock(), FakeRunner()
    settings = BatchSettings(tmp_path, "http://router", "offline", concurrency=64, tenant_concurrency={"acme": 4})
    batches = Batches(settings, FileStore(tmp_path, clock), runner, clock)
    for tenant in ("acme", "beta"):
        batches.create(tenant, f"k-{tenant}", _upload(FileStore(tmp_path, clock), tenant, 5), "/v1/completions", "24h")
    assert {job["key"]: job["concurrency"] for job in runner.jobs.values()} == {"k-acme": 4, "k-beta": 64}
