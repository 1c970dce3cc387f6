"""The one module that exports poolserve's metrics (Ray's metrics API -> Prometheus).

Everything else collects typed stats (GateStats, EngineStats, decisions); the classes
here turn them into `poolserve:*` series beside vLLM's `vllm:*` and Serve's
`ray_serve_*` on Ray's metrics endpoint (Ray prefixes every name with `ray_`).
Each process creates only the group it needs, lazily, so importing this is free.
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: infra imports no poolserve package
    from pools.types import EngineStats, GateStats, PriorityClass, SafeRange

LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120]
TPOT_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5]

NAMES = {
    "queue_depth": "poolserve_queue_depth",
    "queued_tokens": "poolserve_queued_tokens",
    "active_seqs": "poolserve_active_seqs",
    "inflight_tokens": "poolserve_inflight_tokens",
    "limit_seqs": "poolserve_limit_max_active_seqs",
    "limit_tokens": "poolserve_limit_max_inflight_tokens",
    "range_low": "poolserve_safe_range_low",
    "range_high": "poolserve_safe_range_high",
    "profile_stale": "poolserve_profile_stale",
    "kv_usage": "poolserve_kv_usage",
    "engine_running": "poolserve_engine_running",
    "engine_waiting": "poolserve_engine_waiting",
    "ttft": "poolserve_ttft_seconds",
    "tpot": "poolserve_tpot_seconds",
    "queue_wait": "poolserve_queue_wait_seconds",
    "admitted": "poolserve_admitted_total",
    "rejected": "poolserve_rejected_total",
    "cancelled": "poolserve_cancelled_total",
    "router_requests": "poolserve_router_requests_total",
    "borrowed": "poolserve_borrowed_total",
    "quota_rejections": "poolserve_quota_rejections_total",
    "shed": "poolserve_shed_total",
    "tenant_tokens": "poolserve_tenant_tokens_total",
    "quota_remaining_tokens": "poolserve_quota_remaining_tokens",
    "quota_remaining_requests": "poolserve_quota_remaining_requests",
    "decisions": "poolserve_autoscale_decisions_total",
    "target_seqs": "poolserve_autoscale_target_seqs",
}


def _metrics():
    from ray.util import metrics

    return metrics


class PoolMetrics:
    """Per pool replica: gate and engine state, per-request latencies and outcomes."""

    def __init__(self, pool: str, replica: str) -> None:
        self._tags = {"pool": pool, "replica": replica}
        self._pool = pool

    @cached_property
    def _g(self):
        m = _metrics()
        rk = ("pool", "replica")
        return {
            "queue_depth": m.Gauge(NAMES["queue_depth"], "Requests waiting at the gate", rk + ("priority",)),
            **{k: m.Gauge(NAMES[k], d, rk) for k, d in (
                ("queued_tokens", "Tokens waiting at the gate (prompt + max_tokens)"),
                ("active_seqs", "Requests holding a slot"),
                ("inflight_tokens", "Tokens of the requests holding a slot"),
                ("limit_seqs", "Runtime limit on active sequences"),
                ("limit_tokens", "Runtime limit on in-flight tokens"),
                ("range_low", "Bottom of the safe range"),
                ("range_high", "Top of the safe range"),
                ("kv_usage", "vLLM KV cache usage (0-1)"),
                ("engine_running", "vLLM running requests"),
                ("engine_waiting", "vLLM waiting requests"),
            )},
        }

    @cached_property
    def _h(self):
        m = _metrics()
        k = ("pool", "tenant", "priority")
        return {
            "ttft": m.Histogram(NAMES["ttft"], "Arrival at the replica to first token", LATENCY_BUCKETS_S, k),
            "tpot": m.Histogram(NAMES["tpot"], "Time per output token after the first", TPOT_BUCKETS_S, k),
            "queue_wait": m.Histogram(NAMES["queue_wait"], "Time waiting at the gate", LATENCY_BUCKETS_S, k),
            "admitted": m.Counter(NAMES["admitted"], "Requests admitted by the gate", k),
            "rejected": m.Counter(NAMES["rejected"], "Requests the gate rejected", k + ("reason",)),
            "cancelled": m.Counter(NAMES["cancelled"], "Requests cancelled (client gone)", k),
        }

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
        m = _metrics()
        return {
            "router_requests": m.Counter(NAMES["router_requests"], "Requests by final status",
                                         ("pool", "tenant", "status")),
            "borrowed": m.Counter(NAMES["borrowed"], "Requests sent to another pool's spare capacity",
                                  ("pool", "into", "tenant")),
            "quota_rejections": m.Counter(NAMES["quota_rejections"], "Requests refused by a tenant quota",
                                          ("tenant", "limit")),
            "shed": m.Counter(NAMES["shed"], "Requests the router refused for a pool that could not take them "
                                             "(queue_full, pool_busy, pool_unavailable)", ("pool", "tenant", "reason")),
            "tenant_tokens": m.Counter(NAMES["tenant_tokens"], "Tokens used per tenant",
                                       ("tenant", "pool", "kind")),
            "quota_remaining_tokens": m.Gauge(NAMES["quota_remaining_tokens"],
                                              "Tokens left in the tenant's minute", ("tenant",)),
            "quota_remaining_requests": m.Gauge(NAMES["quota_remaining_requests"],
                                                "Requests left in the tenant's minute", ("tenant",)),
        }

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
        m = _metrics()
        return {
            "decisions": m.Counter(NAMES["decisions"], "Autoscaler decisions",
                                   ("pool", "action", "reason")),
            "target_seqs": m.Gauge(NAMES["target_seqs"], "Autoscaler target max_active_seqs", ("pool",)),
            "profile_stale": m.Gauge(NAMES["profile_stale"], "1 while a pool runs without a profile measured on its "
                                                             "set-up (calibrating, fallback, strict, failed)", ("pool",)),
        }

    def decision(self, pool: str, action: str, code: str, target: int) -> None:
        self._m["decisions"].inc(1, {"pool": pool, "action": action, "reason": code})
        self._m["target_seqs"].set(target, {"pool": pool})

    def calibration(self, pool: str, measured: bool) -> None:
        self._m["profile_stale"].set(0 if measured else 1, {"pool": pool})
