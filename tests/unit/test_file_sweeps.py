"""What the minutely sweep of tenants' files costs the batch service, and what it does with a
folder the volume will not list. The sweep parsed every file object of every tenant at every
sweep (10,000 files a tenant is the default cap) and stat'ed every content for its object,
where a list reads only what is new; and a folder it could not list, or a file it could not
remove, raised out of the sweep and stopped it for every tenant after that one."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from router.files import ORPHAN_GRACE_S, FileStore
from tests.unit.test_batch_polls import _reads_of
from tests.unit.test_batches import Clock, _upload


def test_a_sweep_reads_each_file_object_once(tmp_path, monkeypatch):
    clock = Clock()
    files = FileStore(tmp_path, clock)
    kept = [_upload(files, t, 1) for t in ("acme", "globex") for _ in range(20)]
    soon = files.create("acme", "soon.jsonl", "batch", b"{}\n", expires_after_s=3600)["id"]
    files.sweep()
    objects = _reads_of(monkeypatch, lambda t: '"object": "file"' in str(t))
    files.sweep()
    assert objects == [], "nothing new since the sweep before: no file object read again"
    new = _upload(files, "globex", 2)
    files.sweep()
    assert len(objects) == 1, "only the new file's object"
    clock.now += 3600
    files.sweep()
    listed = {f["id"] for t in ("acme", "globex") for f in files.list(t)["data"]}
    assert listed == {*kept, new} and not files.path("acme", soon).exists(), "the expired file is swept, and only it"


def test_a_sweep_stats_no_content_whose_object_it_listed(tmp_path, monkeypatch):
    clock = Clock()
    files = FileStore(tmp_path, clock)
    for _ in range(30):
        _upload(files, "acme", 1)
    orphan = files.path("acme", "file-0123456789abcdef01234567")
    orphan.write_bytes(b"left by a crash")
    os.utime(orphan, (clock.now - ORPHAN_GRACE_S - 1,) * 2)
    looked: list[str] = []
    exists = Path.exists
    monkeypatch.setattr(Path, "exists", lambda self, *a, **k: (looked.append(self.name), exists(self, *a, **k))[1])
    files.sweep()
    assert looked == [], "the folder's names tell which contents have their object"
    assert not orphan.exists(), "the content a crash left with no object is swept"
    assert len(files.list("acme")["data"]) == 30


def test_a_tenant_folder_the_volume_will_not_list_is_named_and_the_others_are_swept(tmp_path, monkeypatch, caplog):
    clock = Clock()
    files = FileStore(tmp_path, clock)
    gone = {t: files.create(t, "in.jsonl", "batch", b"{}\n", expires_after_s=3600)["id"] for t in ("acme", "globex")}
    clock.now += 3600
    refused = files.path("acme", "x").parent
    real = {name: getattr(os, name) for name in ("listdir", "scandir")}

    def refusing(name):
        def call(path="."):
            if Path(path) == refused:
                raise PermissionError(13, "Permission denied", str(path))
            return real[name](path)
        return call
    for name in real:
        monkeypatch.setattr(os, name, refusing(name))
    with caplog.at_level(logging.WARNING, logger="poolserve.router"):
        files.sweep()
    assert not files.path("globex", gone["globex"]).exists(), "another tenant's expired file is swept"
    assert files.path("acme", gone["acme"]).exists()
    assert [r for r in caplog.records if str(refused) in r.getMessage()], "the folder left unswept is named"
    for name, call in real.items():
        monkeypatch.setattr(os, name, call)
    files.sweep()
    assert not files.path("acme", gone["acme"]).exists(), "swept once the volume lists it again"


def test_a_file_the_volume_will_not_remove_stops_no_other_tenants_sweep(tmp_path, monkeypatch, caplog):
    """An unlink refused (EACCES, EROFS, a stale NFS handle) raised out of the sweep: no tenant
    after that one was swept, and the batch service retried, with a traceback, at every poll.
    It is named once, however many sweeps meet it (found by a review)."""
    clock = Clock()
    files = FileStore(tmp_path, clock)
    gone = {t: files.create(t, "in.jsonl", "batch", b"{}\n", expires_after_s=3600)["id"] for t in ("acme", "globex")}
    clock.now += 3600
    refused = files.path("acme", "x").parent
    unlink = Path.unlink

    def refusing(self, *a, **k):
        if self.parent == refused:
            raise PermissionError(13, "Permission denied", str(self))
        return unlink(self, *a, **k)
    monkeypatch.setattr(Path, "unlink", refusing)
    with caplog.at_level(logging.WARNING, logger="poolserve.router"):
        files.sweep()
        files.sweep()
    assert not files.path("globex", gone["globex"]).exists(), "another tenant's expired file is swept"
    assert len([r for r in caplog.records if str(refused) in r.getMessage()]) == 1, "named once"
    monkeypatch.setattr(Path, "unlink", unlink)
    files.sweep()
    assert not files.path("acme", gone["acme"]).exists(), "swept once the volume lets it"


def test_one_file_the_volume_will_not_remove_holds_back_none_of_its_tenants_others(tmp_path, monkeypatch):
    """A sweep stopped a folder at its first refused unlink: the files after it, in an order
    that stays the same in a process, were never removed and counted in the tenant's share
    for good, though the tenant could not see them to delete them (found by a review)."""
    clock = Clock()
    files = FileStore(tmp_path, clock)
    ids = [files.create("acme", "in.jsonl", "batch", b"{}\n", expires_after_s=3600)["id"] for _ in range(20)]
    clock.now += 3600
    stuck = files.path("acme", ids[7]).with_suffix(".json")
    unlink = Path.unlink
    monkeypatch.setattr(Path, "unlink", lambda self, *a, **k: (_ for _ in ()).throw(PermissionError(13, "no", str(self)))
                        if self == stuck else unlink(self, *a, **k))
    files.sweep()
    assert sorted(p.name for p in stuck.parent.iterdir()) == sorted([ids[7], stuck.name])
