"""PoolServer with a deterministic fake engine: the stream protocol, priorities, slots."""

from __future__ import annotations

import asyncio
import gc
import json
from types import SimpleNamespace

import pytest

from pools.engine import StatsBox
from pools.gate import Ceilings, QueuePolicy
from pools.server import PoolServer, PoolSettings
from pools.types import (Admitted, Arrived, BatchLimits, Finished, PoolCall, PriorityClass, Refused, Rejected,
                         SafeRange)

RANGE = SafeRange((1, 2, 4), 1, 4, 100, 10_000)


class FakeEngine:
    """`pools.engine.Engine`, deterministic: streams `max_tokens` chunks then a usage chunk, as
    vLLM's OpenAI layer does (in lists, as the real engine batches them); records priorities."""

    seen_priorities: list[int] = []
    release = None  # an asyncio.Event that holds streams open when set by a test
    held = 0  # streams waiting for it
    fail_with: Exception | None = None  # raised before the first chunk, as vLLM's chat rendering does

    def __init__(self) -> None:
        self.stats_box = StatsBox()

    async def start(self) -> None:
        pass

    def facts(self):
        return None

    async def warm_up(self, requests: int) -> None:
        pass

    async def check_health(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    def generate(self, call):
        return self._generate(call)

    async def _generate(self, call):
        request = call.body
        FakeEngine.seen_priorities.append(int(call.priority))
        if FakeEngine.fail_with is not None:
            raise FakeEngine.fail_with
        if not request.stream:
            yield SimpleNamespace(usage=SimpleNamespace(prompt_tokens=3, completion_tokens=request.max_tokens))
            return
        for i in range(request.max_tokens):
            if FakeEngine.release is not None and not FakeEngine.release.is_set():
                FakeEngine.held += 1
                try:
                    await FakeEngine.release.wait()
                finally:
                    FakeEngine.held -= 1
            yield [f'data: {{"choices":[{{"text":"t{i}"}}]}}\n\n']
        yield ['data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":%d}}\n\n' % request.max_tokens,
               "data: [DONE]\n\n"]


def settings(**queue) -> PoolSettings:
    return PoolSettings(
        name="p", start_seqs=1, safe_range=RANGE, ceilings=Ceilings(8, 10_000),
        queue=QueuePolicy(max_queued=queue.get("max_queued", 10), max_queued_tokens=100_000),
        report_interval_s=1, latency_window_s=10, stream_batching_ms=0,
        fingerprint_base={"model": "m", "dtype": "float32", "quantization": "none", "max_model_len": 64,
                          "max_num_seqs": 8, "max_num_batched_tokens": 64, "kv_cache_gb": 1.0},
        warmup_requests=0)


async def make_server(**queue) -> PoolServer:
    server = PoolServer.__new__(PoolServer)
    await server.__init__(settings=settings(**queue), engine=FakeEngine())
    return server


def call(priority=PriorityClass.BATCH, max_tokens=3, stream=True, include_usage=False, n=1) -> PoolCall:
    body = SimpleNamespace(stream=stream, max_tokens=max_tokens, priority=0)
    return PoolCall("completions", body, "t", 1.0, priority, prompt_tokens=3, max_tokens=max_tokens,
                    include_usage=include_usage, n=n)


async def until(condition, what: str) -> None:
    """Waits for a state of the server instead of a fixed sleep: on a loaded host a sleep's
    wake-up can come before the other tasks have got there."""
    for _ in range(100_000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never reached: {what}")


def queued(server) -> int:
    return sum(server._gate.gate.stats().queued_by_class.values())


async def collect(server, c) -> list:
    """The stream without its `Arrived` marker (which only a call that queues yields)."""
    items = [item async for item in server.generate(c)]
    assert not any(isinstance(x, Arrived) for x in items[1:])
    return items[1:] if isinstance(items[0], Arrived) else items


def test_stream_protocol_and_priority():
    async def go():
        FakeEngine.release, FakeEngine.seen_priorities = None, []
        server = await make_server()
        items = await collect(server, call(PriorityClass.BATCH))
        return server, items

    server, items = asyncio.run(go())
    assert isinstance(items[0], Admitted) and items[0].pool == "p"
    assert isinstance(items[-1], Finished) and items[-1].usage.completion_tokens == 3
    chunks = "".join("".join(x) for x in items[1:-1])
    assert chunks.count('"text"') == 3 and "usage" not in chunks  # the client did not ask for usage
    assert FakeEngine.seen_priorities == [int(PriorityClass.BATCH)]  # lower runs first in vLLM
    stats = server._gate.gate.stats()
    assert stats.active == 0 and stats.completed == 1


def test_usage_chunk_kept_when_the_client_asked():
    async def go():
        FakeEngine.release = None
        server = await make_server()
        return await collect(server, call(include_usage=True))

    items = asyncio.run(go())
    chunks = "".join("".join(x) for x in items[1:-1])
    assert '"usage"' in chunks and json.loads(chunks.split("data: ")[-2])["usage"]["completion_tokens"] == 3


def test_only_a_call_that_queues_says_it_arrived():
    async def go():
        FakeEngine.release = asyncio.Event()
        server = await make_server(max_queued=2)
        first = server.generate(call())
        head = await first.__anext__()  # takes the only slot
        second = server.generate(call())
        queued_head = await second.__anext__()
        verdict = asyncio.create_task(second.__anext__())
        await until(lambda: queued(server) == 1, "the second call queued")
        await asyncio.sleep(0.05)  # time enough for a wrong verdict to come
        parked = not verdict.done()
        FakeEngine.release.set()
        rest = [x async for x in first]
        after = await verdict
        await second.aclose()
        return head, queued_head, parked, after, rest

    head, queued_head, parked, after, rest = asyncio.run(go())
    assert isinstance(head, Admitted) and isinstance(queued_head, Arrived)
    assert parked and isinstance(after, Admitted)  # the verdict came once the slot was free
    assert isinstance(rest[-1], Finished)


def test_a_caller_that_leaves_while_queued_withdraws_its_ticket():
    async def go():
        FakeEngine.release = asyncio.Event()
        server = await make_server(max_queued=2)
        running = server.generate(call())
        await running.__anext__()  # the only slot
        waiting = server.generate(call())
        assert isinstance(await waiting.__anext__(), Arrived)
        queued = sum(server._gate.gate.stats().queued_by_class.values())
        await waiting.aclose()  # the router went away while it waited
        left = server._gate.gate.stats()
        FakeEngine.release.set()
        _ = [x async for x in running]
        return queued, left, server._gate.gate.stats()

    queued, left, end = asyncio.run(go())
    assert queued == 1 and sum(left.queued_by_class.values()) == 0 and left.cancelled == 1
    assert end.active == 0 and end.completed == 1



def test_a_queued_call_evicted_before_its_caller_left_is_counted_rejected_and_its_verdict_read():
    """A queued call evicted by a more important arrival while it waited at its `Arrived`, whose
    caller then left without reading the verdict, was counted by the gate and by no metric, and
    asyncio logged its verdict as an exception never retrieved."""
    async def go():
        lost: list[dict] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: lost.append(context))
        FakeEngine.release = asyncio.Event()
        server = await make_server(max_queued=1)
        ends: list[str] = []
        server._metrics.rejected = lambda tenant, priority, reason: ends.append(reason)
        server._metrics.cancelled = lambda tenant, priority: ends.append("cancelled")
        running = server.generate(call())
        await running.__anext__()  # the only slot
        waiting = server.generate(call(PriorityClass.BATCH))
        assert isinstance(await waiting.__anext__(), Arrived)
        evictor = server.generate(call(PriorityClass.INTERACTIVE))
        assert isinstance(await evictor.__anext__(), Arrived)  # it took the queue's one place
        await waiting.aclose()  # and the first caller left before reading that it lost it
        FakeEngine.release.set()
        _ = [x async for x in running] + [x async for x in evictor]
        del waiting
        gc.collect()
        return ends, server._gate.gate.stats(), lost

    ends, stats, lost = asyncio.run(go())
    assert (stats.evicted, stats.cancelled, stats.completed) == (1, 0, 2), stats
    assert ends == ["evicted"] and not lost, (ends, lost)


def test_queue_full_yields_a_single_rejection():
    async def go():
        FakeEngine.release = asyncio.Event()
        server = await make_server(max_queued=1)
        running = asyncio.create_task(collect(server, call()))  # holds the only slot
        waiting = asyncio.create_task(collect(server, call()))  # fills the queue
        await until(lambda: server._gate.gate.stats().active == 1 and queued(server) == 1, "one running, one queued")
        refused = await collect(server, call())
        FakeEngine.release.set()
        await asyncio.gather(running, waiting)
        return refused, server, await server.stats()

    refused, server, report = asyncio.run(go())
    assert len(refused) == 1 and isinstance(refused[0], Rejected)
    assert refused[0].status == 429 and refused[0].retry_after_s > 0 and "queue is full" in refused[0].message
    assert server._gate.gate.stats().completed == 2
    waits = sorted(report.latency.wait_s)  # the report carries the gate's waits to the autoscaler
    assert len(waits) == 2 and waits[1] > waits[0]  # the second waited for the first's slot


def test_cancelled_stream_frees_its_slot_and_counts_as_cancelled():
    async def go():
        FakeEngine.release = asyncio.Event()
        server = await make_server()
        gen = server.generate(call(max_tokens=50))
        assert isinstance(await gen.__anext__(), Admitted)  # a free slot: no Arrived first
        task = asyncio.create_task(gen.__anext__())
        await until(lambda: FakeEngine.held > 0, "the stream waiting for its next token")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await gen.aclose()
        return server._gate.gate.stats()

    stats = asyncio.run(go())
    assert stats.active == 0 and stats.cancelled == 1 and stats.inflight_tokens == 0


@pytest.mark.parametrize("stream", [True, False])
def test_input_error_inside_the_engine_is_a_refusal_not_an_exception(stream):
    async def go():
        FakeEngine.release, FakeEngine.fail_with = None, KeyError("role")
        try:
            server = await make_server()
            gate = server._gate.gate
            return await collect(server, call(stream=stream)), gate.stats(), dict(gate._classes[PriorityClass.BATCH].counters)
        finally:
            FakeEngine.fail_with = None

    items, stats, counters = asyncio.run(go())
    assert isinstance(items[0], Admitted) and isinstance(items[-1], Refused)  # no Finished: it did not run
    refused = [x for x in items if isinstance(x, Refused)]
    assert len(refused) == 1 and "KeyError" in refused[0].message and "role" in refused[0].message
    assert stats.active == 0 and stats.inflight_tokens == 0  # the slot is free again
    # counted as the in-process route counts it (it stops reading at the refusal), and nothing
    # of its estimate stays on the tenant's fair-share counter (helper-96: all of it did)
    assert (stats.completed, stats.cancelled) == (0, 1) and set(counters.values()) <= {0.0}


def test_a_call_of_n_choices_needs_n_free_sequences():
    async def go():
        FakeEngine.release = asyncio.Event()
        server = await make_server()
        server._gate.set_limits(RANGE.limits_for(2))
        running = server.generate(call())
        assert isinstance(await running.__anext__(), Admitted)  # one of two sequences
        wide = server.generate(call(n=2))
        first = await wide.__anext__()
        stats = server._gate.gate.stats()
        FakeEngine.release.set()
        _ = [x async for x in running]
        verdict = await wide.__anext__()
        _ = [x async for x in wide]
        return first, stats, verdict

    first, stats, verdict = asyncio.run(go())
    assert isinstance(first, Arrived) and stats.active == 1 and stats.queued == 1
    assert isinstance(verdict, Admitted)


def test_serve_stopping_a_replica_stops_its_report_loop_and_its_engine():
    """Serve awaits a replica's `__del__` when it stops it; the builder's class gives it one."""
    from deployments.app import closed_on_shutdown

    class Reporting(FakeEngine):
        stopped = False

        async def shutdown(self) -> None:
            Reporting.stopped = True

    async def go():
        cls = closed_on_shutdown(PoolServer)
        server = cls.__new__(cls)
        controller = SimpleNamespace(report=SimpleNamespace(remote=lambda stats: asyncio.sleep(3600)))
        await server.__init__(settings=settings(), controller=controller, engine=Reporting())
        assert server._loops.running == ["report to the controller"]
        await server.__del__()  # as Serve calls it
        assert server.__del__() is None  # garbage collection's call: nothing more to do
        return server._loops.running

    assert asyncio.run(go()) == [] and Reporting.stopped


def test_a_lender_refuses_borrowed_work_while_its_own_work_is_here_or_recent():
    """The borrower judged from the controller's view, a report or two old; the lender judges
    from its own gate: its own work now, or within the borrower's quiet time, sends the
    borrowed call home (a refusal the router follows with the home pool)."""
    import dataclasses

    async def go():
        FakeEngine.release = asyncio.Event()
        server = await make_server()
        own = asyncio.get_running_loop().create_task(collect(server, call(PriorityClass.INTERACTIVE)))
        await until(lambda: server._gate.gate.stats().active == 1, "the own request holding its slot")
        borrowed = dataclasses.replace(call(PriorityClass.BORROWED), borrowed=True, lend_below_utilisation=0.5)
        while_busy = await collect(server, borrowed)
        FakeEngine.release.set()
        await own
        just_after = await collect(server, dataclasses.replace(borrowed, lend_after_quiet_s=60))
        quiet_enough = await collect(server, dataclasses.replace(borrowed, lend_after_quiet_s=0))
        return while_busy, just_after, quiet_enough

    while_busy, just_after, quiet_enough = asyncio.run(go())
    for refused in (while_busy, just_after):
        assert isinstance(refused[0], Rejected) and refused[0].reason == "lender_busy" and len(refused) == 1
    assert isinstance(quiet_enough[0], Admitted) and isinstance(quiet_enough[-1], Finished)


def test_a_lender_holds_borrowed_work_to_the_borrowers_share_in_sequences():
    """`borrow.max_share` was the borrower's count of borrowed requests against the lender's
    limit in sequences, a view a report or two old, and the lender never checked it: requests
    of 4 choices took a whole limit of 4 at a share of 0.5, and an idle lender ran any one
    borrowed request however large (found by a review). The lender counts borrowed sequences,
    running and waiting, against the share of its limit."""
    import dataclasses

    async def go():
        FakeEngine.release = asyncio.Event()
        server = await make_server()
        server._gate.gate.set_limits(BatchLimits(4, 10_000))
        lent = dataclasses.replace(call(PriorityClass.BORROWED, n=2), borrowed=True, lend_max_share=0.5)
        first = asyncio.get_running_loop().create_task(collect(server, lent))
        await until(lambda: server._gate.gate.stats().borrowed_seqs == 2, "the first borrowed call running")
        second = await collect(server, lent)  # 2 + 2 > 0.5 x 4
        too_large = await collect(server, dataclasses.replace(lent, n=4))
        FakeEngine.release.set()
        await first
        alone = await collect(server, dataclasses.replace(lent, n=4))  # on an idle lender too
        fits = await collect(server, lent)
        return second, too_large, alone, fits

    second, too_large, alone, fits = asyncio.run(go())
    for refused in (second, too_large, alone):
        assert isinstance(refused[0], Rejected) and refused[0].reason == "lender_busy" and len(refused) == 1
    assert isinstance(fits[0], Admitted) and isinstance(fits[-1], Finished)


def test_a_borrowed_call_with_no_share_waits_in_the_queue():
    """A calibration sweep's calls are borrowed, with no borrower's share: they wait for a slot
    as before, where the share's check sent one home at a full replica, and the sweep counted
    the refusal as an error (found by a review)."""
    import dataclasses

    async def go():
        FakeEngine.release = asyncio.Event()
        server = await make_server()
        server._gate.gate.set_limits(BatchLimits(2, 10_000))
        sweep = dataclasses.replace(call(PriorityClass.BORROWED), borrowed=True)
        running = [asyncio.get_running_loop().create_task(collect(server, sweep)) for _ in range(2)]
        await until(lambda: server._gate.gate.stats().borrowed_seqs == 2, "two sweep calls running")
        third = asyncio.get_running_loop().create_task(collect(server, sweep))
        await until(lambda: queued(server) == 1, "the third waiting")
        FakeEngine.release.set()
        return await third, await asyncio.gather(*running)

    third, _ = asyncio.run(go())
    assert isinstance(third[0], Admitted) and isinstance(third[-1], Finished)
