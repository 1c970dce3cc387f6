"""What a tenant's Files and Batch API calls cost the processes every tenant shares, and what a
crash or a failing volume leaves behind. A list read every file object or batch record the tenant
ever kept, at every call (10,000 files: 0.41 s of the router's CPU a list, in the process that
also routes every tenant's chat); a crash mid-upload left bytes no bound counted and nothing
swept; a volume that timed out read as the tenant's slow upload."""

from __future__ import annotations

import asyncio
import errno
import json
import os
from pathlib import Path

import httpx
import pytest

from router.batch_api import BatchApi
from router.batch_service import BatchService
from router.batch_records import RESCAN_MARGIN_NS
from router.batches import Batches, BatchSettings
from router.errors import ApiError
from router.files import ORPHAN_GRACE_S, FileStore, ReadOnce, volume_failed, write_whole
from tests.unit.test_batch_polls import _reads_of
from tests.unit.test_batch_uploads import app_with
from tests.unit.test_batches import Clock, FakeRunner, _line, _upload, world  # noqa: F401 (a fixture)
from tests.unit.test_batch_api import _file, sdk, sync


def _objects_read(monkeypatch) -> list:
    return _reads_of(monkeypatch, lambda t: '"object": "file"' in str(t))


def test_a_file_list_reads_each_file_object_once(tmp_path, monkeypatch):
    clock = Clock()
    mine, other = FileStore(tmp_path, clock), FileStore(tmp_path, clock)  # two router replicas, one volume
    ids = [_upload(mine, "acme", 1) for _ in range(40)]
    soon = mine.create("acme", "soon.jsonl", "batch", b"{}\n", expires_after_s=3600)["id"]
    assert len(mine.list("acme")["data"]) == 41
    reads = _objects_read(monkeypatch)
    assert len(mine.list("acme")["data"]) == 41 and reads == [], "nothing new: no file object read again"
    other.delete("acme", ids[0])
    new = _upload(other, "acme", 2)
    reads.clear()
    listed = [f["id"] for f in mine.list("acme")["data"]]
    assert len(reads) == 1, "only the new file's object"
    assert new in listed and ids[0] not in listed and len(listed) == 41
    clock.now += 3600
    listed = [f["id"] for f in mine.list("acme")["data"]]
    assert soon not in listed and len(listed) == 40, "an expired file is not listed"
    assert [f["id"] for f in mine.list("acme", limit=2, after=listed[0])["data"]] == listed[1:3]


def test_a_batch_list_reads_each_finished_batch_once(world, monkeypatch):
    clock, runner, service, files = world
    batches = service()
    made = [batches.create("acme", "k", _upload(files, "acme", 1), "/v1/completions", "24h") for _ in range(5)]
    for job in list(runner.jobs)[:4]:
        runner.answer(job, then="SUCCEEDED")
    batches.poll()
    assert [b["status"] for b in batches.list("acme", 100)["data"]].count("completed") == 4
    records = _reads_of(monkeypatch, lambda t: '"object": "batch"' in str(t))
    listed = batches.list("acme", 100)["data"]
    assert len(records) == 1, "only the batch not finished is read again"
    assert sorted(b["id"] for b in listed) == sorted(b["id"] for b in made)
    batches.cancel("acme", made[4]["id"])
    batches.poll()
    assert {b["id"]: b["status"] for b in batches.list("acme", 100)["data"]}[made[4]["id"]] == "cancelled"
    records.clear()
    batches.list("acme", 100)
    assert records == [], "every batch finished: none read"


def _leftovers(files: FileStore, tenant: str, at: float) -> list:
    """What a router that died mid-upload leaves: a content whose object was never written, and
    a content still being written beside its name (write_whole's)."""
    folder = files.path(tenant, "x").parent
    folder.mkdir(parents=True, exist_ok=True)
    orphan, partial = folder / "file-0123456789abcdef01234567", folder / ".file-89abcdef0123456789abcdef.0a1b2c3d"
    orphan.write_bytes(b"o" * 1000)
    partial.write_bytes(b"p" * 5000)
    for path in (orphan, partial):
        os.utime(path, (at, at))
    return [orphan, partial]


