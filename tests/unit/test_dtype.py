"""Which dtype a pool's engines run at, on CPUs with and without bf16 instructions: vLLM's
`auto` runs a float32 checkpoint as bfloat16 even where the CPU has no bf16 (the tiny model then
made 370 output tok/s on an AVX2 host against 762 at float32), and the KV budget must count the
bytes the engine really stores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deployments.app import fingerprint_base, llm_config
from pools.engine import native_bf16, native_fp16, pool_dtype, read_hf_config
from pools.kv_budget import ModelShape, checkpoint_dtype, engine_dtype, runs_at
from tests.unit.test_config import SHAPE, base, check, model_dir, set_path  # noqa: F401 - a fixture

AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw\n\nprocessor\t: 1\nflags\t\t: fpu avx2\n"
SAPPHIRE = "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd atomics\n"


@pytest.mark.parametrize("cpuinfo, machine, native", [
    (AVX2, "x86_64", False), (SAPPHIRE, "x86_64", True), (GRAVITON3, "aarch64", True), (GRAVITON2, "aarch64", False),
    ("flags: whatever\n", "ppc64le", None), ("", "x86_64", None),  # another architecture; nothing to read
])
def test_native_bf16_is_read_from_the_cpus_flags(cpuinfo, machine, native):
    assert native_bf16(cpuinfo, machine) is native


EPYC = "flags\t\t: fpu avx2 avx512f avx512bw avx512_bf16\n"  # Zen 4: bf16, no fp16 arithmetic
GRANITE = "flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_fp16 amx_tile\n"


@pytest.mark.parametrize("cpuinfo, machine, native", [
    (EPYC, "x86_64", False), (AVX2, "x86_64", False), (GRANITE, "x86_64", True),
    (GRAVITON3, "aarch64", None), ("", "x86_64", None),  # not measured on Arm; nothing to read
])
def test_native_fp16_is_read_from_the_cpus_flags(cpuinfo, machine, native):
    assert native_fp16(cpuinfo, machine) is native


@pytest.mark.parametrize("requested, checkpoint, bf16, instead", [
    ("auto", "float16", True, "model.dtype: bfloat16"),  # vLLM's auto keeps a float16 checkpoint's dtype
    ("float16", "float32", True, "model.dtype: bfloat16"),
    ("auto", "float16", False, "model.dtype: float32"),
])
def test_float16_on_a_cpu_without_float16_instructions_is_warned_of(monkeypatch, requested, checkpoint, bf16,
                                                                     instead):
    """On an AVX512-BF16 host without AVX512-FP16 the tiny model made 1,263 output tok/s at
    float16 against 3,795 at float32 and 5,109 at bfloat16 (one core, 640 requests of 200/100)."""
    monkeypatch.setattr("pools.engine.cpu_native_bf16", lambda: bf16)
    monkeypatch.setattr("pools.engine.cpu_native_fp16", lambda: False)
    dtype, slow = pool_dtype(requested, "cpu", {"torch_dtype": checkpoint})
    assert dtype == requested and "float16 instructions" in slow and instead in slow
    assert pool_dtype(requested, "gpu", {"torch_dtype": checkpoint}) == (requested, None)
    monkeypatch.setattr("pools.engine.cpu_native_fp16", lambda: True)
    assert pool_dtype(requested, "cpu", {"torch_dtype": checkpoint}) == (requested, None)
    monkeypatch.setattr("pools.engine.cpu_native_fp16", lambda: None)  # an Arm CPU: not measured, not warned
    assert pool_dtype(requested, "cpu", {"torch_dtype": checkpoint}) == (requested, None)


@pytest.mark.parametrize("requested, checkpoint, native, asked, runs", [
    ("auto", "float32", False, "float32", "float32"),  # the one change: no bf16 in software
    ("auto", "float32", True, "auto", "bfloat16"),
    ("auto", "float32", None, "auto", "bfloat16"),  # a GPU, or a CPU whose flags are unknown: vLLM decides
    ("auto", "bfloat16", False, "auto", "bfloat16"),  # float32 would double the weights' memory
    ("auto", "float16", False, "auto", "float16"),
    ("bfloat16", "float32", False, "bfloat16", "bfloat16"),  # configured: kept
    ("auto", None, False, "auto", None),  # no config.json here: vLLM decides where the model is
])
def test_auto_is_resolved_only_where_vllm_would_emulate_bf16(requested, checkpoint, native, asked, runs):
    assert engine_dtype(requested, checkpoint, native) == asked
    if checkpoint is not None:
        assert runs_at(asked, checkpoint) == runs


@pytest.mark.parametrize("native, accelerator, asked, kv_tokens", [
    (False, "cpu", "float32", 524_288),  # 4 bytes a value, as the engine stores them
    (True, "cpu", "auto", 1_048_576),  # bfloat16: twice the tokens in the same GiB
    (False, "gpu", "auto", 1_048_576),  # the driver's CPU says nothing of a GPU's
])
def test_a_pool_asks_for_its_dtype_and_counts_its_kv_cache_at_it(model_dir, monkeypatch, native, accelerator,
                                                                  asked, kv_tokens):
    monkeypatch.setattr("pools.engine.cpu_native_bf16", lambda: native)
    data = set_path(set_path(base(), "model.dtype", "auto"), "pools.online-chat.engine.accelerator", accelerator)
    r = check(data, model_dir)
    rp = r.pools["online-chat"]
    assert rp.dtype == asked and rp.kv_capacity_tokens == kv_tokens
    assert llm_config(r, rp).engine_kwargs["dtype"] == asked
    assert fingerprint_base(r, rp)["dtype"] == asked  # a profile names what the engine ran at
    assert not [w for w in r.warnings if "bf16 instructions" in w]


def test_a_bfloat16_model_on_a_cpu_without_bf16_is_served_and_warned_of(model_dir, monkeypatch):
    monkeypatch.setattr("pools.engine.cpu_native_bf16", lambda: False)
    r = check(set_path(base(), "model.dtype", "bfloat16"), model_dir)
    assert {rp.dtype for rp in r.pools.values()} == {"bfloat16"}
    slow = [w for w in r.warnings if "bf16 instructions" in w]
    assert len(slow) == 1 and "model.dtype: float32" in slow[0]


@pytest.mark.parametrize("config, named", [
    ({"torch_dtype": "float32"}, "float32"), ({"torch_dtype": "torch.bfloat16"}, "bfloat16"),
    ({"dtype": "float16"}, "float16"),  # newer transformers write `dtype`
    ({"text_config": {"torch_dtype": "bfloat16"}}, "bfloat16"),  # a multimodal model's text model
    ({}, None),  # named nowhere: vLLM reads the weights' headers
    ({"torch_dtype": "float32", "quantization_config": {"quant_method": "awq"}}, None),  # its kernels decide
])
def test_the_checkpoints_dtype_is_what_its_config_names_or_unknown(config, named):
    assert checkpoint_dtype(config) == named


@pytest.mark.parametrize("hf, quantization", [
    ({"torch_dtype": "float32", "quantization_config": {"quant_method": "gptq"}}, None),
    ({"torch_dtype": "float32"}, "fp8"),  # quantized by vLLM at load: 16-bit activations only
    ({}, None),  # no dtype named, no weights to read: a bf16 model must not be upcast
    (None, None),  # a hub id
])
def test_a_model_whose_dtype_is_not_known_here_is_left_to_vllm_and_warned_of(monkeypatch, hf, quantization):
    monkeypatch.setattr("pools.engine.cpu_native_bf16", lambda: False)
    dtype, slow = pool_dtype("auto", "cpu", hf, quantization)
    assert dtype == "auto" and "likely runs" in slow  # vLLM puts bfloat16 first on every x86 CPU
    assert "likely" not in pool_dtype("bfloat16", "cpu", hf, quantization)[1]  # asked for: it does
    monkeypatch.setattr("pools.engine.cpu_native_bf16", lambda: True)
    assert pool_dtype("auto", "cpu", hf, quantization) == ("auto", None)


def safetensors(path: Path, dtypes: dict[str, str]) -> None:
    """A safetensors file of one-element tensors: 8 bytes of header length, the header, the data."""
    size = {"F32": 4, "BF16": 2, "F16": 2}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype in dtypes.items():
        header[name] = {"dtype": dtype, "shape": [1], "data_offsets": [offset, offset + size[dtype]]}
        offset += size[dtype]
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + bytes(offset))


@pytest.mark.parametrize("weights, named", [
    ({"a": "F32", "b": "F32", "norm": "BF16"}, "float32"), ({"a": "BF16", "b": "BF16"}, "bfloat16"), (None, None),
])
def test_a_config_that_names_no_dtype_takes_the_weights_own(tmp_path, weights, named):
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in SHAPE.items() if k != "torch_dtype"}))
    if weights:
        safetensors(tmp_path / "model-00001-of-00002.safetensors", weights)
        safetensors(tmp_path / "model-00002-of-00002.safetensors", {"c": "F16"})  # the first file decides
    assert checkpoint_dtype(read_hf_config(tmp_path)) == named
    assert read_hf_config(tmp_path / "elsewhere") is None


def test_a_multimodal_models_kv_cache_is_its_text_models():
    nested = {"model_type": "llava", "text_config": {**SHAPE, "torch_dtype": "bfloat16"}}
    assert checkpoint_dtype(nested) == "bfloat16"
    assert ModelShape.from_hf_config(nested).bytes_per_token == 2 * 2 * 2 * 64 * 2
    assert checkpoint_dtype({"text_config": "not a table"}) is None
