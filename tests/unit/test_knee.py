"""The knee finder, as a table of ladders."""

from __future__ import annotations

import pytest

from autoscale.calibrate import build_profile, cudagraph_check, markdown_table, sweep
from autoscale.knee import find_knee
from autoscale.profile import (Fingerprint, KneeRule, LadderRow, LengthStats, Percentiles, SLOSpec, TrafficSpec,
                               dump_profile, load_profile)

SLO = SLOSpec(ttft_p99_ms=1000, tpot_p99_ms=100)
RULE = KneeRule()


def row(seqs, tok_s, ttft_p99, tpot_p99=20.0, kv=0.1, errors=0, requests=200, steady=True, offered=None,
        e2e_p99=3.0) -> LadderRow:
    return LadderRow(max_active_seqs=seqs, requests=requests, duration_s=30, steady=steady, req_per_s=requests / 30,
                     input_tok_per_s=tok_s * 4, output_tok_per_s=tok_s, goodput_req_per_s=requests / 30,
                     ttft_ms=Percentiles(p50=ttft_p99 / 2, p95=ttft_p99 * 0.9, p99=ttft_p99),
                     tpot_ms=Percentiles(p50=tpot_p99 / 2, p95=tpot_p99 * 0.9, p99=tpot_p99),
                     e2e_ms=Percentiles(p50=e2e_p99 / 2, p95=e2e_p99 * 0.9, p99=e2e_p99), kv_usage_max=kv,
                     preemptions=0, errors=errors, rejections=0, offered_req_per_s=offered)


def ladder(*points) -> list[LadderRow]:
    return [row(*p) for p in points]


def whole(*points, output_tokens: int = 128) -> list[LadderRow]:
    """A closed loop of whole responses (no TTFT): by Little's law each step's end-to-end
    latency is its concurrency over its request rate."""
    return [row(n, tok, 0.0, e2e_p99=1e3 * n * output_tokens / tok) for n, tok in points]


def responses(*points, output_tokens: int = 128) -> list[LadderRow]:
    """Whole responses of `output_tokens` each (no TTFT, no TPOT): (seqs, output tok/s, P99 ms)."""
    return [row(n, tok, 0.0, 0.0, requests=round(30 * tok / output_tokens), e2e_p99=e2e) for n, tok, e2e in points]


