"""The Files API's store against a model of it, on seeded random schedules: two router
replicas (one keeping little read) share a volume while tenants upload, delete, list page by
page with others' deletes in between, files expire, crashes leave halves and sweeps run. After
every step each replica answers as the model does: what is listed, got and counted, and every
file a tenant kept while it paged is on one of its pages or the list failed visibly."""

from __future__ import annotations

import os
import random
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest

from router.errors import ApiError
from router.files import ORPHAN_GRACE_S, FileStore, ReadOnce
from tests.unit.model_based import replayable, schedules
from tests.unit.test_batch_api import _file, api, sdk, sync  # noqa: F401 (a fixture)
from tests.unit.test_batches import Clock

TENANTS = ("acme", "beta/x")  # a name that is no safe folder name as it is
PURPOSES = (None, "batch", "batch_output")


@dataclass
class Kept:
    tenant: str
    purpose: str
    size: int
    created_at: int
    expires_at: int | None


class World:
    def __init__(self, root: Path, rng: random.Random) -> None:
        self.rng, self.clock, self.root = rng, Clock(), root
        self.replicas = [FileStore(root, self.clock), FileStore(root, self.clock)]
        self.replicas[1]._objects = ReadOnce(rng.choice((300, 2_000)))  # drops what it read, often
        self.files: dict[str, Kept] = {}
        self.halves: dict[Path, tuple[str, float, int]] = {}  # what a crash left: tenant, written at, bytes

    def store(self) -> FileStore:
        return self.rng.choice(self.replicas)

    def visible(self, tenant: str, purpose: str | None = None) -> list[str]:
        now = self.clock.now
        kept = [(-k.created_at, i) for i, k in self.files.items() if k.tenant == tenant
                and (purpose is None or k.purpose == purpose) and (k.expires_at is None or now < k.expires_at)]
        return [i for _, i in sorted(kept)]

    # -- steps --------------------------------------------------------------------

    def create(self, _cursor: str | None = None) -> None:
        tenant, purpose = self.rng.choice(TENANTS), self.rng.choice(PURPOSES[1:])
        expiry = self.rng.choice((None, 3600, 7200))
        size = self.rng.randrange(0, 50)
        meta = self.store().create(tenant, "in.jsonl", purpose, b"x" * size, expiry)
        assert meta["id"] not in self.files
        now = int(self.clock.now)
        self.files[meta["id"]] = Kept(tenant, purpose, size, now, None if expiry is None else now + expiry)

    def delete(self, _cursor: str | None = None) -> None:
        if not self.files:
            return
        file_id = self.rng.choice(sorted(self.files))
        k = self.files[file_id]
        try:
            self.store().delete(k.tenant, file_id)
        except ApiError as e:
            assert e.status == 404 and file_id not in self.visible(k.tenant), f"{file_id} could not be deleted"
            return
        assert file_id in self.visible(k.tenant), f"{file_id} was deleted while expired"
        del self.files[file_id]

    def crash(self, _cursor: str | None = None) -> None:
        """A router died mid-upload: a temp file, or a content whose object was never written."""
        tenant = self.rng.choice(TENANTS)
        folder = self.replicas[0]._dir(tenant)
        folder.mkdir(parents=True, exist_ok=True)
        name = f"file-{self.rng.getrandbits(96):024x}"
        path = folder / (name if self.rng.random() < 0.5 else f".{name}.json.{self.rng.getrandbits(32):08x}")
        path.write_bytes(b"y" * (size := self.rng.randrange(1, 30)))
        os.utime(path, (self.clock.now, self.clock.now))
        self.halves[path] = (tenant, self.clock.now, size)

    def sweep(self, _cursor: str | None = None) -> None:
        keep = {self.replicas[0].path(k.tenant, i) for i, k in self.files.items() if self.rng.random() < 0.3}
        self.store().sweep(keep=keep)
        now = self.clock.now
        for i, k in list(self.files.items()):
            if k.expires_at is not None and now >= k.expires_at and self.replicas[0].path(k.tenant, i) not in keep:
                del self.files[i]
        self.halves = {p: h for p, h in self.halves.items() if h[1] >= now - ORPHAN_GRACE_S}

    def wait(self, _cursor: str | None = None) -> None:
        self.clock.now += self.rng.choice((0.4, 1, 5, 900, 3600))

    def page_through(self) -> None:
        """Every page of one list, in either order, with other clients' deletes (of the page's
        last file too, as a client deleting what it pages through does), uploads, expiries and
        sweeps between pages."""
        tenant, purpose, limit = self.rng.choice(TENANTS), self.rng.choice(PURPOSES), self.rng.randrange(1, 5)
        order = self.rng.choice(("asc", "desc"))
        throughout, seen, after = set(self.visible(tenant, purpose)), [], None
        while True:
            got = self.store().list(tenant, purpose, limit, after, order)
            seen += [f["id"] for f in got["data"]]
            if not got["has_more"]:
                break
            after = got["last_id"]
            for _ in range(self.rng.randrange(0, 3)):
                self.rng.choice((self.delete, self.create, self.wait, self.sweep, self.delete_cursor))(after)
            throughout &= set(self.visible(tenant, purpose))
        assert len(seen) == len(set(seen)), f"a file on two pages: {seen}"
        assert throughout <= set(seen), f"kept all along, on no page: {sorted(throughout - set(seen))}"
        keys = [((-1 if order == "desc" else 1) * self.files[i].created_at, i) for i in seen if i in self.files]
        assert keys == sorted(keys), f"out of {order} order: {keys}"

    def delete_cursor(self, file_id: str) -> None:
        k = self.files.get(file_id)
        if k is not None and file_id in self.visible(k.tenant):
            self.store().delete(k.tenant, file_id)
            del self.files[file_id]

    # -- what every replica answers ----------------------------------------------------

    def check(self) -> None:
        for store in self.replicas:
            for tenant in TENANTS:
                for purpose in PURPOSES:
                    listed = store.list(tenant, purpose)["data"]
                    assert [f["id"] for f in listed] == self.visible(tenant, purpose), (tenant, purpose)
                    assert all(f["bytes"] == self.files[f["id"]].size for f in listed)
                halves = [h for h in self.halves.values() if h[0] == tenant]
                mine = [k for k in self.files.values() if k.tenant == tenant]
                assert store.usage(tenant) == (len(mine) + sum(1 for p, h in self.halves.items() if h[0] == tenant
                                                               and not p.name.startswith(".")),
                                               sum(k.size for k in mine) + sum(h[2] for h in halves)), tenant
            for file_id, k in self.files.items():
                expired = k.expires_at is not None and self.clock.now >= k.expires_at
                assert store.get(k.tenant, file_id, expired_ok=True)["id"] == file_id
                try:
                    store.get(k.tenant, file_id)
                    assert not expired, f"{file_id} got after it expired"
                except ApiError as e:
                    assert expired and e.status == 404, e
                other = TENANTS[1 - TENANTS.index(k.tenant)]
                try:
                    store.get(other, file_id, expired_ok=True)
                    raise AssertionError(f"{other} got {k.tenant}'s file")
                except ApiError as e:
                    assert e.status == 404


