"""Sweeps of known shape for the knee finder, each with the safe range it must give at each SLO.

Queueing curves whose knees follow from their formulas (worked out in docs/calibration.md),
and sweeps published by other projects with the operating point their authors chose.

    python -m tests.unit.knee_fixtures     # redraws docs/images/knee-<name>.png
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from autoscale.profile import LadderRow, Percentiles

SLOS_MS = (100, 1_000, 10_000, 60_000)


def row(step: int, tok_s: float, ttft_p99_ms: float, *, e2e_p99_ms: float = 0.0, tpot_p99_ms: float = 10.0,
        offered: float | None = None, achieved: float | None = None) -> LadderRow:
    def pct(p99: float) -> Percentiles:
        return Percentiles(p50=p99 / 3, p95=p99 * 0.8, p99=p99)
    return LadderRow(max_active_seqs=step, requests=300, duration_s=30, steady=True,
                     req_per_s=achieved if achieved is not None else 10.0, input_tok_per_s=tok_s,
                     output_tok_per_s=tok_s, goodput_req_per_s=10.0, ttft_ms=pct(ttft_p99_ms),
                     tpot_ms=pct(tpot_p99_ms), e2e_ms=pct(e2e_p99_ms), kv_usage_max=0.2, preemptions=0, errors=0,
                     rejections=0, offered_req_per_s=offered)


@dataclass(frozen=True)
class Fixture:
    name: str
    title: str
    source: str
    rows: tuple[LadderRow, ...]
    expected: dict[float, tuple[tuple[int, int], str]]  # TTFT SLO (ms) -> (range, deciding rule)
    tpot_slo_ms: float = 1_000.0
    note: str = ""
    answer: str = ""  # what the sweep's authors chose, for published sweeps
    extra: dict = field(default_factory=dict)


def mm1(mu: float) -> tuple[LadderRow, ...]:
    """An M/M/1 queue offered rho = 0.1 ... 0.9 of its service rate mu (req/s) as steps 1..9, then
    1.1 and 1.2 of it (steps 11, 12: it achieves only mu). P99 sojourn = ln(100) / (mu - lambda);
    100 output tokens per request."""
    rows = []
    for step in (*range(1, 10), 11, 12):
        offered = step / 10 * mu
        achieved = min(offered, mu)
        p99 = 1e3 * math.log(100) / (mu - offered) if offered < mu else 1e7  # unbounded: a long run's value
        rows.append(row(step, 100 * achieved, p99, offered=offered, achieved=achieved))
    return tuple(rows)


def batching(a_ms: float = 20.0, k_ms: float = 1.0) -> tuple[LadderRow, ...]:
    """A closed loop of b streams on an engine whose iteration takes a + k*b ms (a deterministic
    server, M/D/c-like): output tok/s = 1000 b / (a + k b), P99 TTFT = 3 iterations."""
    return tuple(row(b, 1000 * b / (a_ms + k_ms * b), 3 * (a_ms + k_ms * b), tpot_p99_ms=a_ms + k_ms * b)
                 for b in (1, 2, 4, 8, 16, 32, 64, 128))


FIXTURES = (
    Fixture("mm1-seconds", "M/M/1, service rate 10 req/s", "formula",
            mm1(10.0), {100: ((1, 1), "hard limit"), 1_000: ((1, 5), "hard limit"), 10_000: ((1, 8), "knee"),
                        60_000: ((1, 8), "knee")},
            note="rho 0.8 -> 0.9: +12.5% throughput for a doubled P99 (2.3 -> 4.6 s): past the knee at any SLO "
                 "above 4.6 s; at 100 ms even rho 0.1 (0.51 s) breaks the SLO"),
    Fixture("mm1-milliseconds", "M/M/1, service rate 200 req/s", "formula",
            mm1(200.0), {100: ((1, 7), "hard limit"), 1_000: ((1, 8), "knee"), 10_000: ((1, 8), "knee"),
                         60_000: ((1, 8), "knee")},
            note="the same shape on a faster server: the knee is still at rho 0.9 (115 -> 230 ms)"),
    Fixture("batching", "closed loop, iteration 20 + b ms", "formula",
            batching(), {100: ((1, 8), "hard limit"), 1_000: ((1, 64), "knee"), 10_000: ((1, 64), "knee"),
                         60_000: ((1, 64), "knee")},
            note="64 -> 128: +13.5% throughput for +76% P99 TTFT (more than 4 x the gain)"),
    Fixture("inferencebench-llama8b-h100", "InferenceBench concurrency sweep, Llama-3.1-8B on an H100",
            "https://yobitelcomm.github.io/bench/recipes/concurrency-sweep/",
            (row(1, 122.2, 14.95), row(4, 580.3, 32.18), row(16, 1384.2, 64.71), row(64, 1312.3, 464.7)),
            {100: ((1, 16), "hard limit"), 1_000: ((1, 16), "knee"), 10_000: ((1, 16), "knee"),
             60_000: ((1, 16), "knee")},
            answer="16: 'Throughput peaks around conc=16'; 64 'does blow ttft_p99 from 65 ms to 465 ms'"),
    Fixture("emmy-concurrency", "emmy PR #832, serving caps 4, 16 and 32",
            "https://github.com/cloudrift-ai/emmy/pull/832",
            (row(4, 40.8, 2_500), row(16, 133.8, 5_828), row(32, 235.5, 9_917)),
            {100: ((4, 4), "hard limit"), 1_000: ((4, 4), "hard limit"), 6_000: ((4, 16), "hard limit"),
             10_000: ((4, 32), "ladder"), 60_000: ((4, 32), "ladder")},
            answer="16 for chat (P99 TTFT 9.9 s at 32 against 5.8 s at 16); 'a batch or asynchronous workload "
                   "should prefer thirty-two'"),
    Fixture("vultr-mi325x-qwen3vl", "Vultr inference cookbook, Qwen3-VL-235B on MI325X (P99 end to end)",
            "https://docs.vultr.com/inference-cookbook/rocm/optimization/concurrency-tuning",
            tuple(row(c, t, 0.0, e2e_p99_ms=p * 1e3) for c, t, p in (
                (10, 1902, 9.24), (50, 6961, 12.50), (100, 11198, 15.46), (200, 11193, 15.46), (500, 11209, 15.44),
                (750, 11208, 15.44), (1000, 11218, 15.43))),
            {100: ((10, 100), "plateau"), 1_000: ((10, 100), "plateau"), 10_000: ((10, 100), "plateau"),
             60_000: ((10, 100), "plateau")},
            answer="saturation point ~100 concurrent; the tail stays flat above it, so only a plateau rule sees it"),
    Fixture("design-seed", "poolserve's source article: 32 -> 48 for +4% throughput and +40% P99 TTFT",
            "../shared/seeds/000_0776443341444c17.txt",
            (row(16, 620, 700), row(32, 1000, 1000), row(48, 1040, 1400)),
            {100: ((16, 16), "hard limit"), 1_000: ((16, 32), "hard limit"), 10_000: ((16, 32), "knee"),
             60_000: ((16, 32), "knee")},
            answer="32: 'Batch 32 -> 48 adds only 4% throughput but P99 TTFT +40%: usually not worth it'"),
    Fixture("loose-slo", "one step: +11% throughput for 17x the P99 TTFT (3 s) under a 10 s SLO", "issue 18",
            (row(8, 1000, 100), row(16, 1800, 176), row(32, 2000, 3_000)),
            {100: ((8, 8), "hard limit"), 1_000: ((8, 16), "hard limit"), 10_000: ((8, 16), "knee"),
             60_000: ((8, 16), "knee")},
            note="the rule this replaces counted P99 growth only above half the SLO, so it walked on to 32"),
)


def main() -> None:
    from pathlib import Path

    from autoscale.calibrate import build_profile, plot
    from autoscale.profile import Fingerprint, KneeRule, LengthStats, SLOSpec, TrafficSpec

    out = Path(__file__).resolve().parents[2] / "docs" / "images"
    fp = Fingerprint(model="fixture", dtype="-", quantization="none", max_model_len=0, hardware="-",
                     vllm_version="-", max_num_seqs=0, max_num_batched_tokens=0, kv_cache_gb=0)
    lengths = LengthStats(p50=0, p90=0, p99=0)
    traffic = TrafficSpec(source="fixture", scale=1, seed=0, prompt_tokens=lengths, output_tokens=lengths,
                          total_tokens=lengths)
    for f in FIXTURES:
        slo = max(f.expected)
        profile = build_profile(f.name, f.rows, fp, SLOSpec(ttft_p99_ms=slo, tpot_p99_ms=f.tpot_slo_ms), traffic,
                                KneeRule(), [], "fixture")
        plot(profile, str(out / f"knee-{f.name}.png"), title=f"{f.title}\nSLO {slo / 1e3:g} s: range "
                                                             f"{list(profile.range)}, set by the {profile.decided_by} rule")
        print(f"wrote docs/images/knee-{f.name}.png")


if __name__ == "__main__":
    main()