CASES = [
    # (name, rows, knee, range, feasible, decided by, fragment of the reason)
    ("clean knee",  # +3% throughput for +50% P99 at 32: knee at 32, range up to 16
     ladder((4, 1000, 500), (8, 1900, 550), (16, 3400, 600), (32, 3500, 900), (64, 3520, 2500)),
     32, (4, 16), True, "knee", "knee at 32"),
    ("noisy plateau",  # small ups and downs of throughput while the tail climbs
     ladder((1, 300, 300), (2, 580, 320), (4, 1100, 350), (8, 1130, 560), (16, 1110, 700), (32, 1150, 950)),
     8, (1, 4), True, "knee", "knee at 8"),
    ("tenth more throughput for a multiplied tail",  # gain 10% >= the 10% floor, but growth 200% > 5 x gain
     ladder((4, 1000, 200), (8, 1800, 240), (16, 1980, 720)),
     16, (4, 8), True, "knee", "knee at 16"),
    ("growth far below the SLO still counts",  # +150% tail for +26% throughput is saturating, SLO or not
     ladder((1, 300, 60), (2, 560, 100), (4, 700, 250), (8, 800, 400)),
     4, (1, 2), True, "knee", "knee at 4"),
    ("a dip in one step's throughput is not a knee when the curve climbs again",  # a chat sweep on a 2-core box
     ladder((1, 203, 42), (2, 300, 90), (4, 562, 108), (8, 584, 165), (16, 821, 289), (32, 948, 684)),
     32, (1, 16), True, "knee", "knee at 32"),
    ("a knee whose next step gains but multiplies the tail again is no dip",  # 2 -> 8: +40% for 33x
     ladder((1, 100, 50), (2, 200, 60), (4, 220, 400), (8, 280, 900)),
     4, (1, 2), True, "knee", "knee at 4"),
    ("a knee followed by a step that climbs, with a tail multiplied again, is still the knee",  # 16 -> 64 past it too
     ladder((8, 1000, 50), (16, 1800, 88), (32, 2000, 900), (64, 2500, 1000)),
     32, (8, 16), True, "knee", "knee at 32"),
    ("tail moves below the noise floor",  # +60% of a 20 ms tail is 12 ms: noise
     ladder((1, 300, 20), (2, 310, 32), (4, 600, 40)),
     None, (1, 4), True, "ladder", "no knee within the ladder"),
    ("SLO hit before the knee",
     ladder((4, 1000, 300), (8, 1900, 400), (16, 3400, 1200), (32, 3500, 2000)),
     32, (4, 8), True, "hard limit", "16 is unsafe: P99 TTFT 1200 ms > SLO 1000 ms"),
    ("TPOT SLO hit",
     ladder((4, 1000, 100, 40), (8, 1900, 110, 80), (16, 3400, 130, 140)),
     None, (4, 8), True, "hard limit", "P99 TPOT 140.0 ms > SLO 100.0 ms"),
    ("KV watermark hit first",
     ladder((4, 1000, 500, 20, 0.3), (8, 1900, 520, 20, 0.6), (16, 3400, 540, 20, 0.95), (32, 3500, 900, 20, 1.0)),
     32, (4, 8), True, "hard limit", "KV usage 95% > watermark 90%"),
    ("errors",
     ladder((4, 1000, 100), (8, 1900, 110, 20, 0.1, 50)),
     None, (4, 4), True, "hard limit", "error rate"),
    ("an unsteady step is not evidence",
     ladder((1, 300, 50), (2, 580, 55), (4, 1100, 60, 20, 0.1, 0, 200, False), (8, 2100, 70)),
     None, (1, 2), True, "unsteady", "4 never measured steady"),
    ("an open loop falls behind what it is offered",  # 4 achieves 3 of 4 req/s offered, the tail still flat
     ladder((1, 300, 50, 20, 0.1, 0, 30, True, 1.0), (2, 580, 55, 20, 0.1, 0, 60, True, 2.0),
            (4, 1100, 60, 20, 0.1, 0, 90, True, 4.0), (8, 2100, 70, 20, 0.1, 0, 120, True, 8.0)),
     None, (1, 2), True, "saturation", "saturated at 4: achieved 3.00 req/s of 4.00 offered"),
    ("a flat curve ends at its plateau",  # the tail creeps, throughput stops growing: no knee, a plateau
     ladder((1, 100, 100), (2, 190, 110), (4, 260, 125), (8, 270, 140), (16, 272, 155), (32, 273, 170)),
     None, (1, 4), True, "plateau", "plateau from 4"),
    ("a closed loop of whole responses ends at its plateau, not at a knee",  # 8 -> 16: +14% tok/s, e2e +76%
     whole((1, 300), (2, 550), (4, 900), (8, 1100), (16, 1250), (32, 1320), (64, 1340)),
     None, (1, 32), True, "plateau", "no knee rule for a closed loop of whole responses"),
    ("an open loop of whole responses keeps its knee",  # the tail of a queue, not concurrency over throughput
     ladder((4, 1000, 0, 20, 0.1, 0, 200, True, 6.5, 500), (8, 1900, 0, 20, 0.1, 0, 200, True, 6.5, 550),
            (16, 1980, 0, 20, 0.1, 0, 200, True, 6.5, 1650)),
     16, (4, 8), True, "knee", "P99 latency grew +200%"),
    ("whole responses slower than the SLO lets a streamed one of their length",  # 1000 + 127 x 100 ms
     responses((4, 1000, 4000), (8, 1900, 8000), (16, 3400, 16000), (32, 3500, 30000)),
     None, (4, 8), True, "hard limit", "16 is unsafe: P99 latency 16000 ms > 1369"),
    ("a streamed step that answered nothing keeps the ladder streamed, and its knee",  # 64 timed out whole
     ladder((8, 1000, 100), (16, 1800, 176), (32, 2000, 900), (64, 0, 0, 20, 0.1, 0, 0)),
     32, (8, 16), True, "knee", "P99 TTFT grew"),
    ("an open loop saturated at its lowest step keeps that step alone",  # 2 req/s offered, 1 achieved
     ladder((1, 300, 50, 20, 0.1, 0, 30, True, 2.0), (2, 580, 55, 20, 0.1, 0, 60, True, 4.0)),
     None, (1, 1), True, "saturation", "saturated at 1"),
    ("no knee within the ladder",
     ladder((1, 300, 50), (2, 580, 55), (4, 1100, 60), (8, 2100, 70)),
     None, (1, 8), True, "ladder", "no knee within the ladder"),
    ("a single step",
     ladder((8, 2000, 100)),
     None, (8, 8), True, "ladder", "safe range [8, 8]"),
    ("even the lowest step is unsafe",
     ladder((1, 300, 1500), (2, 500, 2500)),
     None, (1, 1), False, "hard limit", "even the lowest step (1) is not usable"),
]