def test_the_file_store_answers_as_its_model_does(tmp_path, monkeypatch):
    for seed in schedules(30):
        with replayable("test_the_file_store_answers_as_its_model_does", seed):
            rng = random.Random(seed)
            monkeypatch.setattr("router.files.uuid", SimpleNamespace(uuid4=lambda: uuid.UUID(int=rng.getrandbits(128))))
            world = World(tmp_path / str(seed), rng)
            steps = (world.create,) * 4 + (world.delete, world.crash, world.sweep, world.wait, world.page_through)
            for _ in range(40):
                rng.choice(steps)()
                world.check()


@sync
async def test_a_client_deleting_what_it_pages_through_reaches_every_file(api, monkeypatch):
    """The openai SDK asks for each page `after` the last file of the page before, so a client
    deleting what it reads removes its own cursor: the next page came back empty and its paging
    ended with files left (found by a review of the 400 that replaced it)."""
    app, _, batches = api
    client = sdk(app, "b")
    made = []
    for i in range(7):
        made.append((await client.files.create(file=("in.jsonl", _file(1)), purpose="batch")).id)
        batches._clock.now += i % 2  # some in one second
    oldest_first = [(f.created_at, f.id) async for f in client.files.list(limit=2, order="asc")]
    assert oldest_first == sorted(oldest_first) and sorted(i for _, i in oldest_first) == sorted(made)
    async for f in client.files.list(limit=2):
        await client.files.delete(f.id)
    assert [f.id async for f in client.files.list()] == []
    monkeypatch.setattr("router.files.new_file_id", lambda now: f"file-{uuid.uuid4().hex[:24]}")  # made before
    for _ in range(2):
        await client.files.create(file=("in.jsonl", _file(1)), purpose="batch")
    first = await client.files.list(limit=1)
    await client.files.delete(first.data[0].id)
    with pytest.raises(openai.BadRequestError) as e:  # an id that says not where it sat: visibly, not an empty page
        await first.get_next_page()
    assert e.value.body["param"] == "after" and "list again without after" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        await client.batches.list(after="batch_" + "0" * 24)
    assert e.value.body["param"] == "after" and "no batch" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        await client.files.list(order="newest")
    assert e.value.body["param"] == "order"
