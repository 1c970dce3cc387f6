"""The engine reaper: a SIGKILLed replica's engine processes (and theirs) are stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pools import reaper

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")

# A stand-in replica: starts an "engine" titled like vLLM's (with a worker under it), starts
# the reaper on itself, prints the pids and sleeps until killed.
REPLICA = r"""
import subprocess, sys, time
sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
engine = subprocess.Popen(["VLLM::EngineCore", "-c",
    "import subprocess, time; subprocess.Popen(['VLLM::Worker', '-c', 'import time; time.sleep(120)'],"
    f" executable={sys.executable!r}); time.sleep(120)"], executable=sys.executable)
other = subprocess.Popen(sleeper)  # not an engine: left alone
from pools import reaper
deadline = time.monotonic() + 60
while not reaper._children().get(engine.pid) and time.monotonic() < deadline:  # its worker started
    time.sleep(0.05)
watcher = reaper.watch()
print(engine.pid, other.pid, watcher.pid if watcher else 0, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    return reaper._stat(pid) is not None


def _wait(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_engines_of_a_killed_replica_are_stopped():
    replica = subprocess.Popen([sys.executable, "-c", REPLICA], stdout=subprocess.PIPE, text=True,
                               cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        engine, other, watcher = map(int, replica.stdout.readline().split())
        assert watcher, "the reaper found no engine child"
        [worker] = reaper._children()[engine]
        assert reaper._is_engine(worker)
        time.sleep(1.5)
        assert _alive(engine) and _alive(worker) and _alive(watcher)  # nothing happens while the replica lives
        replica.send_signal(signal.SIGKILL)
        replica.wait()
        assert _wait(lambda: not _alive(engine) and not _alive(worker), 10), "engine processes outlived the replica"
        assert _wait(lambda: not _alive(watcher), 10)
        assert _alive(other)  # only engines are stopped
    finally:
        replica.kill()
        for pid in (locals().get("other"), locals().get("engine"), locals().get("worker")):
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass


def test_no_engine_children_no_watcher():
    assert reaper.watch() is None


def test_a_reused_pid_is_not_signalled():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        start = reaper._stat(sleeper.pid)[1]
        assert reaper.reap([(sleeper.pid, start + 1)], grace_s=0.1) == []  # another process's start time
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
