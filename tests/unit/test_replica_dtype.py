"""A pool replica decides its engine's dtype on its own CPU. The config is resolved on the head,
and on a cluster the head's CPU may lack bf16 instructions a worker has (the head keeps a
float32 checkpoint at float32, where the worker runs it at bfloat16), or have those a worker
lacks. The engine is asked through Ray LLM's own LLMConfig, as the head built, cached and
pickled it for the replica."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

import pools.engine
from pools.server import own_dtype
from tests.unit.test_pool_server import settings


def shipped(source, head_asked: str):
    """An LLMConfig as a pool replica receives it: its engine config built on the head (Serve's
    deployment options do), then pickled."""
    from ray import cloudpickle
    from ray.serve.llm import LLMConfig

    config = LLMConfig(model_loading_config={"model_id": "m", "model_source": str(source)},
                       engine_kwargs={"dtype": head_asked, "max_num_seqs": 8})
    config.get_engine_config()
    return cloudpickle.loads(cloudpickle.dumps(config))


def asked(config) -> str:
    return config.get_engine_config().get_initialization_kwargs()["dtype"]


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float32"}))
    return tmp_path


def replica(model_dtype="auto", head_asked="auto"):
    return dataclasses.replace(settings(), model_dtype=model_dtype,
                               fingerprint_base={**settings().fingerprint_base, "dtype": head_asked})


@pytest.mark.parametrize("head_asked, this_cpu_bf16, asks", [
    ("float32", True, "auto"),  # the head had no bf16, this worker has them: bfloat16, in half the KV bytes
    ("auto", True, "auto"),
    ("float32", False, "float32"),
])
def test_the_replica_asks_for_what_its_own_cpu_calls_for(monkeypatch, model_dir, head_asked, this_cpu_bf16, asks):
    monkeypatch.setattr(pools.engine, "cpu_native_bf16", lambda: this_cpu_bf16)
    monkeypatch.setattr(pools.engine, "cpu_native_fp16", lambda: False)
    config, s = shipped(model_dir, head_asked), replica(head_asked=head_asked)
    base = own_dtype(config, s)
    assert asked(config) == asks and base["dtype"] == asks  # the engine's config, and the fingerprint
    assert {k: v for k, v in base.items() if k != "dtype"} == {k: v for k, v in s.fingerprint_base.items()
                                                                if k != "dtype"}


def test_a_dtype_that_needs_more_kv_than_the_head_sized_for_is_not_taken(monkeypatch, model_dir, caplog):
    """The head had bf16 and this worker has none: float32 would double the KV bytes per token
    of the cache the head's check and the gate's token budget were sized for. The replica keeps
    the head's choice and says how to size the pool for float32."""
    monkeypatch.setattr(pools.engine, "cpu_native_bf16", lambda: False)
    monkeypatch.setattr(pools.engine, "cpu_native_fp16", lambda: False)
    config, s = shipped(model_dir, "auto"), replica()
    with caplog.at_level(logging.WARNING, logger="poolserve.pool"):
        assert own_dtype(config, s) == s.fingerprint_base
    assert asked(config) == "auto" and "Set model.dtype: float32" in caplog.text


def test_a_dtype_set_in_the_config_is_kept(monkeypatch, model_dir):
    monkeypatch.setattr(pools.engine, "cpu_native_bf16", lambda: False)
    config = shipped(model_dir, "bfloat16")
    own_dtype(config, replica("bfloat16", "bfloat16"))
    assert asked(config) == "bfloat16"


def test_a_replica_that_cannot_read_the_model_keeps_the_heads_choice(monkeypatch, model_dir):
    """A hub id, or a directory only the head has: the checkpoint's dtype is unknown here."""
    monkeypatch.setattr(pools.engine, "cpu_native_bf16", lambda: True)
    for source in (model_dir / "missing", "org/some-model"):
        config = shipped(source, "float32")
        assert own_dtype(config, replica(head_asked="float32")) == replica(head_asked="float32").fingerprint_base
        assert asked(config) == "float32"
    config = shipped(model_dir, "float32")
    assert own_dtype(config, settings()) == settings().fingerprint_base  # no configured dtype: as resolved
    assert asked(config) == "float32"
