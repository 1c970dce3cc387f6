"""vLLM's offline engine (`LLM.generate`) with a pool's engine ceilings on one core: the
ceiling any serving path on top of the same engine can reach. Writes one JSON object to
`--out` (vLLM's own log lines share stdout).

    VLLM_CPU_OMP_THREADS_BIND=1 python -m bench.raw_engine --model .cache/models/tiny-llama --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.raw_engine")
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", type=int, default=640)
    p.add_argument("--input", type=int, default=200)
    p.add_argument("--output", type=int, default=100)
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--batched", type=int, default=4096)
    p.add_argument("--kv-gb", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "auto"))
    p.add_argument("--placement", choices=("free", "bound"), default="free",
                   help="the engine core as vLLM leaves it, or bound beside its workers (bench.setups.place)")
    p.add_argument("--out", required=True, help="where the result's JSON goes")
    a = p.parse_args(argv)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from bench.setups import engine_processes, place

    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=2048, max_num_seqs=a.seqs,
              max_num_batched_tokens=a.batched, enable_chunked_prefill=True,
              kv_cache_memory_bytes=int(a.kv_gb * (1 << 30)))
    cores = place(engine_processes(os.getpid()), a.placement)
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(a.seed)  # random token ids, as `vllm bench serve --dataset-name random` sends

    def prompts(n: int) -> list[TokensPrompt]:
        return [TokensPrompt(prompt_token_ids=[rng.randrange(100, vocab) for _ in range(a.input)]) for _ in range(n)]

    params = SamplingParams(max_tokens=a.output, ignore_eos=True)
    llm.generate(prompts(a.seqs), params, use_tqdm=False)  # warm-up
    batch = prompts(a.prompts)
    t0 = time.monotonic()
    outs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.monotonic() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    with open(a.out, "w") as f:
        json.dump({"requests": len(outs), "output_tokens": tokens, "seconds": seconds,
                   "output_tok_s": tokens / seconds, "engine_cores": cores}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
