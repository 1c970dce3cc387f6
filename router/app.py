"""The router: the HTTP ingress in front of the pools (a plain class; the builder makes it
a Serve ingress deployment).

The life of one request (`_serve`):
  1. body size, API key -> tenant, path -> pool (403 / 404 before reading the body);
  2. JSON -> the OpenAI request model (vLLM's, as ray.serve.llm uses), field checks;
  3. prompt tokens counted with the model's tokenizer; cost = prompt + max_tokens;
  4. priority: the tenant's class or the requested one, clamped to its ceiling;
  5. quota charged from this replica's lease (429 + Retry-After when exhausted);
  6. pool chosen (borrowing while the target is idle), then `generate` on that pool;
     the pool's first item says whether its gate admitted (else 429 / 503);
  7. the response relayed, streamed or whole; when it ends the real usage reconciles
     the quota and the in-flight counts drop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pools.engine import vllm_client_errors
from pools.logs import configure_logging
from pools.metrics import RouterMetrics
from pools.types import Admitted, Arrived, Finished, PoolCall, PriorityClass, Refused, Rejected, Usage
from router.config import RouterConfig, TenantConfig
from router.errors import ApiError, retry_after_header, sse_error
from router.leases import QuotaClient, QuotaExceeded
from router.policy import (BorrowRule, PolicyError, PoolLoad, borrow_decision, choose_pool, queue_surely_full,
                           resolve_priority)
from router.quota import Charge, Quota
from router.tokens import PromptCounter

log = logging.getLogger("poolserve.router")

# Request fields that belong to the operator, not to a tenant: rejected with a 400.
RESERVED_FIELDS = {
    "priority": "set the class with the x-poolserve-priority header instead",
    "request_id": "the router assigns request ids",
    "kv_transfer_params": "internal to disaggregated serving",
    "ec_transfer_params": "internal to disaggregated serving",
    "chat_template": "the model's own chat template is used",
    "vllm_xargs": "engine extension arguments are not accepted from tenants",
    "media_io_kwargs": "text models only",
    "mm_processor_kwargs": "text models only",
}
MAX_N = 16


@dataclass(frozen=True)
class PoolRoute:
    name: str
    prefix: str  # the path segment, e.g. "online" for /online/v1/...
    start_capacity: int
    default_priority: PriorityClass
    borrow: BorrowRule | None = None
    queue_slots: int = 0  # the pool's gate queue per replica (`queue.max_queued`); 0: never shed here


@dataclass(frozen=True)
class RouterSettings:
    model_id: str
    model_source: str
    max_model_len: int
    router: RouterConfig
    tenants: tuple[TenantConfig, ...]
    pools: tuple[PoolRoute, ...]


@dataclass
class _Flight:
    """One request on its way: settles quota and in-flight counts exactly once."""

    router: "Router"
    tenant: TenantConfig
    pool: str
    borrowed: bool
    charge: Charge
    started: float
    usage: Usage | None = None  # the engine's, when the request ran to its end
    never_ran: bool = False  # refused by a gate or the engine: refund the whole charge
    shed: str | None = None  # refused by the router on the pool's behalf: the reason
    status: int = 200
    closed: bool = False
    marks: dict[str, float] = field(default_factory=dict)  # monotonic times of the steps to the first item

    def mark(self, step: str) -> None:
        self.marks[step] = time.monotonic()

    def server_timing(self) -> str:
        """The `Server-Timing` header: where the time to the first byte went, in ms.

        router: parsing, auth, token count and quota before the call; reach: until a pool
        replica took the call; queue: in the pool's gate; engine: until the engine's first
        output reached the router."""
        steps = (("router", self.marks.get("sent")), ("reach", self.marks.get("arrived")),
                 ("queue", self.marks.get("admitted")), ("engine", self.marks.get("first")))
        last, parts = self.started, []
        for name, at in steps:
            if at is not None:
                parts.append(f"{name};dur={(at - last) * 1e3:.1f}")
                last = at
        return ", ".join(parts)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.router._inflight_done(self.pool, self.borrowed)
        used = 0 if self.never_ran else (self.usage.total_tokens if self.usage else None)
        self.router._quota.finish(self.charge, used)
        m = self.router._metrics
        m.request(self.pool, self.tenant.name, self.status)
        if self.shed:
            m.shed(self.pool, self.tenant.name, self.shed)
        u = self.usage or Usage(0, 0)
        if self.usage is not None:
            m.tokens(self.tenant.name, self.pool, u.prompt_tokens, u.completion_tokens)
        log.info("tenant=%s pool=%s borrowed=%s status=%d prompt_tokens=%d completion_tokens=%d ms=%.0f",
                 self.tenant.name, self.pool, self.borrowed, self.status, u.prompt_tokens, u.completion_tokens,
                 (time.monotonic() - self.started) * 1e3)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


DONE = "data: [DONE]\n\n"


def _without_done(text: str) -> str:
    return text.replace(DONE, "")


def _chunk_text(item: Any) -> str:
    if isinstance(item, list):
        return "".join(x if isinstance(x, str) else f"data: {x.model_dump_json()}\n\n" for x in item)
    return item if isinstance(item, str) else f"data: {item.model_dump_json()}\n\n"


class Router:
    def __init__(self, settings: RouterSettings, pools: dict[str, Any], controller: Any, ledger: Any,
                 counter: PromptCounter | None = None) -> None:
        configure_logging()
        self._s = settings
        self._pools = {name: h.options(stream=True) for name, h in pools.items()}
        self._plain_pools = pools
        self._controller = controller
        self._routes = {p.name: p for p in settings.pools}
        self._by_prefix = {p.prefix: p.name for p in settings.pools}
        self._tenants = settings.tenants
        quotas = {t.name: Quota(**t.quota.model_dump()) for t in settings.tenants}
        self._quota = QuotaClient(ledger, quotas, settings.router.lease_fraction, settings.router.lease_ttl_s)
        self._counter = counter or PromptCounter(settings.model_source)
        self._metrics = RouterMetrics()
        self._views: dict[str, Any] = {}
        self._own = {p: 0 for p in self._routes}
        self._own_seen = {p: float("-inf") for p in self._routes}  # when a pool last had its own work here
        self._borrowed = {p: 0 for p in self._routes}
        self._waiting = {p: {c: 0 for c in PriorityClass} for p in self._routes}  # dispatched, not yet admitted
        self._retry_hint = {p: 1.0 for p in self._routes}  # the pool gate's last Retry-After estimate
        self._refresher: asyncio.Task | None = None
        self._models: dict[str, type] = {}

    def warm(self) -> None:
        """Pay now what the first request would: importing the OpenAI request models (vLLM's
        protocol module, seconds on a busy box), their validators and the chat template. Then
        the pool views start refreshing. The Serve constructor calls it (router.ingress)."""
        for kind, sample in (("chat", {"messages": [{"role": "user", "content": "warm"}], "max_tokens": 1}),
                             ("completions", {"prompt": "warm", "max_tokens": 1})):
            self._measure(kind, self._validate(kind, sample))
        self._ensure_background()

    # -- endpoints (mapped to paths in router.ingress) --------------------------

    async def chat(self, request: Request, prefix: str) -> Response:
        return await self._serve(request, "chat", prefix)

    async def completions(self, request: Request, prefix: str) -> Response:
        return await self._serve(request, "completions", prefix)

    async def chat_default(self, request: Request) -> Response:
        return await self._serve(request, "chat", None)

    async def completions_default(self, request: Request) -> Response:
        return await self._serve(request, "completions", None)

    async def models(self, request: Request) -> Response:
        try:
            tenant = self._auth(request)
        except ApiError as e:
            return e.response()
        data = [{"id": self._s.model_id, "object": "model", "owned_by": "poolserve",
                 "max_model_len": self._s.max_model_len, "pools": list(tenant.pools)}]
        return JSONResponse({"object": "list", "data": data})

    async def pool_models(self, request: Request, prefix: str) -> Response:
        try:
            tenant = self._auth(request)
            self._pool_for(prefix, tenant)
        except ApiError as e:
            return e.response()
        return await self.models(request)

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "pools": {n: bool(getattr(v, "fresh", False))
                                                       for n, v in self._views.items()}})

    async def usage(self, request: Request) -> Response:
        """A tenant's own quota figures; a key never sees another tenant's."""
        try:
            tenant = self._auth(request)
            usage = await self._quota.usage(tenant.name)
        except ApiError as e:
            return e.response()
        q = tenant.quota
        return JSONResponse({"tenant": tenant.name, "quota": q.model_dump(), **_finite(usage),
                             "inflight": {p: self._own.get(p, 0) for p in tenant.pools}})

    # -- admin endpoints ------------------------------------------------------------

    async def admin_pools(self, request: Request) -> Response:
        return await self._admin(request, lambda: self._controller.status.remote())

    async def admin_decisions(self, request: Request, limit: int = 100) -> Response:
        async def run():
            return [d.__dict__ for d in await self._controller.decisions.remote(limit)]
        return await self._admin(request, run)

    async def admin_describe(self, request: Request, pool: str) -> Response:
        return await self._admin(request, lambda: self._plain_pools[self._known(pool)].describe.remote())

    async def admin_pin(self, request: Request, pool: str) -> Response:
        async def run():
            body = await self._json(request)
            seqs = body.get("max_active_seqs")
            if not isinstance(seqs, int) or isinstance(seqs, bool) or seqs < 1:
                raise ApiError(400, "invalid_value", "max_active_seqs must be a positive integer",
                               "max_active_seqs")
            try:
                d = await self._controller.pin.remote(self._known(pool), seqs, bool(body.get("calibrating")))
            except ValueError as e:
                raise ApiError(400, "outside_safe_range", str(e), "max_active_seqs")
            return {"pool": pool, "pinned": d.limits.max_active_seqs,
                    "max_inflight_tokens": d.limits.max_inflight_tokens,
                    "allowed": [d.allowed.low, d.allowed.high]}
        return await self._admin(request, run)

    async def admin_unpin(self, request: Request, pool: str) -> Response:
        async def run():
            await self._controller.unpin.remote(self._known(pool))
            return {"pool": pool, "pinned": None}
        return await self._admin(request, run)

    async def admin_lending(self, request: Request, pool: str) -> Response:
        async def run():
            body = await self._json(request)
            if not isinstance(body.get("enabled"), bool):
                raise ApiError(400, "invalid_value", "enabled must be true or false", "enabled")
            await self._controller.set_lending.remote(self._known(pool), body["enabled"])
            return {"pool": pool, "lending": body["enabled"]}
        return await self._admin(request, run)

    async def admin_slo(self, request: Request, pool: str) -> Response:
        async def run():
            body = await self._json(request)
            values = []
            for key in ("ttft_p99_ms", "tpot_p99_ms"):
                v = body.get(key)
                if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                    raise ApiError(400, "invalid_value", f"{key} must be a positive number of milliseconds", key)
                values.append(float(v))
            await self._controller.set_slo.remote(self._known(pool), *values)
            return {"pool": pool, "ttft_p99_ms": values[0], "tpot_p99_ms": values[1]}
        return await self._admin(request, run)

    # -- the top loop ----------------------------------------------------------------

    async def _serve(self, request: Request, kind: str, prefix: str | None) -> Response:
        received = time.monotonic()
        self._ensure_background()
        try:
            tenant = self._auth(request)
            pool = self._pool_for(prefix, tenant)
            body, client_usage = await self._parse(request, kind)
            prompt_tokens, max_tokens = self._measure(kind, body)
            priority = self._priority(request, tenant, pool)
            charge = await self._charge(tenant, prompt_tokens + max_tokens * (getattr(body, "n", 1) or 1))
        except ApiError as e:
            label = "-" if prefix is None else self._by_prefix.get(prefix, "unknown")  # never echo a raw path
            self._metrics.request(label, "-", e.status)
            return e.response()
        if self._s.router.log_prompts:
            log.info("tenant=%s prompt=%s", tenant.name, json.dumps(_prompt_of(body))[:4000])
        call = PoolCall(kind, body, tenant.name, tenant.weight, priority, prompt_tokens, max_tokens,
                        include_usage=client_usage)
        return await self._dispatch(tenant, pool, call, charge, received)

    async def _dispatch(self, tenant: TenantConfig, pool: str, call: PoolCall, charge: Charge,
                        received: float) -> Response:
        target, borrowed = self._choose(pool, call)
        if borrowed and self._queue_full(target, PriorityClass.BORROWED):
            target, borrowed = pool, False
        flight = _Flight(self, tenant, target, borrowed, charge, received)
        self._inflight_start(target, borrowed)
        gen = None
        try:
            if not borrowed and self._queue_full(pool, call.priority):  # the pool would refuse it anyway
                flight.never_ran, flight.shed = True, "queue_full"
                hint = self._retry_hint[pool]
                raise ApiError(429, "queue_full", f"pool {pool!r} is overloaded: its queue is full; retry after "
                                                  f"{retry_after_header(hint)}s", retry_after_s=hint)
            flight.mark("sent")
            gen = self._start(target, call, borrowed)
            admitted = await self._admission(gen, target, flight,
                                             PriorityClass.BORROWED if borrowed else call.priority)
            if isinstance(admitted, Rejected) and borrowed:  # the lender is busy again: go home
                self._inflight_done(target, True)
                flight.pool, flight.borrowed = pool, False
                self._inflight_start(pool, False)
                gen = self._start(pool, call, False)
                admitted = await self._admission(gen, pool, flight, call.priority)
            if isinstance(admitted, Rejected):
                flight.never_ran = True
                raise ApiError(admitted.status, admitted.reason, admitted.message, retry_after_s=admitted.retry_after_s)
            if flight.borrowed:
                self._metrics.borrowed(pool, target, tenant.name)
            first = await gen.__anext__()
            flight.mark("first")
            self._raise_engine_error(first, flight)
        except ApiError as e:
            flight.status = e.status
            flight.close()
            return e.response()
        except asyncio.CancelledError:  # the client left while the request waited
            if gen is not None:
                gen.cancel()
            flight.status = 499
            flight.close()
            raise
        except Exception as e:
            flight.status = 503
            flight.close()
            log.warning("pool %s failed before responding: %r", flight.pool, e)
            return ApiError(503, "pool_unavailable", f"pool {flight.pool!r} is unavailable; retry shortly",
                            retry_after_s=5).response()
        headers = self._headers(flight, call, admitted)
        if getattr(call.body, "stream", False):
            return StreamingResponse(self._relay(gen, first, flight), media_type="text/event-stream", headers=headers)
        return await self._whole(gen, first, flight, headers)

    # -- steps -------------------------------------------------------------------------

    def _auth(self, request: Request) -> TenantConfig:
        header = request.headers.get("authorization", "")
        if not header.lower().startswith("bearer ") or not header[7:].strip():
            raise ApiError(401, "missing_api_key", "no API key: send 'Authorization: Bearer <key>'")
        digest = _sha256(header[7:].strip())
        found = None
        for t in self._tenants:  # compare with every tenant, in constant time each
            if hmac.compare_digest(digest, t.key_sha256):
                found = t
        if found is None:
            raise ApiError(401, "invalid_api_key", "the API key is not valid")
        return found

    def _pool_for(self, prefix: str | None, tenant: TenantConfig) -> str:
        if prefix is not None and prefix not in self._by_prefix:
            known = ", ".join(f"/{p}" for p in self._by_prefix)
            raise ApiError(404, "pool_not_found", f"no pool at /{prefix}; pools are at {known}")
        name = self._by_prefix[prefix] if prefix is not None else None
        try:
            return choose_pool(name, tenant.pools, tenant.home_pool, tuple(self._routes))
        except PolicyError as e:
            raise ApiError(e.status, e.code, e.message, e.param)

    async def _read_body(self, request: Request) -> bytes:
        limit = self._s.router.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, "body_too_large", f"request body is {declared} bytes; the limit is {limit}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, "body_too_large", f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _json(self, request: Request) -> dict:
        raw = await self._read_body(request)
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, "invalid_json", f"the request body is not valid JSON: {e}")
        if not isinstance(data, dict):
            raise ApiError(400, "invalid_json", "the request body must be a JSON object")
        return data

    async def _parse(self, request: Request, kind: str):
        data = await self._json(request)
        for key, why in RESERVED_FIELDS.items():
            if key in data:
                raise ApiError(400, "reserved_field", f"field {key!r} is not accepted: {why}", key)
        model = data.get("model")
        if model is not None and model != self._s.model_id:
            raise ApiError(404, "model_not_found", f"unknown model {model!r}; this service serves "
                                                   f"{self._s.model_id!r}", "model")
        if kind == "chat" and "messages" not in data:
            raise ApiError(400, "missing_field", "field 'messages' is required: a list of "
                                                 "{role, content} messages", "messages")
        if kind == "completions" and data.get("prompt") is None:
            raise ApiError(400, "missing_field", "field 'prompt' is required", "prompt")
        client_usage = False
        if data.get("stream"):  # the pool always gets usage; the client only if it asked
            opts = data.get("stream_options") if isinstance(data.get("stream_options"), dict) else {}
            client_usage = bool(opts.get("include_usage"))
            data["stream_options"] = {**opts, "include_usage": True}
        return self._validate(kind, data), client_usage

    def _validate(self, kind: str, data: dict):
        from pydantic import ValidationError

        model_cls = self._request_model(kind)
        if kind == "chat":  # checked first: pydantic's union errors list every message type instead
            messages = data.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ApiError(400, "invalid_request", "messages must be a non-empty list of {role, content} "
                                                       "objects", "messages")
            for i, m in enumerate(messages):
                if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                    raise ApiError(400, "invalid_request", f"messages[{i}].role is required: each message is "
                                                           "an object with a 'role' and its 'content'",
                                   f"messages[{i}].role")
        try:
            body = model_cls.model_validate(data)
        except ValidationError as e:
            raise ApiError(400, "invalid_request", _validation_message(e), _first_param(e))
        except Exception as e:  # noqa: BLE001 - the body is the only input, so any failure is the body's
            # vLLM's before-validators raise VLLMValidationError, or crash on a field of the wrong
            # type (AttributeError on `structured_outputs: 5`, say) before pydantic checks types.
            if isinstance(e, (ValueError, TypeError, *vllm_client_errors())):
                raise ApiError(400, "invalid_request", f"invalid request: {e}", getattr(e, "parameter", None))
            raise ApiError(400, "invalid_request", f"invalid request ({type(e).__name__}: {e}); a field has the "
                                                   "wrong type: see the schema at /openapi.json")
        if kind == "chat":
            from ray.llm._internal.serve.core.ingress.utils import _sanitize_chat_completion_request

            try:
                body = _sanitize_chat_completion_request(body)
            except ValueError as e:
                raise ApiError(400, "invalid_request", str(e), "messages")
        return body

    def _request_model(self, kind: str):
        if kind not in self._models:
            from ray.llm._internal.serve.core.configs import openai_api_models as m

            self._models[kind] = m.ChatCompletionRequest if kind == "chat" else m.CompletionRequest
        return self._models[kind]

    def _measure(self, kind: str, body) -> tuple[int, int]:
        """(prompt tokens, max_tokens) checked against max_model_len."""
        limit = self._s.max_model_len
        n = getattr(body, "n", 1) or 1
        if n < 1 or n > MAX_N:
            raise ApiError(400, "invalid_value", f"n is {n}; it must be between 1 and {MAX_N}", "n")
        if kind == "chat":
            prompt = self._counter.chat([dict(m) for m in body.messages],
                                        add_generation_prompt=getattr(body, "add_generation_prompt", True))
            asked, param = (body.max_completion_tokens, "max_completion_tokens") \
                if body.max_completion_tokens is not None else (body.max_tokens, "max_tokens")
        else:
            p = body.prompt
            if isinstance(p, list) and p and isinstance(p[0], (list, str)):
                if len(p) != 1:
                    raise ApiError(400, "invalid_value", f"prompt holds {len(p)} prompts; send one prompt "
                                                         "per request", "prompt")
                p = p[0]
            prompt = len(p) if isinstance(p, list) else self._counter.text(p)
            asked, param = body.max_tokens, "max_tokens"
        if prompt >= limit:
            raise ApiError(400, "context_length_exceeded", f"the prompt is {prompt} tokens; max_model_len is "
                                                           f"{limit}: shorten the prompt", "messages"
                           if kind == "chat" else "prompt")
        if asked is None:
            return prompt, limit - prompt
        if asked < 1:
            raise ApiError(400, "invalid_value", f"{param} is {asked}; it must be at least 1", param)
        if prompt + asked > limit:
            raise ApiError(400, "context_length_exceeded",
                           f"{param} is {asked} and the prompt is {prompt} tokens: together above max_model_len "
                           f"{limit}; ask for at most {limit - prompt}", param)
        return prompt, asked

    def _priority(self, request: Request, tenant: TenantConfig, pool: str) -> PriorityClass:
        default = tenant.default_class(self._routes[pool].default_priority)
        try:
            return resolve_priority(default, tenant.ceiling(default), request.headers.get("x-poolserve-priority"))
        except PolicyError as e:
            raise ApiError(e.status, e.code, e.message, e.param)

    async def _charge(self, tenant: TenantConfig, tokens: int) -> Charge:
        try:
            charge = await self._quota.charge(tenant.name, tokens)
        except QuotaExceeded as e:
            d = e.denied
            self._metrics.quota_rejected(tenant.name, d.limit)
            self._metrics.remaining(tenant.name, d.remaining_requests, d.remaining_tokens)
            if d.limit == "too_large":
                raise ApiError(429, "request_too_large_for_quota",
                               f"this request needs {tokens} tokens, more than tenant {tenant.name!r}'s "
                               f"tokens_per_min; lower max_tokens", "max_tokens")
            raise ApiError(429, f"{d.limit}_quota_exceeded",
                           f"tenant {tenant.name!r} exceeded its {d.limit} quota; retry after "
                           f"{retry_after_header(d.retry_after_s)}s", retry_after_s=d.retry_after_s,
                           headers=_ratelimit_headers(d.remaining_requests, d.remaining_tokens))
        return charge

    def _choose(self, pool: str, call: PoolCall) -> tuple[str, bool]:
        rule = self._routes[pool].borrow
        if rule is None or call.priority == PriorityClass.INTERACTIVE or not self._may_borrow(pool, rule.into):
            return pool, False
        ok, _why = borrow_decision(self._load(pool), self._load(rule.into), rule)
        return (rule.into, True) if ok else (pool, False)

    def _may_borrow(self, home: str, target: str) -> bool:
        """Not while either pool is being calibrated, nor from a pool that stopped lending."""
        h, t = self._views.get(home), self._views.get(target)
        return not (getattr(h, "calibrating", False) or getattr(t, "calibrating", False)
                    or not getattr(t, "lending", True))

    def _load(self, pool: str) -> PoolLoad:
        view = self._views.get(pool)
        quiet = 0.0 if self._own[pool] else time.monotonic() - self._own_seen[pool]
        if view is None or not view.fresh:
            return PoolLoad(self._routes[pool].start_capacity, self._own[pool], self._borrowed[pool], quiet_s=quiet)
        return PoolLoad(view.capacity, self._own[pool], self._borrowed[pool], view.active + view.queued, view.queued,
                        quiet)

    def _start(self, pool: str, call: PoolCall, borrowed: bool):
        if borrowed:
            call = dataclasses.replace(call, priority=PriorityClass.BORROWED, borrowed=True)
        return self._pools[pool].generate.remote(call)

    async def _admission(self, gen, pool: str, flight: _Flight, cls: PriorityClass) -> Admitted | Rejected:
        """The pool's verdict on a call. Reaching a replica is bounded by `reach_timeout_s`
        (no replica: it is restarting or gone); the wait in the pool's queue is not."""
        waiting = self._waiting[pool]
        waiting[cls] += 1
        try:
            try:
                arrived = await asyncio.wait_for(gen.__anext__(), self._s.router.reach_timeout_s)
            except asyncio.TimeoutError:
                gen.cancel()
                flight.never_ran = True
                reach = self._s.router.reach_timeout_s
                view = self._views.get(pool)
                alive = view is not None and view.fresh  # it reports, so it is alive: too busy to pick it up
                flight.shed = "pool_busy" if alive else "pool_unavailable"
                if alive:
                    hint = max(self._retry_hint[pool], 5.0)
                    raise ApiError(429, "pool_busy", f"pool {pool!r} is overloaded: no replica picked the request "
                                                     f"up within {reach:g}s; retry after {retry_after_header(hint)}s",
                                   retry_after_s=hint)
                raise ApiError(503, "pool_unavailable", f"no replica of pool {pool!r} answered within "
                                                        f"{reach:g}s; it may be restarting", retry_after_s=10)
            flight.mark("arrived")
            if isinstance(arrived, (Admitted, Rejected)):  # decided at once: no queueing
                verdict = arrived
            elif isinstance(arrived, Arrived):
                verdict = await gen.__anext__()
            else:
                raise RuntimeError(f"pool {pool!r} broke the stream protocol: {type(arrived).__name__} came first")
            flight.mark("admitted")
        finally:
            waiting[cls] -= 1
        if isinstance(verdict, Rejected):
            self._retry_hint[pool] = verdict.retry_after_s
        return verdict

    def _queue_full(self, pool: str, priority: PriorityClass) -> bool:
        view = self._views.get(pool)
        if view is None or not view.fresh:  # unknown: let the pool's gate decide
            return False
        return queue_surely_full(self._waiting[pool], priority, self._routes[pool].queue_slots * view.replicas)

    def _raise_engine_error(self, first: Any, flight: _Flight) -> None:
        if isinstance(first, Refused):
            flight.never_ran = True
            raise ApiError(400, first.code, first.message)
        err = getattr(first, "error", None) if not isinstance(first, (list, str)) else None
        if err is not None and hasattr(err, "message"):
            status = int(getattr(err, "code", 400) or 400)
            status = status if 400 <= status < 600 else 400
            flight.never_ran = True
            raise ApiError(status, str(getattr(err, "type", "invalid_request")), err.message)

    def _headers(self, flight: _Flight, call: PoolCall, admitted: Admitted) -> dict[str, str]:
        rem_req, rem_tok = self._quota.remaining(flight.tenant.name)
        self._metrics.remaining(flight.tenant.name, rem_req, rem_tok)
        return {
            "x-poolserve-pool": flight.pool,
            "x-poolserve-replica": admitted.replica,
            "x-poolserve-priority": (PriorityClass.BORROWED if flight.borrowed else call.priority).label,
            "x-poolserve-borrowed": str(flight.borrowed).lower(),
            "x-poolserve-queued-ms": f"{admitted.queued_s * 1e3:.0f}",
            "server-timing": flight.server_timing(),
            **_ratelimit_headers(rem_req, rem_tok),
        }

    async def _whole(self, gen, first: Any, flight: _Flight, headers: dict[str, str]) -> Response:
        try:
            async for item in gen:
                if isinstance(item, Finished):
                    self._settle_usage(flight, item)
        except asyncio.CancelledError:
            gen.cancel()
            raise
        finally:
            flight.close()
        return JSONResponse(first.model_dump(), headers=headers)

    async def _relay(self, gen, first: Any, flight: _Flight) -> AsyncGenerator[str, None]:
        """Relay the pool's SSE chunks. `[DONE]` is held back until the pool's `Finished`
        arrives, so a client that hangs up at `[DONE]` cannot cut off the usage."""
        finished = False
        try:
            for item in [first]:
                if text := _without_done(_chunk_text(item)):
                    yield text
            async for item in gen:
                if isinstance(item, Finished):
                    self._settle_usage(flight, item)
                elif text := _without_done(_chunk_text(item)):
                    yield text
            finished = True
            yield DONE
        except Exception as e:  # the pool failed mid-stream: end the stream with an error event
            log.warning("pool %s failed mid-stream: %r", flight.pool, e)
            flight.status = 503
            finished = True
            yield sse_error(503, "pool_failed", f"pool {flight.pool!r} failed while streaming; "
                                                "the response is incomplete: retry the request")
            yield DONE
        finally:
            if not finished:
                gen.cancel()
                flight.status = 499  # client closed the connection
            flight.close()

    def _settle_usage(self, flight: _Flight, fin: Finished) -> None:
        flight.usage = fin.usage

    # -- bookkeeping ------------------------------------------------------------------

    def _inflight_start(self, pool: str, borrowed: bool) -> None:
        (self._borrowed if borrowed else self._own)[pool] += 1

    def _inflight_done(self, pool: str, borrowed: bool) -> None:
        (self._borrowed if borrowed else self._own)[pool] -= 1
        if not borrowed:
            self._own_seen[pool] = time.monotonic()

    def _ensure_background(self) -> None:
        if self._refresher is None:
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_views())

    async def _refresh_views(self) -> None:
        """Pool capacity and queues from the controller (the last view stays if it is away),
        and the quota gauges re-exported: Ray drops a gauge that is not refreshed."""
        while True:
            try:
                self._views = await asyncio.wait_for(self._controller.views.remote(), timeout=5)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.debug("controller views unavailable: %r", e)
            for t in self._tenants:
                self._metrics.remaining(t.name, *self._quota.remaining(t.name))
            await asyncio.sleep(self._s.router.pool_view_interval_s)

    def _known(self, pool: str) -> str:
        if pool not in self._routes:
            raise ApiError(404, "pool_not_found", f"unknown pool {pool!r}; pools are {', '.join(self._routes)}")
        return pool

    async def _admin(self, request: Request, action) -> Response:
        try:
            expected = self._s.router.admin_key_sha256
            if expected is None:
                raise ApiError(403, "admin_disabled", "the admin API is off: set router.admin_key_sha256")
            header = request.headers.get("authorization", "")
            if not header.lower().startswith("bearer ") or not hmac.compare_digest(_sha256(header[7:].strip()), expected):
                raise ApiError(401, "invalid_admin_key", "admin endpoints need 'Authorization: Bearer <admin key>'")
            result = await action()
        except ApiError as e:
            return e.response()
        return JSONResponse(_jsonable(result))


def _prompt_of(body: Any) -> Any:
    return getattr(body, "messages", None) or getattr(body, "prompt", None)


def _ratelimit_headers(requests: float, tokens: float) -> dict[str, str]:
    out = {}
    if requests != float("inf"):
        out["x-ratelimit-remaining-requests"] = str(max(0, int(requests)))
    if tokens != float("inf"):
        out["x-ratelimit-remaining-tokens"] = str(max(0, int(tokens)))
    return out


def _finite(d: dict) -> dict:
    return {k: (None if isinstance(v, float) and v == float("inf") else v) for k, v in d.items()}


def _jsonable(x: Any) -> Any:
    if hasattr(x, "__dataclass_fields__"):
        return _jsonable(x.__dict__)
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and x == float("inf"):
        return None
    return x


def _validation_message(e) -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if not str(x).startswith("function-"))
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    more = len(e.errors()) - 5
    return "invalid request: " + "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def _first_param(e) -> str | None:
    errs = e.errors()
    if not errs or not errs[0].get("loc"):
        return None
    return str(errs[0]["loc"][0])
