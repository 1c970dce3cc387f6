"""The pool-stream protocol as the router reads it, and each request's one settlement.

A pool replica's `generate(PoolCall)` streams:

    [Arrived]                  first, only when the call has to queue at the gate
    Admitted | Rejected        a slot was granted, or refused (the last item then)
    Refused | engine items     the engine refused the input (the last item then), or its
                               output: SSE text in lists (a stream) or one whole response
    | Failed                   or a whole answer failed after the engine's work (the last item)
    Finished(usage)            last: the real usage, which settles the quota charge

`Settlement` holds one request's books (its quota charge, its place in the pool load
counts, its metrics and log line) and closes them exactly once, however the request ends:
completed, refused, shed, failed, or abandoned by its client at any await. The route
registers `Settlement.abandon` on its own task, so even a response whose body never
started (its client left between the handler's return and the first byte) is settled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Callable

from infra.bounds import Idle, Overdue, within
from pools.streams import engine_error
from pools.types import (Admitted, Arrived, Failed, Finished, PriorityClass, Refused, Rejected, Usage,
                         error_status)
from router.config import TenantConfig
from router.errors import NO_RETRY, ApiError, retry_after_header, sse_error
from router.leases import QuotaClient
from router.load import PoolLoads
from router.quota import Charge

log = logging.getLogger("poolserve.router")

DONE = "data: [DONE]\n\n"
STEPS = ("router", "reach", "queue", "engine")  # Server-Timing: where the time to the first item went


class Settlement:
    def __init__(self, tenant: TenantConfig, charge: Charge, quota: QuotaClient, loads: PoolLoads, metrics: Any,
                 received: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.tenant, self.charge = tenant, charge
        self._quota, self._loads, self._metrics, self._clock = quota, loads, metrics, clock
        self.received = received
        self.pool: str | None = None
        self.borrowed = False
        self.usage: Usage | None = None  # the engine's, when the request ran to its end
        self.never_ran = True  # until a gate admits it: refund the whole charge
        self.shed: str | None = None  # refused by the router on the pool's behalf: the reason
        self.status = 200
        self.closed = False
        self.stream: "PoolStream | None" = None
        self.marks: dict[str, float] = {}

    def dispatch(self, pool: str, borrowed: bool) -> None:
        """The request goes to `pool` (again, when a lender sent it home)."""
        if self.pool is not None:
            self._loads.done(self.pool, self.tenant.name, self.borrowed)
        self.pool, self.borrowed = pool, borrowed
        self._loads.start(pool, self.tenant.name, borrowed)

    def mark(self, step: str) -> None:
        self.marks[step] = self._clock()

    def server_timing(self) -> str:
        """router: auth, parsing, token count, quota; reach: until a replica took the call;
        queue: in its gate; engine: until the engine's first output reached the router."""
        last, parts = self.received, []
        for name, key in zip(STEPS, ("sent", "arrived", "admitted", "first")):
            if (at := self.marks.get(key)) is not None:
                parts.append(f"{name};dur={(at - last) * 1e3:.1f}")
                last = at
        return ", ".join(parts)

    def fail(self, error: ApiError) -> ApiError:
        """The request ends with `error`: a pool stream it stopped reading is cancelled (the
        pool's generator may sit at a `yield`, holding its slot, with nobody to read on)."""
        self.status = error.status
        if self.stream is not None:
            self.stream.cancel()
        self.close()
        return error

    def abandon(self, _task: Any = None) -> None:
        """The request's task ended: if its books are still open, its client left."""
        if not self.closed:
            if self.stream is not None:
                self.stream.cancel()
            self.status = 499
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.stream is not None:
            self.stream.close()
        if self.pool is not None:
            self._loads.done(self.pool, self.tenant.name, self.borrowed)
        used = 0 if self.never_ran else (self.usage.total_tokens if self.usage else None)
        self._quota.finish(self.charge, used)
        m, u = self._metrics, self.usage or Usage(0, 0)
        m.request(self.pool or "-", self.tenant.name, self.status)
        if self.shed:
            m.shed(self.pool, self.tenant.name, self.shed)
        if self.usage is not None:
            m.tokens(self.tenant.name, self.pool, u.prompt_tokens, u.completion_tokens)
        log.info("tenant=%s pool=%s borrowed=%s status=%d prompt_tokens=%d completion_tokens=%d ms=%.0f",
                 self.tenant.name, self.pool, self.borrowed, self.status, u.prompt_tokens, u.completion_tokens,
                 (self._clock() - self.received) * 1e3)


