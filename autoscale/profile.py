"""Calibration profiles: what a sweep measured on one pool, and the safe range it chose.

A profile is only valid for the set-up it was measured on. Its fingerprint
(`pools.config.Fingerprint`) names the model, dtype / quantisation, context length,
hardware, vLLM version, engine ceilings and the rest of the engine's set-up (the model's
shape, block size, eager mode, chunked prefill, cores bound); a running pool whose own fingerprint
differs treats the profile as stale.
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml
from pydantic import Field, field_validator, model_validator

from infra.stats import percentile
from pools.config import Fingerprint, Frozen

__all__ = ["Fingerprint", "Profile", "load_profile", "dump_profile"]


class Measured(Frozen):
    """Numbers a sweep measured or a rule is judged by, finite: NaN compares false with every
    bound, so a row with NaN for its P99 passed any SLO and watermark, as an SLO of inf would."""

    # before a bound's check, which NaN fails with a message of its own; any value that reads as
    # a number (a string, a Decimal, bytes, a numpy float)
    @field_validator("*", mode="before")
    @classmethod
    def _finite(cls, value):
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):  # not a number, or an int too large for a float
            return value
        if not math.isfinite(number):
            raise ValueError(f"{value} is not a number a range can be judged by: measure the pool again "
                             "(poolserve calibrate) or give the value")
        return value


class Percentiles(Measured):
    p50: float
    p95: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> "Percentiles":
        """Of `values` (0 where there are none: a step where nothing finished)."""
        if not values:
            return cls(p50=0.0, p95=0.0, p99=0.0)
        return cls(p50=percentile(values, 50), p95=percentile(values, 95), p99=percentile(values, 99))


class LengthStats(Frozen):
    p50: int
    p90: int
    p99: int


class TrafficSpec(Frozen):
    source: str
    scale: float
    seed: int
    prompt_tokens: LengthStats
    output_tokens: LengthStats
    total_tokens: LengthStats


class LengthBand(Measured):
    """Responses of `min_tokens` tokens up to a quarter octave longer (BAND): how many, and
    their end to end. Held to what the SLO allows `min_tokens`, the band's longest are held to
    at most a fifth less than theirs (by octaves, a pool at 60% of its TPOT SLO failed)."""

    min_tokens: int
    responses: int
    e2e_ms: Percentiles
    e2e_max_ms: float

    def over(self, allowed_ms: float) -> int:
        """At most how many of its responses took longer than `allowed_ms`, from its percentiles:
        a percentile q within it (interpolated, as `percentile` does) puts every response up to
        position floor(q (n - 1)) within it too. (A share of q's complement counted fewer in a
        small band: one late in each of 20 bands of 50 read as 10 of 1,000.)"""
        if self.e2e_max_ms <= allowed_ms:
            return 0
        e, n = self.e2e_ms, self.responses
        q = next((q for q, at in ((99, e.p99), (95, e.p95), (50, e.p50)) if at <= allowed_ms), None)
        return n if q is None else n - 1 - math.floor(q * (n - 1) / 100)


class LadderRow(Measured):
    max_active_seqs: int
    requests: int  # answered in the measured window (errors and rejections are counted apart)
    duration_s: float
    steady: bool  # the window measured was steady (else the step hit its time cap: not evidence)
    req_per_s: float
    input_tok_per_s: float
    output_tok_per_s: float
    goodput_req_per_s: float
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    e2e_ms: Percentiles
    kv_usage_max: float
    preemptions: int
    errors: int
    rejections: int
    offered_req_per_s: float | None = None  # open-loop ladders: the rate sent (achieved is req_per_s)
    output_tokens_mean: float | None = None  # per completed response (else output tok/s over req/s)
    # whole responses by length band, each held to what the SLO allows its shortest (one figure
    # for all, the mean's allowance failed a pool that kept its SLO for every token where lengths
    # vary, and the longest's passed slow short ones)
    e2e_by_length: tuple[LengthBand, ...] = ()


class KneeRule(Measured):
    """How a sweep's rows become a safe range (`autoscale.knee`). Hard limits: an SLO broken, KV
    usage above `kv_watermark`, or errors above `max_error_rate`. Saturation, judged from the
    curve's shape whatever the SLO: the first step whose P99 TTFT grows by at least
    `max_p99_growth_pct` (and by at least `min_p99_delta_ms`: smaller moves are noise) while its
    output throughput gains less than `min_gain_pct`, or more than `max_growth_per_gain` times
    its gain (unless the move from the step before it to the step after it is not: a dip, not a
    knee); on an open-loop ladder also the first step that achieves less than
    `saturation_ratio` of the load offered. Plateau: nothing above the smallest step within
    `plateau_fraction` of the best throughput among the steps the other rules leave."""

    min_gain_pct: float = Field(10.0, ge=0)
    max_p99_growth_pct: float = Field(40.0, gt=0)
    max_growth_per_gain: float = Field(5.0, gt=0)
    min_p99_delta_ms: float = Field(20.0, ge=0)
    saturation_ratio: float = Field(0.95, gt=0, le=1)
    plateau_fraction: float = Field(0.95, gt=0, le=1)
    kv_watermark: float = Field(0.9, gt=0, le=1)  # a fraction: 90 (a percentage) turned the KV limit off
    max_error_rate: float = Field(0.01, ge=0, lt=1)
    headroom_steps: int = Field(0, ge=0)


BAND = 2 ** 0.25  # a length band's longest over its shortest, at most


def _band(tokens: int) -> int:
    """The shortest length of the band `tokens` falls in: bands start at 1 and each next starts
    where the one before ends, at most BAND times its start (1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 18...)."""
    start = 1
    while (after := max(start + 1, math.floor(start * BAND) + 1)) <= tokens:
        start = after
    return start


def response_lengths(done: list[tuple[int, float]]) -> dict:
    """A step's completed responses, (output tokens, seconds end to end) each, as its row keeps
    them: their mean length, and their end to end by length band."""
    if not done:
        return {"output_tokens_mean": None}
    bands: dict[int, list[float]] = {}
    for tokens, e2e in done:
        bands.setdefault(_band(tokens), []).append(e2e * 1e3)
    return {"output_tokens_mean": sum(t for t, _ in done) / len(done),
            "e2e_by_length": tuple(LengthBand(min_tokens=k, responses=len(v), e2e_max_ms=max(v),
                                              e2e_ms=Percentiles.of(v)) for k, v in sorted(bands.items()))}


class SLOSpec(Measured):
    ttft_p99_ms: float
    tpot_p99_ms: float


class CudaGraphCheck(Frozen):
    captured: tuple[int, ...] = ()
    missed: tuple[int, ...] = ()
    note: str = ""


class Profile(Frozen):
    version: int = 1
    pool: str
    created_at: str
    fingerprint: Fingerprint
    slo: SLOSpec
    traffic: TrafficSpec
    rule: KneeRule
    rows: tuple[LadderRow, ...]
    knee: int | None
    range: tuple[int, int]
    feasible: bool = True
    decided_by: str = ""  # the rule that set the top of the range (autoscale.knee)
    reason: str
    # Some steps never measured steady, for the first time on this set-up: a busy host rather
    # than the set-up may have caused it, so the next start measures again (once).
    provisional: bool = False
    cudagraph: CudaGraphCheck = CudaGraphCheck()

    @model_validator(mode="after")
    def _range_on_its_ladder(self) -> "Profile":
        """A hand-edited profile whose range is not two steps of its own rising ladder: read
        back, the pool's first report raised building its range, and it ran on the fallback."""
        ladder, (low, high) = self.ladder, self.range
        if not ladder or ladder[0] < 1 or any(a >= b for a, b in zip(ladder, ladder[1:])):
            raise ValueError(f"rows: the ladder {list(ladder)} must rise from 1 or more")
        if not (low <= high and low in ladder and high in ladder):
            raise ValueError(f"range {[low, high]} must be two steps of its ladder {list(ladder)}, the lower first")
        return self

    @property
    def ladder(self) -> tuple[int, ...]:
        return tuple(r.max_active_seqs for r in self.rows)

    @property
    def unsteady(self) -> tuple[int, ...]:
        return tuple(r.max_active_seqs for r in self.rows if not r.steady)


def load_profile(path: str | Path) -> Profile:
    return Profile.model_validate(yaml.safe_load(Path(path).read_text()))


def dump_profile(profile: Profile, path: str | Path) -> None:
    data = profile.model_dump(mode="json")
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False, width=100))
