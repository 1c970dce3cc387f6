"""The OpenAI Files and Batches endpoints (`/v1/files`, `/v1/batches`), for tenants' keys.

Files are read and written here, in the folder the config names (`router.files`); batches
are the batch service's (`router.batches.BatchService`, one replica), which runs each as a
Ray job through the batch pool under the tenant's own key. A tenant sees only its own files
and batches: another's id is a 404. An input file is checked as it is uploaded: every
problem is named with its line, and the size and the number of lines are bounded.
"""

from __future__ import annotations

import asyncio
import codecs
import collections
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from infra.batchfile import jsonl_lines, read_input
from infra.bounds import Overdue, within
from router.auth import Auth, bearer
from router.body import BodyLimits, read_json
from router.config import TenantConfig
from router.errors import ApiError
from router.files import FileStore, expiry_seconds, volume_failed

FORM_FRAMING_BYTES = 16 << 10  # a multipart upload's boundaries, headers, file name and small fields
FORM_FIELDS = {"file", "purpose", "expires_after[anchor]", "expires_after[seconds]"}  # as the openai SDK sends them


@dataclass(frozen=True)
class BatchApiSettings:
    root: str  # the files' folder
    pool: str  # the pool batches run on
    max_file_bytes: int
    max_lines: int
    max_uploads_per_tenant: int = 2
    upload_timeout_s: float = 600.0
    max_files_per_tenant: int = 10_000
    max_stored_bytes_per_tenant: int = 10 << 30


