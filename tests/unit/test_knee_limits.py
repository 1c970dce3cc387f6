"""The hard limits and the rule's own bounds, where a review found the safe range wrong."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from pydantic import ValidationError

from autoscale.calibrate import build_profile
from autoscale.knee import find_knee, violations
from autoscale.profile import KneeRule, SLOSpec, response_lengths
from autoscale.ranges import at_slo
from pools.control import CalibrationJson
from tests.unit.test_knee import FP, RULE, SLO, TRAFFIC, ladder, row


def test_a_step_that_preempts_is_a_hard_limit():
    """KV usage is sampled from reports and misses its peaks; preemptions are counted exactly,
    and the autoscaler steps down at any. A step of 400 preemptions joined the range, where the
    limit then climbed, preempted and stepped back down (found by a review)."""
    rows = ladder((4, 1000, 200), (8, 1900, 220), (16, 3400, 240), (32, 6000, 260))
    rows[2] = rows[2].model_copy(update={"preemptions": 400})
    v = find_knee(rows, SLO, RULE)
    assert (v.low, v.high, v.decided_by) == (4, 8, "hard limit") and "400 preemptions" in v.reason


def test_whole_responses_are_held_to_what_the_slo_allows_each_length():
    """20 ms a token against a TPOT SLO of 50, responses of 200 tokens on average and 1,000 at
    P99: the P99 latency (20 s) was held to what the SLO allows the mean (10.9 s), and the pool
    was infeasible at batch size 1 (found by a review). Held to the longest instead, 985 short
    responses of 30 s each passed beside 15 long ones (found by the review of that)."""
    slo = SLOSpec(ttft_p99_ms=1000, tpot_p99_ms=50)

    def step(done):
        return row(1, 50, 0.0, 0.0, e2e_p99=max(e for _, e in done) * 1e3).model_copy(
            update=response_lengths(done))
    varied = [(n, 0.02 * n) for n in [100] * 60 + [200] * 30 + [1000] * 10]
    assert violations(step(varied), slo, RULE) == []
    slow_short = [(10, 30.0)] * 985 + [(1000, 21.0)] * 15
    found = violations(step(slow_short), slo, RULE)
    assert found and "up to 985 of 1000 responses took longer" in found[0], found
    # one slow response in a band of three, among 1,000: within a P99 over all responses, though
    # that band's own P99 is its slowest (found by the review of the bands)
    one_slow = [(100, 2.0)] * 997 + [(20, 1.0), (20, 1.0), (20, 30.0)]
    assert violations(step(one_slow), slo, RULE) == []
    # 60% of the TPOT SLO, lengths of 128 to 255: held to a band of an octave's shortest (7.35 s),
    # the 255-token responses (7.82 s, allowed 13.7) failed the step (found by the same review)
    within = [(n, 0.2 + 0.03 * (n - 1)) for n in range(128, 256)] * 8
    assert violations(step(within), slo, RULE) == []
    # one late in each of 20 bands of 50: 2% of the responses, which a band's share of its P99's
    # complement counted as 10 (found by a final review)
    late = [(m, a * f) for m in (1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 18, 22, 27, 33, 40, 48, 58, 69, 83, 99)
            for a in [1.0 + (m - 1) * 0.05] for f in [0.5] * 49 + [1.3]]
    assert "up to 20 of 1000" in violations(step(late), slo, RULE)[0]


def test_a_replica_stale_at_a_steps_start_adds_no_history_to_its_preemptions():
    """Counts were summed over the replicas that reported: one whose report was stale at the
    start and fresh at the end added its whole history (400 old preemptions made a healthy step
    a hard limit), and the other way round hid real ones (found by a review)."""
    from autoscale.selfcal import _added

    def at(*counts):  # readings one second apart
        return [{r: (t, n) for r, n in c.items()} for t, c in enumerate(counts)]
    assert _added(at({"a": 10}, {"a": 10, "b": 400}, {"a": 10, "b": 400})) == 0
    assert _added(at({"a": 10, "b": 400}, {"a": 40})) == 30
    assert _added(at({"a": 10}, {"a": 12}, {"a": 3})) == 5  # restarted: 2 before, 3 since
    # a report that came late is older than the last read: not a restart (it added 400)
    assert _added([{"a": (1, 400)}, {"a": (3, 402)}, {"a": (2, 401)}, {"a": (4, 403)}]) == 3


@pytest.mark.parametrize("field, value", [("kv_watermark", 90.0), ("kv_watermark", 0.0), ("max_error_rate", 1.5),
                                          ("max_p99_growth_pct", 0.0), ("min_gain_pct", -1.0)])
def test_a_rule_out_of_its_bounds_is_refused(field, value):
    """`kv_watermark` 90 (a percentage) turned the KV and error limits off without a word."""
    with pytest.raises(ValidationError, match=field):
        KneeRule(**{field: value})


def test_the_calibrate_command_names_the_flag_of_a_rule_out_of_bounds():
    from deployments.calibrate_cli import _rule

    args = argparse.Namespace(min_gain=10.0, max_growth=40.0, max_growth_per_gain=5.0, kv_watermark=90.0,
                              headroom_steps=0)
    with pytest.raises(SystemExit, match=r"--kv-watermark 90.0: .*less than or equal to 1 .*0\.9, not 90"):
        _rule(args)


def _profile(rows):
    return build_profile("online-chat", rows, FP, SLO, TRAFFIC, RULE, [], "2026-12-06")


CAL = CalibrationJson(state="profile", detail="")


def test_a_range_wider_than_its_rows_allow_at_its_own_slo_is_judged_from_its_rows():
    """The SLO held the range at [4, 8] (16 breaks it); a hand edit to [4, 32] ran as such at
    the same SLO, and as [4, 8] at an SLO a hair looser (found by a review)."""
    rows = ladder((4, 1000, 200), (8, 1900, 400), (16, 3400, 1500), (32, 6000, 2000))
    profile = _profile(rows)
    assert profile.range == (4, 8)
    edited = profile.model_copy(update={"range": (4, 32)})
    for slo in (SLO, SLOSpec(ttft_p99_ms=1000.0001, tpot_p99_ms=100)):
        cal, judged = at_slo(CAL, edited, slo)
        assert judged.range == (4, 8), slo
    assert "wider than its rows allow" in at_slo(CAL, edited, SLO)[0].detail
    narrowed = profile.model_copy(update={"range": (4, 4)})  # narrower by hand: it stands
    assert at_slo(CAL, narrowed, SLO)[1] is narrowed


def test_an_slo_rebuilt_from_seconds_is_the_profiles_own():
    """The controller rebuilds a pool's SLO as `ttft_slo_s * 1e3`: 1001 ms came back as
    1000.9999999999999, and the profile was judged as at another SLO."""
    rows = ladder((4, 1000, 200), (8, 1900, 400))
    profile = _profile(rows).model_copy(update={"slo": SLOSpec(ttft_p99_ms=1001, tpot_p99_ms=100)})
    rebuilt = SLOSpec(ttft_p99_ms=1.001 * 1e3, tpot_p99_ms=0.1 * 1e3)
    assert rebuilt.ttft_p99_ms != 1001
    assert at_slo(CAL, profile, rebuilt)[1] is profile


@pytest.mark.parametrize("configured_at, stored_at, runs", [
    ("2026-12-06T12:00:00+0000", "2026-12-05T09:00:00+0000", "configured"),  # a hand calibration after the sweep
    ("2026-11-30", "2026-12-05T09:00:00+0000", "stored"),  # a shipped profile older than the sweep
], ids=["hand-calibrated", "shipped"])
def test_the_later_of_the_configured_and_the_stored_profile_of_a_set_up_rules(configured_at, stored_at, runs):
    """`poolserve calibrate` writes a profile the config points to; at the next start the store's
    profile of the same set-up, a background sweep's, won, and the hand calibration did
    nothing (found by a review)."""
    from autoscale.profile import Fingerprint
    from autoscale.ranges import settle
    from autoscale.store import ProfileStore
    from infra.state import MemoryStore
    from tests.unit.test_selfcal import ELSEWHERE, configured_profile, spec

    configured = configured_profile().model_copy(update={"created_at": configured_at})
    stored = configured.model_copy(update={"created_at": stored_at, "range": (1, 4)})
    profiles = ProfileStore(MemoryStore())
    profiles.put(stored)
    cal, profile = settle(dataclasses.replace(spec(), profile=configured), Fingerprint(**ELSEWHERE), profiles)
    assert profile == (configured if runs == "configured" else stored), cal
    assert profiles.get("p", Fingerprint(**ELSEWHERE)) == profile  # the one it runs on is the stored one now


@pytest.mark.parametrize("value", ["nan", b"nan", float("inf"), "decimal-nan", "decimal-inf"])
def test_a_number_that_is_not_one_is_refused_in_any_form(value):
    """Read before pydantic's own checks (a bound's message hid why), a Decimal or bytes NaN passed."""
    from decimal import Decimal

    value = {"decimal-nan": Decimal("NaN"), "decimal-inf": Decimal("Infinity")}.get(value, value)
    with pytest.raises(ValidationError, match="is not a number a range can be judged by"):
        SLOSpec(ttft_p99_ms=value, tpot_p99_ms=50)


def test_an_int_too_large_for_a_float_is_a_validation_error_not_a_crash():
    """The finite check reads any value as a float: an int past a float's range raised OverflowError."""
    with pytest.raises(ValidationError, match="ttft_p99_ms"):
        SLOSpec(ttft_p99_ms=10**400, tpot_p99_ms=50)
    assert KneeRule(headroom_steps=10**400).headroom_steps == 10**400  # an int field keeps its int
