"""A cumulative counter sampled now and then (the engines' generated tokens in the replicas'
reports): its value and rate, interpolated between samples."""

from __future__ import annotations

from infra.stats import counter_at, counter_rate

SAMPLES = [(0.0, 0), (1.0, 100), (2.0, 300), (3.0, 300)]


def test_rate_interpolates_between_samples():
    assert counter_at(SAMPLES, 1.5) == 200
    assert counter_rate(SAMPLES, 0.5, 2.0) == (300 - 50) / 1.5
    assert counter_rate(SAMPLES, 2.0, 3.0) == 0  # nothing generated in a quiet second


def test_no_figure_outside_the_samples_or_across_a_restart():
    restarted = [(0.0, 500), (1.0, 600), (2.0, 10)]  # a replica restarted: its count began again
    assert counter_rate(restarted, -1.0, 1.5) is None and counter_rate(restarted, 1.5, 5) is None
    assert counter_rate(restarted, 0.5, 2.0) is None


def test_the_calibrate_clis_rate_waits_for_live_replicas_and_drops_gone_ones():
    import time
    from types import SimpleNamespace

    from deployments.calibrate_cli import EngineSampler

    admin = SimpleNamespace(pool=lambda name: SimpleNamespace(replicas=[]))
    sampler = EngineSampler(admin, "p", lag_s=2.0)
    now = time.monotonic()
    sampler.tokens = {"a": [(now - 10, 0), (now - 5, 500), (now - 0.5, 950)]}
    assert sampler.rate(now - 10, now - 5) == 100
    assert sampler.rate(now - 5, now) is None  # replica a's next report will cover it
    sampler.tokens["b"] = [(now - 10, 0), (now - 6, 400)]  # replaced 6 s ago: silent for longer than the lag
    assert sampler.rate(now - 10, now - 6) == 200
    assert sampler.rate(now - 5, now - 1) == 100  # a alone


def test_a_calibrate_step_where_every_request_failed_leaves_the_knee_rule_on():
    """`poolserve calibrate` counted requests sent, so a step where all failed showed requests
    without a TTFT: the ladder switched to end-to-end latency, where no knee rule applies, and a
    step past the knee joined the range; its error rate read 50% for 100%."""
    from autoscale.knee import find_knee
    from autoscale.profile import KneeRule, SLOSpec
    from deployments.calibrate_cli import step_row
    from infra.results import Result, summarize
    from tests.unit.knee_fixtures import batching

    failed = [Result(start=i, status=500, error="engine died") for i in range(40)]
    row = step_row(256, summarize(failed, 10.0), True, [], None, 0.0, 0)
    assert (row.requests, row.errors) == (0, 40)
    rows, slo = batching(), SLOSpec(ttft_p99_ms=10_000, tpot_p99_ms=1_000)  # 1..128, streamed, healthy
    healthy = find_knee(rows, slo, KneeRule())
    assert (healthy.high, healthy.decided_by) == (64, "knee"), "the test needs a ladder the knee rule bounds"
    with_failure = find_knee((*rows, row), slo, KneeRule())
    assert (with_failure.high, with_failure.decided_by) == (64, "knee")
    assert "error rate 100.0%" in with_failure.reason
