"""Bootstrap intervals over runs and requests, and the verdicts the benchmarks draw from them."""

from __future__ import annotations

import json
import math
import random

import pytest

from bench import intervals, verdicts
from bench.intervals import Interval, verdict
from infra.loadgen import write_raw
from infra.results import Result


def _exp_runs(rng: random.Random, runs: int, n: int, scale: float = 1.0) -> list[list[float]]:
    return [[rng.expovariate(1 / scale) for _ in range(n)] for _ in range(runs)]


def test_the_interval_covers_the_true_mean_about_as_often_as_it_says():
    rng, hits, trials = random.Random(7), 0, 120
    for seed in range(trials):
        iv = intervals.interval(_exp_runs(rng, 3, 40), intervals.mean, seed=seed, draws=200)
        assert iv.lo <= iv.value <= iv.hi
        hits += iv.lo <= 1.0 <= iv.hi  # the exponential's mean
    assert 0.85 <= hits / trials <= 1.0


def test_drift_between_runs_widens_the_interval_beyond_the_pooled_requests_alone():
    rng = random.Random(3)
    runs = [[rng.gauss(mu, 0.1) for _ in range(100)] for mu in (1.0, 2.0, 3.0)]
    by_run = intervals.interval(runs, intervals.mean)
    pooled = intervals.interval([[x for r in runs for x in r]], intervals.mean)
    assert by_run.value == pytest.approx(pooled.value)
    assert (by_run.hi - by_run.lo) > 5 * (pooled.hi - pooled.lo)


def test_a_constant_sample_has_no_width_and_equal_sides_a_ratio_near_one():
    assert intervals.interval([[2.0] * 5, [2.0] * 3], intervals.p99) == Interval(2.0, 2.0, 2.0)
    rng = random.Random(1)
    iv = intervals.ratio(_exp_runs(rng, 3, 300), _exp_runs(rng, 3, 300), intervals.p50)
    assert iv.lo < 1.0 < iv.hi


def test_the_same_seed_gives_the_same_interval():
    runs = _exp_runs(random.Random(0), 3, 50)
    assert intervals.interval(runs, intervals.p99, seed=4) == intervals.interval(runs, intervals.p99, seed=4)


def test_an_empty_run_is_refused():
    with pytest.raises(ValueError, match="empty run"):
        intervals.interval([[1.0], []], intervals.mean)


@pytest.mark.parametrize("lo, hi, bound, better, expected", [
    (0.5, 0.9, 1.0, "lower", "met"),
    (0.5, 1.0, 1.0, "lower", "met"),
    (0.9, 1.1, 1.0, "lower", "inconclusive"),
    (1.01, 1.3, 1.0, "lower", "missed"),
    (0.96, 1.2, 0.95, "higher", "met"),
    (0.90, 1.2, 0.95, "higher", "inconclusive"),
    (0.5, 0.94, 0.95, "higher", "missed"),
])
def test_a_target_is_met_only_by_the_interval_s_far_end(lo, hi, bound, better, expected):
    assert verdict(Interval((lo + hi) / 2, lo, hi), bound, better) == expected


# -- verdicts from a run's raw data ------------------------------------------------------------------

def _online(ttft_s: float, rng: random.Random, n: int = 60) -> list[Result]:
    out = []
    for i in range(n):
        t = rng.uniform(0.5, 1.5) * ttft_s
        out.append(Result(start=float(i), status=200, ttft=t, e2e=t + 31 * 0.01, output_tokens=32, scheduled=float(i)))
    return out


