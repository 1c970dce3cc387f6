"""Tenants' files for the OpenAI Batch API, in a folder the config names (a shared volume on
Kubernetes, so that every router replica and the batch jobs see the same files).

    <root>/<tenant>/files/<file id>          the content, written once
    <root>/<tenant>/files/<file id>.json     its OpenAI file object

A tenant sees only its own folder: another tenant's file id is simply not found. A file kept
under an expiry policy (OpenAI's `expires_after`) is gone for its tenant from its `expires_at`
on (not found, not listed, not deleted twice); only `sweep()` removes it, and not while an
unfinished batch still reads it.

A file object is written once, so each store reads it once: a list costs the folder's names and
the objects new since the last, not every file the tenant keeps. What a crash leaves (a content
whose object was never written, a half-written file) counts in its tenant's share until `sweep()`
removes it. Pure file I/O with the clock as a parameter; no Ray.
"""

from __future__ import annotations

import collections
import errno
import json
import logging
import os
import re
import threading
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable
from urllib.parse import quote

from router.errors import ApiError

log = logging.getLogger("poolserve.router")

PURPOSES = ("batch", "batch_output")
_ID = re.compile(r"file-[0-9a-f]{24}")
EXPIRY_S = (3600, 30 * 24 * 3600)  # OpenAI's bounds on an expiry policy's seconds
ORPHAN_GRACE_S = 3600.0  # what a crash left is removed once no write can still be under way (uploads end in 600 s)
READ_ONCE_BYTES = 8 << 20  # the JSON text a store keeps parsed (3-5 times that in memory): about 30,000 file objects
_LEFT = re.compile(r"(\.file-[0-9a-f]{24}(\.json)?\.[0-9a-f]{8}|file-[0-9a-f]{24})")  # write_whole's, a content


def expiry_seconds(policy: Any, field: str, how: str = "") -> int | None:
    """The seconds of an expiry policy (`{"anchor": "created_at", "seconds": N}`), or None for none;
    `how` says how the caller sends one, for the error."""
    if policy is None:
        return None
    low, high = EXPIRY_S
    if not (isinstance(policy, dict) and policy.get("anchor") == "created_at" and set(policy) == {"anchor", "seconds"}
            and type(policy["seconds"]) is int and low <= policy["seconds"] <= high):
        raise ApiError(400, "invalid_value", f"{field} must be {{'anchor': 'created_at', 'seconds': N}}{how} with N "
                                             f"from {low} to {high}", field)
    return policy["seconds"]


def tenant_dir(root: Path, tenant: str) -> Path:
    """A tenant's folder; any tenant name makes one safe folder name."""
    return root / quote(tenant, safe="")