@pytest.mark.parametrize("name, rows, knee, rng, feasible, decided_by, reason", CASES, ids=[c[0] for c in CASES])
def test_knee_table(name, rows, knee, rng, feasible, decided_by, reason):
    r = find_knee(rows, SLO, RULE)
    assert (r.knee, (r.low, r.high), r.feasible, r.decided_by) == (knee, rng, feasible, decided_by), r.reason
    assert reason in r.reason


def test_headroom_steps_lower_the_top():
    rows = ladder((4, 1000, 500), (8, 1900, 550), (16, 3400, 600), (32, 3500, 900))
    r = find_knee(rows, SLO, KneeRule(headroom_steps=1))
    assert (r.low, r.high) == (4, 8) and "headroom" in r.reason and r.decided_by == "headroom"


def test_ladder_must_ascend():
    with pytest.raises(ValueError, match="ascend"):
        find_knee(ladder((8, 1, 1), (4, 2, 2)), SLO, RULE)


@pytest.mark.parametrize("captured, missed, fragment", [
    ((), (), "no CUDA graphs"),
    ((1, 2, 4, 8, 16, 24, 32), (), "every ladder point"),
    ((1, 2, 4, 8, 16), (32, 64), "[32, 64] miss"),
])
def test_cudagraph_check(captured, missed, fragment):
    c = cudagraph_check([4, 8, 16, 32, 64] if missed else [4, 8, 16], captured)
    assert c.missed == missed and fragment in c.note


FP = Fingerprint(model="m", dtype="float32", quantization="none", max_model_len=2048, hardware="cpu:x", vllm_version="0.29.0",
                 max_num_seqs=32, max_num_batched_tokens=2048, kv_cache_gb=1.0)
TRAFFIC = TrafficSpec(source="t", scale=0.24, seed=0, prompt_tokens=LengthStats(p50=1, p90=2, p99=3),
                      output_tokens=LengthStats(p50=1, p90=2, p99=3), total_tokens=LengthStats(p50=2, p90=4, p99=6))


