"""The cluster path: a Ray cluster of two nodes started with `ray start` (a head and a worker,
two raylets on this machine, each with a custom resource of its own), `poolserve serve` joining
it by `ray.address`, each pool placed on its node through `replicas.resources`. Both pools
answer from their nodes; when the worker node is lost (its raylet and every process it
started, killed at once) the router answers for its pool with 503 and Retry-After, never a
hang, while the other pool goes on; when the worker comes back, so does the pool. It runs on
a Ray of its own, before the session's stack starts."""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from tests.integration.conftest import MODEL, REPO, Console, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.own_cluster]

LOCAL = REPO / "deployments" / "configs" / "local.yaml"
GCS_PORT, DASHBOARD_PORT, PORT = 6391, 8276, 8014
BASE = f"http://127.0.0.1:{PORT}"
BIN = Path(sys.executable).parent
KEY = {"online": "sk-chat-dev", "offline": "sk-batch-dev"}  # the embedded default's development keys
PR_SET_CHILD_SUBREAPER = 36
# The cluster's own token: `ray start --head` with token auth needs one to exist already (on a
# machine that never ran Ray there is no ~/.ray/auth_token), and every node, `poolserve serve`
# and Ray's CLI send it
TOKEN = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def cluster_env() -> dict[str, str]:
    """A clean shell's environment, with Ray's CLI sending the cluster's token."""
    return {"PATH": f"{BIN}:/usr/bin:/bin", "HOME": os.environ["HOME"], **TOKEN}


