"""A pool's CPU priority on a host whose cores it shares: Linux `nice` for its replicas and
their engine processes; and its engine kept on the cores its workers are bound to.

Where both pools' engines share a host's cores with the router and the HTTP proxy (the
two-core default, a small node), a busy offline engine takes its full share of a core from
whatever lands beside it, the online request path included. A higher nice value (lower
priority) for the offline pool's engine keeps the core for it when nothing else wants it
and yields it at once when the router, the proxy or the online engine do. Raising nice needs
no privilege; lowering it does, so a value below the current one is left alone.

The replica is lowered with its engine. Its route parses, prices and tokenizes the pool's
requests and its engine's output is processed there; at the workers' priority, the edge of an
offline wave (hundreds of requests arriving at once) took the core from the online engine and
the online replica, and the online tail grew with it (bench/notes.md). Its reports to the
autoscaler may come later under a flood; the controller holds a pool it has not heard from and
logs the gap.

vLLM binds a CPU engine's workers to the cores `cpu_threads_bind` names, not its engine core,
which between steps waits for them in a busy loop (its shared-memory queue yields the CPU and
looks again, for a second after each read). Left free, that loop may spin on the cores the
pool's route, the HTTP proxy and the other pool need: on a two-core host, while one long
stream ran, another process waited seconds for a core and the stream's lines came in bursts
after gaps of 1-6 s; bound beside its workers, neither happened (bench/notes.md). Where
vLLM places the workers itself (`auto`) it keeps a core apart for the engine core, and that
placement stays.

Nice values and CPU affinity belong to threads on Linux: every thread of a process changed is
set, and threads and processes started later inherit their creator's value. Elsewhere than
Linux this does nothing.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Mapping

from pools.reaper import PROC, descendants, engine_children, title

WORKER_PREFIX = b"VLLM::Worker"  # vLLM's workers' process title; the engine core's is VLLM::EngineCore

log = logging.getLogger(__name__)


def renice(pids: list[int], nice: int) -> int:
    """Raise every thread of `pids` to at least `nice`; the number of threads changed."""
    return _each_thread(pids, lambda tid: _raise(tid, nice))


def bind(pids: list[int], bound: set[int]) -> int:
    """Bind every thread of `pids` to the cores `bound`; the number of threads changed."""
    return _each_thread(pids, lambda tid: _bind(tid, bound))


def _each_thread(pids: list[int], step: Callable[[int], bool]) -> int:
    """`step` on every thread of `pids`, passing again until a pass changes nothing: a thread
    started during a pass by one not yet changed would keep its creator's value, and hand it
    on. The number of changes."""
    changed = 0
    for _ in range(8):  # a few passes at most: a process starts threads in bursts, not for ever
        more = sum(step(tid) for pid in pids for tid in _threads(pid))
        changed += more
        if not more:
            break
    return changed


def _threads(pid: int) -> list[int]:
    try:
        return [int(t.name) for t in (PROC / str(pid) / "task").iterdir()]
    except OSError:
        return []  # gone, or not Linux


def _raise(tid: int, nice: int) -> bool:
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
            return True
    except OSError:
        pass  # the thread ended meanwhile
    return False


def lower_pool(nice: int, replica: int) -> list[int]:
    """The `replica` process, its engine processes and everything under them, raised to `nice`;
    the engines' pids."""
    pids = descendants([pid for pid, _ in engine_children(replica)]) if PROC.is_dir() else []
    if nice > 0:
        changed = renice([replica, *pids], nice)
        log.info("replica %d and engine processes %s at nice %d (%d threads changed)", replica, pids, nice, changed)
    return pids


def niceness(pid: int) -> int | None:
    """A process's (main thread's) nice value; None if it is gone."""
    try:
        return os.getpriority(os.PRIO_PROCESS, pid)
    except OSError:
        return None


def cores_named(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the engine's workers are bound to cores named for them (`cpu_threads_bind`, or
    VLLM_CPU_OMP_THREADS_BIND inherited), rather than placed by vLLM (`auto`, which keeps a
    core apart for the engine core) or left unbound (`nobind`)."""
    return environ.get("VLLM_CPU_OMP_THREADS_BIND", "").strip() not in ("", "auto", "nobind")


def bind_with_workers(pids: list[int]) -> tuple[int, ...] | None:
    """Bind every thread of the engine processes `pids` but vLLM's workers to the cores its
    workers are bound to; those cores, or None where no worker is found or the workers may run
    on every core this process may (the caller binds only where `cores_named`)."""
    workers = [p for p in pids if title(p).startswith(WORKER_PREFIX)]
    bound = set().union(*(cores(p) or () for p in workers))
    if not bound or bound >= set(cores(os.getpid()) or ()):
        return None
    bind([p for p in pids if p not in workers], bound)
    log.info("engine processes %s bound to cores %s, beside their workers", pids, sorted(bound))
    return tuple(sorted(bound))


def cores(pid: int) -> tuple[int, ...] | None:
    """The cores a process (its main thread) may run on; None if it is gone or not Linux."""
    try:
        return tuple(sorted(os.sched_getaffinity(pid)))
    except (OSError, AttributeError):
        return None


def _bind(tid: int, bound: set[int]) -> bool:
    try:
        if os.sched_getaffinity(tid) != bound:
            os.sched_setaffinity(tid, bound)
            return True
    except OSError:
        pass  # the thread ended meanwhile
    return False
