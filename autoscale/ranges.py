"""Which safe range a pool runs in: the profile measured on its set-up, a fallback while it has
none, or the range an operator's calibration pin opens. Pure: the controller calls it."""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field

from autoscale.knee import find_knee
from autoscale.profile import Fingerprint, Profile, SLOSpec
from autoscale.store import ProfileStore
from pools.config import CalibrationConfig
from pools.control import CalibrationJson
from pools.types import SafeRange

SWEEPS_PER_START = 3  # sweeps that are not evidence before a pool gives up until its next start
RESWEEP_AFTER_S = 60.0  # after a sweep that was not evidence: a busy host may be busy a while longer


@dataclass(frozen=True)
class PoolSpec:
    name: str
    safe_range: SafeRange  # the configured range: the configured profile's, or `limits.range`
    ttft_slo_s: float
    tpot_slo_s: float
    max_num_seqs: int
    fallback: SafeRange | None = None  # where a pool without a profile for its set-up runs (default: safe_range)
    profile: Profile | None = None  # the configured profile; None: a manual range, never calibrated
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    sweep: tuple[int, ...] = ()  # the ladder a calibration steps through
    deployment: str = ""  # the pool's Serve deployment (a calibration sends its requests there)
    app: str = ""  # the Serve application it is in ("": the controller's own)



def measured_range(spec: PoolSpec, profile: Profile) -> SafeRange:
    r = spec.safe_range
    return SafeRange(profile.ladder, *profile.range, r.tokens_per_seq, r.max_inflight_tokens)


def at_slo(calibration: CalibrationJson, profile: Profile | None, slo: SLOSpec
           ) -> tuple[CalibrationJson, Profile | None]:
    """A profile's range judged at the SLO a pool runs at. Its rows are what its sweep measured,
    whatever SLO that sweep was run for; the range it chose was chosen at that SLO, and a pool
    held to a tighter one must not run at steps whose measured P99s break it (nor stay below
    steps a looser one allows, up to the top of the measured ladder). At its own SLO its range
    stands, or a narrower one chosen by hand; a wider one (a hand edit past what its rows allow)
    is judged from its rows as at any other SLO."""
    if profile is None:
        return calibration, profile
    v = find_knee(profile.rows, slo, profile.rule)
    own = all(math.isclose(a, b, rel_tol=1e-9) for a, b in ((profile.slo.ttft_p99_ms, slo.ttft_p99_ms),
                                                            (profile.slo.tpot_p99_ms, slo.tpot_p99_ms)))
    if own and v.low <= profile.range[0] and profile.range[1] <= v.high:
        return calibration, profile
    judged = profile.model_copy(update={"slo": slo, "knee": v.knee, "range": (v.low, v.high), "feasible": v.feasible,
                                        "decided_by": v.decided_by, "reason": v.reason})
    gave = "its own range is wider than its rows allow:" if own else "its sweep's SLO gave"
    return calibration.model_copy(update={"detail": (
        f"range {list(judged.range)} at this pool's SLO (P99 TTFT {slo.ttft_p99_ms:g} ms, TPOT {slo.tpot_p99_ms:g} "
        f"ms), set by the {v.decided_by} rule; {gave} {list(profile.range)}")}), judged


def allowed_range(spec: PoolSpec, state: str, measured: SafeRange | None, calibrating_pin: bool) -> SafeRange:
    r = spec.safe_range
    if calibrating_pin:  # a sweep may pin any step up to the engine's ceiling
        ladder = tuple(range(1, spec.max_num_seqs + 1))
        return SafeRange(ladder, 1, spec.max_num_seqs, r.tokens_per_seq, r.max_inflight_tokens)
    if state == "manual":
        return r
    if measured is not None:
        return measured
    return r.clamp_to_low() if state == "strict" else (spec.fallback or r)


def not_evidence(profile: Profile) -> str | None:
    """Why a sweep says too little about its set-up to be kept, if it does: its lowest step, or
    half its steps or more, never measured steady. Kept, its range would be the lowest step
    alone or a guess, and a busy host (another deployment starting beside it, say) rather
    than the set-up would have set it."""
    unsteady = profile.unsteady
    if profile.rows and not profile.rows[0].steady:
        return f"its lowest step ({profile.rows[0].max_active_seqs}) never measured steady"
    if 2 * len(unsteady) >= len(profile.rows):
        return f"{len(unsteady)} of its {len(profile.rows)} steps never measured steady ({list(unsteady)})"
    return None


