"""The embedded default, started with `poolserve serve` from a clean environment, on a machine
none of its profiles was measured on (the hardware part of the fingerprint overridden with
`calibration.hardware`): both pools serve at their fallback ranges, calibrate themselves in
the background, the console stays quiet at rest, and the next start finds their profiles in
the store at once. It runs on a Ray of its own, before the session's stack starts."""

from __future__ import annotations

import contextlib
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import httpx
import psutil
import pytest
import yaml

from tests.integration.conftest import MODEL, REPO, Console, wait_for

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
    # long enough that the whole burst stays active for seconds once the step stops: the watcher
    # reads the replicas' reports a few times a second and must catch the peak, not its tail
    def one(_):
        return httpx.post(f"{BASE}/offline/v1/completions", headers={"Authorization": f"Bearer {BATCH}"}, timeout=180,
                          json={"prompt": "calibrate me", "max_tokens": 256, "ignore_eos": True}).status_code
    with ThreadPoolExecutor(n) as ex:
        return list(ex.map(one, range(n)))


@pytest.mark.timeout(1800)  # two starts and a sweep, on a slow host too
def test_the_embedded_default_calibrates_itself_on_a_new_machine(tmp_path):
    from deployments.admin_client import AdminClient

    hardware = f"cpu:test-machine-{uuid.uuid4().hex[:8]}"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config(tmp_path, hardware)))
    console = Console(tmp_path / "config.yaml")
    try:
        console.wait_for_line("deploying poolserve", 120)
        started = time.monotonic()
        console.wait_for_line("Ctrl-C stops it.", 240)
        summary = console.text()
        for name, fallback in (("online-chat", [1, 16]), ("offline-batch", [1, 32])):
            # the ladder up to limits.start, not batch size 1
            assert f"safe range {name:<9} {fallback}: calibrating in the background" in summary, summary
        admin = AdminClient(BASE, ADMIN)
        for name, s in admin.pools().items():
            assert s.calibration.state in ("calibrating", "profile") and hardware in s.calibration.source, s

        # Batch work arrives while the offline pool's sweep measures a step: the step stops and the
        # pool serves it at its fallback range.
        detail = wait_for(lambda: "measuring" in (d := admin.pool("offline-batch").calibration.detail) and d, 240,
                          interval=0.5, what="the offline pool's sweep to measure a step")
        step = int(re.search(r"measuring at (\d+) sequences", detail).group(1))
        peaks, stop = [], threading.Event()

        def watch():
            while not stop.is_set():
                peaks.extend(r.active for r in admin.pool("offline-batch").replicas)
                time.sleep(0.2)
        watcher = threading.Thread(target=watch)
        watcher.start()
        burst_from = time.monotonic()
        try:
            codes = _batch_burst(48)
        finally:
            stop.set()
            watcher.join()
        assert codes == [200] * 48
        assert max(peaks) >= max(16, step + 1), (step, peaks)
        print(f"\nburst of 48 during step at {step}: {time.monotonic() - burst_from:.1f} s, active {peaks}")

        # The sweep measures each step until it is steady, so its length is the host's speed: under
        # 5 minutes on the 2-core development host at its usual speed, over 5 when it ran three times
        # slower. The bound catches a sweep that never ends, on a host of any speed.
        left = 900 - (time.monotonic() - started)
        status = wait_for(lambda: (s := _status(admin)) and all(p.calibration.state == "profile" for p in s.values())
                          and s, max(left, 1), interval=1, what="both pools calibrated within 15 minutes of the start")
        for name, s in status.items():
            assert "sweep of this set-up" in s.calibration.source, s.calibration
            assert list((tmp_path / "profiles" / name).glob("*.yaml")), f"no stored profile for {name}"
        print(f"\ncalibrated in {time.monotonic() - started:.0f} s: " +
              ", ".join(f"{n} {list(s.safe_range)} ({s.calibration.detail})" for n, s in status.items()))

        # Once each pool's limit sits inside its new range and every replica applied it (the
        # controller clamps it at its next tick after the profile is adopted, and says so), the
        # console is quiet at rest (reports, views and quota syncs go on several times a second).
        def settled():
            s = _status(admin)
            return s and all(p.target_max_active_seqs is not None
                             and p.safe_range[0] <= p.target_max_active_seqs <= p.safe_range[1]
                             and p.replicas and p.applied(p.epoch) for p in s.values())
        wait_for(settled, 60, interval=0.5, what="every pool's limit inside its new range, applied")
        quiet_from, wall = time.monotonic(), time.time()
        time.sleep(10)
        said = [line for line in console.since(quiet_from) if not _logged_before(line, wall)]
        assert said == [], "\n".join(said)

        # a sweep with unsteady steps is provisional: the next start runs in its range and measures again
        adopted = {n: (s.safe_range, "measured again" in s.calibration.detail) for n, s in status.items()}
    finally:
        code = console.stop()
    assert code == 0, console.text()
    wait_for(lambda: not _serve_processes(), 60, what="the replicas to stop with poolserve serve")

    # The next start on this machine finds both profiles in the store at the pools' first
    # reports: `poolserve serve` prints their measured ranges at once.
    console = Console(tmp_path / "config.yaml")
    try:
        console.wait_for_line("Ctrl-C stops it.", 300)
        [up] = [at for at, line in console.lines if "poolserve is up" in line]
        placed = {line.split()[2]: (at, line) for at, line in console.lines if line.startswith("  safe range ")}
        assert set(placed) == set(adopted), console.text()
        for name, (at, line) in placed.items():
            (low, high), again = adopted[name]
            state = "calibrating in the background" if again else "calibrated"
            assert f"{[low, high]}: {state}: the profile store" in line, line
            assert at - up < 1.0, f"{name} placed {at - up:.2f} s after the start:\n{console.text()}"
        print(f"second start: profiles placed {max(at for at, _ in placed.values()) - up:.2f} s after it was up")
    finally:
        code = console.stop()
    assert code == 0, console.text()
    wait_for(lambda: not _serve_processes(), 60, what="the replicas to stop with poolserve serve")


def _logged_before(line: str, wall: float) -> bool:
    """A log line forwarded late (Ray's log monitor polls the files) of something that happened
    before `wall`, such as this test's own last request."""
    stamp = re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}", line)
    return bool(stamp) and datetime.strptime(stamp.group(), "%Y-%m-%d %H:%M:%S,%f").timestamp() < wall


def _replicas() -> list[psutil.Process]:
    """Ray names each actor's process after it (`ray::ServeReplica:<app>:<deployment>`)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any("ServeReplica:poolserve" in part for part in p.info["cmdline"] or ()):
                out.append(p)
    return out


def _serve_processes() -> list[str]:
    return [" ".join(p.info["cmdline"])[:120] for p in _replicas() if p.is_running()]