class PoolStream:
    """One call's stream from a pool replica (a Serve response generator)."""

    def __init__(self, gen: Any, pool: str, settlement: Settlement, idle_s: float) -> None:
        self._gen, self.pool, self._s, self._idle = gen, pool, settlement, Idle(idle_s)
        self._finished = False  # its Finished came: silence after it is no failure
        settlement.stream = self

    def cancel(self) -> None:
        self._gen.cancel()

    def close(self) -> None:
        self._idle.close()

    async def verdict(self, loads: PoolLoads, cls: PriorityClass, reach_timeout_s: float) -> Admitted | Rejected:
        """The gate's verdict. Reaching a replica is bounded by `reach_timeout_s` (none took the
        call: it is restarting, or swamped); the wait in its queue is not."""
        with loads.waiting(self.pool, cls, self._s.tenant.name):
            try:
                first = await within(reach_timeout_s, self._gen.__anext__())
            except Overdue:
                self.cancel()
                raise self._unreached(loads, reach_timeout_s) from None
            self._s.mark("arrived")
            verdict = await self._gen.__anext__() if isinstance(first, Arrived) else first
            if not isinstance(verdict, (Admitted, Rejected)):
                raise RuntimeError(f"pool {self.pool!r} broke the stream protocol: {type(verdict).__name__} "
                                   "came before its verdict")
            self._s.mark("admitted")
        if isinstance(verdict, Rejected):
            loads.retry_hint[self.pool] = verdict.retry_after_s
        else:
            self._s.never_ran = False
        return verdict

    def _unreached(self, loads: PoolLoads, reach: float) -> ApiError:
        if loads.view(self.pool) is not None:  # it reports, so it is alive: too busy to pick the call up
            self._s.shed = "pool_busy"
            hint = max(loads.retry_hint[self.pool], 5.0)
            return ApiError(429, "pool_busy", f"pool {self.pool!r} is overloaded: no replica picked the request up "
                                              f"within {reach:g}s; retry after {retry_after_header(hint)}s",
                            retry_after_s=hint)
        self._s.shed = "pool_unavailable"
        return ApiError(503, "pool_unavailable", f"no replica of pool {self.pool!r} answered within {reach:g}s; it "
                                                 "may be restarting", retry_after_s=10)

    async def first(self) -> Any:
        """The engine's first item: an input error the engine found is a 400, a whole answer
        that failed after the engine's work a 500, no answer a 502, a pool silent for the idle
        bound a 504."""
        first = await self._next()
        self._s.mark("first")
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            # the client left: an engine that answers a whole response's cancellation with an error
            # (vLLM's serving layer does; the pool's `whole_answer` raises it as the cancellation
            # it is) made no refusal before work (that would refund the engine's tokens)
            raise asyncio.CancelledError
        if isinstance(first, Refused):
            self._s.never_ran = True
            raise ApiError(400, first.code, first.message)
        if isinstance(first, Failed):  # the engine's work is charged; the same request would fail again
            raise ApiError(500, first.code, first.message, headers=NO_RETRY)
        if first is None or isinstance(first, Finished):  # no answer: a Finished was handed on as one, a 500
            raise ApiError(502, "pool_failed", f"pool {self.pool!r} ended the request without an answer; retry it",
                           retry_after_s=5)
        # a streamed request vLLM's serving refused comes as the error in its first chunk's place:
        # an error object from Ray LLM, or the SSE error event vLLM's stream generator sends for
        # what the engine raised as it took the request (a token id out of the vocabulary)
        if (err := engine_error(first)) is not None:
            status = error_status(err)
            # a 4xx is an input the engine refused before any work; a 5xx is a generation that
            # failed, maybe after the engine's work: its usage is unknown and the charge stands
            self._s.never_ran = status < 500
            param = getattr(err, "param", None)
            raise ApiError(status, str(getattr(err, "type", None) or "invalid_request"), str(err.message),
                           param if isinstance(param, str) else None)
        return first

    async def whole(self, first: Any) -> Any:
        """A whole response: the rest of the stream is only its `Finished`."""
        try:
            while await self._next() is not None:
                pass
        except ApiError as e:
            raise self._s.fail(e) from None
        except BaseException as e:
            if not from_pool(e):
                self.cancel()
                raise
            # the pool failed after answering: the usage is lost, the answer is not whole
            log.warning("pool %s failed after its response: %r", self.pool, e)
            raise self._s.fail(ApiError(503, "pool_failed", f"pool {self.pool!r} failed while answering; retry the "
                                                            "request", retry_after_s=5)) from None
        self._s.close()
        return first

    async def relay(self, first: Any) -> AsyncIterator[str]:
        """The pool's SSE chunks as text. `[DONE]` is held back until `Finished` arrived, so a
        client that hangs up at `[DONE]` cannot cut off the usage."""
        finished = False
        try:
            if text := _text(first):
                yield text
            while (item := await self._next()) is not None:
                if not isinstance(item, Finished) and (text := _text(item)):
                    yield text
            finished = True
            yield DONE
        except ApiError as e:  # the pool went silent mid-stream
            self._s.status, finished = e.status, True
            yield sse_error(e.status, e.code, e.message)
            yield DONE
        except BaseException as e:
            if not from_pool(e):
                raise
            # the pool failed mid-stream: end the stream with an error event
            log.warning("pool %s failed mid-stream: %r", self.pool, e)
            self._s.status, finished = 503, True
            yield sse_error(503, "pool_failed", f"pool {self.pool!r} failed while streaming; the response is "
                                                "incomplete: retry the request")
            yield DONE
        finally:
            if not finished:
                self.cancel()
                self._s.status = 499  # the client closed the connection
            self._s.close()

    async def _next(self) -> Any:
        """The pool's next item once admitted, None when the stream ended. A pool that sends
        nothing for `idle_s` (its engine hung, its replica wedged) is a 504 and its call is
        cancelled: the client, its slot in the gate and its quota slot were held for ever, as
        nothing else ends a call that a live replica keeps open. A whole answer is one item, so
        for it the bound is on the whole generation."""
        try:
            item = await self._idle.wait(self._gen.__anext__())
        except StopAsyncIteration:
            return None
        except Overdue:
            self.cancel()
            if self._finished:  # the answer and its usage are whole: only the stream's end is missing
                return None
            log.warning("pool %s sent nothing for %gs after admitting a request; its call is cancelled",
                        self.pool, self._idle.seconds)
            raise ApiError(504, "pool_timeout", f"pool {self.pool!r} sent nothing for {self._idle.seconds:g}s "
                                                "after admitting the request: its engine may be stuck, or a "
                                                "whole answer takes longer (stream it, or ask for fewer tokens)",
                           headers=NO_RETRY) from None
        if isinstance(item, Finished):  # the real usage settles the charge, whatever the request did
            self._s.usage, self._finished = item.usage, True
        elif isinstance(item, Failed):
            self._s.usage = item.usage
        return item


def from_pool(e: BaseException) -> bool:
    """Whether an error of a pool's stream is the pool's failure, not this request's end: a
    cancellation this task was not asked for is Ray Serve's word that the replica cancelled the
    call (it was shutting down), which was taken for the client leaving: no error event, no
    `[DONE]`, and a 499 in the books."""
    if isinstance(e, asyncio.CancelledError):
        task = asyncio.current_task()
        return task is not None and not task.cancelling()
    return isinstance(e, Exception)


def _text(item: Any) -> str:
    if isinstance(item, list):
        text = "".join(x if isinstance(x, str) else f"data: {x.model_dump_json()}\n\n" for x in item)
    else:
        text = item if isinstance(item, str) else f"data: {item.model_dump_json()}\n\n"
    return text.replace(DONE, "")
