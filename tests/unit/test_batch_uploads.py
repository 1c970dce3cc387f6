"""An upload cannot hold the router: uploads were bounded in size but not in time or number, so
one tenant's slow uploads each held a connection and one of the router replica's
`max_ongoing_requests` for as long as it liked, and enough of them stood every tenant's /v1
requests in a queue in front of the router."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest

from pools.types import PriorityClass
from router.app import RouterSettings
from router.batch_api import BatchApiSettings
from router.batches import Batches, BatchSettings
from router.config import RouterConfig
from router.files import FileStore
from router.ingress import ROUTES, Endpoints, make_app
from router.leases import LedgerService
from router.policy import PoolRoute
from router.quota import Quota
from tests.unit.router_harness import TENANTS, FakeController, FakePool, WordCounter
from tests.unit.test_batch_api import InProcessService, _file, sdk, sync
from tests.unit.test_batches import Clock, FakeRunner
from tests.unit.test_config import model_dir  # noqa: F401 (a fixture)

BOUNDARY = "poolserve-test"
HEAD = (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{BOUNDARY}\r\n"
        "Content-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
        "Content-Type: application/octet-stream\r\n\r\n").encode()


def app_with(tmp_path, **uploads):
    clock = Clock()
    batches = Batches(BatchSettings(tmp_path, "http://router", "p"), FileStore(tmp_path, clock), FakeRunner(), clock)
    routes = (PoolRoute("p", "p", 4, PriorityClass.STANDARD, queue_slots=8, max_num_seqs=4),)
    settings = RouterSettings("m", 64, RouterConfig(), TENANTS, routes,
                              BatchApiSettings(str(tmp_path), "p", max_file_bytes=4096, max_lines=20, **uploads))
    router = Endpoints(settings, {"p": FakePool()}, FakeController(),
                       LedgerService({t.name: Quota(**t.quota.model_dump()) for t in TENANTS}), WordCounter(),
                       batches=InProcessService(batches), wall_clock=clock)
    app = make_app()
    for verb, path, name in ROUTES:
        getattr(app, verb)(path, name=name)(getattr(router, name))
    return app


async def stalled_upload(app, tenant: str, started: asyncio.Event | None = None) -> httpx.Response:
    """An upload whose file never finishes arriving (its client is slow, or means to be)."""
    async def body():
        yield HEAD
        if started is not None:
            started.set()
        await asyncio.Event().wait()  # never set: the rest never comes
        yield b""

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as http:
        return await http.post("/v1/files", content=body(), headers={
            "Authorization": f"Bearer key-{tenant}", "Content-Type": f"multipart/form-data; boundary={BOUNDARY}"})


@sync
async def test_an_upload_that_does_not_arrive_in_time_is_a_408(tmp_path):
    app = app_with(tmp_path, upload_timeout_s=0.3)
    r = await asyncio.wait_for(stalled_upload(app, "b"), 60)  # no answer at all before
    assert r.status_code == 408, r.text
    assert r.json()["error"]["code"] == "upload_timeout" and "batches.upload_timeout_s" in r.json()["error"]["message"]
    assert [x async for x in sdk(app, "b").files.list()] == []
    created = await sdk(app, "b").files.create(file=("in.jsonl", _file(2)), purpose="batch")  # in time: kept
    assert created.bytes == len(_file(2))


@sync
async def test_a_tenant_has_at_most_so_many_uploads_arriving_at_once(tmp_path):
    app = app_with(tmp_path, max_uploads_per_tenant=2, upload_timeout_s=3600)
    started = [asyncio.Event(), asyncio.Event()]
    held = [asyncio.create_task(stalled_upload(app, "b", s)) for s in started]
    await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
    try:
        third = await asyncio.wait_for(stalled_upload(app, "b"), 60)  # refused before its body is read
        assert third.status_code == 429, third.text
        assert third.json()["error"]["code"] == "too_many_uploads" and third.headers.get("retry-after")
        assert "batches.max_uploads_per_tenant" in third.json()["error"]["message"]
        other = await sdk(app, "a").files.create(file=("in.jsonl", _file(2)), purpose="batch")  # another tenant
        assert other.bytes == len(_file(2))
    finally:
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
    created = await sdk(app, "b").files.create(file=("in.jsonl", _file(2)), purpose="batch")  # they ended: free
    assert created.bytes == len(_file(2))


def test_the_configs_upload_bounds_reach_the_router(model_dir):
    from deployments.app import router_settings
    from tests.unit.test_config import base, check

    data = {**base(), "batches": {"dir": "batches", "pool": "offline-batch", "max_uploads_per_tenant": 5,
                                  "upload_timeout_s": 42}}
    s = router_settings(check(data, model_dir)).batches
    assert (s.max_uploads_per_tenant, s.upload_timeout_s) == (5, 42)


@sync
async def test_the_forms_spooled_file_is_closed_whatever_was_wrong_with_it(tmp_path, monkeypatch):
    """An unknown form field was refused before the form was closed (found by a review): the
    file spooled to disk stayed until collected."""
    from starlette.datastructures import FormData

    closed = []
    real = FormData.close

    async def close(self):
        closed.append(True)
        await real(self)

    monkeypatch.setattr(FormData, "close", close)
    app = app_with(tmp_path)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as http:
        for extra in ({"surprise": "x"}, {"purpose": "fine-tune"}, {}):
            r = await http.post("/v1/files", headers={"Authorization": "Bearer key-b"},
                                data={"purpose": "batch", **extra}, files={"file": ("in.jsonl", _file(1))})
            assert r.status_code == (200 if not extra else 400), r.text
    assert len(closed) == 3


@sync
async def test_a_tenant_stores_at_most_its_share_of_the_volume(tmp_path):
    """Each upload was bounded, their number was not: one tenant's uploads could fill the volume
    every tenant's batches (and, on one machine, the node) write to."""
    one = len(_file(2))
    app = app_with(tmp_path, max_stored_bytes_per_tenant=3 * one + 1)
    b = sdk(app, "b")
    kept = [await b.files.create(file=("in.jsonl", _file(2)), purpose="batch") for _ in range(3)]
    with pytest.raises(openai.APIStatusError) as e:  # room for a byte, not for the file: refused once it arrived
        await b.files.create(file=("in.jsonl", _file(2)), purpose="batch")
    assert e.value.status_code == 413 and e.value.body["code"] == "tenant_storage_full", e.value.body
    assert "batches.max_stored_bytes_per_tenant" in e.value.body["message"]
    assert len([x async for x in b.files.list()]) == 3, "nothing kept of a refused upload"
    assert (await sdk(app, "a").files.create(file=("in.jsonl", _file(2)), purpose="batch")).bytes == one
    await b.files.delete(kept[0].id)  # room again
    assert (await b.files.create(file=("in.jsonl", _file(2)), purpose="batch")).bytes == one


