"""KV cache budget: bytes per token and how many sequences fit (pure arithmetic).

    KV bytes = 2 (K and V) x layers x kv_heads x head_dim x cached_tokens x bytes_per_element

vLLM allocates KV in blocks of `block_size` tokens, so a sequence of n tokens holds
ceil(n / block_size) blocks; capacity is whole blocks. Size a batch from high
percentiles of prompt + output length, never from the mean: the tail decides OOMs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
               "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}
GIB = 1 << 30


def checkpoint_dtype(config: Mapping) -> str | None:
    """The dtype a Hugging Face `config.json` names (or its text model's); None where it names
    none (vLLM then reads the weights' headers) or the model is quantized (its kernels decide)."""
    if config.get("quantization_config"):
        return None
    for c in (config, _text_config(config)):
        if named := c.get("torch_dtype") or c.get("dtype"):
            return str(named).removeprefix("torch.")
    return None


def _text_config(config: Mapping) -> Mapping:
    """A multimodal model's text model (its layers and heads hold the KV cache); {} if none."""
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else {}


def runs_at(dtype: str, checkpoint: str | None) -> str:
    """What vLLM runs a model at when asked for `dtype`: `auto` keeps a 16-bit checkpoint's
    dtype and downcasts a float32 one to bfloat16 (vLLM 0.29 does so on CPUs too; the tiny
    float32 model ran as bfloat16 on an AVX2 host); a checkpoint not known here runs at 16 bits
    either way."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if checkpoint in (None, "float32", "float") else checkpoint


def engine_dtype(requested: str, checkpoint: str | None, native_bf16: bool | None) -> str:
    """The dtype poolserve asks vLLM for. As configured, except `auto` for a float32 checkpoint
    on a CPU without bf16 instructions (`native_bf16` False), which stays float32: vLLM would
    run it as bfloat16 in software, and the tiny model made 370 output tok/s so against 762 at
    float32 on an AVX2 host. A 16-bit checkpoint keeps its dtype: float32 would double the
    weights' memory. None: the checkpoint, or whether the accelerator is such a CPU, is not
    known here, and vLLM decides."""
    if requested == "auto" and native_bf16 is False and checkpoint in ("float32", "float"):
        return "float32"
    return requested


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int
    bytes_per_element: int

    @classmethod
    def from_hf_config(cls, config: Mapping, dtype: str = "auto", kv_cache_dtype: str = "auto") -> "ModelShape":
        """Read a Hugging Face `config.json`; `dtype` is what vLLM is asked for, and an `auto` KV
        cache holds what the model runs at."""
        chosen = kv_cache_dtype if kv_cache_dtype != "auto" else runs_at(dtype, checkpoint_dtype(config))
        if "num_attention_heads" not in config and _text_config(config):
            config = _text_config(config)
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        if chosen not in DTYPE_BYTES:
            raise ValueError(f"unknown KV dtype {chosen!r}; use one of {sorted(DTYPE_BYTES)}")
        return cls(
            layers=config["num_hidden_layers"],
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            bytes_per_element=DTYPE_BYTES[chosen],
        )

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_element


@dataclass(frozen=True)
class KVBudget:
    shape: ModelShape
    budget_bytes: int
    block_size: int = 16

    @classmethod
    def from_gib(cls, shape: ModelShape, gib: float, block_size: int = 16) -> "KVBudget":
        return cls(shape, int(gib * GIB), block_size)

    @property
    def capacity_blocks(self) -> int:
        return self.budget_bytes // (self.shape.bytes_per_token * self.block_size)

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_blocks * self.block_size

    def blocks_for(self, seq_tokens: int) -> int:
        return math.ceil(seq_tokens / self.block_size)

    def max_sequences(self, seq_tokens: int) -> int:
        """How many sequences of `seq_tokens` (prompt + output) fit at once."""
        return self.capacity_blocks // max(1, self.blocks_for(seq_tokens))
