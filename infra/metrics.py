"""The one module that exports poolserve's metrics (Ray's metrics API -> Prometheus).

Everything else collects typed stats (GateStats, EngineStats, decisions); the classes
here turn them into `poolserve:*` series beside vLLM's `vllm:*` and Serve's
`ray_serve_*` on Ray's metrics endpoint (Ray prefixes every name with `ray_`).
Each process creates only the group it needs, lazily, so importing this is free.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: infra imports no poolserve package
    from pools.types import EngineStats, GateStats, PriorityClass, SafeRange

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

@dataclass(frozen=True)
class Series:
    """One exported series, declared once for the process that sets it and for docs/metrics.md."""

    name: str  # as poolserve names it; Prometheus sees it with Ray's `ray_` in front
    kind: str  # gauge, counter or histogram
    labels: tuple[str, ...]
    help: str
    buckets: tuple[float, ...] = ()


_REPLICA, _REQUEST = ("pool", "replica"), ("pool", "tenant", "priority")

# Per pool replica (`PoolMetrics`), per router replica (`RouterMetrics`), and the controller's.
SERIES = {
    "queue_depth": Series("poolserve_queue_depth", "gauge", _REPLICA + ("priority",), "Requests waiting at the gate"),
    "queued_tokens": Series("poolserve_queued_tokens", "gauge", _REPLICA,
                            "Tokens waiting at the gate (prompt + n x max_tokens each)"),
    "active_seqs": Series("poolserve_active_seqs", "gauge", _REPLICA,
                         "Sequences holding a slot (a request of n choices holds n)"),
    "inflight_tokens": Series("poolserve_inflight_tokens", "gauge", _REPLICA,
                              "Tokens of the requests holding a slot (prompt + n x max_tokens each)"),
    "limit_seqs": Series("poolserve_limit_max_active_seqs", "gauge", _REPLICA, "Runtime limit on active sequences"),
    "limit_tokens": Series("poolserve_limit_max_inflight_tokens", "gauge", _REPLICA,
                           "Runtime limit on in-flight tokens"),
    "range_low": Series("poolserve_safe_range_low", "gauge", _REPLICA, "Bottom of the safe range"),
    "range_high": Series("poolserve_safe_range_high", "gauge", _REPLICA, "Top of the safe range"),
    "kv_usage": Series("poolserve_kv_usage", "gauge", _REPLICA, "vLLM KV cache usage (0-1)"),
    "engine_running": Series("poolserve_engine_running", "gauge", _REPLICA, "vLLM running requests"),
    "engine_waiting": Series("poolserve_engine_waiting", "gauge", _REPLICA, "vLLM waiting requests"),
    "ttft": Series("poolserve_ttft_seconds", "histogram", _REQUEST,
                   "Arrival at the replica to first token, of streamed requests",
                   LATENCY_BUCKETS_S),
    "tpot": Series("poolserve_tpot_seconds", "histogram", _REQUEST,
                   "Time per output token after the first, of streamed requests (all choices' tokens)",
                   TPOT_BUCKETS_S),
    "queue_wait": Series("poolserve_queue_wait_seconds", "histogram", _REQUEST, "Time waiting at the gate",
                         LATENCY_BUCKETS_S),
    "admitted": Series("poolserve_admitted_total", "counter", _REQUEST,
                       "Requests the gate admitted and whose caller took the admission (one admitted as its caller "
                       "left counts in `left_queued`)"),
    "rejected": Series("poolserve_rejected_total", "counter", _REQUEST + ("reason",),
                       "Requests the gate refused (reason: queue_full, evicted, lender_busy)"),
    "cancelled": Series("poolserve_cancelled_total", "counter", _REQUEST,
                        "Admitted requests that did not finish: the client gone, the engine's refusal or error"),
    "left_queued": Series("poolserve_left_queued_total", "counter", _REQUEST,
                          "Requests whose caller left while they waited at the gate, before their admission reached "
                          "it (the gate's cancelled count is this plus `cancelled`)"),
    "router_requests": Series("poolserve_router_requests_total", "counter", ("pool", "tenant", "status"),
                              "Requests by final HTTP status (499: the client left first; 503 also for a stream "
                              "that broke after its 200; before a key is read, tenant `-` and pool `-`, or `unknown` "
                              "for an unknown prefix)"),
    "borrowed": Series("poolserve_borrowed_total", "counter", ("pool", "into", "tenant"),
                       "Requests sent to another pool's spare capacity"),
    "quota_rejections": Series("poolserve_quota_rejections_total", "counter", ("tenant", "limit"),
                               "Requests refused by a tenant quota (limit: requests, tokens, concurrency, too_large)"),
    "shed": Series("poolserve_shed_total", "counter", ("pool", "tenant", "reason"),
                   "Requests the router refused for a pool that could not take them "
                   "(queue_full, pool_busy, pool_unavailable)"),
    "tenant_tokens": Series("poolserve_tenant_tokens_total", "counter", ("tenant", "pool", "kind"),
                            "Tokens used per tenant (kind: prompt, completion)"),
    "quota_remaining_tokens": Series("poolserve_quota_remaining_tokens", "gauge", ("tenant",),
                                     "Tokens left in the tenant's minute (tenants with a token quota)"),
    "quota_remaining_requests": Series("poolserve_quota_remaining_requests", "gauge", ("tenant",),
                                       "Requests left in the tenant's minute (tenants with a request quota)"),
    "decisions": Series("poolserve_autoscale_decisions_total", "counter", ("pool", "action", "reason"),
                        "Autoscaler decisions: one per pool at each tick, holds included, and each up move made at a "
                        "report between ticks; none while a pool is pinned (action: up, down, hold, clamp; reason: "
                        "the decision's `code` in GET /admin/decisions)"),
    "target_seqs": Series("poolserve_autoscale_target_seqs", "gauge", ("pool",),
                          "Autoscaler target max_active_seqs (not set while a pool is pinned)"),
    "profile_stale": Series("poolserve_profile_stale", "gauge", ("pool",),
                            "1 while a pool runs on neither a configured range nor a profile measured on its set-up "
                            "(unknown, calibrating, fallback, strict, failed)"),
}
# which process sets which: a pool replica its gate's and engine's state and its requests', a
# router replica its tenants', the controller its decisions
POOL_STATE = ("queue_depth", "queued_tokens", "active_seqs", "inflight_tokens", "limit_seqs", "limit_tokens",
              "range_low", "range_high", "kv_usage", "engine_running", "engine_waiting")
POOL_REQUESTS = ("ttft", "tpot", "queue_wait", "admitted", "rejected", "cancelled", "left_queued")
ROUTER = ("router_requests", "borrowed", "quota_rejections", "shed", "tenant_tokens", "quota_remaining_tokens",
          "quota_remaining_requests")
CONTROLLER = ("decisions", "target_seqs", "profile_stale")


def _made(*keys: str) -> dict:
    """The series of `keys`, made with Ray's metrics API (imported here: importing this is free)."""
    from ray.util import metrics

    out = {}
    for key in keys:
        s = SERIES[key]
        if s.kind == "histogram":
            out[key] = metrics.Histogram(s.name, s.help, list(s.buckets), s.labels)
        else:
            out[key] = (metrics.Gauge if s.kind == "gauge" else metrics.Counter)(s.name, s.help, s.labels)
    return out