@sync
async def test_a_tenant_keeps_at_most_so_many_files_and_a_full_one_is_refused_before_its_body(tmp_path):
    app = app_with(tmp_path, max_files_per_tenant=2, upload_timeout_s=3600)
    b = sdk(app, "b")
    for _ in range(2):
        await b.files.create(file=("in.jsonl", _file(1)), purpose="batch")
    r = await asyncio.wait_for(stalled_upload(app, "b"), 60)  # its body never comes: answered all the same
    assert r.status_code == 413 and r.json()["error"]["code"] == "tenant_storage_full", r.text
    assert "batches.max_files_per_tenant" in r.json()["error"]["message"]


def test_the_configs_storage_bounds_reach_the_router(model_dir):
    from deployments.app import router_settings
    from tests.unit.test_config import base, check

    data = {**base(), "batches": {"dir": "batches", "pool": "offline-batch", "max_files_per_tenant": 7,
                                  "max_stored_bytes_per_tenant": 4096}}
    s = router_settings(check(data, model_dir)).batches
    assert (s.max_files_per_tenant, s.max_stored_bytes_per_tenant) == (7, 4096)


@sync
async def test_uploads_arriving_at_once_count_each_other(tmp_path):
    """The storage check, an await between the count's check and its increment, let six
    uploads arriving together all read their bodies against a bound of two (found by a review)."""
    app = app_with(tmp_path, max_uploads_per_tenant=2, upload_timeout_s=3600)
    started = [asyncio.Event() for _ in range(6)]
    held = [asyncio.create_task(stalled_upload(app, "b", s)) for s in started]
    try:
        done, _ = await asyncio.wait(held, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        while len(done) < 4:  # the four beyond the bound are answered; two stay reading
            more, _ = await asyncio.wait([t for t in held if not t.done()], timeout=60,
                                         return_when=asyncio.FIRST_COMPLETED)
            assert more, "an upload beyond the bound was never answered"
            done |= more
        assert sorted(t.result().status_code for t in done) == [429] * 4
        for _ in range(600):  # the two within the bound go on to read their bodies
            if sum(s.is_set() for s in started) == 2:
                break
            await asyncio.sleep(0.1)
        assert sum(s.is_set() for s in started) == 2
    finally:
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)


