"""Find the throughput/latency knee of a calibration ladder and choose the safe range.

Pure: rows in, verdict out. The rule (see `KneeRule`):

  1. Hard limits first. A step that breaks the SLO (P99 TTFT or P99 TPOT), runs the KV
     cache above the watermark, or errs more than allowed is unsafe, and so is every
     step above it.
  2. Then the knee. Walking up the ladder, step i is where saturation begins if its
     P99 TTFT grew by more than `max_p99_growth_pct` over step i-1 while either its
     output-throughput gain was below `min_gain_pct`, or the growth exceeded
     `max_growth_per_gain` times the gain. Growth counts only once step i's P99 TTFT is
     above `significant_slo_fraction` of the SLO: far below the SLO, a relative jump of
     a small tail is noise or harmless, and a chat pool capped there queues at the gate.
  3. The safe range is [lowest step, last step before the knee and below any unsafe
     step], lowered by `headroom_steps`. With no knee in the ladder the range is the
     whole ladder (up to the first unsafe step) and the reason says so.

If even the lowest step is unsafe, the profile is marked infeasible and the range is
that lowest step alone: the pool can run, but not within its SLO on this hardware.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from autoscale.profile import KneeRule, LadderRow, SLOSpec


@dataclass(frozen=True)
class KneeResult:
    knee: int | None
    low: int
    high: int
    feasible: bool
    reason: str


def _violations(row: LadderRow, slo: SLOSpec, rule: KneeRule) -> list[str]:
    out = []
    if row.ttft_ms.p99 > slo.ttft_p99_ms:
        out.append(f"P99 TTFT {row.ttft_ms.p99:.0f} ms > SLO {slo.ttft_p99_ms:.0f} ms")
    if row.tpot_ms.p99 > slo.tpot_p99_ms:
        out.append(f"P99 TPOT {row.tpot_ms.p99:.1f} ms > SLO {slo.tpot_p99_ms:.1f} ms")
    if row.kv_usage_max > rule.kv_watermark:
        out.append(f"KV usage {row.kv_usage_max:.0%} > watermark {rule.kv_watermark:.0%}")
    total = row.requests + row.errors
    if total and row.errors / total > rule.max_error_rate:
        out.append(f"error rate {row.errors / total:.1%} > {rule.max_error_rate:.1%}")
    return out


def _pct(new: float, old: float) -> float:
    return (new - old) / old * 100.0 if old > 0 else (0.0 if new <= 0 else float("inf"))


def _knee_index(rows: Sequence[LadderRow], slo: SLOSpec, rule: KneeRule) -> tuple[int | None, str]:
    for i in range(1, len(rows)):
        gain = _pct(rows[i].output_tok_per_s, rows[i - 1].output_tok_per_s)
        growth = _pct(rows[i].ttft_ms.p99, rows[i - 1].ttft_ms.p99)
        if growth <= rule.max_p99_growth_pct or rows[i].ttft_ms.p99 <= rule.significant_slo_fraction * slo.ttft_p99_ms:
            continue
        if gain < rule.min_gain_pct or growth > rule.max_growth_per_gain * gain:
            return i, (f"from {rows[i - 1].max_active_seqs} to {rows[i].max_active_seqs} sequences output "
                       f"throughput changed {gain:+.0f}% while P99 TTFT grew {growth:+.0f}%")
    return None, ""


def find_knee(rows: Sequence[LadderRow], slo: SLOSpec, rule: KneeRule) -> KneeResult:
    if not rows:
        raise ValueError("no ladder rows: run at least one step")
    steps = [r.max_active_seqs for r in rows]
    if steps != sorted(set(steps)):
        raise ValueError(f"ladder steps must ascend without repeats, got {steps}")

    unsafe = next(((i, v) for i, r in enumerate(rows) if (v := _violations(r, slo, rule))), None)
    if unsafe is not None and unsafe[0] == 0:
        return KneeResult(None, steps[0], steps[0], False,
                          f"even the lowest step ({steps[0]}) is unsafe: {'; '.join(unsafe[1])}")

    knee_i, knee_why = _knee_index(rows, slo, rule)
    top, reasons = len(rows) - 1, []
    if knee_i is not None:
        top = knee_i - 1
        reasons.append(f"knee at {steps[knee_i]}: {knee_why}")
    if unsafe is not None and unsafe[0] - 1 < top:
        top = unsafe[0] - 1
        reasons.append(f"{steps[unsafe[0]]} is unsafe: {'; '.join(unsafe[1])}")
    elif unsafe is not None:
        reasons.append(f"{steps[unsafe[0]]} is also unsafe: {'; '.join(unsafe[1])}")
    if knee_i is None:
        reasons.insert(0, "no knee within the ladder" + (
            "; the range is the whole ladder" if unsafe is None else ""))
    if len(rows) == 1:
        reasons = [f"a single step ({steps[0]}): no knee can be found; the range is that step"]
    if rule.headroom_steps:
        lowered = max(0, top - rule.headroom_steps)
        reasons.append(f"lowered {top - lowered} step(s) for headroom")
        top = lowered
    reasons.append(f"safe range [{steps[0]}, {steps[top]}]")
    knee = steps[knee_i] if knee_i is not None else None
    return KneeResult(knee, steps[0], steps[top], True, "; ".join(reasons))
