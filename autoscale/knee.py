"""Find the throughput/latency knee of a calibration ladder and choose the safe range.

Pure: rows in, verdict out. Every rule below proposes a highest usable step; the safe range
is [the lowest step, the lowest of those], and the verdict names the rule that set it.

  hard limits  A step that breaks the SLO (P99 TTFT or P99 TPOT, where measured; for whole
               responses, more than 1% of them later than the TTFT SLO plus the TPOT SLO for each
               further token of their length band's shortest), runs the KV cache above the watermark,
               preempts, or errs more than allowed is unsafe, and so is every step above it.
  unsteady     A step whose measurement never became steady (it hit its time cap) is not
               evidence: the range stops below it.
  knee         Saturation, judged from the curve's shape and not from the SLO: the first step
               whose P99 latency grows by at least `max_p99_growth_pct` (and `min_p99_delta_ms`)
               while output throughput gains less than `min_gain_pct`, or more than
               `max_growth_per_gain` times its gain. A step that still adds a tenth more
               throughput while multiplying the tail is past the knee, however loose the SLO.
               A step is not the knee when the move from the step before it to the step after
               it is not past the knee: that was a dip in one step's measurement.
               Latency is P99 TTFT, or P99 end-to-end for an open-loop ladder of whole
               responses. A closed loop of whole responses has no knee rule: its end-to-end
               latency is its concurrency over its throughput (Little's law), so its growth
               restates the throughput gain and would cut a batch pool at a doubling that still
               pays; the plateau rule ends its range.
  saturation   On an open-loop ladder (rows with an offered rate): the first step that
               achieves less than `saturation_ratio` of what was offered.
  plateau      The smallest step within `plateau_fraction` of the best throughput among the
               steps the rules above leave: above it a larger batch buys (almost) nothing.
  headroom     `headroom_steps` below all of that, if asked for.

If even the lowest step is unsafe or unsteady, the profile is marked infeasible and the range
is that lowest step alone: the pool can run, but not within its SLO on this hardware. An open
loop saturated at its lowest step keeps that step alone too.
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
    decided_by: str  # "hard limit" | "unsteady" | "knee" | "saturation" | "plateau" | "headroom" | "ladder"


def violations(row: LadderRow, slo: SLOSpec, rule: KneeRule) -> list[str]:
    if row.requests == 0 == row.errors:  # its P99s are zeros, which every SLO passed: no evidence it is safe
        return ["no request answered in its window"]
    out = []
    if row.ttft_ms.p99 > slo.ttft_p99_ms:
        out.append(f"P99 TTFT {row.ttft_ms.p99:.0f} ms > SLO {slo.ttft_p99_ms:.0f} ms")
    if row.tpot_ms.p99 > slo.tpot_p99_ms:
        out.append(f"P99 TPOT {row.tpot_ms.p99:.1f} ms > SLO {slo.tpot_p99_ms:.1f} ms")
    if row.ttft_ms.p99 <= 0 < row.e2e_ms.p99 and row.req_per_s > 0:  # whole responses: no first token to time
        allowed = lambda tokens: slo.ttft_p99_ms + max(tokens - 1, 0) * slo.tpot_p99_ms  # noqa: E731
        if row.e2e_by_length:  # P99 over all: more than 1% of the responses late for their length
            late = sum(b.over(allowed(b.min_tokens)) for b in row.e2e_by_length)
            answered = sum(b.responses for b in row.e2e_by_length)
            if late > 0.01 * answered:
                out.append(f"up to {late:.0f} of {answered} responses took longer than the SLO allows a streamed "
                           "response of their length")
        else:  # a row of before: the mean's length
            mean = row.output_tokens_mean or row.output_tok_per_s / row.req_per_s
            if row.e2e_ms.p99 > allowed(mean):
                out.append(f"P99 latency {row.e2e_ms.p99:.0f} ms > {allowed(mean):.0f} ms, what the SLO allows a "
                           f"streamed response of {mean:.0f} tokens")
    if row.kv_usage_max > rule.kv_watermark:
        out.append(f"KV usage {row.kv_usage_max:.0%} > watermark {rule.kv_watermark:.0%}")
    if row.preemptions > 0:  # the KV cache ran out (a sampled KV usage misses its peaks); the policy steps down
        out.append(f"{row.preemptions} preemptions")
    total = row.requests + row.errors
    if total and row.errors / total > rule.max_error_rate:
        out.append(f"error rate {row.errors / total:.1%} > {rule.max_error_rate:.1%}")
    return out


def _pct(new: float, old: float) -> float:
    return (new - old) / old * 100.0 if old > 0 else (0.0 if new <= 0 else float("inf"))


def latency_of(rows: Sequence[LadderRow]) -> tuple[list[float], str]:
    """P99 TTFT where every step that answered anything measured it (a step that answered
    nothing has no TTFT, and a streamed ladder stays one), else P99 end to end (a ladder
    of whole responses)."""
    if all(r.ttft_ms.p99 > 0 for r in rows if r.requests):
        return [r.ttft_ms.p99 for r in rows], "P99 TTFT"
    return [r.e2e_ms.p99 for r in rows], "P99 latency"


def _first_unsafe(rows: Sequence[LadderRow], slo: SLOSpec, rule: KneeRule) -> tuple[int, str] | None:
    for i, r in enumerate(rows):
        if v := violations(r, slo, rule):
            return i, f"{r.max_active_seqs} is unsafe: {'; '.join(v)}"
    return None


def _first_unsteady(rows: Sequence[LadderRow]) -> tuple[int, str] | None:
    return next(((i, f"{r.max_active_seqs} never measured steady (time cap)") for i, r in enumerate(rows)
                 if not r.steady), None)


def _past_knee(rows: Sequence[LadderRow], latency: list[float], a: int, b: int, rule: KneeRule
               ) -> tuple[float, float] | None:
    """(throughput gain %, P99 growth %) from step a to step b, if that move is past the knee."""
    gain = _pct(rows[b].output_tok_per_s, rows[a].output_tok_per_s)
    growth = _pct(latency[b], latency[a])
    if growth < rule.max_p99_growth_pct or latency[b] - latency[a] < rule.min_p99_delta_ms:
        return None
    return (gain, growth) if gain < rule.min_gain_pct or growth > rule.max_growth_per_gain * gain else None


def _knee(rows: Sequence[LadderRow], rule: KneeRule) -> tuple[int, str] | None:
    """The first step past the knee. A step is a dip in the measurement, not the knee, when the
    move from the step before it to the step after it (one that answered, steadily) is not past
    the knee: a saturated curve does not climb back to where the step before would have led."""
    latency, name = latency_of(rows)
    for i in range(1, len(rows)):
        if (past := _past_knee(rows, latency, i - 1, i, rule)) is None:
            continue
        after = rows[i + 1] if i + 1 < len(rows) else None
        if after is not None and after.requests and after.steady and _past_knee(rows, latency, i - 1, i + 1,
                                                                                 rule) is None:
            continue
        gain, growth = past
        return i, (f"knee at {rows[i].max_active_seqs}: from {rows[i - 1].max_active_seqs} to "
                   f"{rows[i].max_active_seqs} sequences output throughput changed {gain:+.0f}% while {name} "
                   f"grew {growth:+.0f}%")
    return None


def _saturation(rows: Sequence[LadderRow], rule: KneeRule) -> tuple[int, str] | None:
    for i, r in enumerate(rows):
        if r.offered_req_per_s and r.req_per_s < rule.saturation_ratio * r.offered_req_per_s:
            return i, (f"saturated at {r.max_active_seqs}: achieved {r.req_per_s:.2f} req/s of "
                       f"{r.offered_req_per_s:.2f} offered")
    return None


def _plateau(rows: Sequence[LadderRow], top: int, rule: KneeRule) -> tuple[int, str] | None:
    """The smallest step within the plateau fraction of the best throughput up to `top`."""
    best = max(r.output_tok_per_s for r in rows[:top + 1])
    i = next(i for i, r in enumerate(rows[:top + 1]) if r.output_tok_per_s >= rule.plateau_fraction * best)
    if i >= top:
        return None
    return i, (f"plateau from {rows[i].max_active_seqs}: {rows[i].output_tok_per_s:.0f} output tok/s is within "
               f"{rule.plateau_fraction:.0%} of the best, {best:.0f}")


def find_knee(rows: Sequence[LadderRow], slo: SLOSpec, rule: KneeRule) -> KneeResult:
    if not rows:
        raise ValueError("no ladder rows: run at least one step")
    steps = [r.max_active_seqs for r in rows]
    if steps != sorted(set(steps)):
        raise ValueError(f"ladder steps must ascend without repeats, got {steps}")

    top, decided_by, reasons = len(rows) - 1, "ladder", []

    def bound(found: tuple[int, str] | None, name: str, inclusive: bool = False) -> None:
        nonlocal top, decided_by
        if found is None:
            return
        i, why = found
        reasons.append(why)
        limit = max(0, i if inclusive else i - 1)  # a rule tripped at the lowest step leaves that step alone
        if limit < top:
            top, decided_by = limit, name

    for found, name in ((_first_unsafe(rows, slo, rule), "hard limit"), (_first_unsteady(rows), "unsteady")):
        if found is not None and found[0] == 0:
            return KneeResult(None, steps[0], steps[0], False, f"even the lowest step ({steps[0]}) is not usable: "
                                                               f"{found[1]}; safe range [{steps[0]}, {steps[0]}], set "
                                                               f"by the {name} rule", name)
    bound(_first_unsafe(rows, slo, rule), "hard limit")
    bound(_first_unsteady(rows), "unsteady")
    little = latency_of(rows)[1] == "P99 latency" and not any(r.offered_req_per_s for r in rows)
    knee = None if little else _knee(rows, rule)
    bound(knee, "knee")
    bound(_saturation(rows, rule), "saturation")
    bound(_plateau(rows, top, rule), "plateau", inclusive=True)
    if little:
        reasons.insert(0, "no knee rule for a closed loop of whole responses (its latency is concurrency over "
                          "throughput)")
    elif knee is None:
        reasons.insert(0, "no knee within the ladder")
    if rule.headroom_steps and top > 0:
        lowered = max(0, top - rule.headroom_steps)
        reasons.append(f"lowered {top - lowered} step(s) for headroom")
        top, decided_by = lowered, "headroom"
    reasons.append(f"safe range [{steps[0]}, {steps[top]}], set by the {decided_by} rule")
    return KneeResult(steps[knee[0]] if knee else None, steps[0], steps[top], True, "; ".join(reasons), decided_by)
