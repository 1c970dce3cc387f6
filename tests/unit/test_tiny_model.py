"""The tiny model is reproducible and has the shapes vLLM's CPU backend needs."""

import json

from pools.tiny_model import directory_digest, make_tiny_model


def test_two_runs_write_identical_files(tmp_path):
    a = make_tiny_model(tmp_path / "a")
    b = make_tiny_model(tmp_path / "b")
    assert directory_digest(a) == directory_digest(b)
    names = sorted(p.name for p in a.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
                     "tokenizer.json", "tokenizer_config.json"]


def test_shapes_and_tokenizer(tmp_path):
    out = make_tiny_model(tmp_path / "m")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == cfg["head_dim"] == 64
    assert cfg["torch_dtype"] == "float32" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["max_position_embeddings"] >= 8192  # room for bench/overhead.py's 4,096-token prompts
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>\nhi</s>\n<|assistant|>\n"
    ids = tok.encode("The batch queue is 42 tokens long.", add_special_tokens=False)
    assert tok.decode(ids) == "The batch queue is 42 tokens long."
    assert len(tok) == cfg["vocab_size"]
