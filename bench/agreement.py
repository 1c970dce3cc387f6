"""The load generator against `vllm bench serve`, side by side: both drive the same endpoint
at the same time, half the concurrency each, so that they see the same server.

On a shared two-core box the server's TTFT drifts by more than 15% from one minute to the
next (a run of the same tool a minute later has measured 260 ms and then 310 ms), so tools
run one after the other compare the machine's drift as much as themselves. Side by side,
only the requests of each tool that started and ended while both were sending are compared.

Both send prompts of the same kind: vLLM's reads ours from a JSONL file (its `custom`
dataset). Its own `random` dataset (random token ids) cost the server itself 7-20 ms more
TTFT per request than word prompts of the same token count here; with `--vllm-dataset random`
that difference shows up in the comparison.

    python -m bench.agreement --base-url http://127.0.0.1:8000 --prefix /online --key sk-chat-dev \\
        --concurrency 4 --prompt 128 --output 64 --requests 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.common import REPO
from bench.intervals import DRAWS, p50, ratio
from infra.loadgen import read_raw
from infra.traffic import make_prompt


STOP_S = 60  # for our load generator to finish its last requests once vLLM's tool is done


@dataclass(frozen=True)
class Timing:
    """One request as either tool saw it; `start` on the system's monotonic clock (Python's
    `time.monotonic` and `time.perf_counter` both read CLOCK_MONOTONIC on Linux)."""

    start: float
    ttft: float
    e2e: float
    output_tokens: int

    @property
    def end(self) -> float:
        return self.start + self.e2e

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def compare(ours: list[Timing], theirs: list[Timing], draws: int = DRAWS) -> dict:
    """Medians of TTFT and TPOT (ms) over each tool's requests inside the window both were
    sending, and how far ours are from theirs."""
    if not ours or not theirs:
        raise ValueError("both tools need completed requests to compare")
    lo = max(min(t.start for t in ours), min(t.start for t in theirs))
    hi = min(max(t.end for t in ours), max(t.end for t in theirs))

    def inside(ts: list[Timing]) -> list[Timing]:
        return [t for t in ts if lo <= t.start and t.end <= hi]

    def samples(ts: list[Timing]) -> dict[str, list[float]]:
        return {"ttft_ms": [t.ttft * 1e3 for t in ts], "tpot_ms": [t.tpot * 1e3 for t in ts if t.tpot is not None]}

    def medians(xs: dict[str, list[float]]) -> dict:
        return {k: statistics.median(v) if v else None for k, v in xs.items()}

    ia, ib = inside(ours), inside(theirs)
    xa, xb = samples(ia), samples(ib)
    a, b = medians(xa), medians(xb)
    diff = {k: (a[k] - b[k]) / b[k] if a[k] is not None and b[k] else None for k in ("ttft_ms", "tpot_ms")}
    # A median of ~100 requests moves by several percent from one sample to the next: the
    # interval says whether a difference is the tools' or the sample's.
    spread = {k: [iv.lo - 1, iv.hi - 1] for k in diff if diff[k] is not None
              for iv in [ratio([xa[k]], [xb[k]], p50, draws=draws)]}
    return {"overlap_s": max(0.0, hi - lo), "ours": {"n": len(ia), **a}, "vllm": {"n": len(ib), **b},
            "relative_difference": diff,
            "relative_difference_95": spread}


def disagree(out: dict, name: str, within: float = 0.15) -> bool:
    """Whether the tools measure `name` more than `within` apart: the whole 95% interval of the
    relative difference beyond it, not the point value, which the sample moves by itself."""
    lo, hi = out["relative_difference_95"][name]
    return lo > within or hi < -within


def vllm_timings(result: dict) -> list[Timing]:
    """Requests from `vllm bench serve --save-detailed`: its latency is TTFT plus the gaps
    between chunks, its TPOT (latency − TTFT) / (output tokens − 1), as ours."""
    out = []
    for start, ttft, itls, n, err in zip(result["start_times"], result["ttfts"], result["itls"],
                                         result["output_lens"], result["errors"]):
        if not err and ttft:
            out.append(Timing(start, ttft, ttft + sum(itls), n))
    return out


def _vllm_command(base_url: str, prefix: str, model: str, tokenizer: str, concurrency: int, prompt: int,
                  output: int, requests: int, seed: int, result_dir: str, dataset: str) -> list[str]:
    if dataset == "random":
        data = ["--dataset-name", "random", "--random-input-len", str(prompt), "--random-output-len", str(output)]
    else:  # our prompts, as they are: no chat template, the output length given
        path = Path(result_dir) / "prompts.jsonl"
        rng = random.Random(seed)
        path.write_text("".join(json.dumps({"prompt": make_prompt(prompt, rng)}) + "\n" for _ in range(requests)))
        data = ["--dataset-name", "custom", "--dataset-path", str(path), "--skip-chat-template",
                "--custom-output-len", str(output)]
    return [sys.executable, "-m", "bench.vllm_bench", "--base-url", base_url,
            "--endpoint", f"{prefix}/v1/completions", "--model", model, "--tokenizer", tokenizer, *data,
            "--ignore-eos", "--max-concurrency", str(concurrency), "--num-prompts", str(requests),
            "--request-rate", "inf", "--seed", str(seed), "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", result_dir, "--result-filename", "vllm.json"]


async def side_by_side(base_url: str, prefix: str, key: str, tokenizer: str, concurrency: int = 4,
                       prompt: int = 128, output: int = 64, requests: int = 100, seed: int = 0,
                       model: str = "tiny-llama", dataset: str = "ours") -> dict:
    """`vllm bench serve` sends `requests` at concurrency/2 while ours keeps concurrency/2
    outstanding until it exits; both with fresh prompts (their own seeds), so that neither finds
    the other's prefixes cached, and each in a process of its own: in the caller's (a test's Ray
    driver, with its threads) ours measured 23% more TTFT than vLLM's tool beside it."""
    half = max(1, concurrency // 2)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "ours.jsonl.gz"
        procs: list[asyncio.subprocess.Process] = []
        try:
            ours_proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "infra.loadgen", "--url", f"{base_url}{prefix}/v1", "--key", key, "--model",
                model, "--concurrency", str(half), "--prompt", str(prompt), "--output", str(output), "--warmup", "0",
                "--duration", str(24 * 3600), "--seed", str(seed), "--raw", str(raw),
                cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            procs.append(ours_proc)
            vllm_proc = await asyncio.create_subprocess_exec(
                *_vllm_command(base_url, prefix, model, tokenizer, half, prompt, output, requests, seed + 1, tmp,
                               dataset),
                cwd=REPO, env={**os.environ, "OPENAI_API_KEY": key},
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
            procs.append(vllm_proc)
            _, err = await vllm_proc.communicate()
            ours_proc.terminate()  # it sends nothing more, finishes what runs and reports what it sent
            out, ours_err = await asyncio.wait_for(ours_proc.communicate(), STOP_S)
        finally:
            for p in procs:  # whatever failed or was cancelled: no tool keeps sending after this
                if p.returncode is None:
                    p.kill()
                    await p.wait()
        if vllm_proc.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed ({vllm_proc.returncode}): {err.decode()[-2000:]}")
        if ours_proc.returncode != 0:
            raise RuntimeError(f"the load generator failed ({ours_proc.returncode}): {ours_err.decode()[-2000:]}")
        theirs = json.loads((Path(tmp) / "vllm.json").read_text())
        results = read_raw(raw)
    ours = [Timing(r.start, r.ttft, r.e2e, r.output_tokens) for r in results
            if r.ok and r.ttft is not None and r.e2e is not None]
    return {"concurrency": {"ours": half, "vllm": half}, "lengths": f"{prompt}/{output}", "vllm_dataset": dataset,
            "requests": {"ours": len(results), "vllm": theirs["completed"]},
            "loop_lag_ms": json.loads(out)["loop_lag_ms"], **compare(ours, vllm_timings(theirs))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.agreement", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--prefix", default="/online", help="the pool's route prefix")
    p.add_argument("--key", required=True)
    p.add_argument("--tokenizer", default=str(REPO / ".cache" / "models" / "tiny-llama"))
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--concurrency", type=int, default=4, help="both tools together (half each)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--requests", type=int, default=100, help="sent by vllm bench serve; ours runs as long")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-dataset", choices=("ours", "random"), default="ours",
                   help="vLLM's prompts: ours from a file, or its own random token ids")
    a = p.parse_args(argv)
    out = asyncio.run(side_by_side(a.base_url, a.prefix, a.key, a.tokenizer, a.concurrency, a.prompt, a.output,
                                   a.requests, a.seed, a.model, a.vllm_dataset))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
