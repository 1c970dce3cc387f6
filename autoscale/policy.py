"""The autoscaler's decision: move a pool's batch limit along its ladder, or hold.

    decide(snapshot, state, config, now) -> (max_active_seqs, state, reason)

`reason` carries an action (up, down, hold, clamp), a short code for metrics, and words.

Pure: a snapshot of the pool's aggregated replica reports in, a target out. In order:

  1. fail-static: no fresh snapshot -> hold;
  2. a target outside the safe range is clamped into it at once (safety beats cooldown);
  3. pressure down: P99 engine TTFT or P99 TPOT above the SLO (with enough samples),
     KV usage above the watermark, or new preemptions; but a TTFT breach while a queue
     persists, or is deep (rule 4), holds instead (see below);
  4. pressure up: a queue of the pool's own work (or rejections) that persisted for
     `queue_persist_ticks` ticks, or at once a deep queue (`deep_queue`: the pool's own work
     running and waiting per replica at least twice the target), or waits at the gate that
     bring clients' first tokens near the SLO (P99 wait plus P99 engine TTFT above `headroom` x
     the TTFT SLO), while P99s are below `headroom` x SLO and KV below `headroom` x watermark;
     borrowed work is the lender's to send home, never a reason to grow;
  5. between the two (hysteresis band) -> hold;
  6. a move waits for `cooldown_s` after any change and `reversal_cooldown_s` after a
     change the other way; it never leaves the range. One exception: an up move on a deep
     queue right after an up move of the autoscaler's waits for nothing: the queue is counted
     at the limit that move set, and is still twice as deep as it, so the move was too small
     (a benchmark's load step met by 1 -> 2 waited a cooldown for its second move, its
     clients' first tokens near the SLO meanwhile, bench/notes.md). Once only: a backlog that
     keeps growing at every limit (an engine whose throughput no longer grows with its batch)
     would otherwise climb the ladder a step a report on P99s measured before each step. Down
     is one ladder step. Up is at least one step, and as far as the step that holds every
     sequence of the pool's own running and waiting (per replica) and room for its next
     burst (`sized`): a load step met one step per cooldown left a backlog that a
     benchmark's high phase never drained (bench/notes.md), where one move meets it at once;
  7. a move that rests on latency (up on headroom, down on an SLO breach) also waits
     `settle_s` after any change, the span the P99s are computed over, so that its
     evidence was measured at the current limit and not the one before. An up move while
     the queue is deep (rejections or not) waits its cooldown at most: the queue is counted at
     the current limit, and a first move too small for a load step could otherwise not be
     followed for a whole latency window. Its headroom check still reads P99s that may
     include requests from before the change: the safe range bounds the move, and a breach
     once measured steps down (a TPOT, KV or preemption breach comes before any up move);
  8. a second step down for the same SLO breach needs the first to have helped: the
     breaching P99 `min_step_gain` lower than when the limit last stepped down for it
     (the breach counts as over only after a whole `settle_s` measured under the SLO, or
     once the limit moves up: a breach at the new limit is a new one).
     If it did not, the batch is not what drives it (another engine on the same cores,
     a burst of long prompts) and the limit holds instead of ratcheting to the bottom.

The TTFT compared with the SLO is measured from admission to first token: time spent
in the gate's queue says "too little capacity", not "batch too large", and is the
reason to step up, not down. And while a queue persists, a smaller batch cannot lower the
TTFT a client sees: the engine's share shrinks a little, the queue's grows by what the
lost throughput no longer serves. A benchmark showed it (bench/notes.md): a TTFT breach
from CPU contention stepped the online pool to the bottom of its range under a standing
queue, and the TTFT its clients saw grew manyfold. So an engine TTFT breach steps down only
when none of the pool's own work waits; TPOT, KV and preemptions, which the batch does drive,
step down regardless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Sequence

from infra.stats import Cumulative, percentile
from pools.control import PoolSnapshot, ReplicaStats
from pools.types import SafeRange, deep_queue

if TYPE_CHECKING:
    from autoscale.config import AutoscaleConfig
    from pools.control import SloJson


@dataclass(frozen=True)
class Reason:
    action: str  # "up" | "down" | "hold" | "clamp"
    code: str  # e.g. "slo_ttft", "queue", "deep_queue", "cooldown", "stale"
    text: str

    def __str__(self) -> str:
        return f"{self.action}: {self.text}"


@dataclass(frozen=True)
class PolicyState:
    target: int
    last_change_at: float | None = None
    last_direction: int = 0
    follow_up: bool = False  # the last change was an up move sized on the queue, not yet followed up at once
    queue_ticks: int = 0
    seen_rejected: int | None = None
    seen_preemptions: int | None = None
    down_code: str = ""  # the SLO breach that last stepped the limit down, while it lasts
    down_level: float = 0.0  # its P99 (s) then
    down_clear_since: float | None = None  # since when that P99 has been measured back under its SLO

    def changed(self, now: float) -> "PolicyState":
        """A change of the limit not made by the autoscaler (a pin, a sweep): its cooldown and the
        latency window count from `now`, with no direction of the autoscaler's to reverse or follow."""
        return replace(self, last_change_at=now, last_direction=0, follow_up=False)

    def seen(self, events: "Events") -> "PolicyState":
        """Every rejection and preemption so far counted as seen (a pin's or a sweep's are their own)."""
        return replace(self, seen_rejected=events.refused, seen_preemptions=events.preempted)

    def restarted(self, now: float) -> "PolicyState":
        """The same target, with nothing kept of the latency measured before `now` (the pool's
        replicas moved to another set-up): the cooldown and the settling window count from now."""
        return PolicyState(target=self.target, last_change_at=now, seen_rejected=self.seen_rejected,
                           seen_preemptions=self.seen_preemptions)


