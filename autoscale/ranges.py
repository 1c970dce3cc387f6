"""Which safe range a pool runs in: the profile measured on its set-up, a fallback while it has
none, or the range an operator's calibration pin opens. Pure: the controller calls it."""

from __future__ import annotations

from dataclasses import dataclass, field

from autoscale.profile import Fingerprint, Profile
from autoscale.store import ProfileStore
from pools.config import CalibrationConfig
from pools.control import CalibrationJson
from pools.types import SafeRange


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



def measured_range(spec: PoolSpec, profile: Profile) -> SafeRange:
    r = spec.safe_range
    return SafeRange(profile.ladder, *profile.range, r.tokens_per_seq, r.max_inflight_tokens)


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


def profiled(profile: Profile, source: str) -> CalibrationJson:
    unsteady = f"; steps {list(profile.unsteady)} never measured steady" if profile.unsteady else ""
    again = ": measured again at the next start" if profile.provisional else ""
    return CalibrationJson(state="profile", source=source, detail=(
        f"range {list(profile.range)}, set by the {profile.decided_by or 'knee'} rule{unsteady}{again}"))


def _found(spec: PoolSpec, profile: Profile, source: str) -> tuple[CalibrationJson, Profile]:
    """A provisional profile keeps the pool out of the fallback range while, in `auto` mode, a
    new sweep measures the set-up again."""
    if profile.provisional and spec.calibration.mode == "auto":
        return CalibrationJson(state="calibrating", source=f"{source}; steps {list(profile.unsteady)} not steady",
                               detail=f"its range {list(profile.range)} until a new sweep has measured this set-up"
                               ), profile
    return profiled(profile, source), profile


def settle(spec: PoolSpec, fingerprint: Fingerprint | None, profiles: ProfileStore
           ) -> tuple[CalibrationJson, Profile | None]:
    """The profile a pool runs on: the store's for its fingerprint, else the configured one if its
    fingerprint matches; without one, what `calibration.mode` says. A pool configured with a
    range instead of a profile keeps that range, unless its mode is `auto` (then the range is its
    fallback until a sweep has measured the set-up)."""
    mode = spec.calibration.mode
    if spec.profile is None and mode != "auto":
        return CalibrationJson(state="manual", source="limits.range in the config"), None
    if fingerprint is None:  # no engine facts to compare
        if spec.profile is None:
            return CalibrationJson(state="manual", source="limits.range (no fingerprint to look up)"), None
        return profiled(spec.profile, "the configured profile (no fingerprint to check)"), spec.profile
    if (stored := profiles.get(spec.name, fingerprint)) is not None:
        return _found(spec, stored, f"the profile store (measured {stored.created_at})")
    if spec.profile is not None and spec.profile.fingerprint == fingerprint:
        profiles.put(spec.profile)
        return _found(spec, spec.profile, "the configured profile")
    why = ("; ".join(spec.profile.fingerprint.differences(fingerprint)) if spec.profile is not None
           else "none configured")
    state = {"auto": "calibrating", "fallback": "fallback", "strict": "strict"}[mode]
    detail = {"calibrating": "a sweep will measure this set-up; the fallback range until then",
              "fallback": "the fallback range (calibration.mode: fallback)",
              "strict": "the bottom of the configured range (calibration.mode: strict)"}[state]
    return CalibrationJson(state=state, source=f"no profile for this set-up ({why})", detail=detail), None
