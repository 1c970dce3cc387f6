"""The engine seam: what a pool replica needs from its LLM engine, and the stats it keeps.

`Engine` is the small protocol `PoolServer` uses. The real one (`pools.llm.RayLLMEngine`)
runs vLLM through ray.serve.llm; unit tests pass a deterministic fake. An engine streams
one call's output as *engine items*: for a streamed request, SSE text chunks; for a whole
one, the response object (`pools.streams`: a whole answer that failed after the engine's
output for it raises `EngineFailed`). It keeps a `StatsBox` that vLLM's stat logger writes.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import math
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable, Mapping, MutableMapping, Protocol

from pools.kv_budget import checkpoint_dtype, engine_dtype, runs_at
from pools.types import EngineStats, LatencySample, PoolCall


@dataclass(frozen=True)
class EngineFacts:
    """What the running engine says about itself: the basis of a profile fingerprint."""

    vllm_version: str
    hardware: str
    kv_capacity_tokens: int
    block_size: int
    cudagraph_capture_sizes: tuple[int, ...] = field(default_factory=tuple)
    setup: str = ""  # what else shapes throughput (`setup_name`)


class Engine(Protocol):
    stats_box: "StatsBox"

    async def start(self) -> None: ...

    def facts(self) -> EngineFacts | None: ...

    def generate(self, call: PoolCall) -> AsyncIterator[Any]: ...

    async def warm_up(self, requests: int) -> None: ...

    async def check_health(self) -> None: ...

    async def shutdown(self) -> None: ...


class StatsBox:
    """Written by the stat logger on the engine's output loop, read by the replica.

    Besides the scheduler's gauges it keeps recent per-request latencies measured by
    the engine itself: TTFT from engine arrival (after our gate) to first token, and
    each finished request's mean time per output token. They cover streaming and
    non-streaming requests alike.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_samples: int = 2048) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.preemptions = 0
        self.generated_tokens = 0
        self._clock = clock
        self._ttft: collections.deque[tuple[float, float]] = collections.deque(maxlen=max_samples)
        self._tpot: collections.deque[tuple[float, float]] = collections.deque(maxlen=max_samples)

    def add_ttft(self, values: Iterable[float]) -> None:
        now = self._clock()
        self._ttft.extend((now, v) for v in values)

    def add_tpot(self, values: Iterable[float]) -> None:
        now = self._clock()
        self._tpot.extend((now, v) for v in values if v > 0)

    def clear_latency(self) -> None:
        """Forget latencies so far (the warm-up's compile times are not the pool's)."""
        self._ttft.clear()
        self._tpot.clear()

    def snapshot(self) -> EngineStats:
        return EngineStats(self.running, self.waiting, self.kv_usage, self.preemptions, self.generated_tokens)

    def latency(self, window_s: float) -> LatencySample:
        horizon = self._clock() - window_s
        return LatencySample(tuple(v for t, v in self._ttft if t >= horizon),
                             tuple(v for t, v in self._tpot if t >= horizon))


ARCHITECTURE = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "vocab_size")


def setup_name(hf_config: Any, block_size: int, eager: bool, chunked_prefill: bool) -> str:
    """The rest of an engine's set-up a profile depends on: the model's shape (the served name may
    stay while the weights change; a fine-tune of the same shape runs alike), the KV block size,
    eager mode, chunked prefill, and how many CPU cores its threads are bound to."""
    shape = {k: getattr(hf_config, k, None) for k in ARCHITECTURE}
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return (f"{shape['model_type']}:{digest} block={block_size} eager={eager} chunked_prefill={chunked_prefill} "
            f"threads={_cores(os.environ.get('VLLM_CPU_OMP_THREADS_BIND'))}")


def _cores(bind: str | None) -> str:
    """How many cores a thread binding like '0-3,6' names (5), or the binding as it is ('auto')."""
    try:
        return str(sum(int(b) - int(a) + 1 for a, _, b in (p.partition("-") if "-" in p else (p, "", p)
                                                          for p in bind.split(","))))
    except (AttributeError, ValueError):
        return bind or "all"


