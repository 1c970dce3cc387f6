"""The router's /v1/files, /v1/batches and /v1/models/{id} over ASGI, driven by the official
`openai` SDK where it can be, with the batch service's logic run in-process on a fake job
runner (the integration test runs real Ray jobs)."""

from __future__ import annotations

import asyncio
import functools
import json

import httpx
import openai
import pytest

from pools.types import PriorityClass
from router.app import RouterSettings
from router.batch_api import BatchApiSettings
from router.batches import Batches, BatchSettings
from router.config import RouterConfig, TenantConfig
from router.errors import ApiError
from router.files import FileStore
from router.ingress import ROUTES, Endpoints, make_app
from router.leases import LedgerService
from router.policy import PoolRoute
from router.quota import Quota
from tests.unit.router_harness import TENANTS, FakeController, FakePool, WordCounter, sha
from tests.unit.test_batches import Clock, FakeRunner, _line, _upload, world  # noqa: F401 (a fixture)

NO_BATCH_POOL = TenantConfig(name="chat-only", key_sha256=sha("key-chat-only"), pools=("q",))


class InProcessService:
    """The batch service's `call`, on a Batches in this process."""

    def __init__(self, batches: Batches) -> None:
        self.batches = batches

    @property
    def call(self):
        outer = self

        class _Call:
            async def remote(self, method, *args):
                try:
                    return {"ok": getattr(outer.batches, method)(*args)}
                except ApiError as e:
                    return {"error": [e.status, e.code, e.message, e.param]}
        return _Call()


@pytest.fixture
def api(tmp_path):
    clock, runner = Clock(), FakeRunner()
    batches = Batches(BatchSettings(tmp_path, "http://router", "p"), FileStore(tmp_path, clock), runner, clock)
    tenants = (*TENANTS, NO_BATCH_POOL)
    routes = (PoolRoute("p", "p", 4, PriorityClass.STANDARD, queue_slots=8, max_num_seqs=4),
              PoolRoute("q", "q", 4, PriorityClass.INTERACTIVE, queue_slots=8, max_num_seqs=4))
    settings = RouterSettings("m", 64, RouterConfig(), tenants, routes,
                              BatchApiSettings(str(tmp_path), "p", max_file_bytes=4096, max_lines=20))
    router = Endpoints(settings, {"p": FakePool(), "q": FakePool()}, FakeController(),
                       LedgerService({t.name: Quota(**t.quota.model_dump()) for t in tenants}), WordCounter(),
                       batches=InProcessService(batches), wall_clock=clock)
    app = make_app()
    for verb, path, name in ROUTES:
        getattr(app, verb)(path, name=name)(getattr(router, name))
    return app, runner, batches


