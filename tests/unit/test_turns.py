"""router.turns: at most `width` holders, free turns to the most important waiter, none lost
to a waiter that leaves, checked against a model over seeded random schedules."""

from __future__ import annotations

import asyncio
import random

import pytest

from router.turns import Turns


def _run(main) -> None:
    """A lost turn leaves someone waiting forever: here that fails the test instead."""
    asyncio.run(asyncio.wait_for(main(), 10))


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_an_interactive_request_overtakes_a_burst_of_batch_ones():
    async def main():
        turns, order, gate = Turns(2), [], asyncio.Event()

        async def one(name: str, priority: int) -> None:
            async with turns.turn(priority):
                order.append(name)
                await gate.wait()

        tasks = [asyncio.create_task(one(f"batch{i}", 2)) for i in range(50)]
        await _settle()
        tasks.append(asyncio.create_task(one("chat", 0)))
        await _settle()
        assert order == ["batch0", "batch1"] and turns.busy == 2 and turns.waiting == 49
        gate.set()
        await asyncio.gather(*tasks)
        assert order[2] == "chat" and order[3:] == [f"batch{i}" for i in range(2, 50)]
        assert turns.busy == 0 and turns.waiting == 0

    _run(main)


def test_a_waiter_cancelled_after_it_was_handed_a_turn_passes_it_on():
    async def main():
        turns, got = Turns(1), []

        async def waiter(name: str) -> None:
            async with turns.turn(2):
                got.append(name)

        held = turns.turn(2)
        await held.__aenter__()
        a, b = asyncio.create_task(waiter("a")), asyncio.create_task(waiter("b"))
        await _settle()
        await held.__aexit__(None, None, None)  # hands the turn to a, whose task has not run since...
        assert turns.busy == 1 and turns.waiting == 1 and not got  # (a has it, b still waits)
        a.cancel()  # ...and leaves before it does
        await asyncio.gather(a, b, return_exceptions=True)
        assert got == ["b"] and turns.busy == 0 and turns.waiting == 0

    _run(main)


def test_waiters_that_give_up_while_every_turn_is_taken_do_not_pile_up():
    async def main():
        turns = Turns(1)
        held = turns.turn(0)
        await held.__aenter__()
        for _ in range(20):  # clients that give up and retry, while the one turn stays taken
            tasks = [asyncio.create_task(_wait_turn(turns)) for _ in range(100)]
            await _settle()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        assert turns.waiting == 0 and len(turns._waiting) <= 200
        await held.__aexit__(None, None, None)
        assert turns.busy == 0 and not turns._waiting

    _run(main)


async def _wait_turn(turns: Turns) -> None:
    async with turns.turn(2):
        pass


def test_width_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        Turns(0)


class _Watched(Turns):
    """Turns that check each handover: the turn goes to the most important, oldest live waiter."""

    def _next(self) -> None:
        live = sorted((p, o, f) for p, o, f in self._waiting if not f.done())
        super()._next()
        handed = [(p, o) for p, o, f in live if f.done()]
        assert handed == [(p, o) for p, o, _ in live[:1]], (handed, live[:1])


@pytest.mark.parametrize("seed", range(300))
def test_random_schedules_keep_the_width_and_serve_by_priority(seed):
    """Holders come and go and waiters leave at random awaits: never more than `width`
    holders, each freed turn to the most important live waiter, and no turn lost (everyone
    who stayed got one, and the turns all come back)."""
    rng = random.Random(seed)
    width = rng.randint(1, 3)

    async def main():
        turns, holding, served = _Watched(width), set(), set()

        async def one(i: int, priority: int) -> None:
            async with turns.turn(priority):
                assert len(holding) < width
                holding.add(i)
                try:
                    for _ in range(rng.randint(0, 3)):
                        await asyncio.sleep(0)
                    served.add(i)
                finally:
                    holding.discard(i)

        tasks: list[asyncio.Task] = []
        for i in range(rng.randint(5, 40)):
            tasks.append(asyncio.create_task(one(i, rng.randint(0, 3))))
            for _ in range(rng.randint(0, 2)):
                await asyncio.sleep(0)
            if rng.random() < 0.2:
                rng.choice(tasks).cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert not [e for e in outcomes if isinstance(e, Exception)], outcomes
        assert turns.busy == 0 and turns.waiting == 0 and not holding
        assert served | {i for i, t in enumerate(tasks) if t.cancelled()} == set(range(len(tasks)))

    _run(main)