def test_a_file_deleted_while_the_usage_is_read_is_not_counted(tmp_path, monkeypatch):
    """A delete between the folder's listing and a file's stat raised out of the upload: a 500."""
    import os

    files = FileStore(tmp_path, Clock())
    gone, kept = (files.create("b", "in.jsonl", "batch", _file(n))["id"] for n in (1, 2))
    listing = os.scandir

    class Racing:
        def __init__(self, path):
            self._it = listing(path)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._it.close()

        def __iter__(self):
            for entry in self._it:
                if entry.name == gone:
                    os.unlink(entry.path)
                yield entry

    monkeypatch.setattr(os, "scandir", Racing)
    assert files.usage("b") == (1, len(_file(2)))


@sync
async def test_an_upload_counts_against_the_tenants_uploads_until_it_is_written(tmp_path, monkeypatch):
    """The count dropped once the body arrived, before the file was checked and written: a tenant
    keeping two uploads arriving had any number held in memory, each passing the share's check
    before the others were written (found by a review); and one whose client left while it was
    checked let its count go while its thread went on with it (found by the review of that)."""
    from router.batch_api import BatchApi

    app, checking, go = app_with(tmp_path, max_uploads_per_tenant=2), [], threading.Event()
    check = BatchApi._check_batch_file

    def slow_check(self, content):
        checking.append(1)
        assert go.wait(60)
        return check(self, content)
    monkeypatch.setattr(BatchApi, "_check_batch_file", slow_check)
    b = sdk(app, "b")
    held = [asyncio.create_task(b.files.create(file=("in.jsonl", _file(2)), purpose="batch")) for _ in range(2)]
    try:
        await asyncio.wait_for(_until(lambda: len(checking) == 2), 60)
        with pytest.raises(openai.APIStatusError) as e:
            await b.files.create(file=("in.jsonl", _file(2)), purpose="batch")
        assert e.value.status_code == 429 and e.value.body["code"] == "too_many_uploads", e.value.body
        held[0].cancel()  # its client leaves: its thread goes on with the file in memory, and so does its count
        await asyncio.gather(held[0], return_exceptions=True)
        with pytest.raises(openai.APIStatusError) as e:
            await b.files.create(file=("in.jsonl", _file(2)), purpose="batch")
        assert e.value.status_code == 429, e.value.body
    finally:
        go.set()
    assert (await held[1]).bytes == len(_file(2))
    async def two_at_once() -> bool:  # both counts free: the left upload's thread wrote its file and let its go
        sent = await asyncio.gather(*(b.files.create(file=("in.jsonl", _file(2)), purpose="batch") for _ in range(2)),
                                    return_exceptions=True)
        assert all(not isinstance(x, Exception) or getattr(x, "status_code", None) == 429 for x in sent), sent
        return not any(isinstance(x, Exception) for x in sent)
    for _ in range(600):
        if await two_at_once():
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the left upload's count was never let go")


@sync
async def test_a_tenant_whose_share_is_full_creates_no_batch(tmp_path):
    """A batch's output and error files are its tenant's: a tenant at its share created batches
    all the same, and their output filled the volume past it (found by a review)."""
    app = app_with(tmp_path, max_stored_bytes_per_tenant=len(_file(2)))
    b = sdk(app, "b")
    f = await b.files.create(file=("in.jsonl", _file(2)), purpose="batch")
    with pytest.raises(openai.APIStatusError) as e:
        await b.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    assert e.value.status_code == 413 and e.value.body["code"] == "tenant_storage_full", e.value.body
    assert e.value.body["param"] == "input_file_id" and "a batch's output" in e.value.body["message"]
    await b.files.delete(f.id)
    f = await b.files.create(file=("in.jsonl", _file(1)), purpose="batch")  # room again
    assert (await b.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                   completion_window="24h")).status == "in_progress"


async def _until(done) -> None:
    while not done():
        await asyncio.sleep(0.01)