def _run(tmp_path, ours_ttft: float, rounds: int = 2, busy_running: int = 32) -> dict:
    rng, flood = random.Random(0), []
    for i in range(2 * rounds):
        setup = ("poolserve", "stock-two-pools")[i % 2]
        write_raw(tmp_path / f"flood-{i:02d}-{setup}-online.jsonl.gz",
                  _online(ours_ttft if setup == "poolserve" else 0.2, rng))
        if setup == "poolserve":
            samples = [{"t": k, "offline-batch": [{"queued": 5, "running": busy_running, "limit": 32}],
                        "online-chat": [{"queued": 0, "running": 1, "limit": 16}]} for k in range(10)]
            (tmp_path / f"flood-{i:02d}-{setup}-pools.json").write_text(json.dumps(samples))
        flood.append({"round": i, "setup": setup, "online_scheduled": 60, "online_sent_in_window": 60,
                      "offline_tok_s": 1000.0 if setup != "poolserve" else (900.0 if i == 0 else 1100.0)})
    return {"flood": flood, "ceiling": [], "online_timeout_s": 120}


def test_flood_verdicts_follow_the_raw_requests(tmp_path):
    fast = {f.target.name: f for f in verdicts.findings(_run(tmp_path, 0.1), tmp_path)}
    ttft = fast["flood: online P99 TTFT, poolserve / stock two pools"]
    assert ttft.verdict == "met" and ttft.interval.hi < 1.0 and ttft.runs == (2, 2)
    assert fast["flood: offline tok/s, poolserve / stock two pools"].verdict == "inconclusive"
    assert fast["flood: share of the online schedule sent in its window, worst round of any set-up"].verdict == "met"
    assert fast["flood: offline-batch engine busy while requests wait at its gate"].verdict == "met"
    # the online pool never had a queue: no data, so no verdict
    assert fast["flood: online-chat engine busy while requests wait at its gate"].why == "no data"

    slow = {f.target.name: f for f in verdicts.findings(_run(tmp_path, 0.4, busy_running=0), tmp_path)}
    assert slow["flood: online P99 TTFT, poolserve / stock two pools"].verdict == "missed"
    assert slow["flood: offline-batch engine busy while requests wait at its gate"].verdict == "missed"


def test_one_run_a_side_is_never_a_verdict(tmp_path):
    found = {f.target.name: f for f in verdicts.findings(_run(tmp_path, 0.1, rounds=1), tmp_path)}
    ttft = found["flood: online P99 TTFT, poolserve / stock two pools"]
    assert ttft.verdict == "inconclusive" and ttft.interval.hi < 1.0 and "fewer than 2 runs" in ttft.why


def test_a_late_online_schedule_is_missed(tmp_path):
    d = _run(tmp_path, 0.1)
    d["flood"][3]["online_sent_in_window"] = 59
    found = {f.target.name: f for f in verdicts.findings(d, tmp_path)}
    sent = found["flood: share of the online schedule sent in its window, worst round of any set-up"]
    assert sent.verdict == "missed" and math.isclose(float(sent.why), 59 / 60, abs_tol=1e-3)


def test_a_baseline_measured_in_two_arms_is_judged_by_its_stronger_one(tmp_path):
    """Each target compares poolserve with the baseline arm that does best on that target's
    figure, and names it: faster first tokens in one arm, more offline tokens in the other."""
    d = _run(tmp_path, 0.15)
    rng = random.Random(1)
    for i in (4, 5):  # two more rounds: the stock set-up with its engine cores bound
        write_raw(tmp_path / f"flood-{i:02d}-stock-two-pools-bound-online.jsonl.gz", _online(0.4, rng))
        d["flood"].append({"round": i, "setup": "stock-two-pools-bound", "online_scheduled": 60,
                           "online_sent_in_window": 60, "offline_tok_s": 2000.0})
    found = {f.target.name: f for f in verdicts.findings(d, tmp_path)}
    ttft = found["flood: online P99 TTFT, poolserve / stock two pools"]
    assert ttft.verdict == "met" and ttft.why == "the baseline's stronger arm: engine core free"
    tok = found["flood: offline tok/s, poolserve / stock two pools"]
    assert tok.verdict == "missed" and tok.why == "the baseline's stronger arm: engine core bound"
    assert tok.interval.hi < 0.95 and "(the baseline's stronger arm: engine core bound)" in tok.row()


# -- the autoscaler's load step ----------------------------------------------------------------------

PHASES = [["low", 1.0, 15], ["high", 5.0, 40], ["low-again", 1.0, 15]]
SLO = {"ttft_p99_ms": 1000.0, "tpot_p99_ms": 100.0}


