"""PoolEngine: ray.serve.llm's VLLMEngine plus a window onto vLLM's scheduler stats.

vLLM's AsyncLLM hands every scheduler step's stats to its stat loggers. We add one
logger that keeps the latest running / waiting / KV-usage figures and counts
preemptions and generated tokens, so the pool replica can report them without scraping Prometheus.
vLLM is imported lazily: only a replica that starts an engine needs it.
"""

from __future__ import annotations

import collections
import os
import platform
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from pools.types import EngineStats, LatencySample


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


@dataclass(frozen=True)
class EngineFacts:
    """What the running engine says about itself: the basis of a profile fingerprint."""

    vllm_version: str
    hardware: str
    kv_capacity_tokens: int
    block_size: int
    cudagraph_capture_sizes: tuple[int, ...] = field(default_factory=tuple)


def hardware_name() -> str:
    """The accelerator a profile was measured on: GPU name, or the CPU model and cores."""
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
    return f"cpu:{platform.machine()}:{model}:{os.cpu_count()}cores"


def _recorder_cls(box: StatsBox):
    from vllm.v1.metrics.loggers import AggregateStatLoggerBase

    class _Recorder(AggregateStatLoggerBase):
        def __init__(self, vllm_config, engine_indexes):  # noqa: D401 - vLLM's signature
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if scheduler_stats is not None:
                box.running = scheduler_stats.num_running_reqs
                box.waiting = scheduler_stats.num_waiting_reqs
                box.kv_usage = scheduler_stats.kv_cache_usage
            if iteration_stats is not None:
                box.preemptions += iteration_stats.num_preempted_reqs
                box.generated_tokens += iteration_stats.num_generation_tokens
                box.add_ttft(iteration_stats.time_to_first_tokens_iter)
                box.add_tpot(r.mean_time_per_output_token for r in iteration_stats.finished_requests)

        def log_engine_initialized(self):
            pass

    return _Recorder


def vllm_client_errors() -> tuple[type[BaseException], ...]:
    """vLLM's own exception for bad input (its validators raise it), or nothing when vLLM is
    not installed (the pure tests)."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return ()
    return (VLLMClientError,)


def pool_engine_cls():
    """VLLMEngine with a StatsBox; a factory so that importing this module needs no vLLM."""
    from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine

    class PoolEngine(VLLMEngine):
        def __init__(self, llm_config) -> None:
            super().__init__(llm_config)
            self.stats_box = StatsBox()
            self.vllm_config = None

        def _start_async_llm_engine(self, vllm_engine_args, vllm_engine_config, placement_group):
            client = super()._start_async_llm_engine(vllm_engine_args, vllm_engine_config, placement_group)
            self.vllm_config = vllm_engine_config
            if client.logger_manager is not None:
                client.logger_manager.stat_loggers.append(_recorder_cls(self.stats_box)(None, [0]))
            return client

        def facts(self) -> EngineFacts:
            import vllm

            cache = self.vllm_config.cache_config
            sizes = self.vllm_config.compilation_config.cudagraph_capture_sizes or []
            return EngineFacts(
                vllm_version=vllm.__version__,
                hardware=hardware_name(),
                kv_capacity_tokens=(cache.num_gpu_blocks or 0) * cache.block_size,
                block_size=cache.block_size,
                cudagraph_capture_sizes=tuple(sorted(sizes)),
            )

    return PoolEngine