@dataclass(frozen=True)
class PolicyConfig:
    safe_range: SafeRange
    ttft_slo_s: float
    tpot_slo_s: float
    cooldown_s: float
    reversal_cooldown_s: float
    kv_watermark: float
    headroom: float
    queue_persist_ticks: int
    min_samples: int
    settle_s: float = 0.0
    min_step_gain: float = 0.1

    @classmethod
    def of(cls, c: "AutoscaleConfig", allowed: SafeRange, slo: "SloJson") -> "PolicyConfig":
        """A pool's: the autoscaler's settings, its safe range and its SLO."""
        return cls(safe_range=allowed, ttft_slo_s=slo.ttft_p99_ms / 1e3, tpot_slo_s=slo.tpot_p99_ms / 1e3,
                   cooldown_s=c.cooldown_s, reversal_cooldown_s=c.reversal_cooldown_s, kv_watermark=c.kv_watermark,
                   headroom=c.headroom, queue_persist_ticks=c.queue_persist_ticks, min_samples=c.min_samples,
                   settle_s=c.latency_window_s, min_step_gain=c.min_step_gain)

    def breach(self, snap: PoolSnapshot, code: str) -> float | None:
        """The P99 (s) behind an SLO code, when it is above its SLO with enough samples."""
        if snap.samples < self.min_samples:
            return None
        value, slo = {"slo_ttft": (snap.ttft_p99_s, self.ttft_slo_s),
                      "slo_tpot": (snap.tpot_p99_s, self.tpot_slo_s)}.get(code, (None, 0.0))
        return value if value is not None and value > slo else None


@dataclass
class Events:
    """A pool's rejections and preemptions, counted as each replica's cumulative counters move
    (`Cumulative`: a replica back from a silence, or heard first by a controller that restarted,
    added its whole history at once, and the pool stepped down for preemptions minutes old)."""

    refusals: Cumulative = field(default_factory=Cumulative)
    preemptions: Cumulative = field(default_factory=Cumulative)

    @property
    def refused(self) -> int:
        return self.refusals.total

    @property
    def preempted(self) -> int:
        return self.preemptions.total

    def note(self, stats: ReplicaStats) -> None:
        self.refusals.read(stats.replica, stats.time, stats.gate.own_refused)
        self.preemptions.read(stats.replica, stats.time, stats.engine.preemptions)

    def forget(self, replicas: Sequence[str]) -> None:
        self.refusals.forget(replicas)
        self.preemptions.forget(replicas)


