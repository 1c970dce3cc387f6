"""Typed objects that cross the pool boundary: limits, priorities, calls and replies.

The router and the autoscaler import these; nothing here imports Ray or vLLM.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal


class PriorityClass(enum.IntEnum):
    """Strict admission classes; a lower value is admitted first (as vLLM's priority)."""

    INTERACTIVE = 0
    STANDARD = 1
    BATCH = 2
    BORROWED = 3

    @classmethod
    def parse(cls, name: str) -> "PriorityClass":
        try:
            return cls[name.strip().upper()]
        except KeyError:
            names = ", ".join(c.name.lower() for c in cls if c is not cls.BORROWED)
            raise ValueError(f"unknown priority {name!r}; use one of {names}") from None

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class BatchLimits:
    """A replica's runtime batch budget: at most this many active sequences and tokens.

    A request's tokens are its prompt tokens plus its `max_tokens`: the KV it may grow to.
    """

    max_active_seqs: int
    max_inflight_tokens: int

    def __post_init__(self) -> None:
        assert self.max_active_seqs >= 1 and self.max_inflight_tokens >= 1, self


@dataclass(frozen=True)
class SafeRange:
    """The calibrated range of `max_active_seqs` and the ladder the autoscaler steps on.

    `tokens_per_seq` turns a sequence limit into a token budget; `max_inflight_tokens`
    caps it at what the KV cache holds.
    """

    ladder: tuple[int, ...]
    low: int
    high: int
    tokens_per_seq: int
    max_inflight_tokens: int

    def __post_init__(self) -> None:
        assert self.ladder == tuple(sorted(set(self.ladder))), self.ladder
        assert self.low in self.ladder and self.high in self.ladder and self.low <= self.high, self

    @property
    def steps(self) -> tuple[int, ...]:
        """The ladder points inside the range, ascending."""
        return tuple(s for s in self.ladder if self.low <= s <= self.high)

    def limits_for(self, seqs: int) -> BatchLimits:
        return BatchLimits(seqs, min(seqs * self.tokens_per_seq, self.max_inflight_tokens))

    def contains(self, limits: BatchLimits) -> bool:
        return (self.low <= limits.max_active_seqs <= self.high
                and limits.max_inflight_tokens <= self.max_inflight_tokens)

    def describe(self) -> str:
        return (f"max_active_seqs in [{self.low}, {self.high}] and "
                f"max_inflight_tokens <= {self.max_inflight_tokens}")

    def clamp_to_low(self) -> "SafeRange":
        """The same range pinned at its bottom step (a stale profile may not go higher)."""
        return SafeRange(self.ladder, self.low, self.low, self.tokens_per_seq, self.max_inflight_tokens)


CallKind = Literal["chat", "completions"]


@dataclass(frozen=True)
class CountedPrompt:
    """A request's prompt tokens as a renderer counted them; `rendered`, if the renderer
    keeps it, is the request as rendering left it with the engine inputs it made."""

    tokens: int
    rendered: Any = None


@dataclass(frozen=True)
class PoolCall:
    """One request as the router hands it to a pool replica.

    `body` is the validated OpenAI request (ray.serve.llm's ChatCompletionRequest or
    CompletionRequest). `prompt_tokens` was counted by the router with the model's
    tokenizer; `max_tokens` is the request's own or the rest of the context; the engine
    runs `n` sequences (the request's choices), each up to `max_tokens`.
    """

    kind: CallKind
    body: Any
    tenant: str
    weight: float
    priority: PriorityClass
    prompt_tokens: int
    max_tokens: int
    borrowed: bool = False
    include_usage: bool = False
    n: int = 1
    # a borrowed call: the lender takes it only while its own work has been away this long and
    # holds less than this share of its limit, and while borrowed work, this call's sequences
    # included, holds at most `lend_max_share` of it, or one sequence (the borrower's rule, judged
    # where it is exact; None: no share, as for a calibration sweep's calls, which wait in the queue)
    lend_after_quiet_s: float = 0.0
    lend_below_utilisation: float = 1.0
    lend_max_share: float | None = None
    # what the route's renderer made of the prompt, for an engine in the same process to take
    # instead of rendering it again; never pickled: another process's engine renders its own
    rendered: Any = field(default=None, compare=False, repr=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "rendered": None}

    @property
    def cost(self) -> int:
        """The tokens it may hold in the KV cache: the prompt once (its n sequences share its
        blocks), plus each sequence's output."""
        return self.prompt_tokens + self.n * self.max_tokens


@dataclass(frozen=True)
class Admitted:
    """First item of every pool stream that got a slot."""

    pool: str
    replica: str
    queued_s: float


@dataclass(frozen=True)
class Arrived:
    """The first item of a pool stream whose call has to queue: it reached a replica (so the
    router can tell a pool that is restarting from one whose queue is long). A call decided
    at once (a free slot, or a full queue) starts with its verdict instead: one item less
    between the router and the first token."""

    replica: str


@dataclass(frozen=True)
class Rejected:
    """The verdict, and last item, of a pool stream that got no slot (status 429 or 503)."""

    status: int
    reason: str
    message: str
    retry_after_s: float


@dataclass(frozen=True)
class Refused:
    """The engine refused an admitted request before producing output (bad input that got
    past the router's validation); the router answers 400 with this message."""

    code: str
    message: str


@dataclass(frozen=True)
class Failed:
    """The engine failed on an admitted whole answer after generating it: the router answers
    500 with this message, and charges the usage (the whole charge stands when it is None)."""

    code: str
    message: str
    usage: "Usage | None" = None


def error_status(error: Any) -> int:
    """The HTTP status an engine's error object names: its `code` if that reads as a 4xx or 5xx
    (vLLM's are ints; a string or a float is read as its number), else 400, the engine's
    refusal of the input. The pool and the router read an error's status only here."""
    try:
        status = int(getattr(error, "code", 400) or 400)
    except (TypeError, ValueError, OverflowError):  # no number (or inf)
        return 400
    return status if 400 <= status < 600 else 400


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Finished:
    """Last item of a pool stream: the real usage (for quota reconciliation) and timings."""

    usage: Usage | None
    ttft_s: float | None
    e2e_s: float


@dataclass(frozen=True)
class EngineStats:
    """What vLLM's scheduler last reported for this replica."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    preemptions: int = 0
    generated_tokens: int = 0  # output tokens the engine produced since it started, all requests


@dataclass(frozen=True)
class GateStats:
    active: int  # sequences holding a slot (a request of n choices counts n)
    inflight_tokens: int
    queued_by_class: dict[str, int]
    queued_tokens: int
    oldest_wait_s: float
    limits: BatchLimits
    admitted: int
    rejected: int
    cancelled: int
    evicted: int
    completed: int
    own_refused: int = 0  # of those rejected and evicted, the pool's own requests (not borrowed ones)
    peak_active: int = 0  # most sequences active at once since the limits last changed
    active_requests: int = 0
    borrowed_requests: int = 0  # of the active requests, those of another pool (or a calibration sweep)
    borrowed_seqs: int = 0  # the sequences of those
    own_idle_s: float = float("inf")  # since the pool's own traffic last ran or waited here (0: it does now)

    @property
    def own_work(self) -> int:
        """Requests of the pool's own traffic, running or waiting."""
        return (self.active_requests - self.borrowed_requests
                + sum(n for cls, n in self.queued_by_class.items() if cls != "borrowed"))

    @property
    def queued(self) -> int:
        return sum(self.queued_by_class.values())

    @property
    def own_load(self) -> tuple[int, int]:
        """The pool's own sequences running, at most the applied limit (those above a limit just
        lowered are leaving), and its own requests waiting: what a deep queue is judged on."""
        running = min(self.active - self.borrowed_seqs, self.limits.max_active_seqs)
        return running, self.queued - self.queued_by_class.get("borrowed", 0)

    @property
    def deep(self) -> bool:
        """The pool's own work waits here in a queue as deep as this replica's batch (`deep_queue`)."""
        return deep_queue(*self.own_load, 1, self.limits.max_active_seqs)


def deep_queue(running: int, waiting: int, replicas: int, target: int) -> bool:
    """The pool's own work waits in a queue at least as deep as the batch (per replica): such a
    queue stands at its first sight. A batch of one under a load step drains and refills its
    queue between ticks, and waiting for it to show at two ticks in a row cost a benchmark's
    step 4-10 s of first tokens near the SLO (bench/notes.md). Borrowed work is the lender's
    to send home, not a reason to grow."""
    return waiting > 0 and running + waiting >= 2 * target * replicas


@dataclass(frozen=True)
class LatencySample:
    """Recent per-request latencies measured at the replica (seconds)."""

    ttft_s: tuple[float, ...] = ()
    tpot_s: tuple[float, ...] = ()
    wait_s: tuple[float, ...] = ()  # in the gate's queue: the pool's own requests (still waiting: so far)