class FileStore:
    def __init__(self, root: str | Path, clock: Callable[[], float]) -> None:
        self._root = Path(root)
        self._clock = clock
        self._objects = ReadOnce(READ_ONCE_BYTES)  # file objects are written once: never stale
        self._failed: set[Path] = set()  # folders the last sweep could not sweep (logged once each)

    def _dir(self, tenant: str) -> Path:
        return tenant_dir(self._root, tenant) / "files"

    def create(self, tenant: str, filename: str, purpose: str, content: bytes, expires_after_s: int | None = None
               ) -> dict:
        if purpose not in PURPOSES:
            raise ApiError(400, "invalid_value", f"purpose {purpose!r}: use 'batch'", "purpose")
        folder = self._dir(tenant)
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        now = int(self._clock())
        file_id = new_file_id(now)
        write_whole(folder / file_id, content)
        meta = {"id": file_id, "object": "file", "bytes": len(content), "created_at": now, "filename": filename,
                "purpose": purpose, "status": "processed", "status_details": None,
                "expires_at": None if expires_after_s is None else now + expires_after_s}
        try:
            write_whole(folder / f"{file_id}.json", json.dumps(meta).encode())  # last: a file exists once this does
        except BaseException:
            if not (folder / f"{file_id}.json").exists():  # (a rename retried over NFS may have happened)
                (folder / file_id).unlink(missing_ok=True)
            raise
        return meta

    def get(self, tenant: str, file_id: str, expired_ok: bool = False) -> dict:
        """A file's object; `expired_ok` for a batch that still reads its input."""
        meta = _read_meta(self._meta_path(tenant, file_id))
        if meta is None or (self._expired(meta) and not expired_ok):
            raise ApiError(404, "file_not_found", f"no file {file_id!r}", "file_id")
        return meta

    def content_path(self, tenant: str, file_id: str, expired_ok: bool = False) -> Path:
        self.get(tenant, file_id, expired_ok)
        return self.path(tenant, file_id)

    def path(self, tenant: str, file_id: str) -> Path:
        """Where a file's content is (or would be), unchecked."""
        return self._dir(tenant) / file_id

    def usage(self, tenant: str) -> tuple[int, int]:
        """The files a tenant keeps on the volume and their bytes, expired ones not yet swept,
        batch outputs and what a crash left included: what the tenant takes of the volume now."""
        files, stored = 0, 0
        for entry in _leftovers_and_contents(self._dir(tenant)):  # their sizes: no file object is read
            try:
                stored += entry.stat().st_size
            except FileNotFoundError:  # deleted meanwhile
                continue
            files += not entry.name.startswith(".")
        return files, stored

    def list(self, tenant: str, purpose: str | None = None, limit: int = 10000, after: str | None = None,
             order: str = "desc") -> dict:
        if order not in ("asc", "desc"):
            raise ApiError(400, "invalid_value", f"order {order!r}: use 'asc' or 'desc' (by created_at)", "order")
        folder = self._dir(tenant)
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            names = []
        now = self._clock()
        objects = self._objects.read(folder, _object_names(names), lambda path: (_read_meta(path), True))
        sign = -1 if order == "desc" else 1

        def key(m: dict) -> tuple[int, str]:
            return sign * m["created_at"], m["id"]

        def place(file_id: str) -> tuple[int, str] | None:  # a cursor gone from the list: expired, or deleted
            at = next((m["created_at"] for m in objects if m["id"] == file_id), None)
            at = created_at_of(file_id) if at is None else at
            return None if at is None else (sign * at, file_id)

        metas = sorted((m for m in objects if (purpose is None or m["purpose"] == purpose) and not _expired(m, now)),
                       key=key)
        listed = page(metas, limit, after, "file", key, place)
        return {**listed, "data": [dict(m) for m in listed["data"]]}  # the kept ones stay as read

    def delete(self, tenant: str, file_id: str) -> dict:
        self.get(tenant, file_id)
        self._remove(self._dir(tenant), file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    def sweep(self, keep: set[Path] = frozenset(), keep_tenants: set[Path] = frozenset()) -> None:
        """Remove every tenant's expired files but those whose content path is in `keep` and
        those of the tenant folders in `keep_tenants`, and what a crash left, theirs too (older
        than ORPHAN_GRACE_S: no write can still be under way). Like a list, it reads only the
        file objects new since it last read the folder (within the store's budget); a folder the
        volume fails on is named in the log (once) and swept once it can be, the others meanwhile."""
        for folder in self._tenant_folders():
            try:
                failed = self._sweep_folder(folder, keep, folder.parent in keep_tenants)
            except FileNotFoundError:
                failed = None
            except OSError as e:
                failed = e
            if failed is None:
                self._failed.discard(folder)
            elif folder not in self._failed:
                self._failed.add(folder)
                log.warning("could not remove the expired files of %s: %s", folder, failed)

    def _sweep_folder(self, folder: Path, keep: set[Path], kept: bool) -> OSError | None:
        """One tenant's folder swept; the volume's first failure on one of its files, if any
        (the others are swept all the same: one stuck file held back the rest for good)."""
        names, failed = set(os.listdir(folder)), None
        expired = [] if kept else [m["id"] for m in self._objects.read(folder, _object_names(names), _readable_meta)
                                   if self._expired(m) and folder / m["id"] not in keep]
        for file_id in expired:
            try:
                self._remove(folder, file_id)
            except OSError as e:
                failed = failed or e
        for name in names:
            if _LEFT.fullmatch(name) and (name.startswith(".") or f"{name}.json" not in names):
                try:
                    if _changed_at(folder / name) < self._clock() - ORPHAN_GRACE_S:
                        (folder / name).unlink(missing_ok=True)
                except OSError as e:
                    failed = failed or e
        return failed

    def _tenant_folders(self) -> list[Path]:
        """Each tenant's files' folder; a root the volume will not list raises (the caller logs it)."""
        return [folder / "files" for folder in tenant_folders(self._root)]

    def _remove(self, folder: Path, file_id: str) -> None:
        (folder / f"{file_id}.json").unlink(missing_ok=True)  # the object first: a file exists while it does
        (folder / file_id).unlink(missing_ok=True)

    def _expired(self, meta: dict) -> bool:
        return _expired(meta, self._clock())

    def _meta_path(self, tenant: str, file_id: str) -> Path:
        if not _ID.fullmatch(file_id):
            raise ApiError(404, "file_not_found", f"no file {file_id!r}", "file_id")
        return self._dir(tenant) / f"{file_id}.json"


def _expired(meta: dict, now: float) -> bool:
    return meta.get("expires_at") is not None and now >= meta["expires_at"]


def _read_meta(path: Path) -> dict | None:
    """A file's object, or None (being deleted, or not one). A volume that fails raises: its
    error is named (a 503), where taking it for no file answered 404."""
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, IsADirectoryError, ValueError):
        return None
    if not (isinstance(meta, dict) and isinstance(meta.get("id"), str) and _ID.fullmatch(meta["id"])
            and all(type(meta.get(k)) is t for k, t in (("bytes", int), ("created_at", int), ("purpose", str),
                                                          ("filename", str)))):
        return None  # another shape (another version's, damaged): listed, it made every list a 500
    expires = meta.get("expires_at")
    return meta if expires is None or type(expires) is int else None  # (a NaN never expired)