def test_what_a_crash_leaves_among_a_tenants_files_is_counted_then_swept(tmp_path):
    clock = Clock()
    files = FileStore(tmp_path, clock)
    kept = _upload(files, "acme", 1)
    size = files.get("acme", kept)["bytes"]
    old = _leftovers(files, "acme", clock.now - ORPHAN_GRACE_S - 1)
    assert files.usage("acme") == (2, size + 6000), "the tenant's share counts what its crashed uploads hold"
    files.sweep()
    assert not any(p.exists() for p in old) and files.usage("acme") == (1, size)
    young = _leftovers(files, "acme", clock.now - 10)  # an upload in progress, or just ended
    files.sweep()
    assert all(p.exists() for p in young), "what may still be in progress is kept"
    assert [f["id"] for f in files.list("acme")["data"]] == [kept]


def test_a_write_that_fails_leaves_nothing_behind(tmp_path, monkeypatch):
    files = FileStore(tmp_path, Clock())
    replace = os.replace

    def full(src, dst):
        if str(dst).endswith(".json"):
            raise OSError(errno.ENOSPC, "No space left on device")
        replace(src, dst)
    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError):
        files.create("acme", "in.jsonl", "batch", b"{}\n")
    assert list(files.path("acme", "x").parent.iterdir()) == [], "no content without its object, no half file"
    with pytest.raises(OSError):
        write_whole(tmp_path / "r.json", b"{}")
    assert list(tmp_path.glob("*r.json*")) == []


@sync
async def test_a_volume_that_fails_is_named_never_taken_for_a_slow_upload(tmp_path, monkeypatch):
    app = app_with(tmp_path, upload_timeout_s=600)
    problems = iter([TimeoutError(errno.ETIMEDOUT, "Connection timed out"), OSError(errno.EIO, "I/O error"),
                     OSError(errno.ENOSPC, "No space left on device")])

    def failing(self, tenant):
        raise next(problems)
    monkeypatch.setattr(FileStore, "usage", failing)
    answers = []
    for _ in range(3):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as http:
            answers.append(await http.post("/v1/files", files={"file": ("in.jsonl", _file(1))},
                                           data={"purpose": "batch"}, headers={"Authorization": "Bearer key-b"}))
    assert [(r.status_code, r.json()["error"]["code"]) for r in answers] == [
        (503, "storage_unavailable"), (503, "storage_unavailable"), (507, "storage_full")], [r.text for r in answers]
    assert "Connection timed out" in answers[0].json()["error"]["message"]
    assert answers[0].headers["retry-after"] and "retry-after" not in answers[2].headers
    monkeypatch.undo()
    assert [f async for f in sdk(app, "b").files.list()] == [], "nothing kept"


def test_what_is_kept_read_stays_within_its_budget_and_leaves_with_its_file(tmp_path):
    """Entries were dropped one at a time from the front of one dict, which slowed every insert
    as the dict ran (210 us each after 400,000), and files another replica deleted stayed for
    ever (found by a review)."""
    parsed = []

    def parse(path: Path):
        parsed.append(path.name)
        return {"name": path.name, "pad": "x" * 80}, True
    kept = ReadOnce(budget=2_000)
    a, b = tmp_path / "a", tmp_path / "b"
    names = [f"{i}.json" for i in range(10)]  # about 1,100 bytes of text
    assert len(kept.read(a, names, parse)) == 10 and len(parsed) == 10
    kept.read(a, names[1:], parse)  # one deleted: it leaves what is kept
    assert len(parsed) == 10 and kept._bytes < 1_100
    kept.read(b, names, parse)  # past the budget: the folder listed longest ago goes
    kept.read(a, names, parse)
    assert len(parsed) == 30 and kept._bytes <= 2_000
    big = [f"{i}.json" for i in range(30)]  # one folder past the budget is read each time
    kept.read(a, big, parse), kept.read(a, big, parse)
    assert len(parsed) == 80 and kept._bytes <= 2_000


