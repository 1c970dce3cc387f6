"""What a batch service's poll reads: only the batches not finished (a marker names each) and
only the output lines written since the last poll; finished batches and answered lines cost it
nothing. Markers hold through crashes, restarts and two services polling one folder during a
rolling update, with a version before them that kept none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.errors import ApiError
from tests.unit.test_batches import _upload, world  # noqa: F401 (a fixture)


def _reads_of(monkeypatch, what) -> list:
    """The JSON texts parsed from now on that `what` picks out (any module's `json.loads`)."""
    parsed, loads = [], json.loads
    monkeypatch.setattr(json, "loads", lambda text, *a, **k: (parsed.append(text) if what(text) else None,
                                                              loads(text, *a, **k))[1])
    return parsed


def test_a_poll_reads_no_finished_batch_and_no_line_twice(world, monkeypatch):
    """Each poll read every record the service ever kept and every job's whole output: 2,000
    finished batches and 8 running ones of 50,000 lines cost 1.4 s a poll, every 2 s, for ever."""
    clock, runner, service, files = world
    batches = service()
    one = _upload(files, "acme", 1)
    for _ in range(30):
        batches.create("acme", "k", one, "/v1/completions", "24h")
        runner.answer(next(j for j, job in runner.jobs.items() if job["state"] == "RUNNING"), then="SUCCEEDED")
        batches.poll()
    running = batches.create("acme", "k", _upload(files, "acme", 40), "/v1/completions", "24h")
    job = next(j for j, job in runner.jobs.items() if job["state"] == "RUNNING")
    runner.answer(job, 30)
    batches.poll()
    runner.answer(job, 10)
    records = _reads_of(monkeypatch, lambda t: '"object": "batch"' in str(t))
    rows = _reads_of(monkeypatch, lambda t: "custom_id" in str(t))
    batches.poll()
    assert len(records) == 1, "only the batch not finished is read"
    assert len(rows) == 10, "only the lines written since the last poll"
    assert batches.get("acme", running["id"])["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
    restarted = service()  # a new service counts the whole output once, then only what is new
    restarted.poll()
    assert batches.get("acme", running["id"])["request_counts"]["completed"] == 40


def test_a_tenant_has_at_most_max_active_batches_unfinished(world):
    clock, runner, service, files = world
    batches, fid = service(), _upload(files, "acme", 2)
    made = [batches.create("acme", "k", fid, "/v1/completions", "24h") for _ in range(8)]
    with pytest.raises(ApiError) as e:
        batches.create("acme", "k", fid, "/v1/completions", "24h")
    assert e.value.status == 429 and e.value.code == "too_many_batches"
    assert batches.create("other", "k", _upload(files, "other", 2), "/v1/completions", "24h")
    batches.cancel("acme", made[0]["id"])
    batches.poll()  # its job stopped: the batch ends
    assert batches.get("acme", made[0]["id"])["status"] == "cancelled"
    assert batches.create("acme", "k", fid, "/v1/completions", "24h")["status"] == "in_progress"


def test_batches_of_a_version_without_markers_and_a_marker_without_a_batch(world):
    """Records kept before the poll looked for markers still move on; a marker left by a crash
    before its record was written is no batch, and is dropped once no record can be on its way."""
    import shutil

    clock, runner, service, files = world
    b = service().create("acme", "k", _upload(files, "acme", 3), "/v1/completions", "24h")
    batch_dir = Path(files._dir("acme")).parent / "batches"
    shutil.rmtree(batch_dir / "open")
    (batch_dir / "open").mkdir()
    stray = batch_dir / "open" / "batch_0123456789abcdef01234567"
    stray.write_text(str(int(clock.now)))
    batches = service()
    runner.answer(next(iter(runner.jobs)), then="SUCCEEDED")
    batches.poll()
    assert batches.get("acme", b["id"])["status"] == "completed"
    assert list((batch_dir / "open").iterdir()) == [stray], "its record may still be on its way"
    clock.now += 601
    batches.poll()
    assert list((batch_dir / "open").iterdir()) == []


def test_a_marker_whose_record_is_being_written_is_kept_by_another_services_poll(world):
    """During a rolling update two services poll one folder. One's poll came while the other
    validated a new batch's input, between its marker and its record, took the marker for a
    crash's leftover and dropped it: the batch was never polled again (found by a review)."""
    clock, runner, service, files = world
    a, b = service(), service()
    fid = _upload(files, "acme", 5)
    read = a._files.content_path

    def validating(*args, **kwargs):  # b polls while a reads the input
        b.poll()
        return read(*args, **kwargs)

    a._files.content_path = validating
    made = a.create("acme", "k", fid, "/v1/completions", "24h")
    a._files.content_path = read
    runner.answer(next(iter(runner.jobs)), then="SUCCEEDED")
    a.poll()
    assert a.get("acme", made["id"])["status"] == "completed"


def test_a_batch_a_replica_of_the_version_before_creates_meanwhile_is_marked(world):
    """The version before kept no markers, and a replica of it may still create a batch while
    this one runs (for as long as an upgrade takes): a record written since the last sweep is
    read and marked at the next. The first cut looked only in the first 600 s (found by a review)."""
    clock, runner, service, files = world
    batches, fid = service(), _upload(files, "acme", 3)
    for late in (0, 3600):
        clock.now += late
        batches.poll()
        made = batches.create("acme", "k", fid, "/v1/completions", "24h")
        marker = Path(files._dir("acme")).parent / "batches" / "open" / made["id"]
        marker.unlink()  # as the version before writes it
        clock.now += 61
        batches.poll()  # the sweep marks it
        runner.answer(next(j for j, job in runner.jobs.items() if job["state"] == "RUNNING"), then="SUCCEEDED")
        clock.now += 5
        batches.poll()
        assert batches.get("acme", made["id"])["status"] == "completed" and not marker.exists(), late


def test_two_services_never_move_one_batch_on_at_once(world):
    """During a rolling update one service's poll came while the other wrote a batch's output
    file: both finalized it, and the tenant kept an output file no record named, counted
    against its storage (found by a review). A poll leaves the batches be while another service
    moves them on; the job's raw output goes once its files are written."""
    clock, runner, service, files = world
    a, b = service(), service()
    made = a.create("acme", "k", _upload(files, "acme", 4), "/v1/completions", "24h")
    runner.answer(next(iter(runner.jobs)), then="SUCCEEDED")
    create = a._files.create

    def creating(*args, **kwargs):  # b polls while a writes the output file
        a._files.create = create
        meta = create(*args, **kwargs)
        b.poll()
        return meta

    a._files.create = creating
    a.poll()
    b.poll()
    done = a.get("acme", made["id"])
    outputs = [m["id"] for m in files.list("acme")["data"] if m["purpose"] == "batch_output"]
    assert done["status"] == "completed" and outputs == [done["output_file_id"]]
    assert not (Path(files._dir("acme")).parent / "batches" / made["id"]).exists(), "the raw output is gone"


def test_a_record_written_beside_and_renamed_is_found_whatever_its_written_time(world):
    """A record is written beside and renamed, so its written time may be older than another's
    the last rescan read: the rescan skipped it for good (found by a review). It reads by the
    rename's change time, with a margin."""
    import os

    clock, runner, service, files = world
    batches, fid = service(), _upload(files, "acme", 3)
    batches.create("acme", "k", fid, "/v1/completions", "24h")
    batches.poll()  # a sweep reads that batch's record
    made = batches.create("acme", "k", fid, "/v1/completions", "24h")
    folder = Path(files._dir("acme")).parent / "batches"
    (folder / "open" / made["id"]).unlink()  # as the version before writes it ...
    hour_ago = (folder / f"{made['id']}.json").stat().st_mtime - 3600
    os.utime(folder / f"{made['id']}.json", (hour_ago, hour_ago))  # ... written long before its rename
    clock.now += 61
    batches.poll()
    assert (folder / "open" / made["id"]).exists()


def test_a_finished_batch_leaves_no_key_nor_raw_output_even_when_its_service_died_tidying(world, monkeypatch,
                                                                                         caplog):
    from router.batch_records import BatchStore

    clock, runner, service, files = world
    batches = service()
    made = batches.create("acme", "k", _upload(files, "acme", 3), "/v1/completions", "24h")
    runner.answer(next(iter(runner.jobs)), then="SUCCEEDED")
    tidy = BatchStore.tidy
    monkeypatch.setattr(BatchStore, "tidy", lambda self, record: (_ for _ in ()).throw(SystemError("died")))
    batches.poll()  # the record is saved finished, then the service dies
    monkeypatch.setattr(BatchStore, "tidy", tidy)
    folder = Path(files._dir("acme")).parent / "batches"
    assert (folder / made["id"] / "key").exists()
    with caplog.at_level("WARNING", logger="poolserve.router"):
        service().poll()  # the next service: its own folder scan reads no batch folder as a record
    assert batches.get("acme", made["id"])["status"] == "completed" and not (folder / made["id"]).exists()
    assert not (folder / "open" / made["id"]).exists()
    assert not [r for r in caplog.records if "cannot be read" in r.getMessage()]


def test_a_create_while_another_service_holds_the_batches_waits_then_is_a_503(world, monkeypatch):
    """Another service's poll may hold the folder across a job API that answers slowly or never."""
    import router.batch_records

    clock, runner, service, files = world
    a, b = service(), service()
    monkeypatch.setattr(router.batch_records, "LOCK_WAIT_S", 0.2)
    with a._store.exclusive() as mine:
        assert mine
        with pytest.raises(ApiError) as e:
            b.create("acme", "k", _upload(files, "acme", 1), "/v1/completions", "24h")
    assert e.value.status == 503 and e.value.code == "batches_busy" and e.value.retry_after_s
    assert b.create("acme", "k", _upload(files, "acme", 1), "/v1/completions", "24h")["status"] == "in_progress"


def test_a_create_waiting_for_another_service_holds_no_retrieve(tmp_path, monkeypatch):
    """The create's wait held the service's one lock, so every tenant's retrieve and list waited
    behind it too, though they change nothing (found by a review)."""
    import asyncio

    import router.batch_records
    from router.batch_service import BatchService
    from router.batches import BatchSettings
    from router.files import FileStore
    from tests.unit.test_batches import Clock, FakeRunner

    monkeypatch.setattr(router.batch_records, "LOCK_WAIT_S", 60.0)
    clock, settings = Clock(), BatchSettings(tmp_path, "http://router", "offline", max_lines=100)
    fid = _upload(FileStore(tmp_path, clock), "acme", 2)

    async def go():
        a, b = (BatchService(settings, FakeRunner(), poll_interval_s=3600, clock=clock) for _ in range(2))
        made = (await b.call("create", "acme", "k", fid, "/v1/completions", "24h"))["ok"]
        with a._batches._store.exclusive():  # another service's poll, held by a job API that hangs
            waiting = asyncio.create_task(b.call("create", "acme", "k", fid, "/v1/completions", "24h"))
            await asyncio.sleep(0.1)
            got = await asyncio.wait_for(b.call("get", "acme", made["id"]), 30)
            assert got["ok"]["id"] == made["id"] and not waiting.done()
        assert (await asyncio.wait_for(waiting, 60))["ok"]["status"] == "in_progress"
        await a.close()
        await b.close()

    asyncio.run(go())


def test_creates_waiting_together_each_wait_the_bound_at_most_and_say_when_to_retry(tmp_path, monkeypatch):
    """Each create waited for this service's turn before its own wait for another's began, so
    the fourth of four waited four times the bound; and the 503's Retry-After was lost on its
    way from the service (both found by a review)."""
    import asyncio
    import time

    import router.batch_records
    from router.batch_service import BatchService
    from router.batches import BatchSettings
    from router.errors import ApiError
    from router.files import FileStore
    from tests.unit.test_batches import Clock, FakeRunner

    monkeypatch.setattr(router.batch_records, "LOCK_WAIT_S", 2.0)
    clock, settings = Clock(), BatchSettings(tmp_path, "http://router", "offline", max_lines=100)
    fid = _upload(FileStore(tmp_path, clock), "acme", 2)

    async def go():
        a, b = (BatchService(settings, FakeRunner(), poll_interval_s=3600, clock=clock) for _ in range(2))
        with a._batches._store.exclusive():
            started = time.monotonic()
            answers = await asyncio.gather(*(b.call("create", "acme", "k", fid, "/v1/completions", "24h")
                                             for _ in range(4)))
            waited = time.monotonic() - started
        await a.close()
        await b.close()
        return answers, waited

    answers, waited = asyncio.run(go())
    errors = [ApiError(*answer["error"]) for answer in answers]
    assert [(e.status, e.code) for e in errors] == [(503, "batches_busy")] * 4
    assert all(e.retry_after_s for e in errors) and errors[0].response().headers["retry-after"]
    assert waited < 2 * 2.0, f"{waited:.1f} s: the creates waited one after another"  # 8 s before


def test_a_batch_whose_input_was_deleted_stops_the_job_a_lost_answer_started(world):
    """The job API started the job but its answer was lost, so the record named none; the input
    was then deleted and the batch failed at once, its folder removed under the job, which ran
    on under the tenant's key (found by a review)."""
    clock, runner, service, files = world
    batches, fid = service(), _upload(files, "acme", 3)
    runner.die_after_submit = True
    made = batches.create("acme", "k", fid, "/v1/completions", "24h")
    runner.die_after_submit = False
    files.delete("acme", fid)
    [job] = runner.jobs
    batches.poll()
    assert runner.stopped == [job] and batches.get("acme", made["id"])["status"] == "validating"
    batches.poll()
    done = batches.get("acme", made["id"])
    assert done["status"] == "failed" and done["errors"]["data"][0]["code"] == "input_file_missing"


def test_a_job_its_api_lost_is_not_run_again_while_it_still_writes(world):
    """During a RayService upgrade the new cluster's batch service asks its own job API about a
    job the old cluster runs: it answers 404, read as FAILED, and the batch was submitted again
    while the old job still wrote its output; so was a cancelled one whose job had not yet exited."""
    import fcntl
    import os

    clock, runner, service, files = world
    batches = service()
    b = batches.create("acme", "k", _upload(files, "acme", 10), "/v1/completions", "24h")
    old = next(iter(runner.jobs))
    runner.answer(old, 3)
    output = runner.jobs[old]["output"]
    held = os.open(output, os.O_WRONLY | os.O_APPEND)  # the job, on another cluster
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    del runner.jobs[old]  # this cluster's API does not know it
    batches.poll()
    batches.poll()
    assert runner.jobs == {} and batches.get("acme", b["id"])["status"] == "in_progress"
    batches.cancel("acme", b["id"])
    batches.poll()
    assert batches.get("acme", b["id"])["status"] == "cancelling", "its job still writes"
    os.close(held)  # it ended (its cluster was deleted)
    batches.poll()
    b = batches.get("acme", b["id"])
    assert b["status"] == "cancelled" and b["request_counts"]["completed"] == 3 and runner.jobs == {}
    batches.poll()
    assert batches._store._held_told == set(), "a finished batch is not remembered (the set only grew)"


def test_a_lock_no_job_releases_ends_with_the_window_and_a_volume_without_locks_holds_none(world, monkeypatch):
    """A held output had no bound: a lock an NFS server keeps for a node that never came back
    kept the batch in progress for ever; and on NFSv4 the probe's exclusive lock on a read-only
    descriptor failed (EBADF), which stopped every batch whose job had ended (found by a review)."""
    import errno
    import fcntl
    import os

    from router.batch_records import HELD_GRACE_S, output_held

    clock, runner, service, files = world
    batches = service()
    b = batches.create("acme", "k", _upload(files, "acme", 10), "/v1/completions", "24h")
    job = next(iter(runner.jobs))
    runner.answer(job, 2)
    output = runner.jobs.pop(job)["output"]
    held = os.open(output, os.O_WRONLY | os.O_APPEND)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    clock.now = b["expires_at"] + HELD_GRACE_S - 1
    batches.poll()
    assert batches.get("acme", b["id"])["status"] == "in_progress" and runner.jobs == {}
    clock.now += 1
    batches.poll()
    b = batches.get("acme", b["id"])
    assert b["status"] == "expired" and b["request_counts"] == {"total": 10, "completed": 2, "failed": 8}
    os.close(held)

    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("")
    flock, locks = fcntl.flock, {"on": True}

    def nfs(fd, how):  # NFSv4 emulates flock with POSIX locks: an exclusive one needs a descriptor open for writing
        if not locks["on"]:
            raise OSError(errno.ENOLCK, "No locks available")
        if how & fcntl.LOCK_EX and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, "Bad file descriptor")
        return flock(fd, how)
    monkeypatch.setattr(fcntl, "flock", nfs)
    job = os.open(output, os.O_WRONLY | os.O_APPEND)
    nfs(job, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert output_held(output) is True
    os.close(job)
    assert output_held(output) is False
    locks["on"] = False
    assert output_held(output) is False, "a volume without locks holds nothing"


def test_a_job_that_ends_during_an_upgrade_completes_its_batch(tmp_path):
    """Two clusters' services share the folder during a RayService upgrade, each asking its own
    job API: a job that answered every line and ended was unknown to the other's (read as
    failed), submitted again there, then here, and the batch failed at max_attempts with every
    line answered (found by a review)."""
    from router.batches import Batches, BatchSettings
    from router.files import FileStore
    from tests.unit.test_batches import Clock, FakeRunner

    clock, old, new = Clock(), FakeRunner(), FakeRunner()
    settings = BatchSettings(tmp_path, "http://router:8000", "offline", max_attempts=3, max_lines=100)
    a, b = (Batches(settings, FileStore(tmp_path, clock), runner, clock) for runner in (old, new))
    made = a.create("acme", "k", _upload(FileStore(tmp_path, clock), "acme", 5), "/v1/completions", "24h")
    old.answer(next(iter(old.jobs)), then="SUCCEEDED")
    for service in (b, a, b):
        service.poll()
    done = b.get("acme", made["id"])
    assert done["status"] == "completed" and done["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    assert new.jobs == {} and len(old.jobs) == 1
    twice = a.create("acme", "k", _upload(FileStore(tmp_path, clock), "acme", 5), "/v1/completions", "24h")
    job = list(old.jobs)[-1]
    old.answer(job, 3)  # with another job that wrote two of them again, where locks did not exclude:
    old.jobs[job]["output"].write_text(old.jobs[job]["output"].read_text() * 2, encoding="utf-8")
    old.jobs[job]["state"] = "FAILED"  # 6 rows for 5 requests, 2 of which never ran
    a.poll()
    assert a.get("acme", twice["id"])["status"] == "in_progress" and len(old.jobs) == 3, "run again, not completed"