def sync(test):
    """An async test, run in its own event loop."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))
    return run


def sdk(app, tenant: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://router/v1", api_key=f"key-{tenant}", max_retries=0,
                              http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)))


def _file(lines: int) -> bytes:
    return "".join(_line(i) + "\n" for i in range(lines)).encode()


@sync
async def test_the_sdk_uploads_creates_polls_downloads_and_cancels(api):
    app, runner, batches = api
    client = sdk(app, "b")
    f = await client.files.create(file=("in.jsonl", _file(5)), purpose="batch")
    assert f.purpose == "batch" and f.bytes == len(_file(5))
    b = await client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                                    metadata={"owner": "eval"})
    assert b.status == "in_progress" and b.request_counts.total == 5
    runner.answer(next(iter(runner.jobs)), then="SUCCEEDED")
    batches.poll()
    b = await client.batches.retrieve(b.id)
    assert b.status == "completed" and b.request_counts.completed == 5 and b.error_file_id is None
    rows = [json.loads(x) for x in (await client.files.content(b.output_file_id)).text.splitlines()]
    assert sorted(r["custom_id"] for r in rows) == [f"req-{i}" for i in range(5)]
    assert [x.id async for x in client.batches.list()] == [b.id]
    assert {x.id async for x in client.files.list()} == {f.id, b.output_file_id}

    second = await client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    cancelling = await client.batches.cancel(second.id)
    assert cancelling.status == "cancelling"
    batches.poll()
    assert (await client.batches.retrieve(second.id)).status == "cancelled"
    assert (await client.files.delete(f.id)).deleted


@sync
async def test_another_tenant_gets_404_for_every_id(api):
    app, _, _ = api
    owner, other = sdk(app, "b"), sdk(app, "a")
    f = await owner.files.create(file=("in.jsonl", _file(2)), purpose="batch")
    b = await owner.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    for call in (other.files.retrieve(f.id), other.files.content(f.id), other.files.delete(f.id),
                 other.batches.retrieve(b.id), other.batches.cancel(b.id),
                 other.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            await call
    assert [x async for x in other.batches.list()] == []


@sync
async def test_a_bad_file_is_refused_naming_its_lines_and_nothing_is_kept(api, tmp_path):
    app, _, _ = api
    client = sdk(app, "b")
    bad = _file(2) + b'{"custom_id": "req-0", "url": "/v1/completions", "body": {}}\nnot json\n'
    with pytest.raises(openai.BadRequestError) as e:
        await client.files.create(file=("in.jsonl", bad), purpose="batch")
    message = e.value.body["message"]
    assert "line 3: duplicate custom_id 'req-0'" in message and "line 4: not valid JSON" in message
    with pytest.raises(openai.BadRequestError) as e:
        await client.files.create(file=("in.jsonl", _file(21)), purpose="batch")
    assert "holds 21 requests; a batch may hold 20" in e.value.body["message"]
    with pytest.raises(openai.APIStatusError) as e:
        await client.files.create(file=("in.jsonl", _file(200)), purpose="batch")
    assert e.value.status_code == 413 and "batches.max_file_bytes" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        await client.files.create(file=("in.jsonl", _file(1)), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    assert [x async for x in client.files.list()] == []


@sync
async def test_a_prompt_holding_unicode_line_separators_stays_one_line(api):
    """JSON may hold U+0085, U+2028 and U+2029 unescaped; JSON Lines end at LF (or CRLF) only."""
    app, _, _ = api
    client = sdk(app, "b")
    content = "".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                                  "body": {"model": "m", "prompt": f"a{sep}b", "max_tokens": 4}},
                                 ensure_ascii=False) + "\r\n" for i, sep in enumerate("\u0085\u2028\u2029"))
    f = await client.files.create(file=("in.jsonl", content.encode()), purpose="batch")
    b = await client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    assert b.status == "in_progress" and b.request_counts.total == 3


@sync
async def test_batches_need_the_batch_pool_and_known_fields(api):
    app, _, _ = api
    with pytest.raises(openai.PermissionDeniedError) as e:
        await sdk(app, "chat-only").batches.create(input_file_id="file-x", endpoint="/v1/completions",
                                                    completion_window="24h")
    assert "pool 'p'" in e.value.body["message"]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as http:
        r = await http.post("/v1/batches", headers={"Authorization": "Bearer key-b"},
                            json={"input_file_id": "file-x", "endpoint": "/v1/completions"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "completion_window"
        r = await http.post("/v1/batches", headers={"Authorization": "Bearer key-b"},
                            json={"input_file_id": "f", "endpoint": "/v1/completions", "completion_window": "24h",
                                  "priority": "high"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        r = await http.get("/v1/batches?limit=0", headers={"Authorization": "Bearer key-b"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "limit"
        r = await http.post("/v1/files", headers={"Authorization": "Bearer key-b"}, json={"file": "x"})
        assert r.status_code == 400 and "multipart/form-data" in r.json()["error"]["message"]
        r = await http.get("/v1/files")
        assert r.status_code == 401


@sync
async def test_models_by_id(api):
    app, _, _ = api
    client = sdk(app, "b")
    m = await client.models.retrieve("m")
    assert m.id == "m" and m.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        await client.models.retrieve("gpt-4")
    assert "'m'" in e.value.body["message"]


@sync
async def test_the_batch_api_off_says_so(tmp_path):
    settings = RouterSettings("m", 64, RouterConfig(), TENANTS,
                              (PoolRoute("p", "p", 4, PriorityClass.STANDARD, queue_slots=8, max_num_seqs=4),))
    router = Endpoints(settings, {"p": FakePool()}, FakeController(),
                       LedgerService({t.name: Quota(**t.quota.model_dump()) for t in TENANTS}), WordCounter())
    app = make_app()
    for verb, path, name in ROUTES:
        getattr(app, verb)(path, name=name)(getattr(router, name))
    with pytest.raises(openai.NotFoundError) as e:
        await sdk(app, "b").batches.list()
    assert "batches.dir" in e.value.body["message"]


@sync
async def test_the_file_edges_a_user_meets(api):
    """A file of exactly `max_file_bytes` fits (the multipart framing around it is not the
    file), a UTF-8 byte-order mark (as Windows editors write) is no error, and an unknown input
    file is named by the field that holds it."""
    app, _, _ = api
    client = sdk(app, "b")
    head = b"\xef\xbb\xbf" + _file(2)
    tail = json.dumps({"custom_id": "req-pad", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "m", "prompt": "", "max_tokens": 4}}).encode() + b"\n"
    content = head + tail.replace(b'"prompt": ""', b'"prompt": "' + b"x" * (4096 - len(head) - len(tail)) + b'"')
    assert len(content) == 4096
    f = await client.files.create(file=("in.jsonl", content), purpose="batch")
    assert f.bytes == 4096
    b = await client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    assert b.status == "in_progress" and b.request_counts.total == 3
    with pytest.raises(openai.APIStatusError) as e:
        await client.files.create(file=("in.jsonl", content + b"\n"), purpose="batch")
    assert e.value.status_code == 413
    with pytest.raises(openai.BadRequestError) as e:
        await client.files.create(file=("in.jsonl", b"\xef\xbb\xbf{\xff"), purpose="batch")
    assert "(byte 4)" in e.value.body["message"], "the file's own offset, the mark counted"
    with pytest.raises(openai.NotFoundError) as e:
        await client.batches.create(input_file_id="file-" + "0" * 24, endpoint="/v1/completions",
                                    completion_window="24h")
    assert e.value.body["param"] == "input_file_id" and "POST /v1/files" in e.value.body["message"]


@sync
async def test_files_expire_when_asked_but_not_under_a_batch_still_reading_them(api):
    app, runner, batches = api
    clock = batches._clock
    client = sdk(app, "b")
    kept = await client.files.create(file=("in.jsonl", _file(3)), purpose="batch")
    short = await client.files.create(file=("in.jsonl", _file(3)), purpose="batch",
                                      expires_after={"anchor": "created_at", "seconds": 3600})
    assert kept.expires_at is None and short.expires_at == short.created_at + 3600
    b = await client.batches.create(input_file_id=short.id, endpoint="/v1/completions", completion_window="24h",
                                    output_expires_after={"anchor": "created_at", "seconds": 7200})
    runner.answer(next(iter(runner.jobs)), n=1, then="FAILED")  # to be run again after its input expired
    clock.now += 3600
    for call in (client.files.retrieve(short.id), client.files.delete(short.id)):
        with pytest.raises(openai.NotFoundError):
            await call
    assert {x.id async for x in client.files.list()} == {kept.id}
    batches.poll()  # the job is run again, and reads its input
    runner.answer(list(runner.jobs)[-1], then="SUCCEEDED")
    batches.poll()
    b = await client.batches.retrieve(b.id)
    assert b.status == "completed" and b.request_counts.completed == 3
    out = await client.files.retrieve(b.output_file_id)
    assert out.expires_at == out.created_at + 7200
    clock.now += 7200
    batches.poll()  # the batch service's sweep removes what expired, read or not, once no batch reads it
    folder = batches._files._dir("b")
    assert sorted(p.name for p in folder.iterdir()) == sorted([kept.id, f"{kept.id}.json"])
    for policy in ({"anchor": "created_at", "seconds": 60}, {"anchor": "last_active_at", "seconds": 3600}):
        with pytest.raises(openai.BadRequestError) as e:
            await client.files.create(file=("in.jsonl", _file(1)), purpose="batch", expires_after=policy)
        assert e.value.body["param"] == "expires_after" and "expires_after[seconds]" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        await client.batches.create(input_file_id=kept.id, endpoint="/v1/completions", completion_window="24h",
                                    output_expires_after={"anchor": "created_at", "seconds": 10**9})
    assert e.value.body["param"] == "output_expires_after" and "2592000" in e.value.body["message"]


@sync
async def test_an_upload_names_a_form_field_it_does_not_know(api):
    """An expiry policy sent some other way than the SDK's was ignored: the file never expired."""
    app, _, _ = api
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as http:
        for field, value in (("expires_after", '{"anchor": "created_at", "seconds": 3600}'),
                             ("expire_after[seconds]", "3600"), ("expires_after[seconds]", "\u00b2")):
            r = await http.post("/v1/files", headers={"Authorization": "Bearer key-b"},
                                data={"purpose": "batch", field: value}, files={"file": ("in.jsonl", _file(1))})
            assert r.status_code == 400 and r.json()["error"]["param"] == field.split("[")[0], (field, r.text)


