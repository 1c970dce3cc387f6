"""The router: the HTTP ingress in front of the pools (a plain class; the builder makes it a
Serve ingress deployment and `router.ingress` maps its methods to paths).

The life of one request (`route`): authenticate, charge the request (a request and a
concurrency slot, before any work), read and price its body, charge its tokens, choose
where it goes (the pure dispatch plan: home, or borrowed and then home), dispatch it to a
pool's gate, and respond, streamed or whole. Its `Settlement` closes its books once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from infra.bounds import within
from infra.logs import configure_logging
from infra.loops import Loops
from infra.metrics import RouterMetrics
from pools.types import Admitted, CallKind, PoolCall, PriorityClass
from router.admin import Admin
from router.auth import Auth, keys_from_dir
from router.batch_api import BatchApi, BatchApiSettings
from router.body import BodyLimits, read_json
from router.config import RouterConfig, TenantConfig
from router.errors import ApiError, retry_after_header
from router.grammar import GrammarLimits
from router.leases import QuotaClient, QuotaExceeded, QuotaUnavailable
from router.load import PoolLoads
from router.policy import PoolRoute, choose_pool, dispatch_plan, resolve_priority
from router.pricing import PricedRequest, Pricer, PromptCounter
from router.quota import Charge, Quota
from router.stream import PoolStream, Settlement, from_pool
from router.turns import Turns

log = logging.getLogger("poolserve.router")

# Prompts counted at once (router.turns): enough to keep the renderer's thread busy, few
# enough that an interactive request waits for at most this many counts, not for a burst.
COUNTS_AT_ONCE = 4


@dataclass(frozen=True)
class RouterSettings:
    model_id: str
    max_model_len: int
    router: RouterConfig
    tenants: tuple[TenantConfig, ...]
    pools: tuple[PoolRoute, ...]
    batches: BatchApiSettings | None = None  # None: the Batch API is off


class Router:
    def __init__(self, settings: RouterSettings, pools: dict[str, Any], controller: Any, ledger: Any,
                 counter: PromptCounter, clock: Callable[[], float] = time.monotonic, batches: Any = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        configure_logging()
        c = settings.router
        self._s, self._clock = settings, clock
        self._pools = {name: h.options(stream=True) for name, h in pools.items()}
        self._controller = controller
        self._routes = {p.name: p for p in settings.pools}
        self._by_prefix = {p.prefix: p.name for p in settings.pools}
        tenants, admin = keys_from_dir(settings.tenants, c.admin_key_sha256, c.keys_dir)
        self._auth = Auth(tenants, admin)
        self._limits = BodyLimits(c.max_body_bytes, c.body_timeout_s, c.max_json_depth)
        self._pricer = Pricer(settings.model_id, settings.max_model_len, counter,
                              GrammarLimits(c.max_grammar_bytes, c.max_pattern_repeats))
        self._turns = Turns(COUNTS_AT_ONCE)
        quotas = {t.name: Quota(**t.quota.model_dump()) for t in settings.tenants}
        self._quota = QuotaClient(ledger, quotas, c.lease_fraction, clock)
        self._loads = PoolLoads(self._routes, clock, c.view_max_age_s)
        self._metrics = RouterMetrics()
        self.admin = Admin(self._auth, controller, pools, self._limits)
        self.batch_api = BatchApi(self._auth, settings.batches, batches, self._limits, wall_clock)
        self._loops = Loops("router")

    async def warm(self) -> None:
        """Pay now what the first request would: the request models, their validators and a
        render of each kind (vLLM's protocol module and renderer load in seconds on a busy
        box). Then the background loops start. The Serve constructor calls it."""
        for kind, sample in (("chat", {"messages": [{"role": "user", "content": "warm"}], "max_tokens": 1}),
                             ("completions", {"prompt": "warm", "max_tokens": 1})):
            await self._pricer.price(kind, sample)
        self._loops.start("pool views", self._refresh_views, self._s.router.pool_view_interval_s)
        self._loops.start("quota sync", self._quota.sync, self._s.router.lease_ttl_s)

    async def close(self) -> None:
        await self._loops.stop()

    # -- the route ------------------------------------------------------------------------

    async def route(self, request: Request, kind: CallKind, prefix: str | None) -> Response:
        received, settlement = self._clock(), None
        try:
            tenant = self._auth.tenant(request.headers)
            home = self._pool_for(prefix, tenant)
            priority = self._priority(request, tenant, home)
            settlement = self._settlement(tenant, await self._charge(tenant, 0), received)
            data = await read_json(request, self._limits)
            async with self._turns.turn(priority):
                priced = await self._pricer.price(kind, data)
            settlement.charge = await self._charge(tenant, priced.cost, settlement.charge)
            return await self._dispatch(settlement, home, priced, priority)
        except ApiError as e:
            if settlement is None:
                self._metrics.request("-" if prefix is None else self._by_prefix.get(prefix, "unknown"), "-", e.status)
            else:
                settlement.fail(e)
            return e.response()

    def _settlement(self, tenant: TenantConfig, charge: Charge, received: float) -> Settlement:
        """The request's books, closed when its task ends if nothing closed them before."""
        s = Settlement(tenant, charge, self._quota, self._loads, self._metrics, received, self._clock)
        asyncio.current_task().add_done_callback(s.abandon)
        return s

    async def _dispatch(self, s: Settlement, home: str, priced: PricedRequest, priority: PriorityClass) -> Response:
        if self._s.router.log_prompts:
            log.info("tenant=%s prompt=%s", s.tenant.name, json.dumps(_prompt_of(priced.body))[:4000])
        call = PoolCall(priced.kind, priced.body, s.tenant.name, s.tenant.weight, priority, priced.prompt_tokens,
                        priced.max_tokens, include_usage=priced.client_usage, n=priced.n, rendered=priced.rendered)
        plan = self._plan(home, priority, s.tenant.name)
        for i, attempt in enumerate(plan):
            s.dispatch(attempt.pool, attempt.borrowed)
            cls = PriorityClass.BORROWED if attempt.borrowed else priority
            if not attempt.borrowed and self._loads.queue_full(attempt.pool, cls, s.tenant.name):
                s.shed = "queue_full"
                hint = self._loads.retry_hint[attempt.pool]
                raise ApiError(429, "queue_full", f"pool {attempt.pool!r} is overloaded: its queue is full; retry "
                                                  f"after {retry_after_header(hint)}s", retry_after_s=hint)
            s.mark("sent")
            sent = dataclasses.replace(call, priority=cls, borrowed=attempt.borrowed)
            if attempt.borrowed and (rule := self._routes[home].borrow) is not None:
                sent = dataclasses.replace(sent, lend_after_quiet_s=rule.after_quiet_s,
                                           lend_below_utilisation=rule.while_below_utilisation,
                                           lend_max_share=rule.max_share)
            stream = PoolStream(self._pools[attempt.pool].generate.remote(sent), attempt.pool, s,
                                self._s.router.idle_timeout_s)
            try:
                verdict = await _guarded(stream, stream.verdict(self._loads, cls, self._s.router.reach_timeout_s))
            except ApiError as e:
                if not attempt.borrowed or i == len(plan) - 1:
                    raise
                # a lender that died or that nobody picked the call up at is no answer: home is
                log.warning("borrowing from pool %s failed (%s); sending the request home", attempt.pool, e.code)
                stream.cancel()
                s.shed = None
                continue
            if isinstance(verdict, Admitted):
                break
            if i == len(plan) - 1:  # refused at home too (a borrowed refusal goes home instead)
                raise ApiError(verdict.status, verdict.reason, verdict.message, retry_after_s=verdict.retry_after_s)
        if s.borrowed:
            self._metrics.borrowed(home, s.pool, s.tenant.name)
        first = await _guarded(stream, stream.first())
        headers = self._headers(s, priority, verdict)
        if priced.stream:
            return StreamingResponse(stream.relay(first), media_type="text/event-stream", headers=headers)
        return JSONResponse((await stream.whole(first)).model_dump(), headers=headers)

    def _plan(self, home: str, priority: PriorityClass, tenant: str):
        rule = self._routes[home].borrow
        target = rule.into if rule else None
        return dispatch_plan(home, priority, rule, self._loads.load(home),
                             self._loads.load(target) if target else None,
                             bool(target) and self._loads.may_borrow(home, target),
                             bool(target) and self._loads.queue_full(target, PriorityClass.BORROWED, tenant))

    # -- steps ------------------------------------------------------------------------------

    def _pool_for(self, prefix: str | None, tenant: TenantConfig) -> str:
        if prefix is not None and prefix not in self._by_prefix:
            known = ", ".join(f"/{p}" for p in self._by_prefix)
            raise ApiError(404, "pool_not_found", f"no pool at /{prefix}; pools are at {known}")
        path_pool = self._by_prefix[prefix] if prefix is not None else None
        return choose_pool(path_pool, tenant.pools, tenant.home_pool, tuple(self._routes))

    def _priority(self, request: Request, tenant: TenantConfig, pool: str) -> PriorityClass:
        pool_default = self._routes[pool].default_priority
        return resolve_priority(tenant.default_class(pool_default), tenant.ceiling(pool_default),
                                request.headers.get("x-poolserve-priority"))

    async def _charge(self, tenant: TenantConfig, tokens: int, request: Charge | None = None) -> Charge:
        """A new request (and its slot) when `request` is None, else `tokens` more for it."""
        try:
            if request is None:
                return await self._quota.charge(tenant.name, tokens)
            return await self._quota.charge_tokens(request, tokens)
        except QuotaUnavailable as e:
            log.warning("quota ledger unavailable: %s", e)
            raise ApiError(503, "quota_unavailable", "the quota service is unavailable; retry shortly",
                           retry_after_s=5) from None
        except QuotaExceeded as e:
            d = e.denied
            self._metrics.quota_rejected(tenant.name, d.limit)
            self._metrics.remaining(tenant.name, d.remaining_requests, d.remaining_tokens)
            if d.limit == "too_large":
                raise ApiError(429, "request_too_large_for_quota",
                               f"this request needs {tokens} tokens (its prompt as the engine renders it, plus n x "
                               f"max_tokens), more than tenant {tenant.name!r}'s tokens_per_min; lower max_tokens "
                               "or send less", "max_tokens") from None
            raise ApiError(429, f"{d.limit}_quota_exceeded",
                           f"tenant {tenant.name!r} exceeded its {d.limit} quota; retry after "
                           f"{retry_after_header(d.retry_after_s)}s", retry_after_s=d.retry_after_s,
                           headers=_ratelimit_headers(d.remaining_requests, d.remaining_tokens)) from None

    def _headers(self, s: Settlement, priority: PriorityClass, admitted: Admitted) -> dict[str, str]:
        rem_req, rem_tok = self._quota.remaining(s.tenant.name)
        self._metrics.remaining(s.tenant.name, rem_req, rem_tok)
        return {
            "x-poolserve-pool": s.pool,
            "x-poolserve-replica": admitted.replica,
            "x-poolserve-priority": (PriorityClass.BORROWED if s.borrowed else priority).label,
            "x-poolserve-borrowed": str(s.borrowed).lower(),
            "x-poolserve-queued-ms": f"{admitted.queued_s * 1e3:.0f}",
            "server-timing": s.server_timing(),
            **_ratelimit_headers(rem_req, rem_tok),
        }

    async def _refresh_views(self) -> None:
        """Pool capacity and queues from the controller, and the quota gauges re-exported (Ray
        drops a gauge that is not refreshed). A view the controller stops sending goes stale."""
        self._loads.update_views(await within(5, self._controller.views.remote()))
        for t in self._s.tenants:
            self._metrics.remaining(t.name, *self._quota.remaining(t.name))

    # -- the other tenant endpoints ----------------------------------------------------------

    async def models(self, request: Request, prefix: str | None = None) -> Response:
        try:
            tenant = self._auth.tenant(request.headers)
            if prefix is not None:
                self._pool_for(prefix, tenant)
        except ApiError as e:
            return e.response()
        return JSONResponse({"object": "list", "data": [self._model(tenant)]})

    async def model(self, request: Request, model_id: str) -> Response:
        """`GET /v1/models/{id}`, as OpenAI defines it."""
        try:
            tenant = self._auth.tenant(request.headers)
            if model_id != self._s.model_id:
                raise ApiError(404, "model_not_found", f"unknown model {model_id!r}; this server serves "
                                                       f"{self._s.model_id!r}", "model")
        except ApiError as e:
            return e.response()
        return JSONResponse(self._model(tenant))

    def _model(self, tenant: TenantConfig) -> dict:
        return {"id": self._s.model_id, "object": "model", "created": 0, "owned_by": "poolserve",
                "max_model_len": self._s.max_model_len, "pools": list(tenant.pools)}

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "pools": self._loads.views_fresh()})

    async def usage(self, request: Request) -> Response:
        """A tenant's own quota figures and requests in flight; never another tenant's."""
        try:
            tenant = self._auth.tenant(request.headers)
            usage = await self._quota.usage(tenant.name)
        except QuotaUnavailable:
            return ApiError(503, "quota_unavailable", "the quota service is unavailable; retry shortly",
                            retry_after_s=5).response()
        except ApiError as e:
            return e.response()
        return JSONResponse({"tenant": tenant.name, "quota": tenant.quota.model_dump(), **_finite(usage),
                             "inflight": self._loads.tenant_inflight(tenant.name, tenant.pools)})


async def _guarded(stream: PoolStream, step) -> Any:
    """A step of a pool stream; a replica that died or a call that failed is a 503."""
    try:
        return await step
    except ApiError:
        raise
    except BaseException as e:
        if not from_pool(e):
            raise
        log.warning("pool %s failed before responding: %r", stream.pool, e)
        raise ApiError(503, "pool_unavailable", f"pool {stream.pool!r} is unavailable; retry shortly",
                       retry_after_s=5) from None


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
