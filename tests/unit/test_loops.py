"""Background loops: a failing step is logged and the loop goes on; `stop` ends every loop."""

from __future__ import annotations

import asyncio

from infra.loops import Loops


def test_a_failing_step_does_not_end_the_loop():
    calls = []

    async def step():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("the controller is away")

    async def go():
        loops = Loops("test")
        loops.start("step", step, 0.001)
        while len(calls) < 5:
            await asyncio.sleep(0.001)
        assert loops.running == ["step"]
        await loops.stop()
        assert loops.running == []
    asyncio.run(go())


def test_stop_ends_a_loop_whose_step_swallows_its_cancellation():
    """Python 3.11's `asyncio.wait_for` returns its result and drops a cancellation that arrives
    as the awaited call completes; the router's pool-view step awaits one. The loop must end
    anyway, or a replica's shutdown waits forever."""
    swallowed = []

    async def swallowing_once():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed.append(True)

    async def go():
        loops = Loops("test")
        loops.start("step", swallowing_once, 0.001)
        await asyncio.sleep(0.01)
        await asyncio.wait_for(loops.stop(), 5)
    asyncio.run(go())


def test_a_step_that_meets_another_tasks_cancellation_does_not_end_the_loop():
    """A step awaiting work that someone else cancelled (a shared task, a call torn down) gets a
    CancelledError although its loop was not cancelled; the loop ended, silently, for good (a
    replica's stats or a ledger sync would stop with nothing in the log)."""
    calls = []

    async def step():
        calls.append(1)
        if len(calls) == 1:
            shared = asyncio.get_running_loop().create_task(asyncio.sleep(10))
            asyncio.get_running_loop().call_soon(shared.cancel)
            await shared

    async def go():
        loops = Loops("test")
        loops.start("step", step, 0.001)
        await asyncio.wait_for(_until(lambda: len(calls) >= 3), 5)
        assert loops.running == ["step"]
        await loops.stop()
    asyncio.run(go())


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.001)
