"""A cumulative counter sampled now and then (the engines' generated tokens in the replicas'
reports): its value and rate, interpolated between samples."""

from __future__ import annotations

from bench.common import EngineTokens
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


def test_the_benchmarks_counter_reads_the_same_way():
    c = EngineTokens(stack=None)
    c.samples = list(SAMPLES)
    assert c.at(1.5) == 200 and c.rate(0.5, 1.5) == (300 - 50) / 1.5 and c.rate(1.0, 0) is None
