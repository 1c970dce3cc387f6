"""A pool replica decides its engine's dtype on its own CPU. The config is resolved on the head,
and on a cluster the head's CPU may have bf16 instructions a worker lacks (the engine would run
bfloat16 in software, at half the speed) or lack those a worker has."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

import pools.engine
from pools.server import own_dtype
from tests.unit.test_pool_server import settings


def llm_config(source, asked: str) -> SimpleNamespace:
    return SimpleNamespace(engine_kwargs={"dtype": asked, "max_num_seqs": 8},
                           model_loading_config=SimpleNamespace(model_id="m", model_source=str(source)))


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float32"}))
    return tmp_path


@pytest.mark.parametrize("head_asked, this_cpu_bf16, asks", [
    ("auto", False, "float32"),  # the head had bf16, this worker has none: float32, not bf16 in software
    ("float32", True, "auto"),  # the head had none, this worker has them: vLLM's bfloat16
    ("auto", True, "auto"),
    ("float32", False, "float32"),
])
def test_the_replica_asks_for_what_its_own_cpu_calls_for(monkeypatch, model_dir, head_asked, this_cpu_bf16, asks):
    monkeypatch.setattr(pools.engine, "cpu_native_bf16", lambda: this_cpu_bf16)
    monkeypatch.setattr(pools.engine, "cpu_native_fp16", lambda: False)
    config = llm_config(model_dir, head_asked)
    s = dataclasses.replace(settings(), model_dtype="auto",
                            fingerprint_base={**settings().fingerprint_base, "dtype": head_asked})
    base = own_dtype(config, s)
    assert config.engine_kwargs["dtype"] == asks and base["dtype"] == asks  # the fingerprint names what it asked
    assert {k: v for k, v in base.items() if k != "dtype"} == {k: v for k, v in s.fingerprint_base.items()
                                                                if k != "dtype"}


def test_a_dtype_set_in_the_config_is_kept(monkeypatch, model_dir):
    monkeypatch.setattr(pools.engine, "cpu_native_bf16", lambda: False)
    config = llm_config(model_dir, "bfloat16")
    own_dtype(config, dataclasses.replace(settings(), model_dtype="bfloat16"))
    assert config.engine_kwargs["dtype"] == "bfloat16"


def test_a_replica_that_cannot_read_the_model_keeps_the_heads_choice(monkeypatch, tmp_path, model_dir):
    """A hub id, or a directory only the head has: the checkpoint's dtype is unknown here."""
    monkeypatch.setattr(pools.engine, "cpu_native_bf16", lambda: True)
    s = dataclasses.replace(settings(), model_dtype="auto")
    for source in (model_dir / "missing", "org/some-model"):
        config = llm_config(source, "float32")
        assert own_dtype(config, s) == s.fingerprint_base and config.engine_kwargs["dtype"] == "float32"
    config = llm_config(model_dir, "float32")
    assert own_dtype(config, settings()) == settings().fingerprint_base  # no configured dtype: as resolved
    assert config.engine_kwargs["dtype"] == "float32"