@sync
async def test_a_batch_whose_input_was_deleted_ends_failed_with_its_answers(api):
    """It waited out its 24-hour window, `in_progress`, its job unable to start."""
    app, runner, batches = api
    client = sdk(app, "b")
    f = await client.files.create(file=("in.jsonl", _file(3)), purpose="batch")
    b = await client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    runner.answer(next(iter(runner.jobs)), n=2, then="FAILED")
    await client.files.delete(f.id)
    batches.poll()
    b = await client.batches.retrieve(b.id)
    assert b.status == "failed" and b.request_counts.completed == 2 and b.output_file_id is not None
    assert b.errors.data[0].code == "input_file_missing" and f.id in b.errors.data[0].message


def test_files_list_page_and_delete(world):
    clock, _, _, files = world
    ids = []
    for i in range(3):
        clock.now += 1
        ids.append(_upload(files, "acme", 1))
    first = files.list("acme", limit=2)
    assert [f["id"] for f in first["data"]] == ids[::-1][:2] and first["has_more"]
    rest = files.list("acme", limit=2, after=first["last_id"])
    assert [f["id"] for f in rest["data"]] == [ids[0]] and not rest["has_more"]
    assert files.delete("acme", ids[0])["deleted"]
    with pytest.raises(ApiError):
        files.get("acme", ids[0])
    assert (files.content_path("acme", ids[1]).stat().st_mode & 0o077) == 0, "readable by its owner only"
    for bad in ("../../etc/passwd", "file-" + "x" * 24):
        with pytest.raises(ApiError) as e:
            files.get("acme", bad)
        assert e.value.status == 404


