"""*Pure.* Batch records and their jobs' output as they lie on disk, read defensively: a record
of another version's shape, or a torn or foreign line of output, is passed over, never raised,
so one damaged batch cannot stop the others. File I/O with the clock as a parameter; no Ray."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Callable, Iterator

from router.errors import ApiError
from router.files import READ_ONCE_BYTES, ReadOnce, tenant_dir, tenant_folders, write_whole

log = logging.getLogger("poolserve.router")

TERMINAL = ("completed", "failed", "cancelled", "expired")
MARKER_GRACE_S = 600.0  # a marker naming no record is dropped only this long after it was made
RESCAN_MARGIN_NS = 300 * 10**9  # a rescan reads again what changed this long before the last change it saw
LOCK_WAIT_S = 30.0  # a create or a cancel waits this long for another service's turn, then is a 503
HELD_GRACE_S = 3600.0  # how long past its window a batch waits for a job that holds its output
_ID = re.compile(r"batch_[0-9a-f]{24}")
_MOVING = ("validating", "in_progress", "finalizing", "cancelling")
_SHAPE = {"id": str, "status": str, "_tenant": str, "input_file_id": str, "endpoint": str, "created_at": int,
          "expires_at": int, "_attempts": int, "request_counts": dict}  # what moving a batch on reads
_OPTIONAL = ("_job", "output_file_id", "error_file_id")  # ... and these, which may be null


def read_record(path: Path) -> dict | None:
    """A batch's record, or None: none there, torn, or of a shape this service cannot move on
    (another version's, damaged). A volume that fails raises: a batch it hides is no 404."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, IsADirectoryError, ValueError):
        return None
    if not (isinstance(record, dict) and all(isinstance(record.get(k), t) for k, t in _SHAPE.items())
            and all(k in record and isinstance(record[k], (str, type(None))) for k in _OPTIONAL)
            and record["id"] == path.stem and record["status"] in (*TERMINAL, *_MOVING)
            and (record["status"] != "finalizing" or record.get("_final") in TERMINAL)
            and _in_its_tenants_folder(record["_tenant"], path)):
        return None
    return record


def _in_its_tenants_folder(tenant: str, path: Path) -> bool:
    """Whether the tenant a record names is the one whose folder holds it: a damaged one would
    move another tenant's batches, or, naming what no folder can be named (a lone surrogate),
    raise at every poll and at the service's start."""
    try:
        return tenant_dir(Path(), tenant).name == path.parent.parent.name
    except UnicodeEncodeError:
        return False


def output_held(path: Path) -> bool:
    """Whether a job holds the output's lock (`deployments.batch_job.Output`): it still runs,
    whatever its job API says (one of another cluster's during a RayService upgrade, which this
    API does not know; one told to stop that has not yet exited). The probe is a shared lock on
    a read-only descriptor (all NFS asks of one), held for an instant, which a job starting then
    waits out. A volume whose locks fail holds nothing, as `BatchStore.exclusive` takes it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, IsADirectoryError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError as e:
        log.warning("cannot probe %s for a job's lock (%s): taken as free", path, e)
    finally:
        os.close(fd)  # and with it the lock, if it was taken
    return False


def _record_and_whether_final(path: Path) -> tuple[dict | None, bool]:
    record = read_record(path)
    return record, record is not None and record["status"] in TERMINAL


def answered(row: dict) -> bool:
    return isinstance(response := row.get("response"), dict) and response.get("status_code") == 200


def output_rows(path: Path, start: int = 0):
    """The whole lines of a job's output from byte `start` (a torn last line is the job's to
    cut), each as (its row, or None when it is not the job's, the byte after it)."""
    if not path.exists():
        return
    with path.open("rb") as f:
        f.seek(start)
        for line in f:
            if not line.endswith(b"\n"):
                return
            start += len(line)
            try:
                row = json.loads(line.decode("utf-8", errors="replace")) if line.strip() else None
            except ValueError:
                row = None
            yield (row if isinstance(row, dict) and isinstance(row.get("custom_id"), str) else None), start


class BatchStore:
    """Every tenant's batch records (`<root>/<tenant>/batches/<id>.json`), with a marker for each
    batch not finished (`open/<id>`, holding when it was made) so that a poll reads only those,
    and each job's output counted from where the last count stopped: finished batches and
    answered lines cost a poll nothing. A finished record is written no more, so a list reads it
    once."""

    def __init__(self, root: Path, clock: Callable[[], float]) -> None:
        self._root, self._clock = root, clock
        self._unreadable: set[Path] = set()  # logged once each
        # tenants with a record, a folder or an entry the last poll could not read: what it holds
        # is unknown, so none of their files is swept (a job run again reads its input)
        self.unread_tenants: set[Path] = set()
        self._read_again: set[Path] = set()  # records `mark_unfinished` could not read
        self._counted: dict[str, tuple[int, int, int]] = {}  # batch id: its output's bytes counted, answered, failed
        # tenant folder: its batches' folder (device, inode) and the latest change to a record its scan read
        self._scanned_ns: dict[Path, tuple[tuple[int, int] | None, int]] = {}
        self._finished = ReadOnce(READ_ONCE_BYTES)  # a finished record is written no more
        self._held_told: set[str] = set()  # batches whose held output was logged

    def load(self, tenant: str, batch_id: str) -> dict:
        record = read_record(self._path(tenant, batch_id)) if _ID.fullmatch(batch_id) else None
        if record is None:
            raise ApiError(404, "batch_not_found", f"no batch {batch_id!r}", "batch_id")
        return record

    def save(self, record: dict) -> None:
        path = self._path(record["_tenant"], record["id"])
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_whole(path, json.dumps(record).encode())

    def records(self, tenant: str) -> list[dict]:
        folder = tenant_dir(self._root, tenant) / "batches"
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            names = []
        return self._finished.read(folder, [n for n in names if n.endswith(".json") and _ID.fullmatch(n[:-5])],
                                   _record_and_whether_final)

    def folder(self, record: dict) -> Path:
        """Where a batch's job writes its output and finds the tenant's key."""
        return tenant_dir(self._root, record["_tenant"]) / "batches" / record["id"]

    def output(self, record: dict) -> Path:
        return self.folder(record) / "output.jsonl"

    def held(self, record: dict) -> bool:
        """Whether a job its API does not know still writes the batch's output (`output_held`),
        until HELD_GRACE_S past the batch's window: a lock no job releases (one an NFS server
        keeps for a node that never came back) ends with the window."""
        if not output_held(self.output(record)):
            return False
        if record["id"] not in self._held_told:
            self._held_told.add(record["id"])
            log.warning("batch %s: a job still holds its output, though its job API says it ended or knows it "
                        "not; waiting for it", record["id"])
        return self._clock() < record["expires_at"] + HELD_GRACE_S

    # -- the batches not finished -------------------------------------------------------

    def mark(self, tenant: str, batch_id: str) -> None:
        """Before its record is first written: a crash between leaves a marker naming no record,
        which `unfinished` drops once none can be on its way."""
        marker = self._marker(tenant, batch_id)
        marker.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_whole(marker, str(int(self._clock())).encode())

    def tidy(self, record: dict) -> None:
        """What a finished batch leaves: its marker, its tenant's key, and its job's raw output
        (split into the batch's output and error files by now: kept, it took the volume twice,
        outside the tenant's storage bound). After the record is saved, so a crash between leaves
        a finished record whose marker the next poll finds and tidies."""
        (self.folder(record) / "key").unlink(missing_ok=True)
        self.output(record).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # not empty: something of another version's, left as it is
            self.folder(record).rmdir()
        self._marker(record["_tenant"], record["id"]).unlink(missing_ok=True)
        self._counted.pop(record["id"], None)

    def unfinished(self) -> Iterator[dict]:
        """The records of every batch not finished, as their markers name them. A marker whose
        batch ended (in a service that died before tidying it) is tidied, and one naming no
        record is dropped once another service's create can no longer be writing it."""
        self.unread_tenants = set()
        markers = [Path(e.path) for t in self._tenants() for e in self._scan(t / "batches" / "open", t) or ()
                   if e.name.startswith("batch_")]
        for marker in markers:
            path = marker.parent.parent / f"{marker.name}.json"
            try:
                record = read_record(path)
                there = record is not None or path.exists()
            except OSError:  # the volume's: this batch waits for a later poll, the others move on
                self._cannot_read(path, tenant=path.parent.parent)
                continue
            if record is None:
                if not there and _marked_at(marker) < self._clock() - MARKER_GRACE_S:
                    marker.unlink(missing_ok=True)
                elif there:
                    self._cannot_read(path)
            elif record["status"] in TERMINAL:  # a service died while tidying it
                self.tidy(record)
            else:
                yield record

    def unfinished_of(self, tenant: str) -> int:
        """A tenant's batches not finished, for its cap. A markers' folder the volume fails to
        list raises: Path.glob passed over it, and a count of none let the tenant past its cap."""
        try:
            with os.scandir(tenant_dir(self._root, tenant) / "batches" / "open") as entries:
                names = [e.name for e in entries if e.name.startswith("batch_")]
        except (FileNotFoundError, NotADirectoryError):
            return 0
        return sum(1 for name in names
                   if (r := read_record(self._path(tenant, name))) is not None and r["status"] not in TERMINAL)

    def mark_unfinished(self) -> list[dict]:
        """A marker for each batch not finished that has none: the records of a version that kept
        no markers (a replica of it may still create batches while this one runs); the records
        marked, whose inputs the sweep after must keep. Reads, in each tenant's folder, only the
        records changed since shortly before the last change its scan before saw (a record is
        written beside and renamed), so a service can call it at every sweep; a folder the
        volume fails to list is scanned from where it was once it lists, and a record it fails to
        read (or mark) is read again at every call until it can be."""
        paths = list(self._read_again)
        for tenant in self._tenants():
            folder = _identity(tenant / "batches")
            entries = self._scan(tenant / "batches", tenant)
            if entries is not None and _identity(tenant / "batches") != folder:  # swapped while listed
                self._cannot_read(tenant / "batches", tenant=tenant)  # its files kept; scanned whole next time
                entries = None
            if entries is None:  # its scan stays where it was
                continue
            scanned, latest = self._scanned_ns.get(tenant, (None, -RESCAN_MARGIN_NS))
            if scanned is None or scanned != folder:  # another folder by that name (put back by a rename): its
                latest = -RESCAN_MARGIN_NS  # records' times are its own
            since = latest - RESCAN_MARGIN_NS
            for entry in entries:
                if not (entry.name.startswith("batch_") and entry.name.endswith(".json")):
                    continue  # the batches' own folders, the markers'
                try:
                    changed = entry.stat().st_ctime_ns  # a rename changes it, not the written time
                except FileNotFoundError:
                    continue
                except OSError:  # the volume's: read below, and read again at the next call if that fails too
                    paths.append(Path(entry.path))
                    continue
                if changed >= since:
                    latest = max(latest, changed)
                    paths.append(Path(entry.path))
            self._scanned_ns[tenant] = (folder, latest)
        marked = []
        for path in dict.fromkeys(paths):
            try:
                record = read_record(path)
                if record is not None and record["status"] not in TERMINAL \
                        and not self._marker(record["_tenant"], record["id"]).exists():
                    self.mark(record["_tenant"], record["id"])
                    marked.append(record)
            except OSError:  # the volume's: read again at the next call, however far the scan moves
                self._cannot_read(path, tenant=path.parent.parent)
                self._read_again.add(path)
                continue
            self._read_again.discard(path)
            if record is None and path.exists():
                self._cannot_read(path)
        return marked

    @contextlib.contextmanager
    def exclusive(self, wait_s: float | None = None) -> Iterator[bool]:
        """Whether this service holds the folder's lock, waited for up to `wait_s` (LOCK_WAIT_S). Two services (a
        rolling update) that moved one batch on at once each wrote its output file. A volume
        without file locks is used as before, unlocked."""
        self._root.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self._root / ".batches.lock", "a") as lock:
            deadline = time.monotonic() + (LOCK_WAIT_S if wait_s is None else wait_s)  # real time: a caller's wait
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held = True
                except BlockingIOError:
                    held = False
                except OSError:  # no locks on this volume
                    held = True
                if held or time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
            yield held

    def count(self, record: dict) -> None:
        """The job's answers so far into the record, reading only the lines written since the last
        count (a batch of 50,000 lines read whole at every poll cost about 0.2 s each time)."""
        path = self.output(record)
        start, ok, failed = self._counted.get(record["id"], (0, 0, 0))
        if not path.exists() or path.stat().st_size < start:  # not the file counted before: all of it again
            start, ok, failed = 0, 0, 0
        for row, start in output_rows(path, start):
            if row is not None:
                ok, failed = (ok + 1, failed) if answered(row) else (ok, failed + 1)
        self._counted[record["id"]] = (start, ok, failed)
        record["request_counts"].update(completed=ok, failed=failed)

    def forget_but(self, ids: set[str]) -> None:
        """What is kept of each batch but those of `ids` (the unfinished): kept, it only grew."""
        self._counted = {k: v for k, v in self._counted.items() if k in ids}
        self._held_told &= ids

    def _cannot_read(self, path: Path, tenant: Path | None = None) -> None:
        """A record or folder the volume failed to read, of `tenant`, may name an input a job
        will read again, so the tenant's expired files are kept; a damaged record (no `tenant`)
        is left as it is."""
        if tenant is not None:
            self.unread_tenants.add(tenant)
        if path not in self._unreadable:
            log.warning("%s cannot be read (%s); it is left as it is", path,
                        "the volume failed: its tenant's expired files are kept until it reads" if tenant
                        else "damaged, or another version's")
            self._unreadable.add(path)

    def _tenants(self) -> list[Path]:
        return tenant_folders(self._root, lambda path: self._cannot_read(path, tenant=path))

    def _scan(self, folder: Path, tenant: Path) -> list[os.DirEntry] | None:
        """A folder's entries; None for one the volume fails to list, which holds what is
        unknown (Path.glob passes over it without a word), so its tenant's expired files are kept."""
        try:
            with os.scandir(folder) as entries:
                return list(entries)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError:
            self._cannot_read(folder, tenant=tenant)
            return None

    def _path(self, tenant: str, batch_id: str) -> Path:
        return tenant_dir(self._root, tenant) / "batches" / f"{batch_id}.json"

    def _marker(self, tenant: str, batch_id: str) -> Path:
        return tenant_dir(self._root, tenant) / "batches" / "open" / batch_id


def _identity(folder: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(folder)
    except OSError:  # none yet, or the volume's: its scan starts over once it has one
        return None
    return st.st_dev, st.st_ino


def _marked_at(marker: Path) -> float:
    try:
        return float(marker.read_text())
    except (OSError, ValueError):  # unreadable: as old as can be
        return 0.0