def test_a_batch_that_fails_its_checks_is_saved_finished_once(world, monkeypatch):
    """Its finished record was saved again by the step after its checks, and a list between the
    two writes kept the first (found by a review)."""
    from router.batch_records import BatchStore

    _, runner, service, files = world
    batches, saved, save = service(), [], BatchStore.save
    monkeypatch.setattr(BatchStore, "save", lambda self, record: (saved.append(record["status"]), save(self, record)))
    fid = files.create("acme", "in.jsonl", "batch", (_line(0, url="/v1/chat/completions") + "\n").encode())["id"]
    b = batches.create("acme", "k", fid, "/v1/completions", "24h")
    assert b["status"] == "failed" and saved == ["failed"] and runner.jobs == {}


def _volume_fails(monkeypatch, problem: OSError, where=lambda path: str(path).endswith(".json")):
    read = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (_ for _ in ()).throw(problem) if where(self)
                        else read(self, *a, **k))


@sync
async def test_a_volume_that_fails_is_no_missing_file_and_no_restarting_service(tmp_path, monkeypatch):
    """A file object the volume could not read was taken for no file (404); a create or cancel
    that met the volume's error was answered as the batch service restarting; a content the
    volume could not read was a bare 500; a timeout of anything else while an upload arrived
    was the upload's 408 (found by a review)."""
    app = app_with(tmp_path, upload_timeout_s=600)
    made = await sdk(app, "b").files.create(file=("in.jsonl", _file(2)), purpose="batch")
    auth = {"Authorization": "Bearer key-b"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as http:
        with monkeypatch.context() as m:
            _volume_fails(m, OSError(errno.EIO, "I/O error"))
            got = [await http.get(f"/v1/files/{made.id}", headers=auth),
                   await http.get(f"/v1/files/{made.id}/content", headers=auth),
                   await http.delete(f"/v1/files/{made.id}", headers=auth)]
        with monkeypatch.context() as m:
            m.setattr(BatchApi, "_read", lambda *a: (_ for _ in ()).throw(TimeoutError(errno.ETIMEDOUT, "timed out")))
            got.append(await http.post("/v1/files", files={"file": ("in.jsonl", _file(1))}, data={"purpose": "batch"},
                                       headers=auth))
    assert [(r.status_code, r.json()["error"]["code"]) for r in got] == [(503, "storage_unavailable")] * 4, \
        [r.text for r in got]
    assert (await sdk(app, "b").files.retrieve(made.id)).id == made.id, "nothing lost"

    clock = Clock()
    service = BatchService(BatchSettings(tmp_path, "http://router", "p"), FakeRunner(), poll_interval_s=3600,
                           clock=clock)
    try:
        with monkeypatch.context() as m:
            m.setattr(Batches, "create", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space")))
            full = await service.call("create", "b", "k", made.id, "/v1/completions", "24h")
    finally:
        await service.close()
    assert full["error"][:2] == [507, "storage_full"] and "No space" in full["error"][2]


def test_a_batch_record_the_volume_cannot_read_is_no_missing_batch(world, monkeypatch):
    """Its get and cancel were a 404 and its list left it out, so a client took the batch for
    gone; now they are 503, and a poll moves the other batches on meanwhile (found by a review)."""
    clock, runner, service, files = world
    batches = service()
    hidden, other = (batches.create("acme", "k", _upload(files, "acme", 2), "/v1/completions", "24h")
                     for _ in range(2))
    runner.answer(list(runner.jobs)[1], then="SUCCEEDED")
    fid = _upload(files, "acme", 2)
    _volume_fails(monkeypatch, OSError(errno.EIO, "I/O error"), lambda path: path.name == f"{hidden['id']}.json")
    for call in (lambda: batches.get("acme", hidden["id"]), lambda: batches.cancel("acme", hidden["id"]),
                 lambda: batches.list("acme"),  # and a create, whose count of unfinished batches cannot be made:
                 lambda: batches.create("acme", "k", fid, "/v1/completions", "24h")):
        with pytest.raises(OSError):  # which the batch service answers 503 storage_unavailable (test above)
            call()
    batches.poll()
    assert batches.get("acme", other["id"])["status"] == "completed"
    monkeypatch.undo()
    assert batches.get("acme", hidden["id"])["status"] == "in_progress"


def test_the_files_of_a_tenant_whose_batch_record_cannot_be_read_are_not_swept(world, monkeypatch):
    """A poll passed over the unreadable record, so its input was not among those kept, and the
    sweep removed it once expired: a job run again once the volume came back found no input
    (found by a review)."""
    clock, runner, service, files = world
    batches = service()
    fid = files.create("acme", "in.jsonl", "batch", _file(2), expires_after_s=3600)["id"]
    other = files.create("beta", "old.jsonl", "batch", b"{}\n", expires_after_s=3600)["id"]
    hidden = batches.create("acme", "k", fid, "/v1/completions", "24h")
    clock.now += 7200
    with monkeypatch.context() as m:
        _volume_fails(m, OSError(errno.EIO, "I/O error"), lambda path: path.name == f"{hidden['id']}.json")
        batches.poll()
    assert files.content_path("acme", fid, expired_ok=True).exists(), "the unread batch's input was swept"
    with pytest.raises(ApiError):
        files.get("beta", other, expired_ok=True)  # another tenant's expired file went, as before
    runner.answer(next(iter(runner.jobs)), n=2, then="SUCCEEDED")
    batches.poll()
    assert batches.get("acme", hidden["id"])["status"] == "completed"


def test_a_damaged_batch_record_keeps_none_of_its_tenants_files_from_the_sweep(world):
    """A damaged record (read as none, for good) noted its tenant at every poll: its expired
    files and what crashes left were never swept and counted in its share for ever (found by a
    review). Only a record the volume fails to read keeps them, and a crash's halves go anyway."""
    clock, runner, service, files = world
    batches = service()
    made = batches.create("acme", "k", _upload(files, "acme", 2), "/v1/completions", "24h")
    (files._dir("acme").parent / "batches" / f"{made['id']}.json").write_text("{not json")
    old = files.create("acme", "old.jsonl", "batch", b"{}\n", expires_after_s=3600)["id"]
    half = files._dir("acme") / f"file-{'a' * 24}"  # a content whose object a crash never wrote
    half.write_bytes(b"x" * 10)
    os.utime(half, (clock.now, clock.now))
    clock.now += 2 * 3600
    batches.poll()
    with pytest.raises(ApiError):
        files.get("acme", old, expired_ok=True)
    assert not half.exists()


def test_a_batch_record_of_the_version_before_keeps_its_input_until_it_is_read(world, monkeypatch):
    """A record with no marker (the version before kept none) is marked at a sweep: its input was
    gathered for keeping before the marking, so that sweep removed it once expired; and one the
    volume failed to read was read no more once other records moved the scan past it, and its
    input swept meanwhile (both found by a review)."""
    clock, runner, service, files = world
    batches = service()
    inputs = [files.create("acme", "in.jsonl", "batch", _file(2), expires_after_s=3600)["id"] for _ in range(2)]
    made = [batches.create("acme", "k", fid, "/v1/completions", "24h") for fid in inputs]
    for b in made:
        (files._dir("acme").parent / "batches" / "open" / b["id"]).unlink()  # as the version before keeps it
    half = files._dir("acme") / f".{'file-' + 'b' * 24}.json.0123abcd"  # a crash's half: swept all the same
    half.write_bytes(b"x")
    os.utime(half, (clock.now, clock.now))
    clock.now += 7200
    with monkeypatch.context() as m:
        _volume_fails(m, OSError(errno.EIO, "I/O error"), lambda path: path.name == f"{made[1]['id']}.json")
        batches.poll()
        assert all(files.content_path("acme", fid, expired_ok=True).exists() for fid in inputs)
        assert not half.exists()
        scanned = batches._store._scanned_ns  # records changed since: the scan moves past it
        scanned.update({t: (f, ns + 2 * RESCAN_MARGIN_NS) for t, (f, ns) in scanned.items()})
        clock.now += 61
        batches.poll()
        assert files.content_path("acme", inputs[1], expired_ok=True).exists(), "swept while it could not be read"
    clock.now += 61
    batches.poll()
    assert (files._dir("acme").parent / "batches" / "open" / made[1]["id"]).exists(), "marked once read"
    runner.answer(list(runner.jobs)[1], then="SUCCEEDED")
    batches.poll()
    assert batches.get("acme", made[1]["id"])["status"] == "completed"


def test_a_batches_folder_the_volume_fails_to_list_keeps_its_tenants_files(world, monkeypatch):
    """Path.glob passed over a tenant's markers the volume refused to list (EACCES), so its
    batches stood still and their expired inputs were swept; a scan the volume failed dropped
    the records waiting to be read again (both found by a review)."""
    clock, runner, service, files = world
    batches = service()
    fid = files.create("acme", "in.jsonl", "batch", _file(2), expires_after_s=3600)["id"]
    made = batches.create("acme", "k", fid, "/v1/completions", "24h")
    old = files.create("beta", "in.jsonl", "batch", _file(1), expires_after_s=3600)["id"]
    unmarked = batches.create("beta", "k", old, "/v1/completions", "24h")
    (files._dir("beta").parent / "batches" / "open" / unmarked["id"]).unlink()  # as the version before keeps it
    clock.now += 7200
    refused = {str(files._dir("acme").parent / "batches" / "open"), str(files._dir("beta").parent / "batches")}
    scandir = os.scandir
    with monkeypatch.context() as m:
        m.setattr(os, "scandir", lambda p=".": (_ for _ in ()).throw(PermissionError(errno.EACCES, "Permission denied"))
                  if str(p) in refused else scandir(p))
        batches.poll()
        assert files.content_path("acme", fid, expired_ok=True).exists() and \
            files.content_path("beta", old, expired_ok=True).exists()
    with monkeypatch.context() as m:
        _volume_fails(m, OSError(errno.EIO, "I/O error"), lambda path: path.name == f"{unmarked['id']}.json")
        clock.now += 61
        batches.poll()
        scanned = batches._store._scanned_ns  # other records changed since: the scan moves past it
        scanned.update({t: (f, ns + 2 * RESCAN_MARGIN_NS) for t, (f, ns) in scanned.items()})
        m.setattr(os, "scandir", lambda p=".": (_ for _ in ()).throw(OSError(errno.EIO, "I/O error"))
                  if str(p) == str(files._dir("acme").parent / "batches") else scandir(p))
        clock.now += 61
        batches.poll()  # the acme scan fails: beta's record still waits to be read again
    clock.now += 61
    batches.poll()
    assert (files._dir("beta").parent / "batches" / "open" / unmarked["id"]).exists(), "marked once read"
    assert files.content_path("beta", old, expired_ok=True).exists()
    for job in list(runner.jobs):
        runner.answer(job, then="SUCCEEDED")
    batches.poll()
    assert [batches.get(t, b["id"])["status"] for t, b in (("acme", made), ("beta", unmarked))] == ["completed"] * 2


def test_a_volume_failure_is_logged_with_its_path_and_answered_without_it(caplog):
    """The log named the error's type and code but not the folder that failed (an OSError's
    repr leaves its path out), so an operator could not tell which; the client's answer names
    no path of the server's."""
    e = PermissionError(errno.EACCES, "Permission denied", "/vol/acme/batches/open")
    with caplog.at_level("WARNING", logger="poolserve.router"):
        refusal = volume_failed(e)
    assert refusal.status == 503 and "/vol" not in refusal.message
    assert any("/vol/acme/batches/open" in r.getMessage() for r in caplog.records)