def aggregate(reports: Sequence[ReplicaStats], events: Events | None = None) -> PoolSnapshot:
    """A pool's fresh replica reports as one snapshot (P99s over all their latency samples); the
    rejection and preemption totals are `events`' where given, else the reports' sums."""
    if not reports:
        return PoolSnapshot(fresh=False)
    ttft = [x for s in reports for x in s.latency.ttft_s]
    tpot = [x for s in reports for x in s.latency.tpot_s]
    wait = [x for s in reports for x in s.latency.wait_s]
    running, waiting = own_load(reports)
    return PoolSnapshot(
        fresh=True, replicas=len(reports), queued=sum(s.gate.queued for s in reports),
        own_running=running, own_queued=waiting,
        queued_tokens=sum(s.gate.queued_tokens for s in reports), active=sum(s.gate.active for s in reports),
        rejected_total=events.refused if events is not None else sum(s.gate.own_refused for s in reports),
        preemptions_total=events.preempted if events is not None else sum(s.engine.preemptions for s in reports),
        kv_usage=max(s.engine.kv_usage for s in reports),
        ttft_p99_s=percentile(ttft, 99) if ttft else None, tpot_p99_s=percentile(tpot, 99) if tpot else None,
        samples=min(len(ttft), len(tpot)) if tpot else len(ttft),
        wait_p99_s=percentile(wait, 99) if wait else None, wait_samples=len(wait))


def _forget_breach(snap: PoolSnapshot, state: PolicyState, cfg: PolicyConfig, now: float) -> PolicyState:
    """The breach behind the last step down is over once its P99 has been measured under the
    SLO for a whole latency window (`settle_s`). Too few samples to tell is not an end: at a
    low limit few requests finish, and forgetting then let a TPOT hovering around its SLO
    ratchet the online pool down step after step in a benchmark, each a fresh "first" one."""
    if snap.samples < cfg.min_samples:
        return state
    if cfg.breach(snap, state.down_code) is not None:
        return replace(state, down_clear_since=None)
    since = state.down_clear_since if state.down_clear_since is not None else now
    if now - since >= cfg.settle_s:
        return replace(state, down_code="", down_level=0.0, down_clear_since=None)
    return replace(state, down_clear_since=since)


def _step(steps: tuple[int, ...], current: int, direction: int) -> int:
    """The next ladder step from `current` in `direction` (current need not be a step)."""
    if direction > 0:
        return next((s for s in steps if s > current), current)
    return next((s for s in reversed(steps) if s < current), current)