def profiled(profile: Profile, source: str) -> CalibrationJson:
    unsteady = f"; steps {list(profile.unsteady)} never measured steady" if profile.unsteady else ""
    again = ": measured again at the next start" if profile.provisional else ""
    return CalibrationJson(state="profile", source=source, detail=(
        f"range {list(profile.range)}, set by the {profile.decided_by or 'knee'} rule{unsteady}{again}"))


def judge_sweep(profile: Profile, before: Profile | None, discarded: int, source: str, running: SafeRange | None,
                not_this: str | None = None) -> tuple[CalibrationJson, Profile | None]:
    """What a finished background sweep does: the pool's calibration, and the profile to keep and
    run on (None: discarded). Unsteady steps make the profile provisional, unless the sweep before
    it was unsteady too. A sweep that is not evidence is discarded: the pool keeps the range it
    runs in (its fallback, or `running`: a provisional profile's) and sweeps again after
    `RESWEEP_AFTER_S`, `SWEEPS_PER_START` times at most (`discarded` already were). `not_this`
    says why the sweep measured something else than the set-up, when it did."""
    if (why := not_this or not_evidence(profile)) is not None:
        keeps = ("the fallback range" if running is None
                 else f"the range {[running.low, running.high]} of its provisional profile")
        if discarded + 1 >= SWEEPS_PER_START:
            return CalibrationJson(state="failed", source=source, detail=(
                f"{discarded + 1} sweeps were not evidence, the last because {why}: {keeps} until the next start "
                "measures again")), None
        return CalibrationJson(state="calibrating", source=source, detail=(
            f"a sweep was discarded ({why}): {keeps}; it measures again in {RESWEEP_AFTER_S:g} s")), None
    profile = profile.model_copy(update={"provisional": bool(profile.unsteady)
                                         and not (before is not None and before.provisional)})
    return profiled(profile, f"a sweep of this set-up ({profile.created_at})"), profile


def _found(spec: PoolSpec, profile: Profile, source: str) -> tuple[CalibrationJson, Profile]:
    """A provisional profile keeps the pool out of the fallback range while, in `auto` mode, a
    new sweep measures the set-up again."""
    if profile.provisional and spec.calibration.mode == "auto":
        return CalibrationJson(state="calibrating", source=f"{source}; steps {list(profile.unsteady)} not steady",
                               detail=f"its range {list(profile.range)} until a new sweep has measured this set-up"
                               ), profile
    return profiled(profile, source), profile


def _measured_at(profile: Profile) -> datetime.datetime:
    """When a profile was measured; one whose time does not read is the oldest."""
    try:
        at = datetime.datetime.fromisoformat(profile.created_at)
    except ValueError:
        return datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)
    return at if at.tzinfo else at.replace(tzinfo=datetime.timezone.utc)


def settle(spec: PoolSpec, fingerprint: Fingerprint | None, profiles: ProfileStore
           ) -> tuple[CalibrationJson, Profile | None]:
    """The profile a pool runs on: the store's for its fingerprint, or the configured one if its
    fingerprint matches and it was measured later; without one, what `calibration.mode` says. A pool configured with a
    range instead of a profile keeps that range, unless its mode is `auto` (then the range is its
    fallback until a sweep has measured the set-up)."""
    mode = spec.calibration.mode
    if spec.profile is None and mode != "auto":
        return CalibrationJson(state="manual", source="limits.range in the config"), None
    if fingerprint is None:  # no engine facts to compare
        if spec.profile is None:
            return CalibrationJson(state="manual", source="limits.range (no fingerprint to look up)"), None
        return profiled(spec.profile, "the configured profile (no fingerprint to check)"), spec.profile
    configured = spec.profile is not None and spec.profile.fingerprint == fingerprint
    # a hand calibration of this set-up (`poolserve calibrate`) replaces the sweep it was run to redo
    if (stored := profiles.get(spec.name, fingerprint)) is not None and not (
            configured and _measured_at(spec.profile) > _measured_at(stored)):
        return _found(spec, stored, f"the profile store (measured {stored.created_at})")
    if configured:
        profiles.put(spec.profile)
        return _found(spec, spec.profile, "the configured profile")
    why = ("; ".join(spec.profile.fingerprint.differences(fingerprint)) if spec.profile is not None
           else "none configured")
    if damaged := profiles.unreadable.get(profiles.key(spec.name, fingerprint)):
        why = f"the stored one cannot be read ({damaged}); {why}"
    state = {"auto": "calibrating", "fallback": "fallback", "strict": "strict"}[mode]
    detail = {"calibrating": "a sweep will measure this set-up; the fallback range until then",
              "fallback": "the fallback range (calibration.mode: fallback)",
              "strict": "the bottom of the configured range (calibration.mode: strict)"}[state]
    return CalibrationJson(state=state, source=f"no profile for this set-up ({why})", detail=detail), None