def test_sweep_profile_roundtrip(tmp_path):
    figures = {4: (1000, 500), 8: (1900, 550), 16: (3400, 600), 32: (3500, 900)}
    applied = []
    rows = sweep(list(figures), applied.append, lambda s: row(s, *figures[s]), progress=lambda _: None)
    assert applied == [4, 8, 16, 32]
    profile = build_profile("online-chat", rows, FP, SLO, TRAFFIC, RULE, [], "2026-11-30T00:00:00")
    assert profile.range == (4, 16) and profile.knee == 32 and profile.ladder == (4, 8, 16, 32)
    assert profile.decided_by == "knee"
    dump_profile(profile, tmp_path / "p.yaml")
    assert load_profile(tmp_path / "p.yaml") == profile
    table = markdown_table(profile)
    assert "| 32 |" in table and "knee" in table and "Safe range [4, 16]" in table


def test_fingerprint_differences_name_the_field():
    other = FP.model_copy(update={"hardware": "gpu:H100", "vllm_version": "0.32.0"})
    diffs = FP.differences(other)
    assert diffs == ["hardware: profile 'cpu:x' vs running 'gpu:H100'",
                     "vllm_version: profile '0.29.0' vs running '0.32.0'"]


@pytest.mark.parametrize("where, value", [
    (("rows", 0, "ttft_ms", "p99"), float("nan")), (("rows", 1, "kv_usage_max"), float("nan")),
    (("slo", "tpot_p99_ms"), float("nan")), (("rule", "max_error_rate"), float("nan")),
    (("slo", "ttft_p99_ms"), float("inf")), (("rows", 0, "ttft_ms", "p99"), float("-inf")),
], ids=["ttft", "kv", "slo", "rule", "slo inf", "ttft -inf"])
def test_a_profile_with_nan_is_refused_by_name(tmp_path, where, value):
    """NaN compares false with every bound: a hand-edited row with `.nan` for its P99 passed
    every SLO and watermark check, and its step joined the safe range (as every step passes an
    SLO of `.inf`)."""
    import yaml
    from pydantic import ValidationError

    rows = sweep([4, 8], lambda _: None, lambda s: row(s, 100 * s, 500), progress=lambda _: None)
    dump_profile(build_profile("online-chat", rows, FP, SLO, TRAFFIC, RULE, [], "2026-12-04"), tmp_path / "p.yaml")
    data = yaml.safe_load((tmp_path / "p.yaml").read_text())
    node = data
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ValidationError, match="is not a number a range can be judged by") as e:
        load_profile(tmp_path / "p.yaml")
    assert ".".join(map(str, where)) in str(e.value)


def test_a_step_that_answered_nothing_is_no_evidence_of_safety():
    """A step whose window answered no request has P99s of zero, which passed every SLO: it
    joined the range, the top of it (a long-output step's window can end before any answer;
    `poolserve calibrate` takes its steadiness from the engine's token rate). Found by a review."""
    r = find_knee([row(1, 100, 100), row(2, 0, 0, requests=0), row(4, 400, 120)], SLO, RULE)
    assert (r.low, r.high) == (1, 1) and "no request answered" in r.reason


@pytest.mark.parametrize("edit", [{"range": [3, 8]}, {"range": [8, 4]}, {"range": [4, 64]},
                                  {"rows": "reversed"}], ids=["low off the ladder", "high first", "past the ladder",
                                                              "rows not rising"])
def test_a_profile_whose_range_is_off_its_ladder_is_refused(tmp_path, edit):
    """A hand-edited profile whose range is not two steps of its own ladder read back: the
    pool's first report then raised building its range, and the pool ran on the fallback
    range for good, its profile shown as in force and never measured again (found by a review)."""
    import yaml
    from pydantic import ValidationError

    rows = sweep([4, 8], lambda _: None, lambda s: row(s, 100 * s, 500), progress=lambda _: None)
    dump_profile(build_profile("online-chat", rows, FP, SLO, TRAFFIC, RULE, [], "2026-12-04"), tmp_path / "p.yaml")
    data = yaml.safe_load((tmp_path / "p.yaml").read_text())
    data.update({k: data[k][::-1] if v == "reversed" else v for k, v in edit.items()})
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ValidationError, match="ladder"):
        load_profile(tmp_path / "p.yaml")