def ray(*args: str, timeout: float = 120) -> str:
    run = subprocess.run([str(BIN / "ray"), *args], env=cluster_env(), capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, f"ray {' '.join(args)}:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}"
    return run.stdout


def start_worker() -> None:
    ray("start", f"--address=127.0.0.1:{GCS_PORT}", "--num-cpus=2", '--resources={"worker-node": 1}',
        "--disable-usage-stats")


def config(tmp: Path) -> dict:
    data = yaml.safe_load(LOCAL.read_text())
    data["model"]["source"] = str(MODEL)
    data["ray"] = {"address": f"127.0.0.1:{GCS_PORT}"}
    data["router"]["port"] = PORT
    data["router"]["reach_timeout_s"] = 5  # how soon a lost node's pool answers 503
    data["profiles"] = {"dir": str(tmp / "profiles")}
    data.pop("batches", None)
    for name, node in (("online-chat", "head-node"), ("offline-batch", "worker-node")):
        pool = data["pools"][name]
        pool["limits"]["profile"] = str((LOCAL.parent / pool["limits"]["profile"]).resolve())
        pool["calibration"]["mode"] = "fallback"  # no sweeps: this test is about placement
        pool["replicas"]["resources"] = {node: 1}
        pool["replicas"].pop("nice", None)
    return data


def state(kind: str, *filters: tuple[str, str, str]) -> list[dict]:
    """Ray's state API (what `ray list` asks), straight from the dashboard: a CLI call costs
    seconds of imports on two busy cores."""
    params = {"detail": "true", "limit": 1000, "filter_keys": [k for k, _, _ in filters],
              "filter_predicates": [p for _, p, _ in filters], "filter_values": [v for _, _, v in filters]}
    r = httpx.get(f"http://127.0.0.1:{DASHBOARD_PORT}/api/v0/{kind}", params=params, timeout=30,
                  headers={"Authorization": f"Bearer {TOKEN['RAY_AUTH_TOKEN']}"})
    r.raise_for_status()
    return r.json()["data"]["result"]["result"]


def nodes() -> dict[str, str]:
    """Live node id -> the custom resource it offers."""
    return {n["node_id"]: next((r for r in ("head-node", "worker-node") if r in n["resources_total"]), "")
            for n in state("nodes", ("state", "=", "ALIVE"))}


def replica_node(deployment: str, alive: bool = True) -> str | None:
    """The node of the deployment's live replica (or, with alive=False, of one placed there and
    perhaps still starting)."""
    from deployments.app import replica_class

    found = state("actors", ("class_name", "=", replica_class(deployment)),
                  ("state", "=", "ALIVE") if alive else ("state", "!=", "DEAD"))
    return next((a["node_id"] for a in found if a.get("node_id")), None)


def ask(pool: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{BASE}/{pool}/v1/completions", headers={"Authorization": f"Bearer {KEY[pool]}"},
                      json={"model": "tiny-llama", "prompt": "where do you run?", "max_tokens": 4}, timeout=timeout)


def answered(pool: str) -> httpx.Response | None:
    with contextlib.suppress(httpx.TransportError):
        r = ask(pool, timeout=45)
        return r if r.status_code == 200 else None


@contextlib.contextmanager
def adopted_daemons():
    """`ray start` leaves its daemons running on their own; as their subreaper this process
    can find every one of them (and only them) afterwards and stop it by its id."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        yield
    finally:
        me = psutil.Process()
        procs = me.children(recursive=True)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(procs, timeout=10)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=10)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        # `ray start` left the cluster's address for later `ray.init()` calls to join, as `ray stop`
        # would not (it stops every Ray on the machine): forget it
        with contextlib.suppress(OSError):
            address_file = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
            if address_file.read_text().strip().endswith(f":{GCS_PORT}"):
                address_file.unlink()


def test_two_nodes_each_pool_on_its_node_and_a_lost_node_answers_503(tmp_path):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config(tmp_path)))
    with adopted_daemons():
        ray("start", "--head", f"--port={GCS_PORT}", "--num-cpus=4", '--resources={"head-node": 1}',
            "--include-dashboard=true", f"--dashboard-port={DASHBOARD_PORT}", "--disable-usage-stats")
        console = Console(tmp_path / "config.yaml", **TOKEN)  # as docs/kubernetes.md says
        try:
            # the worker joins once the router and the control plane are placed on the head (while
            # they and the online engine still start), so that its two CPUs are left for the
            # offline pool's replica and engine alone
            def on_the_head():
                assert console.proc.poll() is None, "poolserve serve exited:\n" + console.text()
                return all(replica_node(d, alive=False) for d in ("router", "autoscale-controller", "quota-ledger"))
            wait_for(on_the_head, 180, interval=0.5, what="the router and the control plane placed on the head")
            start_worker()
            console.wait_for_line("Ctrl-C stops it.", 300)
            for pool in ("online", "offline"):  # a first call across nodes may take longer than the reach timeout
                wait_for(lambda: answered(pool), 120, interval=1, what=f"the {pool} pool's first answer")
            where = nodes()
            assert where[replica_node("pool-online-chat")] == "head-node"
            assert where[replica_node("pool-offline-batch")] == "worker-node"

            # the worker node is lost: its raylet and every process it started (the pool's replica,
            # its engine, the node's proxy and agents) die at once, as they do with their machine
            [raylet] = [p for p in psutil.process_iter(["name", "cmdline"])
                        if p.info["name"] == "raylet" and "worker-node" in " ".join(p.info["cmdline"] or [])]
            for p in [raylet, *raylet.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            lost = time.monotonic()

            # Through the router (the tenant's default pool, /v1) a lost pool is a fast 503. Its own
            # path has no replica left to answer it: Serve's entry holds such a request until the
            # pool is back (docs/reliability.md).
            def refused():
                t = time.monotonic()
                with contextlib.suppress(httpx.TransportError):  # a connection the dead node's proxy held
                    r = httpx.post(f"{BASE}/v1/completions", headers={"Authorization": f"Bearer {KEY['offline']}"},
                                   json={"model": "tiny-llama", "prompt": "where do you run?", "max_tokens": 4},
                                   timeout=45)
                    assert time.monotonic() - t < 45, "an answer, not a hang"
                    return r if r.status_code == 503 else None
            r = wait_for(refused, 120, interval=1, what="a 503 for the lost node's pool")
            assert float(r.headers["retry-after"]) > 0 and r.json()["error"]["message"], r.text
            assert ask("online").status_code == 200, "the other pool goes on"

            start_worker()
            back = wait_for(lambda: answered("offline"), 240, interval=2, what="the pool to come back with its node")
            assert back.headers.get("x-poolserve-pool") == "offline-batch"
            assert nodes()[replica_node("pool-offline-batch")] == "worker-node"
            print(f"node lost to pool back: {time.monotonic() - lost:.0f} s")
        finally:
            console.proc.kill()  # the cluster goes with it: no graceful shutdown to wait for
