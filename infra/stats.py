"""Small statistics shared by the controller, calibration and the load generator."""

from __future__ import annotations

import math
from typing import Sequence


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty list."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of an empty list")
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    if xs[lo] == xs[hi]:  # also where both are infinite (an unbounded ratio), which interpolates to nan
        return xs[lo]
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def counter_at(samples: Sequence[tuple[float, float]], t: float) -> float | None:
    """A cumulative counter's value at time t, interpolated between the (time, count) samples
    around it; None outside them."""
    for (t0, v0), (t1, v1) in zip(samples, samples[1:]):
        if t0 <= t <= t1:
            return v0 + (v1 - v0) * ((t - t0) / (t1 - t0) if t1 > t0 else 0.0)
    return None


def counter_rate(samples: Sequence[tuple[float, float]], a: float, b: float) -> float | None:
    """The counter's rate over [a, b]; None outside the samples, or where the count fell (its
    source restarted and began again)."""
    x, y = counter_at(samples, a), counter_at(samples, b)
    return None if x is None or y is None or y < x or b <= a else (y - x) / (b - a)


class PerReplica:
    """What replicas' cumulative counters (an engine's preemptions) added over a window, each
    replica from its own first reading in it. Summed over the replicas that reported, a replica
    whose report was stale at the window's start and fresh at its end added its whole history
    (a healthy step read as 400 preemptions), and the other way round took it away; a counter
    that went back (a restarted replica) counts from zero. Each reading comes with the time its
    replica made it: one older than the last read (a report that came late) is passed over, or
    it read as a restart and added the replica's whole history."""

    def __init__(self) -> None:
        self.first: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self._at: dict[str, float] = {}
        self._before: dict[str, int] = {}  # what a replica added before it restarted

    def read(self, counts: dict[str, tuple[float, int]]) -> None:
        for replica, (at, n) in counts.items():
            if at <= self._at.get(replica, float("-inf")):
                continue
            self._at[replica] = at
            self.first.setdefault(replica, n)
            previous = self.last.get(replica, n)
            if n < previous:  # restarted: from zero since
                self._before[replica] = self._before.get(replica, 0) + previous - self.first[replica]
                self.first[replica] = 0
            self.last[replica] = n

    def added(self) -> int:
        return sum(n - self.first[r] + self._before.get(r, 0) for r, n in self.last.items())

