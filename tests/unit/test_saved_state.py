"""State saved by one process and read back by the next (a restart, or another version of
poolserve): a record that no longer reads (another shape, a damaged key, NaN) is that record's
trouble, logged, never the whole service's: no constructor raises, no loop stops, no list 500s."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import time
from pathlib import Path

import pytest

from router.errors import ApiError
from router.quota import Need, Quota
from tests.unit.test_batch_api import _file
from tests.unit.test_batches import _output_rows, _upload, world  # noqa: F401 (a fixture)


@pytest.mark.parametrize("damage", [
    "not json", [1], {"tokens": 5}, {"tokens": {"level": None, "updated": 1000.0}},
    {"tokens": {"level": 10.0, "updated": float("nan")}}, {"slots_out": None}, {"slots_out": {"router-1": "x"}},
    {"seen": {"router-1": float("nan")}},
], ids=["not json", "not a mapping", "bucket number", "level null", "updated nan", "slots null", "slots text",
        "seen nan"])
def test_an_account_that_no_longer_reads_starts_afresh_and_the_others_are_kept(damage, caplog):
    """A saved account of another shape (another version, a damaged key) made the ledger's
    constructor raise: the control app, router included, could not start, at every restart. A
    NaN time never refilled the bucket (the tenant refused for good) or never let a router's
    slots go. That tenant starts afresh, logged; the others keep their saved accounts."""
    import json

    from infra.state import MemoryStore
    from router.leases import LedgerService

    class Store(MemoryStore):
        def get(self, key):
            value = super().get(key)
            if value == "not json":
                return json.loads("{not json")  # what the GCS store's json.loads raises
            return value

    async def go():
        quotas = {"t": Quota(tokens_per_min=6000, max_concurrent=4), "u": Quota(tokens_per_min=6000)}
        store, now = Store(), [1000.0]
        first = LedgerService(quotas, clock=lambda: now[0], store=store)
        await first.grant("u", "router-1", Need(tokens=5000))
        store.put(LedgerService.PREFIX + "t", damage)
        now[0] += 6.0
        with caplog.at_level("WARNING", logger="poolserve.router"):
            second = LedgerService(quotas, clock=lambda: now[0], store=store)
        return await second.usage("t"), await second.usage("u"), await second.grant("t", "r", Need(slots=4))

    t, u, granted = asyncio.run(go())
    assert t["remaining_tokens"] == 6000 and t["concurrent"] == 0 and granted.granted
    assert u["remaining_tokens"] == pytest.approx(1000 + 600)
    assert any("quota-ledger/t" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


@pytest.mark.parametrize("damage", ["[]", '"x"', '{"id": "batch_%s"}', '{"status": "in_progress"}', "_tenant", "_job",
                                    "=\udcff", "=beta"],
                         ids=["list", "string", "no status", "no id", "no tenant", "no job", "tenant no folder can be",
                              "another tenant"])
def test_a_batch_record_that_no_longer_reads_stops_no_other_batch(world, damage, caplog):
    """Records outlive a version of the service: one of another shape made every poll raise
    before the batches after it (every tenant's) moved on, and the tenant's batch list a 500;
    one missing a field only moving it on reads raised at every poll, for good. One naming a
    tenant no folder can be named for (a lone surrogate) raised at every poll and at the
    service's start, and one naming another tenant was moved on with that tenant's files (both
    found by a review)."""
    clock, runner, service, files = world
    batches = service()
    b = batches.create("acme", "sk-acme", _upload(files, "acme", 3), "/v1/completions", "24h")
    folder = Path(files._dir("acme")).parent / "batches"
    record = json.loads((folder / f"{b['id']}.json").read_text())
    for i in range(3):  # before and after the good one, whatever order the folder lists them in
        path = folder / f"batch_{i:024x}.json"
        if damage.startswith("_"):  # a field missing
            path.write_text(json.dumps({k: v for k, v in {**record, "id": path.stem}.items() if k != damage}))
        elif damage.startswith("="):  # another tenant's name
            path.write_text(json.dumps({**record, "id": path.stem, "_tenant": damage[1:]}))
        else:
            path.write_text(damage.replace("%s", f"{i:024x}"))
    runner.answer(next(iter(runner.jobs)), then="SUCCEEDED")
    with caplog.at_level("WARNING", logger="poolserve.router"):
        batches = service()  # a restart: the records of a version that kept no markers are read
        for _ in range(3):
            batches.poll()
    assert batches.get("acme", b["id"])["status"] == "completed"
    assert [x["id"] for x in batches.list("acme")["data"]] == [b["id"]]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3 and all("cannot be read" in m for m in said), said  # once each, no traceback per poll


@pytest.mark.parametrize("rows", [b"[1]\n", b'{"custom_id": "req-9", "response": [200]}\n', b"\xff\xfe{}\n"],
                         ids=["not an object", "response a list", "not utf-8"])
def test_a_damaged_output_row_is_skipped_and_the_batch_finishes(world, rows):
    """A row of the job's output that is not what the job writes stuck its batch: every poll
    raised counting it, and the batch never finished nor expired."""
    clock, runner, service, files = world
    batches = service()
    b = batches.create("acme", "sk-acme", _upload(files, "acme", 3), "/v1/completions", "24h")
    job = next(iter(runner.jobs))
    with runner.jobs[job]["output"].open("ab") as f:
        f.write(rows)
    runner.answer(job, then="SUCCEEDED")
    batches.poll()
    done = batches.get("acme", b["id"])
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 3
    assert {r["custom_id"] for r in _output_rows(files, "acme", done["output_file_id"])} == {"req-0", "req-1", "req-2"}


@pytest.mark.parametrize("change", [{"created_at": None}, {"created_at": "yesterday"}, {"purpose": None},
                                    {"bytes": "many"}, {"expires_at": float("nan")}],
                         ids=["created null", "created text", "no purpose", "bytes text", "expiry nan"])
def test_a_file_object_that_no_longer_reads_is_gone_not_a_500(world, change):
    """A file's object of another shape made the tenant's file list raise at every call (a
    500); with a NaN expiry the file never expired."""
    clock, _, _, files = world
    keep, damaged = _upload(files, "acme", 1), _upload(files, "acme", 1)
    path = Path(files._dir("acme")) / f"{damaged}.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    assert [f["id"] for f in files.list("acme")["data"]] == [keep]
    with pytest.raises(ApiError) as e:
        files.get("acme", damaged)
    assert e.value.status == 404


def test_a_write_the_disk_takes_in_part_is_finished_not_torn_mid_file(tmp_path, monkeypatch):
    """`os.write` may take part of a line (a volume filling up, a signal): the rest was dropped
    and the next line appended after it, a tear in the middle of the output that no resume cuts."""
    import os

    from deployments import batch_job
    from infra.batchfile import completed_ids, result_line

    real = os.write
    monkeypatch.setattr(batch_job.os, "write", lambda fd, data: real(fd, data[:7]))
    out = batch_job.Output(tmp_path / "out.jsonl")
    for i in range(3):
        out.write(result_line(f"req-{i}", 200, {"text": "é" * i}, "r"))
    out.close()
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert [json.loads(x)["custom_id"] for x in lines] == ["req-0", "req-1", "req-2"]
    assert completed_ids(tmp_path / "out.jsonl") == {"req-0", "req-1", "req-2"}


def test_what_a_volume_holds_besides_tenants_folders_stops_no_tenants_batches(world):
    """A symlink loop beside the tenants' folders made every poll raise once the folders were
    listed by hand (pathlib's glob had passed over it), and a `batches` that is a file kept its
    tenant's expired files for ever (both found by a review)."""
    clock, runner, service, files = world
    batches = service()
    made = batches.create("acme", "k", _upload(files, "acme", 1), "/v1/completions", "24h")
    old = files.create("beta", "in.jsonl", "batch", b"{}\n", expires_after_s=3600)["id"]
    (files._dir("beta").parent / "batches").write_text("not a folder")
    root = files._dir("acme").parent.parent
    (root / "loop").symlink_to("loop")
    runner.answer(next(iter(runner.jobs)), then="SUCCEEDED")
    clock.now += 7200
    batches.poll()
    assert batches.get("acme", made["id"])["status"] == "completed"
    with pytest.raises(ApiError):
        files.get("beta", old, expired_ok=True)


def test_a_record_in_a_folder_the_volume_failed_to_list_is_marked_once_it_lists(world, monkeypatch):
    """A sweep that could not list one tenant's batches moved its scan past the records it
    did see, so that tenant's records of the version before (no marker) older than the scan's
    margin were never read once its folder listed again: never marked, never moved, their
    expired inputs swept (found by a review)."""
    clock, runner, service, files = world
    monkeypatch.setattr("router.batch_records.RESCAN_MARGIN_NS", 0)  # the margin, as if it had passed
    batches = service()
    old = files.create("beta", "in.jsonl", "batch", _file(1), expires_after_s=3600)["id"]
    unmarked = batches.create("beta", "k", old, "/v1/completions", "24h")
    (files._dir("beta").parent / "batches" / "open" / unmarked["id"]).unlink()  # as the version before keeps it
    time.sleep(0.05)  # a later change time for the next record (the volume's clock, not a wait for anything)
    batches.create("acme", "k", _upload(files, "acme", 1), "/v1/completions", "24h")
    clock.now += 7200
    refused, scandir = str(files._dir("beta").parent / "batches"), os.scandir
    with monkeypatch.context() as m:
        m.setattr(os, "scandir", lambda p=".": (_ for _ in ()).throw(OSError(errno.EIO, "I/O error"))
                  if str(p) == refused else scandir(p))
        batches.poll()
    clock.now += 61
    batches.poll()
    assert (files._dir("beta").parent / "batches" / "open" / unmarked["id"]).exists(), "never marked"
    assert files.content_path("beta", old, expired_ok=True).exists(), "its input swept"




def _unmarked_then_others(world, monkeypatch) -> tuple:
    """beta's batch of the version before (no marker, an expiring input), then acme's three, each
    record changed later than the one before; the scan's margin as if it had passed."""
    clock, runner, service, files = world
    monkeypatch.setattr("router.batch_records.RESCAN_MARGIN_NS", 0)
    batches = service()
    old = files.create("beta", "in.jsonl", "batch", _file(1), expires_after_s=3600)["id"]
    unmarked = batches.create("beta", "k", old, "/v1/completions", "24h")
    (files._dir("beta").parent / "batches" / "open" / unmarked["id"]).unlink()
    made = []
    for _ in range(3):
        time.sleep(0.02)  # change times of their own (the volume's clock, not a wait for anything)
        made.append(batches.create("acme", "k", _upload(files, "acme", 1), "/v1/completions", "24h"))
    clock.now += 7200
    return batches, old, unmarked, made


def test_one_tenant_folder_the_volume_fails_on_costs_the_others_nothing(world, monkeypatch):
    """One folder that failed for good (a `lost+found` the pods may not read, say) held the scan
    of every tenant back, so each sweep read every record ever kept; a tenant folder whose own
    entry failed let the scan move past its records, never marked, their inputs swept (both
    found by a review)."""
    clock, runner, service, files = world
    batches, old, unmarked, made = _unmarked_then_others(world, monkeypatch)
    beta, is_dir, scandir = str(files._dir("beta").parent), os.DirEntry.is_dir, os.scandir
    with monkeypatch.context() as m:  # beta's own entry fails while acme's records move the scan on
        m.setattr(os.DirEntry, "is_dir", lambda e, **k: (_ for _ in ()).throw(OSError(errno.ESTALE, "Stale handle"))
                  if e.path == beta else is_dir(e, **k))
        batches.poll()
    clock.now += 61
    batches.poll()
    assert (files._dir("beta").parent / "batches" / "open" / unmarked["id"]).exists(), "never marked"
    assert files.content_path("beta", old, expired_ok=True).exists(), "its input swept"
    lost = files._dir("beta").parent.parent / "lost+found" / "batches"
    lost.mkdir(parents=True)
    with monkeypatch.context() as m:
        m.setattr(os, "scandir", lambda p=".": (_ for _ in ()).throw(PermissionError(errno.EACCES, "Permission denied"))
                  if str(p) == str(lost) else scandir(p))
        batches._store.mark_unfinished()
        reads, read = [], Path.read_text
        m.setattr(Path, "read_text", lambda p, *a, **k: reads.append(p) or read(p, *a, **k))
        batches._store.mark_unfinished()  # what the next sweep reads
    again = [p for p in reads if p.parent.name == "batches"]  # but each folder's latest, at its mark
    assert len(again) <= 2, f"it read again what it had read: {again}"

def test_a_record_that_cannot_be_marked_stops_no_start_and_no_sweep(world, monkeypatch):
    """A file where a tenant's markers' folder should be made marking its record of the version
    before raise: out of the service's constructor (the batch service could not start) and out
    of every sweep (found by a review)."""
    clock, runner, service, files = world
    batches, old, unmarked, made = _unmarked_then_others(world, monkeypatch)
    (files._dir("beta").parent / "batches" / "open").rmdir()
    (files._dir("beta").parent / "batches" / "open").write_text("not a folder")
    batches = service()  # a restart
    batches.poll()
    for job in list(runner.jobs):
        runner.answer(job, then="SUCCEEDED")
    batches.poll()
    assert [batches.get("acme", b["id"])["status"] for b in made] == ["completed"] * 3
    assert files.content_path("beta", old, expired_ok=True).exists(), "its input swept"


def test_a_markers_folder_the_volume_fails_to_list_lets_no_tenant_past_its_cap(world, monkeypatch):
    """A tenant's count of its unfinished batches passed over a markers' folder the volume
    refused to list (Path.glob does), so it counted none and a create went past
    `batches.max_active_per_tenant`. The create fails instead (the service names the volume)."""
    clock, runner, service, files = world
    batches, fid = service(), _upload(files, "acme", 1)
    for _ in range(8):
        batches.create("acme", "k", fid, "/v1/completions", "24h")
    markers, scandir = str(files._dir("acme").parent / "batches" / "open"), os.scandir
    with monkeypatch.context() as m:
        m.setattr(os, "scandir", lambda p=".": (_ for _ in ()).throw(PermissionError(errno.EACCES, "Permission denied"))
                  if str(p) == markers else scandir(p))
        with pytest.raises(PermissionError):
            batches.create("acme", "k", fid, "/v1/completions", "24h")
    assert len(batches.list("acme")["data"]) == 8
    with pytest.raises(ApiError) as e:
        batches.create("acme", "k", fid, "/v1/completions", "24h")
    assert e.value.code == "too_many_batches"


def test_a_tenant_folder_put_back_by_a_rename_is_scanned_whole(world, monkeypatch, tmp_path_factory):
    """A tenant's folder restored by a rename (`mv` from a backup) keeps its records' change
    times, older than its scan's place, so its records of the version before were never read:
    never marked, their expired inputs swept (found by a review)."""
    clock, runner, service, files = world
    monkeypatch.setattr("router.batch_records.RESCAN_MARGIN_NS", 0)  # the margin, as if it had passed
    batches = service()
    old = files.create("beta", "in.jsonl", "batch", _file(1), expires_after_s=3600)["id"]
    unmarked = batches.create("beta", "k", old, "/v1/completions", "24h")
    beta = files._dir("beta").parent
    (beta / "batches" / "open" / unmarked["id"]).unlink()  # as the version before keeps it
    aside = tmp_path_factory.mktemp("aside")  # outside the store's root, on its filesystem
    beta.rename(aside / "backup")
    time.sleep(0.05)  # a later change time for the next record (the volume's clock, not a wait for anything)
    batches.create("beta", "k", _upload(files, "beta", 1), "/v1/completions", "24h")
    batches._store.mark_unfinished()  # the scan's place: past the record put away
    beta.rename(aside / "replaced")
    (aside / "backup").rename(beta)
    clock.now += 7200
    batches.poll()
    assert (beta / "batches" / "open" / unmarked["id"]).exists(), "never marked"
    assert files.content_path("beta", old, expired_ok=True).exists(), "its input swept"