def demand(snap: PoolSnapshot) -> int:
    """Sequences per replica the pool's own work would run if nothing waited: running plus
    queued. Borrowed work is the lender's to send home when its own returns, not a load to
    size the batch for: counted, a lender's limit grew, burst room and all, for another pool's
    backlog, and its own clients met the wider batch when they came back."""
    return -(-(snap.own_running + snap.own_queued) // max(1, snap.replicas))


def sized(load: int) -> int:
    """The limit per replica an up move sizes for, with `load` sequences running and waiting per
    replica: the load and room for its next burst, a rule of thumb borrowed from square-root
    staffing (were `load` the offered load of a queue with that many servers, load + 2√load
    of them would leave a request a few percent chance to wait; it is one reading, backlog
    included). Sized to the load alone, a benchmark's load step stopped a step short and
    queued at its next burst (bench/notes.md). The safe range bounds the batch; the limit then
    stays until an SLO breach steps it down."""
    return load + math.ceil(2 * math.sqrt(load))


def own_load(reports: Sequence[ReplicaStats]) -> tuple[int, int]:
    """The pool's own sequences running and requests waiting, over `reports` (`GateStats.own_load`)."""
    loads = [s.gate.own_load for s in reports]
    return sum(r for r, _ in loads), sum(w for _, w in loads)


def _up_to(steps: tuple[int, ...], current: int, wanted: int) -> int:
    """The next step up, or further: the smallest step that holds `wanted` (the top at most)."""
    holds = next((s for s in steps if s >= wanted), steps[-1])
    return max(_step(steps, current, +1), holds)


def _pressure(snap: PoolSnapshot, cfg: PolicyConfig, target: int, new_rejects: int, new_preempts: int,
              queue_ticks: int, deep: bool) -> tuple[int, str, str]:
    ttft, tpot = snap.ttft_p99_s, snap.tpot_p99_s
    queue_persists = queue_ticks >= cfg.queue_persist_ticks or deep
    ttft_breach = cfg.breach(snap, "slo_ttft") is not None
    if ttft_breach and not queue_persists:
        return -1, "slo_ttft", f"P99 TTFT {ttft * 1e3:.0f} ms above SLO {cfg.ttft_slo_s * 1e3:.0f} ms"
    if cfg.breach(snap, "slo_tpot") is not None:
        return -1, "slo_tpot", f"P99 TPOT {tpot * 1e3:.1f} ms above SLO {cfg.tpot_slo_s * 1e3:.1f} ms"
    if snap.kv_usage > cfg.kv_watermark:
        return -1, "kv", f"KV usage {snap.kv_usage:.0%} above watermark {cfg.kv_watermark:.0%}"
    if new_preempts > 0:
        return -1, "preemption", f"{new_preempts} preemptions"
    if ttft_breach:
        return 0, "slo_ttft_queued", (f"P99 TTFT {ttft * 1e3:.0f} ms above SLO {cfg.ttft_slo_s * 1e3:.0f} ms "
                                      f"with a queue of {snap.own_queued} for {queue_ticks} ticks: "
                                      "a smaller batch would lengthen the wait")
    slow_wait = _waits_near_the_slo(snap, cfg)
    if not (queue_persists or new_rejects > 0 or slow_wait):
        return 0, "idle", "no persistent queue"
    headroom_ok = (
        (ttft is None or ttft <= cfg.headroom * cfg.ttft_slo_s)
        and (tpot is None or tpot <= cfg.headroom * cfg.tpot_slo_s)
        and snap.kv_usage <= cfg.headroom * cfg.kv_watermark
    )
    if new_rejects:
        code, pull = "rejections", f"{new_rejects} rejections"
    elif deep:
        code, pull = "deep_queue", (f"{snap.own_queued} of the pool's own requests waiting beside {snap.own_running} "
                                    f"running on {snap.replicas} replica(s): twice a batch of {target} each or more")
    elif queue_persists:
        code, pull = "queue", f"a queue of {snap.own_queued} for {queue_ticks} ticks"
    else:
        code, pull = "wait", f"P99 wait at the gate {snap.wait_p99_s * 1e3:.0f} ms"
    if not headroom_ok:
        return 0, "band", f"{pull}, but latency is inside the hysteresis band"
    if code != "wait":
        return +1, code, f"{pull} with latency headroom"
    return +1, code, (f"{pull} and P99 engine TTFT {(ttft or 0.0) * 1e3:.0f} ms: clients' first tokens above "
                      f"{cfg.headroom:g}x the SLO {cfg.ttft_slo_s * 1e3:.0f} ms while the engine has headroom")


def _waits_near_the_slo(snap: PoolSnapshot, cfg: PolicyConfig) -> bool:
    """Requests wait at the gate long enough that, with the engine's own time, clients' first
    tokens come near the SLO: a queue that forms and drains between two ticks, which
    `queue_persist_ticks` never sees (a batch of one at one request a second did, in a benchmark)."""
    if snap.wait_p99_s is None or snap.wait_samples < cfg.min_samples:
        return False
    return snap.wait_p99_s + (snap.ttft_p99_s or 0.0) > cfg.headroom * cfg.ttft_slo_s


def decide(snap: PoolSnapshot, state: PolicyState, cfg: PolicyConfig, now: float,
           at_tick: bool = True) -> tuple[int, PolicyState, Reason]:
    """`at_tick` False: a decision between ticks (a deep queue at a report), which counts no tick."""
    steps = cfg.safe_range.steps
    if not snap.fresh:
        return state.target, state, Reason("hold", "stale", "stats missing or stale")
    if state.target < steps[0] or state.target > steps[-1]:
        clamped = min(max(state.target, steps[0]), steps[-1])
        moved = replace(state, target=clamped, last_change_at=now, follow_up=False,
                        last_direction=1 if clamped > state.target else -1)
        return clamped, moved, Reason("clamp", "range", f"{state.target} is outside the safe range "
                                                        f"[{steps[0]}, {steps[-1]}]")

    new_rejects = 0 if state.seen_rejected is None else max(0, snap.rejected_total - state.seen_rejected)
    new_preempts = 0 if state.seen_preemptions is None else max(0, snap.preemptions_total - state.seen_preemptions)
    queue_ticks = state.queue_ticks if not at_tick else state.queue_ticks + 1 if snap.own_queued > 0 else 0
    state = replace(state, queue_ticks=queue_ticks, seen_rejected=snap.rejected_total,
                    seen_preemptions=snap.preemptions_total)
    if state.down_code:
        state = _forget_breach(snap, state, cfg, now)

    deep = deep_queue(snap.own_running, snap.own_queued, snap.replicas, state.target)
    direction, code, why = _pressure(snap, cfg, state.target, new_rejects, new_preempts, queue_ticks, deep)
    if direction == 0:
        return state.target, state, Reason("hold", code, why)
    level = cfg.breach(snap, code) if direction < 0 else None
    load = demand(snap) if direction > 0 else 0
    wanted = sized(load)
    nxt = _up_to(steps, state.target, wanted) if direction > 0 else _step(steps, state.target, direction)
    if nxt == state.target:
        edge = "top" if direction > 0 else "bottom"
        return state.target, state, Reason("hold", "range_edge", f"at the {edge} of the safe range: {why}")
    quick = False  # a follow-up made inside the cooldown
    if state.last_change_at is not None:
        waited = now - state.last_change_at
        reversing = state.last_direction != 0 and direction != state.last_direction
        need = cfg.reversal_cooldown_s if reversing else cfg.cooldown_s
        if direction > 0 and deep and state.follow_up:  # still deep at the limit that move set: too small
            quick, need = waited < need, 0.0
        if waited < need:
            kind = "reversal_cooldown" if reversing else "cooldown"
            return state.target, state, Reason("hold", kind, f"{kind.replace('_', ' ')} ({need - waited:.0f}s left); "
                                                             f"wants {'up' if direction > 0 else 'down'}: {why}")
        if (direction > 0 and not deep or level is not None) and waited < cfg.settle_s:
            return state.target, state, Reason("hold", "settling", f"P99s still include requests from before the "
                                                                   f"last change ({cfg.settle_s - waited:.0f}s left); "
                                                                   f"wants {'up' if direction > 0 else 'down'}: {why}")
    if level is not None and state.down_code == code and level > state.down_level * (1 - cfg.min_step_gain):
        return state.target, state, Reason(
            "hold", "step_ineffective", f"{why}, but it was {state.down_level * 1e3:.0f} ms before the last step "
                                        f"down: a smaller batch does not lower it")
    moved = replace(state, target=nxt, last_change_at=now, last_direction=direction, queue_ticks=0,
                    follow_up=direction > 0 and not quick)
    if level is not None:
        moved = replace(moved, down_code=code, down_level=level, down_clear_since=None)
    elif direction > 0:  # a breach met at the new limit is a new one, not the step down's level measured below
        moved = replace(moved, down_code="", down_level=0.0, down_clear_since=None)
    if direction > 0 and nxt != _step(steps, state.target, +1):
        why += (f"; to {nxt}, which holds the {load} sequences of its own running and waiting per replica and "
                f"a burst ({wanted})" if nxt >= wanted else
                f"; to {nxt}, the top of the safe range ({load} sequences of its own running and waiting per "
                f"replica, {wanted} with a burst)")
    return nxt, moved, Reason("up" if direction > 0 else "down", code, why)
