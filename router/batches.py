"""OpenAI batches, each run as a Ray job of the resumable batch runner (`deployments.batch_job`)
through a pool, under the tenant's own key: its quota and priority apply to every line.

A batch is a JSON record beside its tenant's files (`<root>/<tenant>/batches/<id>.json`, its
job's output in `<id>/output.jsonl`), moved on at each `poll()`:

    validating -> in_progress (its job submitted) -> finalizing (the output split into the
    output and error files) -> completed
    failed     (the input is refused or deleted, or the job failed `max_attempts` times)
    cancelling -> cancelled, and expired (past its completion window): partial results kept

A job that fails or stops on its own is submitted again with the same output file: the runner
skips the ids already answered, so every line is answered exactly once (an input file that
expires meanwhile is kept until the batch ends). A batch whose job could not be submitted yet
stays `validating` (the create still answers, so a client's retry never makes a second batch)
until a poll submits it or its window ends. A finalize that fails half-way is done again with
the end it was heading for, and never runs the job again. A service that restarts reads the
records back and carries on. A poll reads only the batches not finished, found by a marker each
(`<root>/<tenant>/batches/open/<id>`), and of each job's output only the lines written since the
last poll: finished batches and answered lines cost it nothing. The tenant's key is kept for the batch's jobs
in a file readable by its owner only (`<id>/key`, never in a record, nor in the job's runtime
environment, which the dashboard shows) and removed when the batch ends.

Pure orchestration: the jobs go through a `JobRunner`, the clock is a parameter.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from infra.batchfile import ENDPOINTS, jsonl_lines, read_input, result_line
from router.batch_records import TERMINAL, BatchStore, answered, output_rows
from router.errors import ApiError
from router.files import FileStore, expiry_seconds, page, write_whole

log = logging.getLogger("poolserve.router")

WINDOWS = {"24h": 24 * 3600}
_STOPPED = ("FAILED", "STOPPED")
SWEEP_INTERVAL_S = 60.0


class JobRunner(Protocol):
    """Ray job submission, as the batch service needs it."""

    # A name submitted before is that job, returned, not a second one: the service can die after
    # a job started and before the batch's record named it, and the next one submits it again.
    def submit(self, name: str, args: list[str]) -> str: ...
    def status(self, job_id: str) -> str: ...  # PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED
    def stop(self, job_id: str) -> None: ...
    def logs(self, job_id: str) -> str: ...


@dataclass(frozen=True)
class BatchSettings:
    root: Path
    router_url: str  # where the jobs send their requests
    pool_prefix: str  # the pool they send them to (its route prefix, without the slash)
    concurrency: int = 64
    max_attempts: int = 3
    max_lines: int = 50_000
    max_active: int = 8  # unfinished batches per tenant
    # a tenant's quota.max_concurrent: a job keeping more requests outstanding has the rest refused
    # (429) and retried every second, load on the router and the ledger that buys nothing
    tenant_concurrency: Mapping[str, int] = field(default_factory=dict)


class Batches:
    def __init__(self, settings: BatchSettings, files: FileStore, runner: JobRunner,
                 clock: Callable[[], float]) -> None:
        self._s, self._files, self._runner, self._clock = settings, files, runner, clock
        self._store = BatchStore(settings.root, clock)
        self._swept_at = -float("inf")
        self._store.mark_unfinished()

    # -- the API ----------------------------------------------------------------------

    def create(self, tenant: str, key: str, input_file_id: Any, endpoint: Any, completion_window: Any,
               metadata: Any = None, output_expires_after: Any = None, wait_s: float | None = None) -> dict:
        with self._store.exclusive(wait_s) as mine:
            if not mine:
                raise busy()
            return self._create(tenant, key, input_file_id, endpoint, completion_window, metadata,
                                output_expires_after)

    def _create(self, tenant: str, key: str, input_file_id: Any, endpoint: Any, completion_window: Any,
                metadata: Any, output_expires_after: Any) -> dict:
        if endpoint not in ENDPOINTS:
            raise ApiError(400, "invalid_value", f"endpoint {endpoint!r}: use one of {sorted(ENDPOINTS)}", "endpoint")
        if completion_window not in WINDOWS:
            raise ApiError(400, "invalid_value", f"completion_window {completion_window!r}: use '24h'",
                           "completion_window")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items())):
            raise ApiError(400, "invalid_value", "metadata must map at most 16 keys (64 characters) to strings "
                                                 "(512 characters)", "metadata")
        if not isinstance(input_file_id, str):
            raise ApiError(400, "invalid_value", "input_file_id must be the id of an uploaded file", "input_file_id")
        output_expires_s = expiry_seconds(output_expires_after, "output_expires_after")
        meta = self._input(tenant, input_file_id)
        if meta["purpose"] != "batch":
            raise ApiError(400, "invalid_value", f"file {input_file_id!r} has purpose {meta['purpose']!r}; upload "
                                                 "the input with purpose 'batch'", "input_file_id")
        if (active := self._store.unfinished_of(tenant)) >= self._s.max_active:
            raise ApiError(429, "too_many_batches", f"tenant {tenant!r} has {active} batches unfinished, the most "
                                                    "it may have at once (batches.max_active_per_tenant): wait for "
                                                    "one to end, or cancel one")
        now = int(self._clock())
        batch_id = f"batch_{uuid.uuid4().hex[:24]}"
        record = {
            "id": batch_id, "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": input_file_id, "completion_window": completion_window, "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
            "expires_at": now + WINDOWS[completion_window], "finalizing_at": None, "completed_at": None,
            "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata,
            "_tenant": tenant, "_job": None, "_attempts": 0, "_output_expires_s": output_expires_s,
        }
        self._store.mark(tenant, batch_id)
        self._validate(record, key)
        if record["status"] in TERMINAL:  # its input failed validation: saved finished, never written again
            return _public(record)
        try:
            self._advance(record)
        except Exception:  # a 503 here had the SDK's retries create a batch each: the poll submits it
            log.warning("batch %s: its job could not be submitted yet; the next poll tries again", batch_id,
                        exc_info=True)
        return _public(record)

    def get(self, tenant: str, batch_id: str) -> dict:
        return _public(self._store.load(tenant, batch_id))

    def list(self, tenant: str, limit: int = 20, after: str | None = None) -> dict:
        records = sorted(self._store.records(tenant), key=lambda r: (-r["created_at"], r["id"]))
        return page([_public(r) for r in records], limit, after, "batch")

    def cancel(self, tenant: str, batch_id: str, wait_s: float | None = None) -> dict:
        with self._store.exclusive(wait_s) as mine:
            if not mine:
                raise busy()
            return self._cancel(tenant, batch_id)

    def _cancel(self, tenant: str, batch_id: str) -> dict:
        record = self._store.load(tenant, batch_id)
        if record["status"] in TERMINAL or record["status"] == "cancelling":
            if record["status"] in ("completed", "failed", "expired"):
                raise ApiError(409, "batch_not_cancellable", f"batch {batch_id!r} is {record['status']} already")
            return _public(record)
        record["status"], record["cancelling_at"] = "cancelling", int(self._clock())
        self._store.save(record)  # accepted, whatever the job API answers now: a poll stops the job and ends it
        try:
            self._advance(record)
        except Exception:  # noqa: BLE001 - the job API away
            log.warning("batch %s: cancelling; its job is stopped at a later poll", batch_id, exc_info=True)
        return _public(record)

    def poll(self) -> None:
        """Move every batch that is not finished on by one step; now and then, remove expired
        files (but the inputs of batches not finished: a job run again reads its input). While
        another service moves batches on (a rolling update), this one leaves them be."""
        with self._store.exclusive(wait_s=0) as mine:
            if mine:
                self._poll()

    def _poll(self) -> None:
        reading, moving = set(), set()
        for record in self._store.unfinished():
            try:
                self._advance(record)
            except Exception:  # one batch's trouble must not stop the others
                log.exception("batch %s: could not move it on", record["id"])
            if record["status"] not in TERMINAL:
                reading.add(self._files.path(record["_tenant"], record["input_file_id"]))
                moving.add(record["id"])
        self._store.forget_but(moving)
        if self._clock() >= self._swept_at + SWEEP_INTERVAL_S:  # it reads every file's object: not at every poll
            try:
                marked = self._store.mark_unfinished()  # a replica of the version before may still create batches
                reading |= {self._files.path(r["_tenant"], r["input_file_id"]) for r in marked}
                self._files.sweep(keep=reading, keep_tenants=self._store.unread_tenants)
                self._swept_at = self._clock()
            except OSError:  # a shared volume's hiccup: the next poll sweeps again
                log.exception("could not remove expired files")

    def _input(self, tenant: str, file_id: str) -> dict:
        try:
            return self._files.get(tenant, file_id)
        except ApiError as e:
            raise ApiError(e.status, e.code, f"{e.message}: input_file_id must be the id of a file you uploaded "
                                             "(POST /v1/files)", "input_file_id") from None

    # -- the life of a batch ----------------------------------------------------------

    def _validate(self, record: dict, key: str) -> None:
        path = self._files.content_path(record["_tenant"], record["input_file_id"], expired_ok=True)
        total, problems = _problems(jsonl_lines(path.read_bytes(), errors="replace"), record["endpoint"],
                                    self._s.max_lines)
        record["request_counts"]["total"] = total
        if problems:
            record["errors"] = {"object": "list", "data": [_line_error(str(p)) for p in problems[:100]]}
            self._finish(record, "failed")
        else:
            self._store.folder(record).mkdir(parents=True, exist_ok=True, mode=0o700)
            write_whole(self._store.folder(record) / "key", key.encode())
            self._store.save(record)

    def _advance(self, record: dict) -> None:
        now = int(self._clock())
        status, job = record["status"], record["_job"]
        if status == "validating" and now < record["expires_at"]:
            self._submit(record)
            return
        if status == "finalizing":  # a finalize that failed half-way: done again, the job never rerun
            self._finalize(record, record["_final"])
            return
        self._store.count(record)
        state = self._runner.status(job) if job else None
        if status in ("cancelling", "validating") or (status == "in_progress" and now >= record["expires_at"]):
            if not self._stopped(record, state):
                return
            self._finalize(record, "cancelled" if status == "cancelling" else "expired")
        elif state == "SUCCEEDED":
            self._finalize(record, "completed")
        elif state in _STOPPED:
            if _all_answered(record, self._store.output(record), lambda: self._requests(record)):  # (an upgrade)
                self._finalize(record, "completed")
            elif self._store.held(record):  # it runs on: submitted again, it would write twice
                self._store.save(record)
            elif record["_attempts"] < self._s.max_attempts:
                log.warning("batch %s: job %s ended %s; submitting it again to resume", record["id"], job, state)
                self._submit(record)
            else:
                tail = self._runner.logs(job)[-500:]
                record["errors"] = {"object": "list", "data": [{
                    "code": "job_failed", "line": None, "param": None,
                    "message": f"the batch's job failed {record['_attempts']} times; its last lines: {tail}"}]}
                self._finalize(record, "failed")
        else:
            self._store.save(record)

    def _stopped(self, record: dict, state: str | None) -> bool:
        """Whether no job of the batch runs, else they are told to stop and the next poll asks
        again. The next attempt's job too: it may have started before a crash (or a lost answer
        of the job API) kept this record from naming it."""
        job, after = record["_job"], _job_name(record, record["_attempts"] + 1)
        running = [j for j, s in ((job, state), (after, self._runner.status(after)))
                   if j is not None and s not in ("SUCCEEDED", *_STOPPED)]
        for j in running:
            self._runner.stop(j)
        if running or self._store.held(record):
            self._store.save(record)
            return False
        return True

    def _submit(self, record: dict) -> None:
        try:
            path = self._files.content_path(record["_tenant"], record["input_file_id"], expired_ok=True)
        except ApiError:  # deleted: no job can read it, so the batch ends once none runs, its answers kept
            if not self._stopped(record, self._runner.status(record["_job"]) if record["_job"] else None):
                return
            record["errors"] = {"object": "list", "data": [{
                "code": "input_file_missing", "line": None, "param": "input_file_id",
                "message": f"the input file {record['input_file_id']!r} was deleted before the batch's job could "
                           "read it"}]}
            self._finalize(record, "failed")
            return
        args = ["--input", str(path),
                "--output", str(self._store.output(record)), "--key-file", str(self._store.folder(record) / "key"),
                "--url", self._s.router_url, "--pool", self._s.pool_prefix,
                "--concurrency", str(min(self._s.concurrency,
                                         self._s.tenant_concurrency.get(record["_tenant"], self._s.concurrency)))]
        record["_job"] = self._runner.submit(_job_name(record, record["_attempts"] + 1), args)
        record["_attempts"] += 1
        if record["status"] == "validating":
            record["status"], record["in_progress_at"] = "in_progress", int(self._clock())
        self._store.save(record)

    def _finalize(self, record: dict, status: str) -> None:
        """The job's output, split: answers in the output file, failures in the error file."""
        if record["status"] != "finalizing":
            record["status"], record["finalizing_at"], record["_final"] = "finalizing", int(self._clock()), status
            self._store.save(record)
        self._store.count(record)
        good, bad, seen = [], [], set()
        for row, _ in output_rows(self._store.output(record)):
            if row is not None:
                (good if answered(row) else bad).append(json.dumps(row))
                seen.add(row["custom_id"])
        ended_early = self._requests(record) if status != "completed" else []  # a completed batch ran every line
        unreached = [result_line(r.custom_id, None, None, None, {"code": f"batch_{status}", "message": (
            f"the batch was {status} before this request ran")}).rstrip("\n") for r in ended_early
            if r.custom_id not in seen]  # as OpenAI's (`batch_expired`)
        bad += unreached
        record["request_counts"]["failed"] += len(unreached)
        for rows, field, suffix in ((good, "output_file_id", "output"), (bad, "error_file_id", "error")):
            if rows and record[field] is None:  # a file written before a failed finalize is kept, not written twice
                meta = self._files.create(record["_tenant"], f"{record['id']}_{suffix}.jsonl", "batch_output",
                                          ("\n".join(rows) + "\n").encode(), record.get("_output_expires_s"))
                record[field] = meta["id"]
                self._store.save(record)
        self._finish(record, status)

    def _requests(self, record: dict) -> list:
        """The batch's requests, or none if its input is gone (its end then says so)."""
        try:
            path = self._files.content_path(record["_tenant"], record["input_file_id"], expired_ok=True)
        except ApiError:
            return []
        return read_input(jsonl_lines(path.read_bytes(), errors="replace"))[0]

    def _finish(self, record: dict, status: str) -> None:
        record["status"] = status
        record[f"{status}_at"] = int(self._clock())
        self._store.save(record)
        self._store.tidy(record)