def test_a_tenant_name_cannot_reach_outside_its_folder(world, tmp_path):
    _, _, _, files = world
    fid = _upload(files, "../evil", 1)
    assert files.content_path("../evil", fid).resolve().is_relative_to(tmp_path.resolve())


@sync
async def test_an_upload_without_a_declared_size_is_refused_once_it_passes_the_limit(api):
    """A chunked upload declares no Content-Length: the form parser spooled all of it to disk
    before the file's size was checked, so one request could fill the router's disk."""
    app, _, _ = api
    boundary = "poolserve-test"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{boundary}\r\n"
            "Content-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
            "Content-Type: application/octet-stream\r\n\r\n").encode()
    chunk, chunks, pulled = b"x" * 1024, 400, 0  # 400 KiB against a 4 KiB file limit

    async def body():
        nonlocal pulled
        for piece in (head, *[chunk] * chunks, f"\r\n--{boundary}--\r\n".encode()):
            pulled += len(piece)
            yield piece

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as http:
        r = await http.post("/v1/files", content=body(), headers={
            "Authorization": "Bearer key-b", "Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert r.status_code == 413 and "batches.max_file_bytes" in r.json()["error"]["message"], r.text
    assert pulled <= 4096 + (16 << 10) + 2 * len(chunk), f"the router read {pulled} bytes of the body"
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as http:
        r = await http.post("/v1/files", content=b"--x\r\n", headers={
            "Authorization": "Bearer key-b", "Content-Type": "multipart/form-data; boundary=x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
    assert [x async for x in sdk(app, "b").files.list()] == []


@sync
async def test_a_tenant_has_at_most_so_many_batches_unfinished(api):
    """Each batch runs as a Ray job: a tenant could start as many as it liked on the cluster."""
    app, runner, batches = api
    client, other = sdk(app, "b"), sdk(app, "a")
    f = await client.files.create(file=("in.jsonl", _file(2)), purpose="batch")
    made = [await client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
            for _ in range(8)]
    with pytest.raises(openai.RateLimitError) as e:
        await client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    assert e.value.body["code"] == "too_many_batches" and "batches.max_active_per_tenant" in e.value.body["message"]
    assert len(runner.jobs) == 8, "no job for the refused one"
    g = await other.files.create(file=("in.jsonl", _file(2)), purpose="batch")
    assert (await other.batches.create(input_file_id=g.id, endpoint="/v1/completions",
                                       completion_window="24h")).status == "in_progress", "another tenant's own count"
    await client.batches.cancel(made[0].id)
    batches.poll()  # the cancel ends it
    assert (await client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                        completion_window="24h")).status == "in_progress"
