"""What poolserve takes from the machine and the user's shell: only what it means to.

* Its own calls to a loopback address never go through the environment's proxy: httpx sent
  them, tenant and admin keys with them, to the `HTTP_PROXY` of the user's shell unless
  `NO_PROXY` named the address, where they failed or leaked. A remote address keeps the user's
  proxy settings, as any client's. Real HTTP servers on 127.0.0.1, a real proxy variable.
* The hardware a profile names is the cores the engine can use, not the host's.
* The README's commands take their settings from make's command line, not from the shell.
* A KV cache size in the shell does not size the engines (`VLLM_CPU_KVCACHE_SPACE`)."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import threading
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deployments import batch_job
from deployments.admin_client import AdminClient
from infra import loadgen
from infra.batchfile import BatchRequest
from infra.loadgen import Target
from infra.wire import trust_env

REPO = Path(__file__).resolve().parents[2]

VERSION = {"ray_version": "2.60.0", "version": "4", "session_name": "s"}  # Ray's job API, as its client checks it
ANSWER = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "a b c d"}],
          "usage": {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}}


class _Server:
    """An HTTP server on 127.0.0.1 in a thread that records who called it: `status` to every
    request, with the admin API's empty decision log or a completion."""

    def __init__(self, status: int) -> None:
        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def _reply(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                seen.append((self.command, self.path, self.headers.get("authorization")))
                data = json.dumps([] if "/admin/" in self.path else VERSION if self.path == "/api/version"
                                  else ANSWER).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _reply

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def behind_a_proxy(monkeypatch):
    """poolserve's server, and a proxy the user's shell names for every scheme (it answers 502)."""
    server, proxy = _Server(200), _Server(502)
    for name in ("no_proxy", "NO_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.setenv(name, proxy.url)
    yield server, proxy
    server.close()
    proxy.close()


def test_the_load_generator_reaches_a_local_server_directly(behind_a_proxy):
    server, proxy = behind_a_proxy
    target = Target(f"{server.url}/offline/v1", "sk-tenant", stream=False)

    async def go():
        async with loadgen._client(target, 1) as client:
            return await loadgen.send(client, target, "a b", 4)

    res = asyncio.run(go())
    assert (res.status, res.output_tokens, res.ok) == (200, 4, True)
    assert proxy.seen == [] and server.seen == [("POST", "/offline/v1/completions", "Bearer sk-tenant")]


def test_a_batch_job_reaches_a_local_router_directly(behind_a_proxy, tmp_path):
    server, proxy = behind_a_proxy
    out = tmp_path / "out.jsonl"
    progress = asyncio.run(batch_job.run([BatchRequest(1, "c1", "completions", {"prompt": "a b", "max_tokens": 4})],
                                         out, f"{server.url}/offline/v1", "sk-tenant", 1,
                                         batch_job.RetryPolicy(max_attempts=1)))
    assert (progress.done, progress.failed) == (1, 0)
    assert json.loads(out.read_text())["response"]["status_code"] == 200
    assert proxy.seen == [] and [who for *_, who in server.seen] == ["Bearer sk-tenant"]


def test_the_admin_client_reaches_a_local_router_directly(behind_a_proxy):
    server, proxy = behind_a_proxy
    assert AdminClient(server.url, "admin-key").decisions() == []
    assert proxy.seen == [] and server.seen == [("GET", "/admin/decisions?limit=100", "Bearer admin-key")]


def test_rays_job_client_reaches_a_local_job_api_directly(behind_a_proxy, monkeypatch):
    """Ray's job client (batch submission, from the CLI and the Batch API's service) uses
    `requests`, which poolserve does not build: loopback addresses are named in NO_PROXY for it,
    keeping what the shell named there, in both spellings."""
    from deployments import batch_cli

    server, proxy = behind_a_proxy
    monkeypatch.setenv("NO_PROXY", "corp.internal")
    monkeypatch.setenv("no_proxy", "")  # both restored after the test
    batch_cli._client(server.url)
    assert proxy.seen == [] and {path for _, path, _ in server.seen} == {"/api/version"}
    for key in ("no_proxy", "NO_PROXY"):
        assert os.environ[key].split(",")[:2] == ["corp.internal", "localhost"]
    batch_cli._client(server.url)  # a second client names nothing twice
    assert os.environ["no_proxy"].count("127.0.0.1") == 1


@pytest.mark.parametrize("url, trusted", [
    ("http://127.0.0.1:8000/v1", False), ("http://127.8.9.10:8000", False), ("http://localhost:8000", False),
    ("http://[::1]:8000/v1", False), ("https://LOCALHOST/v1", False), ("http://0.0.0.0:8000", False),
    ("http://localhost.:8000", False), ("http://pool.localhost:8000", False), ("http://[::ffff:127.0.0.1]:80", False),
    ("http://10.0.0.5:8000", True), ("http://raycluster-head-svc:8000", True), ("https://api.example.com/v1", True),
])
def test_only_a_remote_address_takes_the_environments_proxy(url, trusted):
    assert trust_env(url) is trusted


@pytest.mark.parametrize("files, cores", [
    ({}, 8),  # no cgroup limit: the affinity's
    ({"cpu.max": "max 100000\n"}, 8),
    ({"cpu.max": "400000 100000\n"}, 4),  # a Kubernetes limit of 4 cores
    ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 cores' worth runs on 2
    ({"cpu.max": "2000000 100000\n"}, 8),  # a quota above the affinity does not add cores
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, 8),  # cgroup v1, no limit
    ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2),
    ({"cpu.max": "garbage\n"}, 8),
])
def test_the_hardware_names_the_cores_the_engine_can_use_not_the_hosts(tmp_path, monkeypatch, files, cores):
    """A pod held to 4 cores of a 64-core node named the node's 64 (`os.cpu_count()`), and shared
    a profile measured by pods that had them all."""
    from pools import engine

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(engine.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(engine.os, "cpu_count", lambda: 64)
    assert engine.usable_cores(tmp_path) == cores
    monkeypatch.delenv("POOLSERVE_HARDWARE", raising=False)
    monkeypatch.setattr(engine, "usable_cores", lambda: cores)
    monkeypatch.setattr(engine, "_detected_hardware", functools.cache(engine._detected_hardware.__wrapped__))
    assert engine.hardware_name().endswith(f":{cores}cores")


def test_the_hardware_is_detected_once_and_a_named_one_still_wins(monkeypatch):
    """Every replica report asks for the fingerprint; the cgroup files are read once a process."""
    from pools import engine

    calls = []
    monkeypatch.delenv("POOLSERVE_HARDWARE", raising=False)
    monkeypatch.setattr(engine, "usable_cores", lambda: calls.append(1) or 3)
    engine._detected_hardware.cache_clear()  # what this process detected before the patch
    try:
        assert engine.hardware_name() == engine.hardware_name() and engine.hardware_name().endswith(":3cores")
        assert len(calls) == 1
        monkeypatch.setenv("POOLSERVE_HARDWARE", "gpu:L4:1")
        assert engine.hardware_name() == "gpu:L4:1"
    finally:
        engine._detected_hardware.cache_clear()  # not the patched cores for the tests after this one


@pytest.mark.parametrize("target", ["serve", "setup"])
def test_make_takes_its_settings_from_its_command_line_not_from_the_shell(target):
    """A `CONFIG`, `PYTHON` or `PIP_EXTRA` exported for something else did not change what the
    README's commands ran; on make's command line they do."""
    # Under `make test PYTHON=...`, MAKEFLAGS carries the outer command line into this make.
    outer = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}

    def dry_run(*args: str, **env: str) -> str:
        return subprocess.run(["make", "-n", "-B", target, *args], cwd=REPO, capture_output=True, text=True,
                              check=True, env={**outer, **env}).stdout

    shell = dry_run(CONFIG="/elsewhere/other.yaml", PYTHON="/no/such/python", PIP_EXTRA="--index-url http://x")
    assert "/elsewhere" not in shell and "/no/such/python" not in shell and "http://x" not in shell
    assert "python3 -m venv .venv" in shell
    if target == "serve":
        assert "poolserve serve deployments/configs/local.yaml" in shell
        assert "poolserve serve /elsewhere/other.yaml" in dry_run("CONFIG=/elsewhere/other.yaml")


def test_a_kv_cache_size_in_the_users_shell_does_not_reach_the_engine():
    """vLLM's CPU platform lets a non-empty `VLLM_CPU_KVCACHE_SPACE` replace the engine's
    `kv_cache_memory_bytes`; a replica drops it before its engine starts (the integration stack
    starts Ray with it set and checks the engines' cache size)."""
    from pools.engine import drop_engine_overrides

    environ = {"VLLM_CPU_KVCACHE_SPACE": "8", "VLLM_CPU_OMP_THREADS_BIND": "0", "PATH": "/bin"}
    assert drop_engine_overrides(environ) == ["VLLM_CPU_KVCACHE_SPACE"]
    assert environ == {"VLLM_CPU_OMP_THREADS_BIND": "0", "PATH": "/bin"}
    assert drop_engine_overrides(environ) == []
