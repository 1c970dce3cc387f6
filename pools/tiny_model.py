"""Write a tiny, seeded Llama with a trained byte-level BPE tokenizer.

The model has random weights, so it generates gibberish, but it has the shapes that
vLLM's CPU backend accepts (head_dim 64: the CPU attention kernels reject 16) and a
real tokenizer and chat template, so every byte of the serving path is exercised.
Two runs with the same seed write byte-identical files.

torch, transformers and tokenizers are imported lazily: importing `pools` must not
pull them in.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

# Like the templates of real chat models, it renders tools, documents and assistant tool calls
# into the prompt: what a client sends besides its messages costs prompt tokens too.
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</s>\n{% endif %}"
    "{% if documents %}<|system|>\n{% for doc in documents %}{{ doc | tojson }}\n{% endfor %}</s>\n{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] or '' }}"
    "{% for call in message.get('tool_calls') or [] %}{{ call | tojson }}{% endfor %}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]


@dataclass(frozen=True)
class TinyModelSpec:
    """Shapes of the tiny model. head_dim = hidden_size / num_attention_heads = 64."""

    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 704
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 8192  # RoPE: no weights depend on it; the deployments choose max_model_len
    seed: int = 0


_WORDS = (
    "the a an of to in on for with from by about batch token cache queue model "
    "request latency throughput prefill decode sequence pool tenant quota chat "
    "offline online serve replica engine limit budget window knee range profile "
    "time first output input length memory block kernel graph priority fair share "
    "is are was be can will should must not and or but if then when while because "
    "we you they it this that these those one two three four eight sixteen"
).split()


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    """A seeded pseudo-English corpus with digits and punctuation, for BPE training."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 18))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        sentence = " ".join(words)
        out.append(sentence[0].upper() + sentence[1:] + rng.choice(".?!,;:"))
    return out


def _train_tokenizer(spec: TinyModelSpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    return tok


def _write_tokenizer(tok, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"},
                   indent=2, sort_keys=True) + "\n"
    )


def _model_config(spec: TinyModelSpec, tok) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.hidden_size // spec.num_attention_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": tok.token_to_id("<s>"),
        "eos_token_id": tok.token_to_id("</s>"),
        "pad_token_id": tok.token_to_id("<pad>"),
        "initializer_range": 0.02,
    }


def _weights(spec: TinyModelSpec) -> dict:
    """Llama parameter tensors, normal(0, 0.02), norms at 1, from one seeded generator."""
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    h, i, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    kv = spec.num_key_value_heads * (h // spec.num_attention_heads)

    def normal(*shape: int):
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * 0.02

    tensors = {"model.embed_tokens.weight": normal(v, h)}
    for layer in range(spec.num_hidden_layers):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "self_attn.q_proj.weight": normal(h, h),
            p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h),
            p + "self_attn.o_proj.weight": normal(h, h),
            p + "mlp.gate_proj.weight": normal(i, h),
            p + "mlp.up_proj.weight": normal(i, h),
            p + "mlp.down_proj.weight": normal(h, i),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        }
    tensors["model.norm.weight"] = torch.ones(h)
    tensors["lm_head.weight"] = normal(v, h)
    return tensors


def make_tiny_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write config, weights, tokenizer and generation config into `out_dir`."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(spec)
    _write_tokenizer(tok, out)
    config = _model_config(spec, tok)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    save_file(_weights(spec), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def directory_digest(path: str | Path) -> str:
    """SHA-256 over every file's name and bytes, in name order: equal digests, equal models."""
    digest = hashlib.sha256()
    for f in sorted(Path(path).iterdir()):
        if f.is_file():
            digest.update(f.name.encode())
            digest.update(f.read_bytes())
    return digest.hexdigest()
