"""The calibration sweep: step a pool's limit up a ladder, measure each step, pick the range.

The loop is here; how a limit is applied and how a step is measured are injected (the
`poolserve calibrate` command passes the admin API and the load generator), so the sweep
and the profile it builds need neither Ray nor HTTP.
"""

from __future__ import annotations

from typing import Callable, Sequence

from autoscale.knee import find_knee, latency_of
from autoscale.profile import (CudaGraphCheck, Fingerprint, KneeRule, LadderRow, Profile, SLOSpec, TrafficSpec)


def sweep(ladder: Sequence[int], apply_limit: Callable[[int], None], measure: Callable[[int], LadderRow],
          progress: Callable[[str], None] = print) -> list[LadderRow]:
    rows = []
    for i, seqs in enumerate(ladder, 1):
        progress(f"[{i}/{len(ladder)}] max_active_seqs={seqs}: applying limit, warming up, measuring ...")
        apply_limit(seqs)
        row = measure(seqs)
        rows.append(row)
        progress(f"[{i}/{len(ladder)}] max_active_seqs={seqs}: {row.output_tok_per_s:.0f} output tok/s, "
                 f"P99 TTFT {row.ttft_ms.p99:.0f} ms, P99 TPOT {row.tpot_ms.p99:.1f} ms, "
                 f"KV {row.kv_usage_max:.0%}, {row.requests} requests in {row.duration_s:.0f}s"
                 f"{'' if row.steady else ' (time cap: not steady)'}")
    return rows


def cudagraph_check(ladder: Sequence[int], captured: Sequence[int]) -> CudaGraphCheck:
    """Which ladder points miss the engine's captured CUDA-graph batch sizes: those pad to a
    larger graph or fall back to eager mode, so their figures do not carry over."""
    if not captured:
        return CudaGraphCheck(note="the engine captured no CUDA graphs (CPU, or enforce_eager): nothing to check")
    missed = tuple(s for s in ladder if s not in set(captured))
    note = ("every ladder point is a captured batch size" if not missed else
            f"ladder points {list(missed)} miss the captured sizes: they pad or run eager")
    return CudaGraphCheck(captured=tuple(sorted(captured)), missed=missed, note=note)


def build_profile(pool: str, rows: Sequence[LadderRow], fingerprint: Fingerprint, slo: SLOSpec,
                  traffic: TrafficSpec, rule: KneeRule, captured: Sequence[int], created_at: str) -> Profile:
    verdict = find_knee(rows, slo, rule)
    return Profile(pool=pool, created_at=created_at, fingerprint=fingerprint, slo=slo, traffic=traffic, rule=rule,
                   rows=tuple(rows), knee=verdict.knee, range=(verdict.low, verdict.high),
                   feasible=verdict.feasible, decided_by=verdict.decided_by, reason=verdict.reason,
                   cudagraph=cudagraph_check([r.max_active_seqs for r in rows], captured))


def markdown_table(profile: Profile) -> str:
    low, high = profile.range
    head = ("| max_active_seqs | req/s | input tok/s | output tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) "
            "| KV max | preempt | errors | in range |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
    lines = [head]
    for r in profile.rows:
        mark = "knee" if r.max_active_seqs == profile.knee else ("yes" if low <= r.max_active_seqs <= high else "")
        lines.append(f"| {r.max_active_seqs} | {r.req_per_s:.2f} | {r.input_tok_per_s:.0f} | {r.output_tok_per_s:.0f} "
                     f"| {r.ttft_ms.p50:.0f} / {r.ttft_ms.p99:.0f} | {r.tpot_ms.p50:.1f} / {r.tpot_ms.p99:.1f} "
                     f"| {r.kv_usage_max:.0%} | {r.preemptions} | {r.errors} | {mark} |")
    return "\n".join(lines) + f"\n\nSafe range [{low}, {high}]: {profile.reason}.\n"


def plot(profile: Profile, path: str, title: str | None = None) -> None:
    """Output tok/s against the ladder's P99 latency (TTFT, or end to end for whole responses),
    one point per step, the knee marked, the range shaded, the TTFT SLO drawn where it applies."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = profile.rows
    x, name = latency_of(rows)
    y = [r.output_tok_per_s for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    low, high = profile.range
    inside = [a for a, r in zip(x, rows) if low <= r.max_active_seqs <= high]
    if inside:
        ax.axvspan(min(inside) * 0.95, max(inside) * 1.05, color="tab:green", alpha=0.15,
                   label=f"safe range [{low}, {high}]")
    ax.plot(x, y, "o-", color="tab:blue")
    for a, b, r in zip(x, y, rows):
        ax.annotate(str(r.max_active_seqs), (a, b), textcoords="offset points", xytext=(5, 5))
    if profile.knee is not None:
        k = next(i for i, r in enumerate(rows) if r.max_active_seqs == profile.knee)
        ax.plot([x[k]], [y[k]], "X", color="tab:red", markersize=12, label=f"knee ({profile.knee})")
    if name == "P99 TTFT" and profile.slo.ttft_p99_ms < max(x) * 3:
        ax.axvline(profile.slo.ttft_p99_ms, color="tab:red", linestyle=":", label="TTFT SLO")
    ax.set_xscale("log")
    ax.set_xlabel(f"{name} (ms, log)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title or f"{profile.pool}: throughput vs tail latency by max_active_seqs", fontsize=10)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
