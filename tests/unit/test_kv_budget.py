"""KV budget arithmetic against hand-computed figures."""

import pytest

from infra.stats import percentile
from pools.kv_budget import GIB, KVBudget, ModelShape

TINY = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256,
        "head_dim": 64, "torch_dtype": "float32"}
LLAMA3_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
             "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("config, dtype, kv_dtype, per_token", [
    (TINY, "auto", "auto", 2 * 2 * 2 * 64 * 2),  # vLLM runs a float32 checkpoint as bfloat16 under auto
    (TINY, "float32", "auto", 2 * 2 * 2 * 64 * 4),
    (TINY, "float16", "auto", 2 * 2 * 2 * 64 * 2),
    (LLAMA3_8B, "auto", "auto", 2 * 32 * 8 * 128 * 2),  # 128 KiB per token
    (LLAMA3_8B, "auto", "fp8", 2 * 32 * 8 * 128 * 1),
], ids=["tiny-auto", "tiny-fp32", "tiny-fp16", "llama3-8b-bf16", "llama3-8b-fp8-kv"])
def test_bytes_per_token(config, dtype, kv_dtype, per_token):
    assert ModelShape.from_hf_config(config, dtype, kv_dtype).bytes_per_token == per_token


def test_capacity_and_sequences_in_whole_blocks():
    kv = KVBudget.from_gib(ModelShape.from_hf_config(TINY, "float32"), 1.0, block_size=16)
    assert kv.capacity_tokens == GIB // 2048 == 524_288
    assert kv.max_sequences(2048) == 256
    assert kv.max_sequences(1100) == kv.capacity_blocks // 69  # ceil(1100 / 16) blocks each


def test_unknown_dtype_is_named():
    with pytest.raises(ValueError, match="unknown KV dtype 'int3'"):
        ModelShape.from_hf_config(TINY, "int3")


@pytest.mark.parametrize("q, expected", [(0, 1), (50, 3), (100, 5), (25, 2)])
def test_percentile(q, expected):
    assert percentile([5, 1, 4, 2, 3], q) == expected
