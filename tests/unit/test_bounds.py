"""`infra.bounds.within`: the one bounded await."""

import asyncio
import errno

import pytest

from infra.bounds import Idle, Overdue, within


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


def _steady(items: int, gap_s: float):
    async def gen():
        for i in range(items):
            await asyncio.sleep(gap_s)
            yield i
    return gen()


def test_idle_ends_a_wait_longer_than_its_bound_and_cancels_the_work():
    async def go():
        bound, work = Idle(0.05), asyncio.ensure_future(asyncio.sleep(10))
        assert await bound.wait(asyncio.sleep(0, "first")) == "first"
        with pytest.raises(Overdue):
            await bound.wait(work)
        await asyncio.sleep(0)
        assert work.cancelled() and asyncio.current_task().cancelling() == 0
        bound.close()
    asyncio.run(go())


def test_idle_bounds_each_wait_not_their_sum():
    # 30 waits of 0.02 s (0.6 s in all) under a bound of 0.3 s: the timer, armed at the first
    # wait, fires in a later one and is re-armed from that wait's start
    async def go():
        bound, items = Idle(0.3), _steady(30, 0.02)
        got = [await bound.wait(items.__anext__()) for _ in range(30)]
        bound.close()
        return got
    assert asyncio.run(go()) == list(range(30))


def test_idle_never_cancels_the_task_between_waits():
    # the task does other work between waits (a relay sending a chunk to a slow client)
    async def go():
        bound = Idle(0.02)
        await bound.wait(asyncio.sleep(0))
        await asyncio.sleep(0.1)  # the timer fires here, past the bound, with no wait open
        assert await bound.wait(asyncio.sleep(0.005, "next")) == "next"
        bound.close()
    asyncio.run(go())


def test_a_callers_cancellation_with_the_idle_bound_stays_a_cancellation():
    async def go():
        bound = Idle(0.05)

        async def caller():
            return await bound.wait(asyncio.sleep(10))
        task = asyncio.create_task(caller())
        due = bound._due
        bound._due = lambda: (due(), task.cancel())  # the client leaves in the turn the bound fires
        with pytest.raises(asyncio.CancelledError):
            await task
        assert bound._fired
        bound.close()
    asyncio.run(go())


def test_a_closed_idle_bound_holds_no_timer():
    async def go():
        loop = asyncio.get_running_loop()
        bound = Idle(600)
        await bound.wait(asyncio.sleep(0))
        assert bound._timer is not None
        bound.close()
        assert bound._timer is None and not any(h for h in loop._scheduled if not h.cancelled() and h.when() >
                                                 loop.time() + 500)
    asyncio.run(go())


async def _answers_its_cancellation():
    """What vLLM's whole-answer generators do: a cancellation becomes an error answer."""
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        return "Client disconnected"


@pytest.mark.parametrize("bound", ["within", "Idle"])
def test_work_that_answers_its_cancellation_is_still_overdue(bound):
    async def go():
        if bound == "within":
            await within(0.02, _answers_its_cancellation())
        else:
            await Idle(0.02).wait(_answers_its_cancellation())
    with pytest.raises(Overdue):
        asyncio.run(go())


async def _raises_on_cancellation():
    """A pool's generator that turns its cancellation into an error of its own."""
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        raise RuntimeError("request cancelled") from None


def test_work_that_turns_its_cancellation_into_an_error_is_overdue_and_uncancelled():
    async def go():
        with pytest.raises(Overdue):
            await Idle(0.02).wait(_raises_on_cancellation())
        return asyncio.current_task().cancelling()
    assert asyncio.run(go()) == 0, "the task stays marked cancelled: a later pool cancellation reads as the client's"


def test_a_callers_cancellation_swallowed_with_the_bounds_is_still_a_cancellation():
    async def swallows_both():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            asyncio.current_task().cancel()  # the client leaves in the turn the bound fired
            return "Client disconnected"

    async def go():
        task = asyncio.create_task(within(0.02, swallows_both()))
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(go())