class BatchApi:
    def __init__(self, auth: Auth, settings: BatchApiSettings | None, service: Any, limits: BodyLimits,
                 clock: Callable[[], float]) -> None:
        self._auth, self._s, self._service, self._limits = auth, settings, service, limits
        self._files = FileStore(Path(settings.root), clock) if settings else None
        self._uploading: collections.Counter[str] = collections.Counter()  # tenant -> uploads arriving

    # -- files ------------------------------------------------------------------------

    async def upload(self, request: Request) -> Response:
        async def run(tenant: TenantConfig) -> dict:
            limit = self._s.max_file_bytes + FORM_FRAMING_BYTES  # the file, its name and the form's other fields
            size = request.headers.get("content-length")
            if size is not None and size.isdigit() and int(size) > limit:
                raise _too_large(self._s.max_file_bytes)
            if self._uploading[tenant.name] >= self._s.max_uploads_per_tenant:
                raise ApiError(429, "too_many_uploads", f"{self._uploading[tenant.name]} uploads of this tenant are "
                                                        "still arriving or being written "
                                                        "(batches.max_uploads_per_tenant); send the "
                                                        "next when one has finished", "file", retry_after_s=5)
            self._uploading[tenant.name] += 1  # before any await: uploads arriving at once count each other
            keeping = None  # until it is written: each holds its file in memory, and is not yet in the tenant's share
            try:
                await asyncio.to_thread(self._room_for, tenant.name, 1)  # full already: refused before the body
                name, purpose, content, expires_after_s = await self._arrival(request, limit)
                keeping = asyncio.ensure_future(asyncio.to_thread(self._keep, tenant.name, name, purpose, content,
                                                                  expires_after_s))
                keeping.add_done_callback(functools.partial(self._arrived, tenant.name))  # it outlives its caller
                return await asyncio.shield(keeping)
            finally:
                if keeping is None:
                    self._arrived(tenant.name)
        return await self._run(request, run)

    def _keep(self, tenant: str, name: str, purpose: str, content: bytes, expires_after_s: int | None) -> dict:
        self._check_batch_file(content)
        self._room_for(tenant, len(content))
        return self._files.create(tenant, name, purpose, content, expires_after_s)

    def _arrived(self, tenant: str, kept: asyncio.Future | None = None) -> None:
        if kept is not None and not kept.cancelled():
            kept.exception()  # its caller may have left: its refusal is read here, not left unread
        self._uploading[tenant] -= 1
        if not self._uploading[tenant]:
            del self._uploading[tenant]

    async def _arrival(self, request: Request, limit: int) -> tuple[str, str, bytes, int | None]:
        """The upload, once it arrived within `upload_timeout_s`."""
        try:
            return await within(self._s.upload_timeout_s, self._receive(request, limit))
        except Overdue:
            raise ApiError(408, "upload_timeout", f"the file did not arrive within batches.upload_timeout_s "
                                                  f"({self._s.upload_timeout_s:g} s); send it faster, or split it",
                           "file") from None

    async def _receive(self, request: Request, limit: int) -> tuple[str, str, bytes, int | None]:
        """The upload's file name, purpose, content and expiry, its form checked."""
        try:  # a chunked body declares no size: it is counted as it arrives
            form = await Request(request.scope, _bounded(request.receive, limit, self._s.max_file_bytes)).form(
                max_files=1, max_fields=8)
        except ApiError:
            raise
        except Exception as e:  # not multipart, or a broken one
            raise ApiError(400, "invalid_request", f"send the file as multipart/form-data with fields 'file' "
                                                   f"and 'purpose' ({type(e).__name__}: {e})", "file") from None
        try:
            return await self._read(form)
        finally:
            await form.close()  # its spooled file, whatever was wrong with the form

    async def _read(self, form: Any) -> tuple[str, str, bytes, int | None]:
        unknown = sorted(set(form.keys()) - FORM_FIELDS)
        if unknown:
            raise ApiError(400, "invalid_request", f"unknown form field {unknown[0]!r}: send 'file', 'purpose' and "
                                                   "optionally expires_after[anchor] and expires_after[seconds]",
                           unknown[0].split("[")[0] or "file")  # (a field with no name: the form's)
        upload, purpose = form.get("file"), form.get("purpose")
        if upload is None:
            raise ApiError(400, "missing_field", "'file' is required: send the file as multipart/form-data with "
                                                  "fields 'file' and 'purpose'", "file")
        if isinstance(upload, str):  # a text field (no filename): the file's name and content type are not known
            raise ApiError(400, "invalid_value", "'file' must be a file part, with a filename (curl -F "
                                                  "file=@in.jsonl), not a text field", "file")
        if purpose is None:
            raise ApiError(400, "missing_field", "'purpose' is required: use 'batch'", "purpose")
        if purpose not in ("batch",):
            raise ApiError(400, "invalid_value", f"purpose {purpose!r}: use 'batch'", "purpose")
        expires_after_s = expiry_seconds(_form_object(form, "expires_after"), "expires_after",
                                         " (as form fields expires_after[anchor] and expires_after[seconds])")
        content = await upload.read(self._s.max_file_bytes + 1)
        if len(content) > self._s.max_file_bytes:
            raise _too_large(self._s.max_file_bytes)
        return upload.filename or "upload.jsonl", purpose, content, expires_after_s

    def _room_for(self, tenant: str, size: int, param: str = "file", what: str = "this one") -> None:
        """Whether the volume holds one more file of `size` bytes (`what`) for `tenant` within its share.
        Uploads arriving at once may each pass it: `max_uploads_per_tenant` files over per replica."""
        files, stored = self._files.usage(tenant)
        fix = "delete files it no longer needs (DELETE /v1/files/{file_id})"
        if files >= self._s.max_files_per_tenant:
            raise ApiError(413, "tenant_storage_full", f"tenant {tenant!r} keeps {files:,} files, the most "
                                                       f"batches.max_files_per_tenant allows: {fix}", param)
        if stored + size > self._s.max_stored_bytes_per_tenant:
            raise ApiError(413, "tenant_storage_full", f"tenant {tenant!r} keeps {stored:,} bytes of files and {what} "
                                                       f"would take it past batches.max_stored_bytes_per_tenant "
                                                       f"({self._s.max_stored_bytes_per_tenant:,}): {fix}", param)

    def _check_batch_file(self, content: bytes) -> None:
        try:
            lines = jsonl_lines(content)
        except UnicodeDecodeError as e:
            at = e.start + 3 * content.startswith(codecs.BOM_UTF8)  # counted after the byte-order mark
            raise ApiError(400, "invalid_file", f"the file is not UTF-8 text (byte {at})", "file") from None
        requests, problems = read_input(lines)
        if problems:
            shown = "; ".join(str(p) for p in problems[:5])
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise ApiError(400, "invalid_file", f"the batch file has {len(problems)} bad lines: {shown}{more}", "file")
        if not requests:
            raise ApiError(400, "invalid_file", "the batch file holds no requests", "file")
        if len(requests) > self._s.max_lines:
            raise ApiError(400, "invalid_file", f"the batch file holds {len(requests)} requests; a batch may hold "
                                                f"{self._s.max_lines} (split it)", "file")

    async def list_files(self, request: Request) -> Response:
        q = request.query_params
        return await self._run(request, lambda t: asyncio.to_thread(
            self._files.list, t.name, q.get("purpose"), _limit(q.get("limit"), 10000), q.get("after") or None,
            q.get("order", "desc")))

    async def get_file(self, request: Request, file_id: str) -> Response:
        return await self._run(request, lambda t: asyncio.to_thread(self._files.get, t.name, file_id))

    async def delete_file(self, request: Request, file_id: str) -> Response:
        return await self._run(request, lambda t: asyncio.to_thread(self._files.delete, t.name, file_id))

    async def file_content(self, request: Request, file_id: str) -> Response:
        try:
            tenant = self._tenant(request)
            path = await asyncio.to_thread(self._files.content_path, tenant.name, file_id)
        except ApiError as e:
            return e.response()
        except OSError as e:
            return volume_failed(e).response()
        return FileResponse(path, media_type="application/jsonl")

    # -- batches ----------------------------------------------------------------------

    async def create_batch(self, request: Request) -> Response:
        async def run(tenant: TenantConfig) -> Any:
            if self._s.pool not in tenant.pools:
                raise ApiError(403, "pool_not_allowed", f"batches run on pool {self._s.pool!r}, which tenant "
                                                        f"{tenant.name!r} may not use")
            body = await read_json(request, self._limits)
            unknown = set(body) - {"input_file_id", "endpoint", "completion_window", "metadata",
                                   "output_expires_after"}
            if unknown:
                raise ApiError(400, "invalid_request", f"unknown field {sorted(unknown)[0]!r}", sorted(unknown)[0])
            for field in ("input_file_id", "endpoint", "completion_window"):
                if field not in body:
                    raise ApiError(400, "missing_field", f"{field!r} is required", field)
            # its output and error files are the tenant's too: a full share takes no more batches
            await asyncio.to_thread(self._room_for, tenant.name, 1, "input_file_id", "a batch's output")
            return await self._call("create", tenant.name, bearer(request.headers), body["input_file_id"],
                                    body["endpoint"], body["completion_window"], body.get("metadata"),
                                    body.get("output_expires_after"))
        return await self._run(request, run)

    async def get_batch(self, request: Request, batch_id: str) -> Response:
        return await self._run(request, lambda t: self._call("get", t.name, batch_id))

    async def list_batches(self, request: Request) -> Response:
        q = request.query_params
        return await self._run(request, lambda t: self._call("list", t.name, _limit(q.get("limit"), 100),
                                                             q.get("after")))

    async def cancel_batch(self, request: Request, batch_id: str) -> Response:
        return await self._run(request, lambda t: self._call("cancel", t.name, batch_id))

    # -- steps ------------------------------------------------------------------------

    def _tenant(self, request: Request) -> TenantConfig:
        tenant = self._auth.tenant(request.headers)
        if self._s is None:
            raise ApiError(404, "batch_api_disabled", "the Batch API is off on this server (batches.dir is unset)")
        return tenant

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            answer = await self._service.call.remote(method, *args)
        except Exception as e:  # the service is restarting
            raise ApiError(503, "batch_service_unavailable", f"the batch service is unavailable ({type(e).__name__}); "
                                                             "retry shortly", retry_after_s=5) from None
        if "error" in answer:
            raise ApiError(*answer["error"])
        return answer["ok"]

    async def _run(self, request: Request, step: Callable[[TenantConfig], Awaitable[Any]]) -> Response:
        try:
            return JSONResponse(await step(self._tenant(request)))
        except ApiError as e:
            return e.response()
        except OSError as e:  # the volume's: named, where it was a 500 (or, timing out, the upload's 408)
            return volume_failed(e).response()