class PoolMetrics:
    """Per pool replica: gate and engine state, per-request latencies and outcomes."""

    def __init__(self, pool: str, replica: str) -> None:
        self._tags = {"pool": pool, "replica": replica}
        self._pool = pool

    @cached_property
    def _g(self):
        return _made(*POOL_STATE)

    @cached_property
    def _h(self):
        return _made(*POOL_REQUESTS)

    def state(self, gate: "GateStats", engine: "EngineStats", allowed: "SafeRange") -> None:
        g, t = self._g, self._tags
        for prio, n in gate.queued_by_class.items():
            g["queue_depth"].set(n, {**t, "priority": prio})
        for key, value in (
            ("queued_tokens", gate.queued_tokens), ("active_seqs", gate.active),
            ("inflight_tokens", gate.inflight_tokens), ("limit_seqs", gate.limits.max_active_seqs),
            ("limit_tokens", gate.limits.max_inflight_tokens), ("range_low", allowed.low),
            ("range_high", allowed.high), ("kv_usage", engine.kv_usage),
            ("engine_running", engine.running), ("engine_waiting", engine.waiting),
        ):
            g[key].set(value, t)

    def _rt(self, tenant: str, priority: "PriorityClass") -> dict[str, str]:
        return {"pool": self._pool, "tenant": tenant, "priority": priority.label}

    def admitted(self, tenant: str, priority: "PriorityClass", waited_s: float) -> None:
        tags = self._rt(tenant, priority)
        self._h["admitted"].inc(1, tags)
        self._h["queue_wait"].observe(waited_s, tags)

    def rejected(self, tenant: str, priority: "PriorityClass", reason: str) -> None:
        self._h["rejected"].inc(1, {**self._rt(tenant, priority), "reason": reason})

    def cancelled(self, tenant: str, priority: "PriorityClass") -> None:
        self._h["cancelled"].inc(1, self._rt(tenant, priority))

    def left_queued(self, tenant: str, priority: "PriorityClass") -> None:
        self._h["left_queued"].inc(1, self._rt(tenant, priority))

    def latency(self, tenant: str, priority: "PriorityClass", ttft_s: float | None, tpot_s: float | None) -> None:
        tags = self._rt(tenant, priority)
        if ttft_s is not None:
            self._h["ttft"].observe(ttft_s, tags)
        if tpot_s is not None:
            self._h["tpot"].observe(tpot_s, tags)


