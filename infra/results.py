"""What the load generator measured: one `Result` per request, a `Run` of them over a
measurement window, and its `Summary` (the formulas are in `infra.loadgen`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from infra.stats import percentile

@dataclass
class Result:
    start: float
    status: int = 0
    ttft: float | None = None
    e2e: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""
    pool: str = ""
    borrowed: bool = False
    retry_after: str | None = None
    server_timing: dict[str, float] = field(default_factory=dict)  # poolserve's router: ms per step
    scheduled: float | None = None  # open loop: when the schedule said to send it (start is when it was)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class Run:
    """Latencies count the requests that started in the measurement window; throughput
    counts the requests that completed in it (so the tail still running at the end of a
    closed loop is not credited to the window)."""

    results: list[Result]
    measure_from: float
    measure_s: float
    loop_lag: dict
    mode: str
    load: float
    steady: bool = True
    timeout_s: float | None = None

    def measured(self) -> list[Result]:
        end = self.measure_from + self.measure_s
        return [r for r in self.results if self.measure_from <= r.start < end]

    def completed_in_window(self) -> list[Result]:
        end = self.measure_from + self.measure_s
        return [r for r in self.results if r.ok and r.e2e is not None and self.measure_from <= r.start + r.e2e < end]

    def summary(self, ttft_slo_s: float | None = None, tpot_slo_s: float | None = None) -> "Summary":
        s = summarize(self.measured(), self.measure_s, ttft_slo_s, tpot_slo_s, self.loop_lag,
                      self.completed_in_window(), self.timeout_s)
        s.window_start = self.measure_from
        return s

    def split(self, seconds: list[float]) -> list["Run"]:
        """Consecutive sub-windows of the measurement window, e.g. one per benchmark phase."""
        out, start = [], self.measure_from
        for s in seconds:
            out.append(Run(self.results, start, s, self.loop_lag, self.mode, self.load, self.steady, self.timeout_s))
            start += s
        return out


@dataclass
class Summary:
    requests: int
    completed: int
    duration_s: float
    req_per_s: float
    input_tok_per_s: float
    output_tok_per_s: float
    goodput_req_per_s: float | None
    error_rate: float
    rejection_rate: float
    ttft_ms: dict
    tpot_ms: dict
    e2e_ms: dict
    borrowed: int
    timeouts: int = 0
    ttft_ms_with_timeouts: dict = field(default_factory=dict)
    statuses: dict = field(default_factory=dict)  # status -> count ("0": no response)
    rejected_without_retry_after: int = 0
    loop_lag_ms: dict = field(default_factory=dict)
    window_start: float | None = None  # time.monotonic(): one clock for every process on the host
    server_timing_ms: dict = field(default_factory=dict)  # poolserve's steps to the first token: p50/p99 each
    errors: dict = field(default_factory=dict)  # "status: message" -> count, every failure but a 429

    def to_json(self) -> dict:
        return asdict(self)


def _pcts(xs: list[float]) -> dict:
    if not xs:
        return {"p50": None, "p95": None, "p99": None, "n": 0}
    return {"p50": percentile(xs, 50) * 1e3, "p95": percentile(xs, 95) * 1e3, "p99": percentile(xs, 99) * 1e3,
            "n": len(xs)}


def ttfts_with_timeouts(results: list[Result], timeout_s: float | None = None) -> list[float]:
    """Every answered request's TTFT (s), and for one that timed out before its first token its
    wait (the timeout, or the time until it was cut off): a lower bound, so that a tail of
    timeouts is not hidden. One cut off after its first token counts its real TTFT."""
    return [r.ttft for r in results if r.status == 200 and r.ttft is not None] + [
        r.e2e or timeout_s for r in results if r.error == "timeout" and r.ttft is None and (r.e2e or timeout_s)]


def summarize(results: list[Result], duration_s: float, ttft_slo_s: float | None = None,
              tpot_slo_s: float | None = None, loop_lag: dict | None = None,
              completed: list[Result] | None = None, timeout_s: float | None = None) -> Summary:
    """`results`: the requests whose latencies count; `completed`: those whose tokens count
    towards throughput (default: the successful ones among `results`)."""
    ok = [r for r in results if r.ok]
    errors = Counter(f"{r.status}: {r.error}" for r in results if not r.ok and r.status != 429)
    done = ok if completed is None else completed
    n = max(1, len(results))
    good = None
    if ttft_slo_s is not None and tpot_slo_s is not None:
        good = sum(1 for r in done if r.ttft is not None and r.ttft <= ttft_slo_s
                   and (r.tpot is None or r.tpot <= tpot_slo_s)) / duration_s
    return Summary(
        requests=len(results), completed=len(ok), duration_s=duration_s,
        req_per_s=len(done) / duration_s,
        input_tok_per_s=sum(r.prompt_tokens for r in done) / duration_s,
        output_tok_per_s=sum(r.output_tokens for r in done) / duration_s,
        goodput_req_per_s=good,
        error_rate=sum(errors.values()) / n,
        rejection_rate=sum(1 for r in results if r.status == 429) / n,
        ttft_ms=_pcts([r.ttft for r in ok if r.ttft is not None]),
        tpot_ms=_pcts([r.tpot for r in ok if r.tpot is not None]),
        e2e_ms=_pcts([r.e2e for r in ok if r.e2e is not None]),
        borrowed=sum(1 for r in ok if r.borrowed),
        timeouts=sum(1 for r in results if r.error == "timeout"),
        statuses={str(k): sum(1 for r in results if r.status == k) for k in sorted({r.status for r in results})},
        rejected_without_retry_after=sum(1 for r in results if r.status == 429 and not r.retry_after),
        ttft_ms_with_timeouts=_pcts(ttfts_with_timeouts(results, timeout_s)),
        loop_lag_ms=loop_lag or {},
        server_timing_ms={step: _pcts([r.server_timing[step] / 1e3 for r in ok if step in r.server_timing])
                          for step in dict.fromkeys(k for r in ok for k in r.server_timing)},
        errors=dict(errors),
    )