class ReadOnce:
    """JSON files parsed once per process where they are never written again (file objects,
    finished batch records): a list pays for the folder's names and what is new. Kept by
    folder, so that what left a folder (deleted by another replica) leaves with its next list,
    within `budget` bytes of their text; the folders listed longest ago go first. Lists run in
    threads."""

    def __init__(self, budget: int) -> None:
        self._budget, self._bytes = budget, 0
        self._folders: collections.OrderedDict[str, dict[str, tuple[dict, int]]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def read(self, folder: Path, names: Iterable[str], parse: Callable[[Path], tuple[dict | None, bool]]
             ) -> list[dict]:
        """What `parse` makes of each name's file, reading only those not kept; `parse` says
        whether its answer may be kept (never written again)."""
        with self._lock:
            kept = self._folders.get(str(folder), {})
        now: dict[str, tuple[dict, int]] = {}
        out = []
        for name in names:
            if (hit := kept.get(name)) is None:
                item, final = parse(folder / name)
                if item is None:  # being deleted, or not one
                    continue
                if final:
                    hit = (item, len(json.dumps(item)))
                else:
                    out.append(item)
                    continue
            now[name] = hit
            out.append(hit[0])
        with self._lock:
            self._bytes -= sum(size for _, size in self._folders.pop(str(folder), {}).values())
            self._folders[str(folder)] = now
            self._bytes += sum(size for _, size in now.values())
            while self._bytes > self._budget and self._folders:  # one folder past the budget is read each time
                self._bytes -= sum(size for _, size in self._folders.popitem(last=False)[1].values())
        return out


def volume_failed(e: OSError) -> ApiError:
    """The volume's own failure, named: never the tenant's fault, never a bare 500. Logged with
    the path it names, for the operator (the client's message holds no path of the server's)."""
    log.warning("the batch volume failed: %s: %s", type(e).__name__, e)
    problem = e.strerror or type(e).__name__
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return ApiError(507, "storage_full", f"the volume batches.dir names is full ({problem}); nothing was kept: "
                                             "tell the server's operator")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return ApiError(503, "storage_unavailable", f"the volume batches.dir names refuses this server ({problem}): "
                                                    "tell the server's operator")
    return ApiError(503, "storage_unavailable", f"the volume batches.dir names failed ({problem}); nothing was "
                                                "kept: retry shortly", retry_after_s=5)


def _leftovers_and_contents(folder: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as entries:
            return [e for e in entries if _LEFT.fullmatch(e.name)]
    except FileNotFoundError:
        return []


def tenant_folders(root: Path, failed: Callable[[Path], None] = lambda path: None) -> list[Path]:
    """The tenants' folders under `root` (none before the first is made). An entry the volume
    fails on (a symlink loop) is passed to `failed` and stops no other tenant's; a root the
    volume will not list raises."""
    folders = []
    try:
        with os.scandir(root) as entries:
            for entry in entries:
                try:
                    if entry.is_dir():
                        folders.append(Path(entry.path))
                except OSError:
                    failed(Path(entry.path))
    except FileNotFoundError:
        return []
    return folders


def _object_names(names: Iterable[str]) -> list[str]:
    """The file objects' names among a folder's."""
    return [n for n in names if n.endswith(".json") and _ID.fullmatch(n[:-5])]


def _readable_meta(path: Path) -> tuple[dict | None, bool]:
    """A file's object for the sweep, kept read; one the volume fails to read now is passed
    over (the others are swept, it at a later sweep)."""
    try:
        return _read_meta(path), True
    except OSError:
        return None, False


def _changed_at(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return float("inf")  # gone already


def write_whole(path: Path, data: bytes) -> None:
    """Whole or not at all: written beside, then renamed; readable by its owner only. A write
    that fails (a full volume) removes its half."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def new_file_id(created_at: int) -> str:
    """`file-` and 24 hex digits, as ever: its creation second, then random ones around a 7 in
    the 13th place (a uuid4 has a 4 there, and made the ids before), so that a list page `after`
    a file deleted since the page before still starts where it would have."""
    r = uuid.uuid4().hex
    return f"file-{min(max(created_at, 0), 0xFFFFFFFF):08x}{r[:4]}7{r[4:15]}"


def created_at_of(file_id: str) -> int | None:
    """The creation second an id of `new_file_id`'s holds; None for an id made before."""
    digits = file_id[5:]
    return int(digits[:8], 16) if _ID.fullmatch(file_id) and digits[12] == "7" else None


def page(items: list[dict], limit: int, after: str | None, noun: str,
         key: Callable[[dict], Any] | None = None, place: Callable[[str], Any] | None = None) -> dict:
    """An OpenAI list page: `items` (in the list's order, by `key`) after the one with id
    `after`, at most `limit`. An `after` no longer among them (deleted or expired since the page
    before: a client deleting what it pages through removes its own cursor) is placed by
    `place`, its key; one that cannot be placed is a 400, where an empty page would end the
    client's paging as if nothing came after it."""
    if after:
        ids = [i["id"] for i in items]
        if after in ids:
            items = items[ids.index(after) + 1:]
        elif key is not None and place is not None and (at := place(after)) is not None:
            items = [i for i in items if key(i) > at]
        else:
            raise ApiError(400, "invalid_value", f"after: no {noun} {after!r} in this list (made before this version "
                                                 "and gone since the page before, or never yours): list again "
                                                 "without after", "after")
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}
