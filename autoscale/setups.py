"""Which engine set-ups serve a pool: the fingerprint each replica reports, and when it last did.

A pool runs on one set-up's profile at a time; the controller settles it again once the
replicas of that set-up have left (`SetUps.moved`). Pure: no Ray, the time is a parameter.
"""

from __future__ import annotations

import logging

from autoscale.profile import Fingerprint
from pools.control import ReplicaStats

log = logging.getLogger("poolserve.autoscale")

GONE_AFTER_REPORTS = 3  # x stats_max_age_s: a set-up whose replicas are silent this long has left the pool
FORGET_AFTER_S = 600.0  # a replica silent this long is forgotten (else, under churn, memory only grew)


def forget_after(max_age: float) -> float:
    """How long a replica may be silent before the controller forgets it: its report, its
    counters' baseline (one that reports again starts a new one) and its set-up."""
    return max(FORGET_AFTER_S, 10 * GONE_AFTER_REPORTS * max_age)


class SetUps:
    def __init__(self) -> None:
        self._last: dict[str, tuple[float, Fingerprint]] = {}  # replica -> (last report, its set-up)
        self._unreadable: set[str] = set()  # replicas already logged
        self._read: dict[str, tuple[dict, Fingerprint]] = {}  # replica -> its last report's fingerprint, read
        self.other_at: float | None = None  # when a set-up other than the pool's last served

    def read(self, stats: ReplicaStats) -> Fingerprint | None:
        """The set-up a replica reports, or None: it sent none, or one this version cannot read
        (a newer replica's field), which is logged once and settles nothing."""
        if not stats.fingerprint:
            return None
        if (seen := self._read.get(stats.replica)) is not None and seen[0] == stats.fingerprint:
            return seen[1]  # a replica reports every second, and its set-up seldom changes
        try:
            fingerprint = Fingerprint(**stats.fingerprint)
        except (ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError
            if stats.replica not in self._unreadable:
                self._unreadable.add(stats.replica)
                log.warning("pool %s replica %s: its fingerprint cannot be read, so it settles no profile: %s",
                            stats.pool, stats.replica, e)
            return None
        self._read[stats.replica] = (dict(stats.fingerprint), fingerprint)
        return fingerprint

    def note(self, replica: str, fingerprint: Fingerprint, now: float, pool_runs: Fingerprint | None) -> None:
        self._last[replica] = (now, fingerprint)
        if fingerprint != pool_runs:
            self.other_at = now

    def forget(self, replicas: list[str]) -> None:
        for r in replicas:
            self._last.pop(r, None)
            self._read.pop(r, None)
            self._unreadable.discard(r)

    def moved(self, pool: str, runs: Fingerprint | None, reported: Fingerprint | None, now: float,
              gone_after: float) -> bool:
        """A replica reported a set-up other than the one the pool runs, and no replica of that
        one has reported for `gone_after` (while both report, the pool keeps the range of the one
        it runs: one pool, one set of limits, and its latency feedback acts on the mix)."""
        if reported is None or reported == runs:
            return False
        if any(fp == runs and now - t <= gone_after for t, fp in self._last.values()):
            return False
        log.warning("pool %s: its replicas now run another set-up (%s): its calibration is settled again", pool,
                    "; ".join(runs.differences(reported)) if runs else "the first with a fingerprint")
        return True

    def served_since(self, t: float) -> bool:
        """Whether a set-up other than the pool's served at `t` or later (or the pool moved then)."""
        return self.other_at is not None and self.other_at >= t
