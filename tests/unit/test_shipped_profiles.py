"""The profiles shipped with the embedded default: each range follows from the knee rules on its
own measured rows, and none comes from headroom alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from autoscale.knee import find_knee
from autoscale.profile import load_profile

PROFILES = sorted((Path(__file__).resolve().parents[2] / "deployments" / "configs" / "profiles").glob("*.yaml"))


def test_both_pools_ship_a_profile():
    assert {p.stem for p in PROFILES} == {"online-chat", "offline-batch"}


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.stem)
def test_a_shipped_range_is_what_a_rule_decides_on_its_rows(path):
    profile = load_profile(path)
    verdict = find_knee(profile.rows, profile.slo, profile.rule)
    assert (verdict.low, verdict.high) == tuple(profile.range) and verdict.decided_by == profile.decided_by
    assert profile.decided_by not in ("", "headroom") and profile.feasible and not profile.provisional
    assert all(r.steady for r in profile.rows if r.max_active_seqs <= profile.range[1])
