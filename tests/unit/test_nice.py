"""A pool's replica and engine processes at a lower CPU priority: every thread, never back up."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pools import nice

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc only")

TWO_THREADS = "import threading, time; threading.Thread(target=time.sleep, args=(30,), daemon=True).start(); " \
              "print('up', flush=True); time.sleep(30)"


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", TWO_THREADS], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    yield proc.pid
    proc.kill()
    proc.wait()


def _thread_nices(pid: int) -> list[int]:
    return [int((t / "stat").read_text().rsplit(")", 1)[1].split()[16]) for t in Path(f"/proc/{pid}/task").iterdir()]


def test_every_thread_of_the_process_is_raised(child):
    assert nice.renice([child], 7) == 2
    assert _thread_nices(child) == [7, 7]
    assert nice.niceness(child) == 7


def test_a_lower_value_leaves_the_priority_where_it_is(child):
    nice.renice([child], 7)
    assert nice.renice([child], 3) == 0
    assert _thread_nices(child) == [7, 7]


def test_a_process_gone_is_skipped():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert nice.renice([proc.pid], 5) == 0
    assert nice.niceness(proc.pid) is None


ENGINE = "import setproctitle, threading, time; setproctitle.setproctitle('VLLM::EngineCore'); " \
         "threading.Thread(target=time.sleep, args=(30,), daemon=True).start(); print('up', flush=True); time.sleep(30)"


REPLICA = "import subprocess, sys, threading, time; engine = subprocess.Popen([sys.executable, '-c', %r], " \
          "stdout=subprocess.PIPE, text=True); engine.stdout.readline(); " \
          "threading.Thread(target=time.sleep, args=(30,), daemon=True).start(); print(engine.pid, flush=True); " \
          "time.sleep(30)" % ENGINE


def test_the_replica_and_its_engines_are_lowered_and_nothing_else():
    """What a pool replica does after its engine started: the replica's threads and its
    engine's go to the pool's nice; this process and one beside the replica keep theirs."""
    replica = subprocess.Popen([sys.executable, "-c", REPLICA], stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen([sys.executable, "-c", TWO_THREADS], stdout=subprocess.PIPE, text=True)
    engine = None
    try:
        engine = int(replica.stdout.readline())
        assert other.stdout.readline().strip() == "up"
        mine = nice.niceness(os.getpid())
        assert nice.lower_pool(mine + 3, replica.pid) == [engine]
        assert _thread_nices(engine) == [mine + 3, mine + 3]
        assert _thread_nices(replica.pid) == [mine + 3, mine + 3]  # every thread, not the process's first
        assert nice.niceness(os.getpid()) == mine and _thread_nices(other.pid) == [mine, mine]
        assert nice.lower_pool(0, other.pid) == [] and _thread_nices(other.pid) == [mine, mine]
    finally:
        if engine is not None:  # the replica's child, not reaped by this process
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine, signal.SIGKILL)
        for p in (replica, other):
            p.kill()
            p.wait()


def _titled(title: str, core: int | None = None) -> subprocess.Popen:
    """A process titled as vLLM titles its engine's, two threads, bound to `core` before its
    second thread starts (as vLLM's worker binds itself) if one is given."""
    bind = f"import os; os.sched_setaffinity(0, {{{core}}}); " if core is not None else ""
    code = f"import setproctitle; setproctitle.setproctitle({title!r}); {bind}{TWO_THREADS}"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    return proc


def _thread_cores(pid: int) -> list[tuple[int, ...]]:
    return [tuple(sorted(os.sched_getaffinity(int(t.name)))) for t in Path(f"/proc/{pid}/task").iterdir()]


@pytest.fixture
def engine_core():
    """A process titled as vLLM's engine core, free to run on every core."""
    proc = _titled("VLLM::EngineCore")
    yield proc.pid
    proc.kill()
    proc.wait()


two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding needs two cores to choose from")


@two_cores
def test_the_engine_core_is_bound_beside_its_worker(engine_core):
    """Every thread of the engine core goes to the cores its worker is bound to; the worker and
    this process keep theirs."""
    last = max(os.sched_getaffinity(0))
    worker = _titled("VLLM::Worker", core=last)
    try:
        mine = _thread_cores(os.getpid())
        assert nice.bind_with_workers([engine_core, worker.pid]) == (last,)
        assert _thread_cores(engine_core) == [(last,), (last,)]  # every thread, not the process's first
        assert _thread_cores(os.getpid()) == mine
        assert nice.cores(engine_core) == (last,)
    finally:
        worker.kill()
        worker.wait()


@two_cores
def test_an_engine_whose_workers_run_anywhere_is_left_free(engine_core):
    free = tuple(sorted(os.sched_getaffinity(0)))
    worker = _titled("VLLM::Worker")
    try:
        assert nice.bind_with_workers([engine_core, worker.pid]) is None
        assert _thread_cores(engine_core) == [free, free]
    finally:
        worker.kill()
        worker.wait()


@two_cores
def test_an_engine_with_no_worker_found_is_left_free(engine_core):
    """No worker process under the replica (a GPU engine's layout, or one that ended): nothing
    to bind to, and a process gone is no error."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert nice.bind_with_workers([engine_core, gone.pid]) is None
    assert _thread_cores(engine_core) == [tuple(sorted(os.sched_getaffinity(0)))] * 2
    assert nice.cores(gone.pid) is None


@two_cores
def test_bind_sets_every_thread_and_counts_only_changes(engine_core):
    """What the engine-binding benchmark uses to free a bound engine core again."""
    every = set(os.sched_getaffinity(0))
    last = {max(every)}
    assert nice.bind([engine_core], last) == 2
    assert nice.bind([engine_core], last) == 0
    assert nice.bind([engine_core], every) == 2
    assert _thread_cores(engine_core) == [tuple(sorted(every))] * 2


@pytest.mark.parametrize("bind, named", [("0", True), ("0-3", True), ("0-1|2-3", True), ("auto", False),
                                         ("nobind", False), ("", False), (None, False)])
def test_only_cores_named_for_the_workers_bind_the_engine_core(bind, named):
    """vLLM's `auto` placement keeps a core apart for the engine core: that stays as it is."""
    assert nice.cores_named({} if bind is None else {"VLLM_CPU_OMP_THREADS_BIND": bind}) is named
