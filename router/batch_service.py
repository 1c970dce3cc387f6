"""The batch service: every tenant's batches (`router.batches.Batches`) behind one Serve
replica, moved on by a poll loop."""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any, Callable

from infra.bounds import Overdue, within
from infra.loops import Loops
from router import batch_records
from router.batches import Batches, BatchSettings, JobRunner, busy
from router.errors import ApiError
from router.files import FileStore, volume_failed


class BatchService:
    """Every tenant's batches behind one Serve replica. Creates, cancels and the poll loop take
    turns (one lock; reads need none) and run off the event loop (file I/O and the job API
    block). Refusals come back as `{"error": [status, code, message, param]}`, results as
    `{"ok": ...}`."""

    def __init__(self, settings: BatchSettings, runner: JobRunner, poll_interval_s: float = 2.0,
                 clock: Callable[[], float] = time.time) -> None:
        self._batches = Batches(settings, FileStore(settings.root, clock), runner, clock)
        self._lock = asyncio.Lock()
        self._loops = Loops("batches")
        self._loops.start("poll", self._poll, poll_interval_s)

    async def close(self) -> None:
        await self._loops.stop()

    async def _poll(self) -> None:
        async with self._lock:
            await asyncio.to_thread(self._batches.poll)

    async def call(self, method: str, *args: Any) -> dict:
        if method not in ("create", "get", "list", "cancel"):
            raise ValueError(method)
        try:
            if method in ("get", "list"):  # reads take no turn (records are written whole)
                return {"ok": await asyncio.to_thread(getattr(self._batches, method), *args)}
            # a create or a cancel waits LOCK_WAIT_S in all, for this service's turn and another's
            deadline = time.monotonic() + batch_records.LOCK_WAIT_S
            try:
                await within(batch_records.LOCK_WAIT_S, self._lock.acquire())
            except Overdue:
                raise busy() from None
            try:
                return {"ok": await asyncio.to_thread(functools.partial(
                    getattr(self._batches, method), *args, wait_s=max(0.0, deadline - time.monotonic())))}
            finally:
                self._lock.release()
        except ApiError as e:
            refusal = e
        except OSError as e:  # the volume's: named, where the router took it for this service restarting
            refusal = volume_failed(e)
        return {"error": [refusal.status, refusal.code, refusal.message, refusal.param, refusal.retry_after_s]}
