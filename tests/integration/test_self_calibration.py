"""The embedded default on a machine none of its profiles was measured on (the hardware part of
the fingerprint overridden with `calibration.hardware`): both pools serve at their fallback
ranges, calibrate themselves in the background, and a new controller finds their profiles in
the store at once. It runs on a Ray of its own, before the session's stack starts."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml

from tests.integration.conftest import MODEL, REPO, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.own_cluster]

LOCAL = REPO / "deployments" / "configs" / "local.yaml"
PORT, METRICS_PORT = 8013, 8093
BASE = f"http://127.0.0.1:{PORT}"
ADMIN, BATCH = "poolserve-admin-dev", "sk-batch-dev"  # the embedded default's development keys


def config(profiles_dir, hardware: str) -> dict:
    data = yaml.safe_load(LOCAL.read_text())
    data["model"]["source"] = str(MODEL)
    for pool in data["pools"].values():
        pool["limits"]["profile"] = str((LOCAL.parent / pool["limits"]["profile"]).resolve())
        pool["calibration"]["hardware"] = hardware
    data["profiles"] = {"dir": str(profiles_dir)}
    data["router"]["port"] = PORT
    data["ray"]["metrics_export_port"] = METRICS_PORT
    return data


def _status(admin):
    try:
        return admin.pools()
    except Exception:  # the controller is (re)starting
        return None


def _batch_burst(n: int) -> list[int]:
    def one(_):
        return httpx.post(f"{BASE}/offline/v1/completions", headers={"Authorization": f"Bearer {BATCH}"}, timeout=120,
                          json={"prompt": "calibrate me", "max_tokens": 64, "ignore_eos": True}).status_code
    with ThreadPoolExecutor(n) as ex:
        return list(ex.map(one, range(n)))


def test_the_embedded_default_calibrates_itself_on_a_new_machine(tmp_path):
    import ray
    from ray import serve

    from deployments.admin_client import AdminClient
    from deployments.app import build_app, local_ray_init_kwargs
    from deployments.config import RayConfig, parse, resolve

    hardware = f"cpu:test-machine-{uuid.uuid4().hex[:8]}"
    resolved = resolve(parse(config(tmp_path, hardware)), REPO)
    ray.init(include_dashboard=True, dashboard_port=8277, log_to_driver=False,
             **local_ray_init_kwargs(RayConfig(num_cpus=8, metrics_export_port=METRICS_PORT)))
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    try:
        started = time.monotonic()
        serve.run(build_app(resolved), name="poolserve", route_prefix="/")
        admin = AdminClient(BASE, ADMIN)
        status = wait_for(lambda: (s := _status(admin)) and all(p.calibration.state != "unknown" for p in s.values())
                          and s, 60, what="every pool to report")
        for name, fallback in (("online-chat", (1, 16)), ("offline-batch", (1, 32))):
            cal = status[name].calibration
            assert cal.state == "calibrating" and hardware in cal.source, cal
            assert status[name].safe_range == fallback  # the ladder up to limits.start, not batch size 1

        # Batch work arrives while the offline pool's sweep measures a step: the step stops and the
        # pool serves it at its fallback range.
        wait_for(lambda: "measuring" in admin.pool("offline-batch").calibration.detail, 240, interval=0.5,
                 what="the offline pool's sweep to measure a step")
        peaks, stop = [], threading.Event()

        def watch():
            while not stop.is_set():
                peaks.extend(r.active for r in admin.pool("offline-batch").replicas)
                time.sleep(0.2)
        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            codes = _batch_burst(48)
        finally:
            stop.set()
            watcher.join()
        assert codes == [200] * 48
        assert max(peaks) >= 16, max(peaks)

        left = 300 - (time.monotonic() - started)
        status = wait_for(lambda: (s := _status(admin)) and all(p.calibration.state == "profile" for p in s.values())
                          and s, max(left, 1), interval=1, what="both pools calibrated within 5 minutes of the start")
        for name, s in status.items():
            assert "sweep of this set-up" in s.calibration.source, s.calibration
            assert list((tmp_path / "profiles" / name).glob("*.yaml")), f"no stored profile for {name}"
        print(f"\ncalibrated in {time.monotonic() - started:.0f} s: " +
              ", ".join(f"{n} {list(s.safe_range)} ({s.calibration.detail})" for n, s in status.items()))

        # A new controller reads the profiles back from the store: no sweep, at its first reports.
        _kill_controller()
        answered = wait_for(lambda: _status(admin) is not None and time.monotonic(), 120, interval=0.1,
                            what="the new controller")
        status = wait_for(lambda: (s := _status(admin)) and all(p.calibration.state != "unknown" for p in s.values())
                          and s, 10, interval=0.1, what="the new controller to place every pool")
        assert time.monotonic() - answered < 1.5  # its first reports (every 0.5 s), then the store's profile
        for name, s in status.items():
            assert s.calibration.state == "profile" and "profile store" in s.calibration.source, (name, s.calibration)
    finally:
        serve.shutdown()
        ray.shutdown()


def _kill_controller() -> None:
    import ray
    from ray.util.state import list_actors

    [actor] = [a for a in list_actors(filters=[("state", "=", "ALIVE")])
               if a.class_name == "ServeReplica:poolserve:autoscale-controller"]
    ray.kill(ray.get_actor(actor.name, namespace=actor.ray_namespace), no_restart=True)