def _bounded(receive: Callable[[], Awaitable[dict]], limit: int, file_limit: int) -> Callable[[], Awaitable[dict]]:
    """`receive`, refusing the body once more than `limit` bytes of it arrived (the form parser
    would spool any size to disk before the file's own size could be checked)."""
    size = 0

    async def bounded() -> dict:
        nonlocal size
        message = await receive()
        size += len(message.get("body", b""))
        if size > limit:
            raise _too_large(file_limit)
        return message
    return bounded


def _too_large(limit: int) -> ApiError:
    return ApiError(413, "file_too_large", f"the file is larger than batches.max_file_bytes ({limit} bytes); split it",
                    "file")


def _form_object(form: Any, name: str) -> dict | None:
    """An object sent in a form as `name[key]` fields (how the openai SDK sends one), or None."""
    prefix = f"{name}["
    fields = {k[len(prefix):-1]: v for k, v in form.multi_items() if k.startswith(prefix) and k.endswith("]")}
    if not fields:
        return None
    if isinstance(fields.get("seconds"), str) and fields["seconds"].isascii() and fields["seconds"].isdecimal():
        fields["seconds"] = int(fields["seconds"])
    return fields


def _limit(value: str | None, most: int) -> int:
    if value is None:
        return min(20, most)
    if not value.isdigit() or not 1 <= int(value) <= most:
        raise ApiError(400, "invalid_value", f"limit {value!r}: use a whole number from 1 to {most}", "limit")
    return int(value)
