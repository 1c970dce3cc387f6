"""The benchmark's engine token counter: interpolated between sampled reports."""

from __future__ import annotations

from bench.common import EngineTokens


def counter(samples) -> EngineTokens:
    c = EngineTokens(stack=None)
    c.samples = list(samples)
    return c


def test_rate_interpolates_between_samples():
    c = counter([(0.0, 0), (1.0, 100), (2.0, 300), (3.0, 300)])
    assert c.at(1.5) == 200
    assert c.rate(0.5, 1.5) == (300 - 50) / 1.5
    assert c.rate(2.0, 1.0) == 0  # nothing generated in a quiet second


def test_no_figure_outside_the_samples_or_across_a_restart():
    c = counter([(0.0, 500), (1.0, 600), (2.0, 10)])  # a replica restarted: its count began again
    assert c.rate(-1.0, 1.5) is None and c.rate(1.5, 5) is None
    assert c.rate(0.5, 1.0) is None