class RouterMetrics:
    """Per router replica: outcomes by status, borrowing, quota use and refusals."""

    @cached_property
    def _m(self):
        return _made(*ROUTER)

    def request(self, pool: str, tenant: str, status: int) -> None:
        self._m["router_requests"].inc(1, {"pool": pool, "tenant": tenant, "status": str(status)})

    def borrowed(self, pool: str, into: str, tenant: str) -> None:
        self._m["borrowed"].inc(1, {"pool": pool, "into": into, "tenant": tenant})

    def shed(self, pool: str, tenant: str, reason: str) -> None:
        self._m["shed"].inc(1, {"pool": pool, "tenant": tenant, "reason": reason})

    def quota_rejected(self, tenant: str, limit: str) -> None:
        self._m["quota_rejections"].inc(1, {"tenant": tenant, "limit": limit})

    def tokens(self, tenant: str, pool: str, prompt: int, completion: int) -> None:
        for kind, n in (("prompt", prompt), ("completion", completion)):
            if n > 0:  # Ray's Counter.inc refuses 0
                self._m["tenant_tokens"].inc(n, {"tenant": tenant, "pool": pool, "kind": kind})

    def remaining(self, tenant: str, requests: float, tokens: float) -> None:
        if requests != float("inf"):
            self._m["quota_remaining_requests"].set(requests, {"tenant": tenant})
        if tokens != float("inf"):
            self._m["quota_remaining_tokens"].set(tokens, {"tenant": tenant})


class ControllerMetrics:
    """The autoscaler: every decision by action and reason, and each pool's target."""

    @cached_property
    def _m(self):
        return _made(*CONTROLLER)

    def decision(self, pool: str, action: str, code: str, target: int) -> None:
        self._m["decisions"].inc(1, {"pool": pool, "action": action, "reason": code})
        self._m["target_seqs"].set(target, {"pool": pool})

    def calibration(self, pool: str, measured: bool) -> None:
        self._m["profile_stale"].set(0 if measured else 1, {"pool": pool})
