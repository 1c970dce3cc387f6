"""Stop a replica's vLLM engine processes when the replica dies without stopping them.

vLLM runs its engine core (and, on the CPU, a worker under it) as child processes of the
replica. A replica that exits normally shuts them down; one that is SIGKILLed (`ray.kill`, an
OOM kill, `ray stop --force`) leaves them re-parented to init, each holding its KV cache
(about 2.4 GB for the tiny model's engine and worker here) and its pinned core, which the
replacement replica then shares.

`watch()` starts a small process beside the replica that records the replica's engine
children and polls its own parent: when the replica is gone, it terminates those engines and
everything under them, then exits. Linux only (it reads /proc); elsewhere it does nothing.

    python -m pools.reaper REPLICA_PID PID:START [PID:START ...]
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

PROC = Path("/proc")
ENGINE_PREFIX = b"VLLM::"  # vLLM's process titles: VLLM::EngineCore, VLLM::Worker...


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a running process, None if it is gone (or
    a zombie: dead, waiting for its parent to collect it)."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the name in parentheses may hold spaces
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[19])


def alive(pid: int, start: int) -> bool:
    """The process recorded as (`pid`, `start`) still runs (a reused pid has another start)."""
    st = _stat(pid)
    return st is not None and st[1] == start


def title(pid: int) -> bytes:
    """A process's command line as /proc holds it (its title, where it set one); empty if it is gone."""
    try:
        return (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return b""


def _is_engine(pid: int) -> bool:
    return title(pid).startswith(ENGINE_PREFIX)


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None:
                tree.setdefault(st[0], []).append(int(entry.name))
    return tree


def engine_children(pid: int) -> list[tuple[int, int]]:
    """(pid, start time) of the engine processes directly under `pid`."""
    out = []
    for child in _children().get(pid, []):
        st = _stat(child)
        if st is not None and _is_engine(child):
            out.append((child, st[1]))
    return out


def descendants(roots: list[int]) -> list[int]:
    tree, out, todo = _children(), [], list(roots)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(tree.get(pid, []))
    return out


def reap(engines: list[tuple[int, int]], grace_s: float = 5.0) -> list[int]:
    """Terminate the recorded engines that still run (same pid and start time: not a reused
    pid) and their descendants: SIGTERM, then SIGKILL after `grace_s`. Returns the pids signalled."""
    victims = descendants([pid for pid, start in engines if alive(pid, start)])
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in victims:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        while sig == signal.SIGTERM and time.monotonic() < deadline and any(_stat(p) for p in victims):
            time.sleep(0.1)
    return victims


def watch(replica_pid: int | None = None) -> subprocess.Popen | None:
    """Start the watcher for this replica's engine children; None when there are none (an
    engine run elsewhere, a fake in tests) or /proc is missing."""
    if not PROC.is_dir():
        return None
    pid = replica_pid or os.getpid()
    engines = engine_children(pid)
    if not engines:
        return None
    args = [f"{p}:{s}" for p, s in engines]
    log.info("engine reaper watching replica %d, engines %s", pid, [p for p, _ in engines])
    return subprocess.Popen([sys.executable, "-m", "pools.reaper", str(pid), *args],
                            stdin=subprocess.DEVNULL, close_fds=True, start_new_session=True)


def main(argv: list[str]) -> int:
    replica = int(argv[0])
    engines = [(int(p), int(s)) for p, s in (a.split(":") for a in argv[1:])]
    while True:
        if os.getppid() != replica:  # the replica is gone: we were re-parented
            victims = reap(engines)
            if victims:
                print(f"pools.reaper: replica {replica} is gone; stopped its engine processes {victims}",
                      file=sys.stderr)
            return 0
        if not any(alive(p, s) for p, s in engines):
            return 0  # the engines ended first: the replica shut them down
        time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
