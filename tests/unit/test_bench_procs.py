"""Which processes the ceiling counts as poolserve's serving cost: a client or a baseline's server
counted there would hide (or invent) a change in poolserve's own CPU."""

import subprocess
import sys
import time

from bench import procs, verdicts


def test_each_process_on_the_path_gets_its_own_role():
    titles = {
        "ray::ProxyActor": "HTTP proxy",
        "/usr/sbin/haproxy -f /tmp/ray/haproxy.cfg": "HTTP proxy (HAProxy)",
        "ray::HAProxyManager.run": "HTTP proxy (HAProxy)",
        "python -m vllm.entrypoints.openai.api_server --model m": "vLLM API server",
        "python -m bench.vllm_bench --base-url http://x": "client",
        "python -m infra.loadgen --url http://x": "client",
        "python -m deployments.batch_job --input in.jsonl": "client",
        "ray::ServeReplica:poolserve-offline-batch:pool-offline-batch.handle_request":
            "replica poolserve-offline-batch:pool-offline-batch",
        "ray::ServeController.run": "Serve controller",
        "VLLM::EngineCore": "engine core",
        "VLLM::Worker_TP0": "engine worker",
        "/work/.venv/bin/gcs_server --log_dir=x": "Ray daemons",
        "[kworker/0:1]": "other",
    }
    assert {t: procs.role(t) for t in titles} == titles


def test_serving_cost_counts_poolserve_and_serve_but_not_clients_engines_or_baselines():
    per_1k = {"HTTP proxy": 0.08, "HTTP proxy (HAProxy)": 0.01, "Serve controller": 0.02, "Ray daemons": 0.03,
              "replica poolserve-offline-batch:pool-offline-batch": 0.15, "replica poolserve:router": 0.1,
              "replica stock-one:OpenAiIngress": 0.2, "engine core of poolserve:pool-offline-batch": 0.2,
              "engine worker": 0.3, "client": 0.5, "vLLM API server": 0.4, "other": 0.05}
    kept = verdicts.serving_cpu(per_1k)
    assert set(kept) == {"HTTP proxy", "HTTP proxy (HAProxy)", "Serve controller", "Ray daemons",
                         "replica poolserve-offline-batch:pool-offline-batch", "replica poolserve:router"}


SPINNER = """import sys, time
from pathlib import Path
go, stop = Path(sys.argv[1]), Path(sys.argv[2])
while not go.exists():
    time.sleep(0.01)
def spin_under_load():
    while not stop.exists():
        sum(range(1000))
spin_under_load()
"""


def test_a_profile_covers_the_whole_block_not_a_window_from_its_start(tmp_path):
    """The process works only after the block has waited a while, as poolserve does once the
    ceiling round's client has started up: its frames are in the profile."""
    go, stop = tmp_path / "go", tmp_path / "stop"
    target = subprocess.Popen([sys.executable, "-c", SPINNER, str(go), str(stop)])
    try:
        with procs.profiling({"spinner": target.pid}, tmp_path / "profile") as files:
            time.sleep(2)  # idle first, as while a client starts up: a fixed window may end in it
            go.touch()
            time.sleep(2)
            stop.touch()
            target.wait(30)
    finally:
        stop.touch()
        target.kill()
        target.wait()
    assert "spin_under_load" in files["spinner"].read_text()
