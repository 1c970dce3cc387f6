"""The control plane's contract: what replicas report, what the controller answers, and what
operators, the router, the CLI, the benchmarks and the tests read back.

Reports and directives cross a Ray handle every report interval, and when a replica's queue
turns deep (dataclasses: cheap to pickle). Status, describe and operator results cross HTTP as
JSON (pydantic models: the admin API writes them with `model_dump(mode="json")`, clients read
them back with `model_validate`), so no reader parses a dict by string keys.

Epochs. Every change of a pool's limits (an autoscaler move, an operator's pin or unpin)
takes the next epoch of that pool; a directive carries it and each replica echoes the
epoch it applied in its next report. "The limit is applied" is then a fact: every replica
reports `applied_epoch >= epoch`, never a guess from timestamps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import Field

from pools.config import Frozen
from pools.types import BatchLimits, EngineStats, GateStats, LatencySample, SafeRange


@dataclass(frozen=True)
class ReplicaStats:
    """A pool replica's report to the controller, every `report_interval_s` and when its queue turns deep."""

    pool: str
    replica: str
    time: float
    gate: GateStats
    engine: EngineStats
    latency: LatencySample
    safe_range: SafeRange
    applied_epoch: int = 0  # the epoch of the last directive this replica applied
    fingerprint: dict[str, str | int | float] = field(default_factory=dict)  # empty until the engine runs


@dataclass(frozen=True)
class LimitsDirective:
    """The controller's reply to a report: the limits a replica should apply now."""

    limits: BatchLimits
    allowed: SafeRange
    epoch: int = 0
    reason: str = ""


@dataclass(frozen=True)
class PoolView:
    """What the router needs to know about a pool: capacity and load across replicas."""

    pool: str
    replicas: int
    capacity: int
    active: int
    queued: int
    fresh: bool
    calibrating: bool = False  # pinned for a sweep: no borrowing into or out of it
    lending: bool = True  # an operator may stop other pools borrowing this one
    own_requests: int = 0  # of its own traffic (not borrowed), running or waiting, across replicas
    borrowed_requests: int = 0  # borrowed from other pools, running, across replicas
    own_quiet_s: float = float("inf")  # since any replica last had its own traffic, as of the view


# -- read by people and programs over HTTP ------------------------------------------------

class LimitsJson(Frozen):
    max_active_seqs: int
    max_inflight_tokens: int


class EngineJson(Frozen):
    running: int
    waiting: int
    kv_usage: float
    preemptions: int
    generated_tokens: int


class ReplicaStatus(Frozen):
    replica: str
    reported_at: float = Field(description="The replica's wall clock when it made the report (s since the epoch).")
    applied_epoch: int
    active: int = Field(description="Sequences holding a slot (a request of n choices counts n).")
    active_requests: int
    peak_active: int
    queued_by_class: dict[str, int]
    queued_tokens: int
    inflight_tokens: int
    limits: LimitsJson
    admitted: int
    rejected: int
    evicted: int
    own_refused: int  # of those rejected and evicted, the pool's own requests: what the autoscaler counts
    cancelled: int
    completed: int
    engine: EngineJson

    @property
    def queued(self) -> int:
        return sum(self.queued_by_class.values())

    @classmethod
    def of(cls, s: ReplicaStats) -> "ReplicaStatus":
        g, e = s.gate, s.engine
        return cls(
            replica=s.replica, reported_at=s.time, applied_epoch=s.applied_epoch, active=g.active,
            active_requests=g.active_requests, peak_active=g.peak_active, queued_by_class=dict(g.queued_by_class),
            queued_tokens=g.queued_tokens, inflight_tokens=g.inflight_tokens,
            limits=LimitsJson(max_active_seqs=g.limits.max_active_seqs,
                              max_inflight_tokens=g.limits.max_inflight_tokens),
            admitted=g.admitted, rejected=g.rejected, evicted=g.evicted, own_refused=g.own_refused,
            cancelled=g.cancelled, completed=g.completed,
            engine=EngineJson(running=e.running, waiting=e.waiting, kv_usage=e.kv_usage, preemptions=e.preemptions,
                              generated_tokens=e.generated_tokens))


