"""`infra.bounds.within`: the one bounded await."""

import asyncio
import errno

import pytest

from infra.bounds import Overdue, within


def test_a_result_that_comes_with_the_callers_cancellation_does_not_swallow_it():
    """3.11's wait_for returned the result and the caller went on for a client that had left."""
    async def go():
        done = asyncio.get_running_loop().create_future()

        async def caller():
            return await within(5, done)
        task = asyncio.create_task(caller())
        await asyncio.sleep(0)
        done.set_result("item")
        task.cancel()  # in the same turn as the result
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(go())


def test_the_bound_passing_is_overdue_and_cancels_the_work():
    async def go():
        work = asyncio.create_task(asyncio.sleep(10))
        with pytest.raises(Overdue) as e:
            await within(0.01, work)
        assert e.value.seconds == 0.01 and isinstance(e.value, TimeoutError)
        await asyncio.sleep(0)
        assert work.cancelled()
    asyncio.run(go())


def test_a_timeout_of_the_work_itself_is_not_the_bounds():
    async def times_out():
        raise OSError(errno.ETIMEDOUT, "connection timed out")  # a TimeoutError, not the bound's

    async def go():
        with pytest.raises(TimeoutError) as e:
            await within(5, times_out())
        assert not isinstance(e.value, Overdue)
    asyncio.run(go())


def test_a_result_in_time_is_returned():
    async def go():
        assert await within(5, asyncio.sleep(0, "ok")) == "ok"
    asyncio.run(go())