def usable_cores(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """The cores this process can use: its CPU affinity, within its cgroup's CPU quota (a
    Kubernetes CPU limit), rounded up. `os.cpu_count()` is the host's: a pod held to 4 cores
    of a 64-core node named the node's 64, and shared a profile with pods that have them all."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = _cpu_quota(cgroup)
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def _cpu_quota(cgroup: Path) -> float | None:
    """Cores' worth of CPU time the cgroup allows: cgroup v2's `cpu.max` ("max 100000" is none),
    else v1's CFS quota over its period (-1 is none); None without a limit or a readable file."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        pass
    try:
        quota, period = (int((cgroup / "cpu" / f"cpu.cfs_{n}_us").read_text()) for n in ("quota", "period"))
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


# Environment variables with which vLLM would override what a pool's config sets.
_ENGINE_OVERRIDES = ("VLLM_CPU_KVCACHE_SPACE",)


def drop_engine_overrides(environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """Remove from a replica's environment, before its engine starts, what vLLM would let
    override the pool's config; the names removed. vLLM's CPU platform sizes the KV cache by a
    non-empty `VLLM_CPU_KVCACHE_SPACE` over `kv_cache_memory_bytes`, and Ray's workers inherit
    the shell that started Ray: a value there sized every pool's cache, not `engine.kv_cache_gb`
    (which the profile's fingerprint names). An empty value is no fix: vLLM's workers parse it."""
    return [name for name in _ENGINE_OVERRIDES if environ.pop(name, None) is not None]


def _cpu_words(cpuinfo: str) -> set[str]:
    words: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            words.update(value.split())
    return words


def native_bf16(cpuinfo: str, machine: str) -> bool | None:
    """Whether a CPU computes bf16 in hardware, from `/proc/cpuinfo`'s text: AVX512-BF16 or AMX
    on x86, the bf16 feature on Arm; None for another architecture, or no flags to read."""
    if not (words := _cpu_words(cpuinfo)):
        return None
    if machine in ("x86_64", "AMD64"):
        return bool(words & {"avx512_bf16", "amx_bf16"})
    if machine in ("aarch64", "arm64"):
        return "bf16" in words
    return None


def native_fp16(cpuinfo: str, machine: str) -> bool | None:
    """Whether an x86 CPU computes float16 in hardware (AVX512-FP16 or AMX-FP16); None for
    another architecture (not measured), or no flags to read."""
    if not (words := _cpu_words(cpuinfo)) or machine not in ("x86_64", "AMD64"):
        return None
    return bool(words & {"avx512_fp16", "amx_fp16"})


@functools.cache
def cpu_native_bf16() -> bool | None:
    """`native_bf16` of this machine's CPU."""
    return native_bf16(*_this_cpu())


@functools.cache
def cpu_native_fp16() -> bool | None:
    """`native_fp16` of this machine's CPU."""
    return native_fp16(*_this_cpu())


def _this_cpu() -> tuple[str, str]:
    try:
        return Path("/proc/cpuinfo").read_text(), platform.machine()
    except OSError:
        return "", platform.machine()


def read_hf_config(model_dir: Path) -> dict | None:
    """A local model directory's `config.json` (None: not here), naming the weights' own dtype
    where it names none, read from the first safetensors file's header as vLLM reads it."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if checkpoint_dtype(config) is None and not config.get("quantization_config"):
        if named := _safetensors_dtype(model_dir):
            config["torch_dtype"] = named
    return config


def _safetensors_dtype(model_dir: Path) -> str | None:
    """The dtype most tensors of the first safetensors file have (8 bytes of header length, then
    a JSON header naming each tensor's dtype)."""
    for path in sorted(model_dir.glob("*.safetensors"))[:1]:
        try:
            with open(path, "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        except (OSError, ValueError):
            return None
        counts = collections.Counter(v["dtype"] for k, v in header.items() if k != "__metadata__")
        if counts:
            return {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(counts.most_common(1)[0][0])
    return None


def pool_dtype(requested: str, accelerator: str, hf_config: Mapping | None,
               quantization: str | None = None) -> tuple[str, str | None]:
    """What a pool's engines are asked for (`kv_budget.engine_dtype` on this machine's CPU), and
    a warning where they would run bfloat16 or float16 in software. A quantized model's dtype is
    left to vLLM: its kernels take 16-bit activations only."""
    native = cpu_native_bf16() if accelerator == "cpu" else None
    checkpoint = checkpoint_dtype(hf_config) if hf_config is not None and not quantization else None
    dtype = engine_dtype(requested, checkpoint, native)
    runs = runs_at(dtype, checkpoint)
    if native is False and runs == "bfloat16":  # unknown under auto: 16 bits, bf16 first
        how = "runs" if dtype == "bfloat16" or checkpoint is not None else "likely runs (vLLM decides)"
        return dtype, (f"model.dtype {requested!r} {how} this model at bfloat16 on a CPU without bf16 "
                       "instructions, in software (the tiny model ran at half its float32 speed on such a host): "
                       "set model.dtype: float32 if the model and the memory allow")
    if runs == "float16" and accelerator == "cpu" and cpu_native_fp16() is False:
        instead = "bfloat16 (this CPU has bf16 instructions)" if native else "float32 if the model and the memory allow"
        return dtype, (f"model.dtype {requested!r} runs this model at float16 on a CPU without float16 instructions "
                       "(AVX512-FP16 or AMX-FP16), in software (the tiny model ran at a third of its float32 speed "
                       f"on such a host): set model.dtype: {instead}")
    return dtype, None


def hardware_name() -> str:
    """The accelerator a profile was measured on: GPU name, or the CPU model and the cores this
    process can use. `POOLSERVE_HARDWARE` overrides it (a fingerprint no profile has forces a
    recalibration)."""
    return os.environ.get("POOLSERVE_HARDWARE") or _detected_hardware()


@functools.cache
def _detected_hardware() -> str:
    """Once per process: a replica's every report carries its fingerprint."""
    try:
        import torch

        if torch.cuda.is_available():
            return f"gpu:{torch.cuda.get_device_name(0)}"
    except Exception:  # torch missing or a driver error: fall through to the CPU name
        pass
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu:{platform.machine()}:{model}:{usable_cores()}cores"
