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
    from its own first reading. Summed over the sources that reported, one whose report was stale
    at the start and fresh at the end added its whole history (a healthy step read as 400
    preemptions), and the other way round took it away. A count that went back (a restarted
    replica) counts from zero, unless its reading is no newer than the last: that is a report
    that came late, passed over (read, it looked like a restart, and the next reading counted
    again from it). A reading older than a restart is the run before's: read against that run's
    last count (read against the new run's, a late one added the old run's whole history). Times
    order only these: a clock stepped back holds no count back."""

    def __init__(self) -> None:
        self.total = 0
        self.last: dict[str, tuple[float, int]] = {}  # source -> (when its reading was made, count)
        self._restarts: dict[str, tuple[float, int]] = {}  # source -> (its last restart's reading time,
        # the run before's last count)

    def read(self, source: str, at: float, n: int) -> None:
        before = self.last.get(source)
        restart = self._restarts.get(source)
        if before is None:
            self.last[source] = (at, n)
        elif restart is not None and at < restart[0]:  # the run before's, come late
            self.total += max(0, n - restart[1])
            self._restarts[source] = (restart[0], max(n, restart[1]))
        elif n >= before[1]:
            self.total += n - before[1]
            self.last[source] = (at, n)
        elif at > before[0]:  # restarted: from zero since
            self.total += n
            self._restarts[source] = (at, before[1])
            self.last[source] = (at, n)

    def read_all(self, counts: dict[str, tuple[float, int]]) -> None:
        for source, (at, n) in counts.items():
            self.read(source, at, n)

    def forget(self, sources: Sequence[str]) -> None:
        """Sources long gone: one that reports again starts from a new first reading."""
        for source in sources:
            self.last.pop(source, None)
            self._restarts.pop(source, None)
