"""One real stack per test session: local Ray, Serve, both vLLM (CPU) pools with the tiny
model, router, ledger and autoscaler, deployed from tests/integration/config.yaml.

Tests talk to it over HTTP (the `openai` SDK and httpx) and synchronise on conditions
with timeouts (`wait_for`), never on fixed sleeps. Tests that change limits or SLOs put
them back (`pinned`, `slo`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CONFIG = HERE / "config.yaml"
MODEL = REPO / ".cache" / "models" / "tiny-llama"
KEYS = {"chat": "sk-test-chat", "batch": "sk-test-batch", "limited": "sk-test-limited", "other": "sk-test-other"}
ADMIN = "test-admin"

pytestmark = pytest.mark.integration


def pytest_collection_modifyitems(config, items):
    """Tests on a Ray of their own run first, before the session's stack starts; tests that kill
    replicas run after every other test of the session."""
    items.sort(key=lambda item: 0 if item.get_closest_marker("own_cluster") else
               2 if item.get_closest_marker("disruptive") else 1)


def wait_for(condition, timeout: float = 60.0, interval: float = 0.2, what: str = "condition"):
    """Poll `condition` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = condition()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


@dataclass
class Stack:
    base_url: str
    metrics_url: str
    dashboard_url: str
    resolved: object

    def client(self, tenant: str = "chat", pool: str | None = "online", **kw):
        from openai import OpenAI

        base = f"{self.base_url}/{pool}/v1" if pool else f"{self.base_url}/v1"
        return OpenAI(base_url=base, api_key=KEYS[tenant], max_retries=0, timeout=kw.pop("timeout", 120), **kw)

    def admin(self, method: str, path: str, **kw) -> httpx.Response:
        return httpx.request(method, f"{self.base_url}{path}", headers={"Authorization": f"Bearer {ADMIN}"},
                             timeout=30, **kw)

    @property
    def admin_client(self):
        from deployments.admin_client import AdminClient

        return AdminClient(self.base_url, ADMIN)

    def pools(self) -> dict:
        return {name: s.model_dump(mode="json") for name, s in self.admin_client.pools().items()}

    def replica(self, pool: str) -> dict:
        """The pool's replica as the controller last heard from it. Under a flood on these two
        shared cores one report can come late (the controller logs each gap), so this waits a
        few seconds for a fresh one instead of failing on the first look."""
        return wait_for(lambda: (self.pools()[pool]["replicas"] or [None])[0], 10,
                        what=f"a fresh report from {pool}")

    def fresh_replica(self, pool: str, since: float | None = None) -> dict:
        """The replica's first report made after this call (or after `since`): it counts
        everything done before."""
        since = time.time() if since is None else since
        return wait_for(lambda: (lambda r: r if r["reported_at"] > since else None)(self.replica(pool)), 10,
                        what=f"a fresh report from {pool}")

    @contextlib.contextmanager
    def pinned(self, pool: str, seqs: int, calibrating: bool = True):
        """Hold a pool's limit for the duration of a block; it starts once every replica applied
        it (they echo the pin's epoch)."""
        with self.admin_client.pinned(pool, seqs, calibrating):
            assert self.replica(pool)["limits"]["max_active_seqs"] == seqs
            yield

    def wait_idle(self, pool: str, timeout: float = 120) -> None:
        last = {}

        def idle() -> bool:
            last["report"] = r = self.replica(pool)
            return r["active"] == 0 and sum(r["queued_by_class"].values()) == 0
        try:
            wait_for(idle, timeout, what=f"{pool} idle")
        except AssertionError as e:
            raise AssertionError(f"{e}; its last report: {last.get('report')}") from None


@pytest.fixture(scope="session")
def stack():
    import ray
    from ray import serve

    from deployments.app import deploy, on_free_metrics_port, on_local_dashboard, start_local_ray
    from deployments.config import load

    if not (MODEL / "config.json").exists():
        from pools.tiny_model import make_tiny_model

        make_tiny_model(MODEL)
    resolved = on_free_metrics_port(load(CONFIG))
    c = resolved.config
    # The shell that starts Ray asks vLLM for another KV cache: the engines keep the config's
    # (test_kv_estimator_matches_vllm_startup_log). Ray's processes have it from here on.
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "3"
    try:
        # Where the Batch API submits, as `poolserve serve` sets it: 8265, or the next free port.
        resolved = on_local_dashboard(resolved, start_local_ray(c.ray, keep_free={c.router.port}, include_dashboard=True,
                                                                log_to_driver=False))
    finally:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE")
    serve.start(http_options={"host": c.router.host, "port": c.router.port})
    deploy(resolved)
    s = Stack(f"http://{c.router.host}:{c.router.port}", f"http://127.0.0.1:{c.ray.metrics_export_port}/metrics",
              resolved.config.batches.dashboard_url, resolved)
    wait_for(lambda: all(v["replicas"] for v in s.pools().values()), 60, what="first replica reports")
    yield s
    serve.shutdown()
    ray.shutdown()


class Console:
    """`poolserve serve` in a process of its own, with a clean environment (a user's shell);
    its output lines as they come, with the time each arrived."""

    def __init__(self, config: Path, **extra_env: str) -> None:
        env = {"PATH": os.environ["PATH"], "HOME": os.environ["HOME"], "PYTHONUNBUFFERED": "1", **extra_env}
        self.proc = subprocess.Popen([str(Path(sys.executable).parent / "poolserve"), "serve", str(config)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=config.parent)
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip()))

    def wait_for_line(self, fragment: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(fragment in line for _, line in self.lines):
            assert self.proc.poll() is None, "poolserve serve exited:\n" + self.text()
            assert time.monotonic() < deadline, f"no line with {fragment!r} in {timeout} s:\n" + self.text()
            time.sleep(0.2)

    def since(self, t: float) -> list[str]:
        return [line for at, line in self.lines if at >= t]

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines[-60:])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
