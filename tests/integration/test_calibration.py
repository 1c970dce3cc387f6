"""Calibration on the real stack: a short sweep, and the load generator against vLLM's bench."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from autoscale.profile import load_profile
from tests.integration.conftest import ADMIN, CONFIG, KEYS, MODEL, REPO

pytestmark = pytest.mark.integration


def test_short_sweep_writes_a_valid_profile(stack, tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "deployments.cli", "calibrate", "--config", str(CONFIG), "--pool", "online-chat",
         "--ladder", "1,2,4", "--key", KEYS["chat"], "--admin-key", ADMIN, "--lengths", "64/32",
         "--warmup", "2", "--check", "3", "--min-measure", "6", "--cap", "9", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    for step in (1, 2, 4):  # progress while it runs
        assert f"max_active_seqs={step}: applying limit" in out and f"max_active_seqs={step}: " in out
    assert "| max_active_seqs |" in out and "Safe range [" in out  # the table and the chosen range
    profile = load_profile(tmp_path / "online-chat.yaml")
    assert profile.ladder == (1, 2, 4)
    tok = [r.output_tok_per_s for r in profile.rows]
    assert tok[0] < tok[1] < tok[2], tok
    assert all(r.requests > 0 and r.errors == 0 for r in profile.rows)
    assert profile.fingerprint.model == "tiny-llama" and profile.fingerprint.max_num_seqs == 32
    assert profile.range[0] == 1 and profile.range[1] in (1, 2, 4) and profile.reason
    assert (tmp_path / "online-chat.png").stat().st_size > 10_000
    assert "Safe range" in (tmp_path / "online-chat.md").read_text()
    # the pool is released after the sweep
    assert stack.pools()["online-chat"]["target_max_active_seqs"] in (2, 4, 8, 16)


N = 120  # requests per run


def _vllm_bench(stack, tmp_path, name: str) -> dict:
    env = {**os.environ, "OPENAI_API_KEY": KEYS["chat"]}
    run = subprocess.run(
        [sys.executable, "-m", "bench.vllm_bench", "--base-url", stack.base_url,
         "--endpoint", "/online/v1/completions", "--model", "tiny-llama", "--tokenizer", str(MODEL),
         "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "64",
         "--ignore-eos", "--max-concurrency", "4", "--num-prompts", str(N), "--request-rate", "inf",
         "--seed", "0", "--save-result", "--result-dir", str(tmp_path), "--result-filename", name],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads((tmp_path / name).read_text())
    assert out["completed"] == N
    return {"ttft": out["median_ttft_ms"], "tpot": out["median_tpot_ms"]}


def _loadgen(stack) -> dict:
    run = subprocess.run(  # in its own process, as vLLM's is
        [sys.executable, "-m", "bench.loadgen", "--url", f"{stack.base_url}/online/v1", "--key", KEYS["chat"],
         "--concurrency", "4", "--prompt", "128", "--output", "64", "--requests", str(N), "--warmup", "0",
         "--duration", "100000"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out["completed"] == N
    return {"ttft": out["ttft_ms"]["p50"], "tpot": out["tpot_ms"]["p50"]}


@pytest.mark.slow  # TTFT medians drifted apart by 14-20% on 2026-11-30 (TPOT agrees): open on issue 5
def test_loadgen_agrees_with_vllm_bench_serve(stack, tmp_path):
    """Same endpoint, lengths (128 in / 64 out) and concurrency (4), N requests a run, the
    tools alternating over three rounds in turned order (AB BA AB) so that drift of the
    machine hits both: the medians of the per-run medians agree within 15%."""
    theirs, ours = [], []
    with stack.pinned("online-chat", 4):
        for i in range(3):
            runs = [lambda: theirs.append(_vllm_bench(stack, tmp_path, f"vllm{i}.json")),
                    lambda: ours.append(_loadgen(stack))]
            for run in runs if i % 2 == 0 else runs[::-1]:
                run()
    print(f"\nloadgen vs vllm bench serve medians (ms): ours {ours}, vLLM's {theirs}")
    for name in ("ttft", "tpot"):
        a = statistics.median(r[name] for r in ours)
        b = statistics.median(r[name] for r in theirs)
        assert abs(a - b) / b <= 0.15, (name, a, b, ours, theirs)
