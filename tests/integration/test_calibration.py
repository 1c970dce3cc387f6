"""Calibration on the real stack: a short sweep, and the load generator beside vLLM's bench."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from autoscale.profile import load_profile
from bench.agreement import disagree, side_by_side
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
    # each step measured real answers; how throughput grows from step to step is the machine's, not
    # the sweep's (on a shared two-core box steps of a short sweep can fall within noise)
    assert all(r.requests > 0 and r.errors == 0 and r.output_tok_per_s > 0 and r.duration_s > 0
               for r in profile.rows), profile.rows
    assert profile.fingerprint.model == "tiny-llama" and profile.fingerprint.max_num_seqs == 32
    assert profile.range[0] == 1 and profile.range[1] in (1, 2, 4) and profile.reason
    assert (tmp_path / "online-chat.png").stat().st_size > 10_000
    assert "Safe range" in (tmp_path / "online-chat.md").read_text()
    # the pool is released after the sweep
    assert stack.pools()["online-chat"]["target_max_active_seqs"] in (2, 4, 8, 16)


def test_calibrate_runs_from_an_installed_package(stack, tmp_path):
    """`pip install` of the package into a fresh virtualenv outside the repository (its
    dependencies borrowed from the project's environment), then `poolserve calibrate` from
    another folder: the trace it replays is package data, and nothing comes from bench/."""
    import site
    import sysconfig

    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(REPO)],
                   check=True, capture_output=True, timeout=300)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], check=True, capture_output=True, text=True).stdout.strip()
    deps = site.getsitepackages()[0] if site.getsitepackages() else sysconfig.get_paths()["purelib"]
    (Path(purelib) / "borrowed_dependencies.pth").write_text(deps + "\n")  # no .pth of that folder is run
    subprocess.run([str(venv / "bin" / "pip"), "install", "--no-deps", "-q", *map(str, wheels.glob("*.whl"))],
                   check=True, capture_output=True, timeout=300)
    where = tmp_path / "elsewhere"
    where.mkdir()
    run = subprocess.run(
        [str(venv / "bin" / "poolserve"), "calibrate", "--config", str(CONFIG), "--pool", "online-chat",
         "--ladder", "1,2", "--key", KEYS["chat"], "--admin-key", ADMIN, "--lengths", "trace",
         "--warmup", "1", "--check", "2", "--min-measure", "4", "--cap", "8", "--out", str(where / "out")],
        cwd=where, capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-3000:]
    imported = subprocess.run([str(venv / "bin" / "python"), "-c", "import infra.traffic, sys; "
                               "print(infra.traffic.__file__); print('bench' in sys.modules)"],
                              cwd=where, capture_output=True, text=True, check=True).stdout.split()
    assert imported[0].startswith(str(venv)) and imported[1] == "False"  # the installed copy, not the repository's
    profile = load_profile(where / "out" / "online-chat.yaml")
    assert profile.ladder == (1, 2) and "azure_llm_2023_conv.csv" in profile.traffic.source


def test_loadgen_agrees_with_vllm_bench_serve(stack):
    """Side by side on the same endpoint (pool pinned at 4, two streams from each tool),
    128 prompt / 64 output tokens, prompts of the same kind: over the requests of each
    tool that ran while both were sending, TTFT and TPOT medians agree within 15%, by the
    95% interval of their difference (a CI run's point values of ~120 requests a tool were
    17.7% apart on TTFT while TPOT agreed to 0.1%)."""
    with stack.pinned("online-chat", 4):
        out = asyncio.run(side_by_side(stack.base_url, "/online", KEYS["chat"], str(MODEL), concurrency=4,
                                       prompt=128, output=64, requests=240, seed=7))
    print(f"\nloadgen vs vllm bench serve: {json.dumps(out)}")
    assert out["requests"]["vllm"] == 240
    assert out["ours"]["n"] >= 120 and out["vllm"]["n"] >= 180, out  # most of both runs overlapped
    for name in ("ttft_ms", "tpot_ms"):
        assert not disagree(out, name), (name, out)


def test_the_shipped_profiles_fit_the_embedded_default(stack):
    """The profiles in deployments/configs/profiles/ were measured on the embedded default's
    engines (this suite's are the same): every part of a running replica's fingerprint but the
    hardware is theirs, so on their hardware the default's pools run in their range at once, and
    anywhere else only the hardware sends them to a sweep."""
    from autoscale.profile import Fingerprint

    for pool in ("online-chat", "offline-batch"):
        shipped = load_profile(REPO / "deployments" / "configs" / "profiles" / f"{pool}.yaml").fingerprint
        running = Fingerprint(**stack.admin_client.describe(pool).fingerprint)
        assert [d for d in shipped.differences(running) if not d.startswith("hardware:")] == [], pool
        assert running.engine.startswith("llama:") and "threads=1" in running.engine
