"""Request lengths and prompts for the load generator: the Azure 2023 chat trace (package
data), scaled to a model's context, or seeded synthetic lengths."""

from __future__ import annotations

import csv
import math
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from infra.stats import percentile

TRACE = Path(__file__).resolve().parent / "traces" / "azure_llm_2023_conv.csv"  # package data
WORDS = ("the batch queue token cache model request latency throughput prefill decode sequence pool tenant "
         "quota chat offline online serve replica engine limit budget window knee range profile time first "
         "output input length memory block kernel graph priority fair share").split()


# -- lengths ----------------------------------------------------------------------

@dataclass(frozen=True)
class Lengths:
    """A seeded source of (prompt tokens, output tokens) pairs, and optional arrival times."""

    pairs: tuple[tuple[int, int], ...]
    arrivals: tuple[float, ...] = ()
    source: str = "synthetic"
    scale: float = 1.0

    def sample(self, rng: random.Random) -> tuple[int, int]:
        return self.pairs[rng.randrange(len(self.pairs))]

    def stats(self) -> dict:
        def pct(xs):
            return {"p50": int(percentile(xs, 50)), "p90": int(percentile(xs, 90)), "p99": int(percentile(xs, 99))}
        p = [a for a, _ in self.pairs]
        o = [b for _, b in self.pairs]
        return {"prompt_tokens": pct(p), "output_tokens": pct(o), "total_tokens": pct([a + b for a, b in self.pairs])}


def trace_lengths(max_model_len: int, path: Path = TRACE, scale: float | None = None,
                  min_output: int = 4) -> Lengths:
    """The trace's lengths, scaled so that its p99 total is half the context (or by `scale`),
    clipped to fit the context; arrivals in seconds from the first row."""
    rows = list(csv.DictReader(path.open()))
    raw = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in rows]
    if scale is None:
        scale = (max_model_len / 2) / percentile([a + b for a, b in raw], 99)
    pairs = []
    for a, b in raw:
        p, o = max(1, round(a * scale)), max(min_output, round(b * scale))
        if p + o >= max_model_len:
            p = max(1, max_model_len - o - 64)
        pairs.append((p, o))
    t0 = _ts(rows[0]["TIMESTAMP"])
    arrivals = tuple(_ts(r["TIMESTAMP"]) - t0 for r in rows)
    return Lengths(tuple(pairs), arrivals, f"azure_llm_2023_conv.csv x{scale:.3f}", scale)


def _ts(text: str) -> float:
    return datetime.strptime(text[:26], "%Y-%m-%d %H:%M:%S.%f").timestamp()


def synthetic_lengths(prompt: int, output: int, spread: float = 0.0, n: int = 1000, seed: int = 0) -> Lengths:
    """Fixed lengths (spread 0) or lognormal around them."""
    rng = random.Random(seed)
    if spread <= 0:
        return Lengths(((prompt, output),), source=f"fixed {prompt}/{output}")
    pairs = tuple((max(1, int(rng.lognormvariate(math.log(prompt), spread))),
                   max(2, int(rng.lognormvariate(math.log(output), spread)))) for _ in range(n))
    return Lengths(pairs, source=f"lognormal {prompt}/{output} sigma {spread}")


def make_prompt(tokens: int, rng: random.Random) -> str:
    """Text of about `tokens` tokens for the tiny model's tokenizer (one word ~ one token)."""
    return " ".join(rng.choice(WORDS) for _ in range(max(1, tokens)))


# -- arrivals ---------------------------------------------------------------------

def poisson_arrivals(rate: float, horizon_s: float, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process at `rate` per second, inside [0, horizon_s) only."""
    times, t = [], rng.expovariate(rate)
    while t < horizon_s:
        times.append(t)
        t += rng.expovariate(rate)
    return times