def _step_run(tmp_path, high_ttft: dict[str, float], runs: int = 3, timeouts: int = 0) -> dict:
    """A load-step record whose ways answer the high phase with these TTFTs (s), the low phases at
    0.1 s (static-low at 0.3 s); `timeouts` requests of the autoscaled way's high phase get no answer."""
    rng, rounds, order = random.Random(0), [], [w for _ in range(runs) for w in high_ttft]
    for i, way in enumerate(order):
        for phase, _, _ in PHASES:
            # a batch of one queues now and then even at the low rate
            rs = _online(high_ttft[way] if phase == "high" else 0.3 if way == "static-low" else 0.1, rng, n=40)
            if way == "static-low":  # a batch of one: the fastest tokens, when it answers in time
                for r in rs:
                    r.e2e = r.ttft + 31 * 0.005
            if way == "autoscaled" and phase == "high":
                for r in rs[:timeouts]:
                    r.status, r.ttft, r.e2e, r.error = 0, None, 20.0, "timeout"
            write_raw(tmp_path / f"{i:02d}-{way}-{phase}.jsonl.gz", rs)
        rounds.append({"round": i, "way": way, "repetition": i // len(high_ttft), "limits": [], "moves": []})
    return {"run": "x", "seed": 0, "order": order, "rounds": rounds,
            "setup": {"phases": PHASES, "slo": SLO, "timeout_s": 20, "runs": runs}}


def _by_name(found) -> dict:
    return {f.target.name: f for f in found}


def test_the_autoscaled_way_is_judged_against_the_better_static_way_in_each_phase(tmp_path):
    d = _step_run(tmp_path, {"autoscaled": 0.3, "static-low": 3.0, "static-high": 0.3})
    found = _by_name(verdicts.autoscale_findings(d, tmp_path))
    assert len(found) == 9  # three phases, three metrics
    high = found["autoscaler, high: P99 TTFT, autoscaled / better static way (static-high)"]
    assert high.runs == (3, 3) and high.interval.lo < 1.0 < high.interval.hi and high.verdict == "met"
    goodput = found["autoscaler, high: goodput, autoscaled / better static way (static-high)"]
    assert goodput.verdict == "met" and goodput.interval.value == pytest.approx(1.0)
    # static-low misses the SLO in the high phase: it is not the way to match there, on any metric
    # (not even TPOT, where its batch of one is the fastest)
    assert not any(name.startswith("autoscaler, high") and name.endswith("(static-low)") for name in found)


def test_a_climb_too_slow_for_the_step_misses_the_high_phase(tmp_path):
    d = _step_run(tmp_path, {"autoscaled": 0.3, "static-low": 3.0, "static-high": 0.3}, timeouts=8)
    found = _by_name(verdicts.autoscale_findings(d, tmp_path))
    ttft = found["autoscaler, high: P99 TTFT, autoscaled / better static way (static-high)"]
    assert ttft.verdict == "missed" and ttft.interval.lo > 10  # the timeouts count at their 20 s wait
    goodput = found["autoscaler, high: goodput, autoscaled / better static way (static-high)"]
    assert goodput.verdict == "missed" and goodput.interval.value == pytest.approx(0.8)
    assert all(f.verdict != "missed" for name, f in found.items() if not name.startswith("autoscaler, high"))


def test_one_run_of_each_way_is_never_a_verdict(tmp_path):
    d = _step_run(tmp_path, {"autoscaled": 0.3, "static-low": 3.0, "static-high": 0.3}, runs=1)
    assert {f.verdict for f in verdicts.autoscale_findings(d, tmp_path)} == {"inconclusive"}


def test_a_way_with_nothing_within_slo_gives_an_unbounded_ratio_not_an_error():
    iv = intervals.ratio([[1.0, 0.0]], [[0.0, 0.0]], intervals.mean)
    assert iv.value == math.inf and iv.hi == math.inf
    assert intervals.ratio([[0.0]], [[0.0]], intervals.mean).value == 1.0
