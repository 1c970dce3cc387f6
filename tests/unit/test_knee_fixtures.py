"""The knee finder on sweeps of known shape, at every SLO each fixture names: queueing curves
whose knees follow from their formulas, and published sweeps with their authors' answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from autoscale.knee import find_knee
from autoscale.profile import KneeRule, SLOSpec
from tests.unit.knee_fixtures import FIXTURES, SLOS_MS

REPO = Path(__file__).resolve().parents[2]
CASES = [(f, slo) for f in FIXTURES for slo in f.expected]


@pytest.mark.parametrize("fixture, slo", CASES, ids=[f"{f.name}-slo{slo / 1e3:g}s" for f, slo in CASES])
def test_safe_range_on_each_fixture_at_each_slo(fixture, slo):
    verdict = find_knee(fixture.rows, SLOSpec(ttft_p99_ms=slo, tpot_p99_ms=fixture.tpot_slo_ms), KneeRule())
    expected_range, rule = fixture.expected[slo]
    assert ((verdict.low, verdict.high), verdict.decided_by) == (expected_range, rule), verdict.reason
    assert f"set by the {rule} rule" in verdict.reason


def test_every_fixture_is_judged_at_every_slo_from_100ms_to_60s():
    for f in FIXTURES:
        assert set(SLOS_MS) <= set(f.expected), f.name


def test_each_fixture_has_its_plot_and_its_row_in_the_doc():
    doc = (REPO / "docs" / "calibration.md").read_text()
    for f in FIXTURES:
        assert (REPO / "docs" / "images" / f"knee-{f.name}.png").stat().st_size > 10_000, f.name
        assert f"knee-{f.name}.png" in doc and f.source in doc, f.name