def _all_answered(record: dict, output: Path, requests: Callable[[], list]) -> bool:
    """Whether every request of the batch has its line in the output, though its job is read as
    ended (a job of another cluster's job API, during an upgrade): no failure then. The counts
    first (rows, which two jobs writing at once, where locks do not reach across nodes, can
    duplicate), then the ids themselves."""
    counts = record["request_counts"]
    if counts["completed"] + counts["failed"] < counts["total"]:
        return False
    seen = {row["custom_id"] for row, _ in output_rows(output) if row is not None}
    return all(r.custom_id in seen for r in requests())


def _problems(lines: list, endpoint: str, max_lines: int) -> tuple[int, list[str]]:
    """How many requests a batch's input holds, and what is wrong with it."""
    requests, problems = read_input(lines)
    url = {v: k for k, v in ENDPOINTS.items()}
    problems += [f"line {r.line}: url {url[r.endpoint]!r} differs from the batch's endpoint {endpoint!r}"
                 for r in requests if url[r.endpoint] != endpoint]
    if len(requests) > max_lines:
        problems.append(f"the file holds {len(requests)} requests; a batch may hold {max_lines}")
    return len(requests), problems


def _public(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith("_")}


def _line_error(message: str) -> dict:
    m = re.match(r"line (\d+): (.*)", message)
    return {"code": "invalid_request", "message": message, "param": None, "line": int(m.group(1)) if m else None}


def _job_name(record: dict, attempt: int) -> str:
    """The job of a batch's `attempt`: one name, so that a job started before a crash is found again."""
    return f"poolserve-{record['id']}-{attempt}"


def busy() -> ApiError:
    """Another service holds the batches (its poll, across a job API that answers slowly, say)."""
    return ApiError(503, "batches_busy", "another batch service is moving the batches on; retry shortly",
                    retry_after_s=5)