class SloJson(Frozen):
    ttft_p99_ms: float = Field(gt=0, allow_inf_nan=False)
    tpot_p99_ms: float = Field(gt=0, allow_inf_nan=False)


class PoolSnapshot(Frozen):
    """A pool's replicas, aggregated: what the autoscaler decides on. `fresh` is False when
    reports are missing or old."""

    fresh: bool
    replicas: int = 0
    queued: int = 0
    queued_tokens: int = 0
    active: int = 0
    own_running: int = 0  # the pool's own sequences, at most each replica's limit (`GateStats.own_load`)
    own_queued: int = 0
    rejected_total: int = 0  # the pool's own requests rejected or evicted (`GateStats.own_refused`), and
    preemptions_total: int = 0  # the engines' preemptions: since this controller began (`autoscale.policy.Events`)
    kv_usage: float = 0.0
    ttft_p99_s: float | None = None
    tpot_p99_s: float | None = None
    samples: int = 0
    wait_p99_s: float | None = None  # in the gates' queues, the pools' own requests
    wait_samples: int = 0


class CalibrationJson(Frozen):
    """Where a pool's safe range comes from."""

    state: str = Field(description="manual (a configured range) | profile (measured on this set-up) | calibrating "
                                   "(a sweep runs in the background; meanwhile the fallback range, or a provisional "
                                   "profile's) | fallback | "
                                   "strict (no profile for this set-up) | failed (the sweep failed; fallback) | "
                                   "unknown (no replica has reported yet)")
    source: str = ""
    detail: str = ""

    @property
    def measured(self) -> bool:
        return self.state in ("manual", "profile")


class PoolStatus(Frozen):
    """One pool as the controller sees it (`GET /admin/pools`)."""

    pool: str
    target_max_active_seqs: int | None
    epoch: int = Field(description="The epoch of the pool's current limits; replicas echo it once applied.")
    pinned: int | None
    calibrating: bool
    safe_range: tuple[int, int]
    ladder: tuple[int, ...]
    serving_range: tuple[int, int] = Field(
        (0, 0), description="The range the pool serves in outside a calibration sweep's pins: its profile's, or "
                            "its fallback while it has none (`safe_range` is the sweep's while one runs).")
    slo: SloJson
    calibration: CalibrationJson
    lending: bool
    snapshot: PoolSnapshot
    replicas: tuple[ReplicaStatus, ...]

    def applied(self, epoch: int) -> bool:
        """Every replica that reports has applied `epoch` (or a later one)."""
        return bool(self.replicas) and all(r.applied_epoch >= epoch for r in self.replicas)


class DecisionJson(Frozen):
    time: float
    pool: str
    old: int
    new: int
    action: str
    code: str
    reason: str
    applied: bool


class NiceJson(Frozen):
    replica: int | None
    engines: tuple[int | None, ...]


class Describe(Frozen):
    """A replica's engine facts and fingerprint (`GET /admin/pools/{pool}/describe`)."""

    pool: str
    replica: str
    fingerprint: dict[str, str | int | float]
    kv_capacity_tokens: int | None
    block_size: int | None
    cudagraph_capture_sizes: tuple[int, ...]
    nice: NiceJson
    engine_cores: tuple[tuple[int, ...] | None, ...] = ()  # each engine process's cores, in `nice.engines`' order


class SloResult(Frozen):
    """An operator's new SLO for a pool, in force from the controller's next tick."""

    pool: str
    ttft_p99_ms: float
    tpot_p99_ms: float


class LendingResult(Frozen):
    """Whether a pool now lends its idle capacity to borrowing pools."""

    pool: str
    lending: bool


class PinResult(Frozen):
    """An operator's pin: applied at `epoch`, or refused with the reason."""

    pool: str
    pinned: int | None = None
    max_inflight_tokens: int | None = None
    allowed: tuple[int, int] | None = None
    epoch: int | None = None
    error: str | None = None
