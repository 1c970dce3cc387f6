"""A token bucket: a quota of so many a minute, refilled continuously (capacity = one
minute's worth, refill = capacity / 60 per second). Pure: every call takes `now`."""

from __future__ import annotations

import math
from dataclasses import dataclass

INF = math.inf


@dataclass
class TokenBucket:
    capacity: float
    refill_per_s: float
    level: float
    updated: float

    @classmethod
    def per_minute(cls, amount: int | None, now: float) -> "TokenBucket | None":
        return None if amount is None else cls(amount, amount / 60.0, float(amount), now)

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.refill_per_s)
            self.updated = now

    def available(self, now: float) -> float:
        self._refill(now)
        return self.level

    def take(self, n: float, now: float) -> bool:
        self._refill(now)
        if self.level + 1e-9 < n:
            return False
        self.level -= n
        return True

    def give_back(self, n: float, now: float) -> None:
        self._refill(now)
        self.level = min(self.capacity, self.level + n)

    def debit(self, n: float, now: float) -> None:
        """Take `n` even if the level goes below zero: usage that exceeded its charge."""
        self._refill(now)
        self.level -= n

    def time_until(self, n: float, now: float) -> float:
        """Seconds until `n` units are available (inf if n exceeds the capacity)."""
        self._refill(now)
        if n > self.capacity:
            return INF
        return max(0.0, (n - self.level) / self.refill_per_s)
