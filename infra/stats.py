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


class Cumulative:
    """What several sources' cumulative counters (replicas' preemptions or refusals) added, each
    from its own first reading; never more than happened. Summed over the sources that reported,
    one whose report was stale at the start and fresh at the end added its whole history (a
    healthy step read as 400 preemptions), and the other way round took it away. A count that
    went back on a newer reading is a restart, counted from zero. A reading older than the
    source's current run (its first reading, or its restart's) is passed over: a report of a run
    before that came late, or a clock stepped back, which the count cannot tell apart (read
    against the new run, a late one added the old run's whole history; its own events are lost,
    and a stepped-back clock's are counted once it passes the run's start again). Within a run,
    a count that grew counts whatever its time; one that did not is a late report."""

    def __init__(self) -> None:
        self.total = 0
        # source -> (its run's start, whether a restart began it, its newest reading's time, count)
        self._runs: dict[str, tuple[float, bool, float, int]] = {}

    @property
    def sources(self) -> set[str]:
        return set(self._runs)

    def read(self, source: str, at: float, n: int) -> None:
        run = self._runs.get(source)
        if run is None:
            self._runs[source] = (at, False, at, n)
            return
        start, restarted, last_at, last_n = run
        if at < start or (restarted and at <= start):  # a restart's time is the new run's first reading
            return
        if n >= last_n:
            self.total += n - last_n
            self._runs[source] = (start, restarted, max(at, last_at), n)
        elif at > last_at:  # restarted: from zero since
            self.total += n
            self._runs[source] = (at, True, at, n)

    def read_all(self, counts: dict[str, tuple[float, int]]) -> None:
        for source, (at, n) in counts.items():
            self.read(source, at, n)

    def forget(self, sources: Sequence[str]) -> None:
        """Sources long gone: one that reports again starts from a new first reading."""
        for source in sources:
            self._runs.pop(source, None)
