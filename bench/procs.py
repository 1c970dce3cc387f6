"""Where the CPU goes: every process on the machine, grouped by its role on the serving path,
its CPU seconds read from /proc at the start and end of a window (Linux only).

Roles come from the process titles Ray and vLLM set (`ray::ProxyActor`,
`ray::ServeReplica:<app>:<deployment>`, `VLLM::EngineCore`, `VLLM::Worker...`); engine
processes are named after the replica they run under, so each pool's engines count apart.
The load generators are named by the caller (their pids).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")
TICK = os.sysconf("SC_CLK_TCK")


def _read(pid: int) -> tuple[int, float, str] | None:
    """(parent pid, CPU seconds, title) of a live process."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
        cmd = (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    f = stat[stat.rindex(")") + 2:].split()
    return int(f[1]), (int(f[11]) + int(f[12])) / TICK, cmd or f"[{name}]"


def role(title: str) -> str:
    """The role of a process on the serving path, from its title."""
    if title.startswith("VLLM::EngineCore"):
        return "engine core"
    if title.startswith("VLLM::"):
        return "engine worker"
    if title.startswith("ray::ProxyActor"):
        return "HTTP proxy"
    if "haproxy" in title.split()[0] or title.startswith("ray::HAProxyManager"):
        return "HTTP proxy (HAProxy)"
    if "vllm.entrypoints.openai.api_server" in title:
        return "vLLM API server"
    if any(client in title for client in ("bench.vllm_bench", "infra.loadgen", "deployments.batch_job")):
        return "client"
    if title.startswith("ray::ServeReplica:"):
        deployment = title.split()[0].split(":", 3)[-1].split(".")[0]
        return f"replica {deployment}"
    if title.startswith("ray::ServeController"):
        return "Serve controller"
    for daemon in ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py", "runtime_env", "ray::IDLE"):
        if daemon in title:
            return "Ray daemons"
    return "other"


@dataclass
class Snapshot:
    cpu: dict[int, float] = field(default_factory=dict)  # pid -> CPU seconds
    roles: dict[int, str] = field(default_factory=dict)


def snapshot(named: dict[int, str] | None = None) -> Snapshot:
    """Every live process's CPU seconds and role; `named` gives roles by pid (load generators).
    An engine process takes the role of the replica it runs under (`engine core of pool-x`)."""
    named = named or {}
    seen: dict[int, tuple[int, float, str]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (r := _read(int(entry.name))) is not None:
            seen[int(entry.name)] = r
    snap = Snapshot()
    for pid, (ppid, cpu, title) in seen.items():
        what = named.get(pid) or role(title)
        if what.startswith("engine"):
            parent = ppid
            while parent in seen and role(seen[parent][2]).startswith("engine"):
                parent = seen[parent][0]
            if parent in seen and role(seen[parent][2]).startswith("replica "):
                what = f"{what} of {role(seen[parent][2])[len('replica '):]}"
        snap.cpu[pid], snap.roles[pid] = cpu, what
    return snap


def cpu_by_role(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """CPU seconds each role used between two snapshots (processes that started or ended in
    between count from zero or up to their last reading)."""
    out: dict[str, float] = {}
    for pid, cpu in after.cpu.items():
        used = cpu - before.cpu.get(pid, 0.0)
        if used > 0:
            out[after.roles[pid]] = out.get(after.roles[pid], 0.0) + used
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def cores_used(over_s: float = 2.0) -> tuple[float, dict[str, float]]:
    """Cores the whole machine used over the next `over_s`, and by role."""
    import time

    a = snapshot()
    time.sleep(over_s)
    by_role = cpu_by_role(a, snapshot())
    return sum(by_role.values()) / over_s, by_role


def idle_level(samples: int = 3) -> tuple[float, dict[str, float]]:
    """The machine's CPU use at rest (everything deployed, nothing sent): the least of a few
    readings, in cores, with its CPU seconds by role."""
    return min((cores_used() for _ in range(samples)), key=lambda reading: reading[0])


def wait_quiet(max_cores: float, over_s: float = 2.0, timeout_s: float = 120.0) -> float:
    """Wait until the whole machine uses at most `max_cores` of CPU over `over_s` (the last
    round's work drained); the seconds waited. Raises TimeoutError."""
    import time

    start = time.monotonic()
    while True:
        used, by_role = cores_used(over_s)
        if used <= max_cores:
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            top = ", ".join(f"{k} {v / over_s:.2f}" for k, v in list(by_role.items())[:5])
            raise TimeoutError(f"the machine stayed busy ({used:.2f} cores: {top}) for {timeout_s} s")


@contextmanager
def profiling(pids: dict[str, int], raw: Path) -> Iterator[dict[str, Path]]:
    """A py-spy profile (raw collapsed stacks) of each named process, taken together for as long
    as the block runs: a fixed window ended before the load began wherever the client took
    longer than it to start (bench/notes.md)."""
    spy = Path(sys.executable).parent / "py-spy"
    files = {name: raw.with_suffix(f".{name}.txt") for name in pids}
    runs = [subprocess.Popen([str(spy), "record", "--pid", str(pid), "--format", "raw", "--output",
                              str(files[name]), "--nonblocking", "--rate", "50"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pid in pids.items()]
    try:
        yield files
    finally:
        for p in runs:
            p.send_signal(signal.SIGINT)  # py-spy writes what it sampled when interrupted
        for p in runs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
