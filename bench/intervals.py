"""95% bootstrap intervals over runs and the requests inside them, and the verdict a target
gets from one.

Each draw picks as many runs as there are, with replacement, and inside each picked run as
many requests as it holds, with replacement: the host's drift from one run to the next and
the spread of requests within a run both widen the interval. A per-run figure (a throughput,
a busy fraction) is a run of one value, so it is resampled over runs only.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from infra.stats import percentile

DRAWS = 2000
LEVEL = 0.95

Runs = Sequence[Sequence[float]]
Stat = Callable[[list[float]], float]
Verdict = Literal["met", "missed", "inconclusive"]


@dataclass(frozen=True)
class Interval:
    value: float  # the statistic on all the data
    lo: float
    hi: float

    def __str__(self) -> str:
        return f"{self.value:.2f} [{self.lo:.2f}, {self.hi:.2f}]"


def p99(xs: list[float]) -> float:
    return percentile(xs, 99)


def p50(xs: list[float]) -> float:
    return percentile(xs, 50)


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _draw(runs: Runs, rng: random.Random) -> list[float]:
    picked = [runs[rng.randrange(len(runs))] for _ in runs]
    return [run[rng.randrange(len(run))] for run in picked for _ in run]


def _bounds(values: list[float], value: float) -> Interval:
    tail = (1 - LEVEL) / 2 * 100
    return Interval(value, percentile(values, tail), percentile(values, 100 - tail))


def _check(runs: Runs) -> None:
    if not runs or not all(runs):
        raise ValueError("an interval needs at least one run, and no empty run")


def interval(runs: Runs, stat: Stat, seed: int = 0, draws: int = DRAWS) -> Interval:
    """`stat` over every request of every run, with its bootstrap interval."""
    _check(runs)
    rng = random.Random(seed)
    return _bounds([stat(_draw(runs, rng)) for _ in range(draws)], stat([x for run in runs for x in run]))


def ratio(ours: Runs, theirs: Runs, stat: Stat, seed: int = 0, draws: int = DRAWS) -> Interval:
    """stat(ours) / stat(theirs), each side drawn on its own, with the ratio's interval."""
    _check(ours)
    _check(theirs)
    rng = random.Random(seed)
    value = _div(stat([x for r in ours for x in r]), stat([x for r in theirs for x in r]))
    return _bounds([_div(stat(_draw(ours, rng)), stat(_draw(theirs, rng))) for _ in range(draws)], value)


def _div(a: float, b: float) -> float:
    """a / b, where a draw with nothing on the other side (b = 0) is an unbounded ratio."""
    return a / b if b else (math.inf if a > 0 else 1.0)


def verdict(iv: Interval, bound: float, better: Literal["lower", "higher"]) -> Verdict:
    """Met only when the whole interval meets the bound, missed when none of it does."""
    if better == "lower":
        return "met" if iv.hi <= bound else "missed" if iv.lo > bound else "inconclusive"
    return "met" if iv.lo >= bound else "missed" if iv.hi < bound else "inconclusive"
