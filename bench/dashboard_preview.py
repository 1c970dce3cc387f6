"""Render a PNG preview of the Grafana dashboard from a real run.

Deploys the embedded default, starts a local Prometheus (Debian's `prometheus` package:
`apt-get install prometheus`) scraping Ray's metrics endpoint every 2 s, drives a few
minutes of mixed traffic (chat, a batch flood, a tenant over its quota, an operator pin),
then evaluates every panel's PromQL over the run with Prometheus' HTTP API and draws the
panels in the dashboard's layout.

    python -m bench.dashboard_preview [--prometheus /usr/bin/prometheus]  # -> docs/images/dashboard.png
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.common import KEYS, REPO, deploy, local_config, ray_cluster
from deployments.dashboard import dashboard

PROM_PORT = 9099


def _prometheus(binary: str, workdir: Path) -> subprocess.Popen:
    cfg = workdir / "prometheus.yml"
    cfg.write_text("global: {scrape_interval: 2s, evaluation_interval: 2s}\n"
                   "scrape_configs:\n  - job_name: ray\n    static_configs: [{targets: ['127.0.0.1:8080']}]\n")
    return subprocess.Popen([binary, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'data'}",
                             f"--web.listen-address=127.0.0.1:{PROM_PORT}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _load(seconds: float) -> None:
    """Chat at 3 req/s, a 400-request batch flood from the middle, a tenant over quota."""
    def loadgen(*args):
        return subprocess.Popen([sys.executable, "-m", "infra.loadgen", *args], cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    chat = loadgen("--url", "http://127.0.0.1:8000/online/v1", "--key", KEYS["chat"], "--chat", "--rate", "3",
                   "--trace", "--warmup", "0", "--duration", str(seconds))
    time.sleep(seconds / 3)
    flood = loadgen("--url", "http://127.0.0.1:8000/offline/v1", "--key", KEYS["batch"], "--no-stream",
                    "--concurrency", "400", "--prompt", "200", "--output", "96", "--warmup", "0",
                    "--duration", str(seconds / 3))
    for _ in range(40):  # acme has 32 concurrent requests at most
        threading.Thread(target=lambda: httpx.post(
            "http://127.0.0.1:8000/online/v1/completions", headers={"Authorization": f"Bearer {KEYS['acme']}"},
            json={"prompt": "x", "max_tokens": 400, "ignore_eos": True}, timeout=300), daemon=True).start()
    flood.wait()
    chat.wait()


def _query(expr: str, start: float, end: float) -> list[tuple[str, list[float], list[float]]]:
    r = httpx.get(f"http://127.0.0.1:{PROM_PORT}/api/v1/query_range",
                  params={"query": expr, "start": start, "end": end, "step": 5}, timeout=60).json()
    out = []
    for series in r.get("data", {}).get("result", []):
        ts = [float(t) - start for t, _ in series["values"]]
        vs = [float(v) for _, v in series["values"]]
        out.append((series["metric"], ts, vs))
    return out


def _legend(fmt: str, labels: dict) -> str:
    for k, v in labels.items():
        fmt = fmt.replace("{{" + k + "}}", v)
    return fmt


def render(start: float, end: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    board = dashboard()
    rows, current = [], None
    for p in board["panels"]:
        if p["type"] == "row":
            current = (p["title"], [])
            rows.append(current)
        else:
            current[1].append(p)
    cols = max(len(r[1]) for r in rows)
    fig, axes = plt.subplots(len(rows), cols, figsize=(5.2 * cols, 3.1 * len(rows)), squeeze=False)
    fig.patch.set_facecolor("#111217")
    for i, (row_title, panels) in enumerate(rows):
        for j in range(cols):
            ax = axes[i][j]
            ax.set_facecolor("#181b1f")
            if j >= len(panels):
                ax.axis("off")
                continue
            p = panels[j]
            for t in p["targets"]:
                for labels, ts, vs in _query(t["expr"], start, end):
                    ax.plot(ts, vs, linewidth=1.2, label=_legend(t["legendFormat"], labels)[:38])
            ax.set_title(p["title"], color="#d8d9da", fontsize=9, loc="left")
            ax.tick_params(colors="#8e8e8e", labelsize=7)
            for s in ax.spines.values():
                s.set_color("#2c3235")
            if ax.lines:
                ax.legend(fontsize=6, loc="upper left", framealpha=0.3, labelcolor="#d8d9da")
            ax.set_xlabel("seconds into the run", color="#8e8e8e", fontsize=7)
        axes[i][0].annotate(row_title, xy=(0, 1.18), xycoords="axes fraction", color="#ffffff", fontsize=10,
                            fontweight="bold")
    fig.suptitle("poolserve dashboard (k8s/dashboards/poolserve.json), rendered from a real local run",
                 color="#ffffff", fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.97), h_pad=2.5)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80, facecolor=fig.get_facecolor())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prometheus", default="/usr/bin/prometheus")
    p.add_argument("--seconds", type=float, default=180)
    p.add_argument("--out", default=str(REPO / "docs" / "images" / "dashboard.png"))
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, ray_cluster():
        prom = _prometheus(a.prometheus, Path(tmp))
        try:
            stack = deploy(local_config())
            start = time.time()
            _load(a.seconds)
            stack.admin.pin("online-chat", 2)  # an operator action shows on the limits panel
            time.sleep(20)
            end = time.time()
            render(start, end, Path(a.out))
            print(f"wrote {a.out}")
        finally:
            prom.terminate()


if __name__ == "__main__":
    main()
