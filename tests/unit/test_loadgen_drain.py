"""The open loop: its drain deadline, and prompts drawn apart from the schedule."""

import asyncio
import json

import httpx
import pytest

from infra import loadgen
from infra.loadgen import Target, Window, open_loop
from infra.traffic import synthetic_lengths
from tests.unit import virtual_time


def _server(slow_after: int):
    """A fake completions endpoint: the first `slow_after` requests answer at once, later ones
    never send a token."""
    seen = {"n": 0}

    async def stream(fast: bool):
        if not fast:
            await asyncio.sleep(3600)
        yield b'data: {"choices": [{"text": "a"}]}\n\n'
        yield b'data: {"choices": [{"text": "b"}], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}\n\n'
        yield b"data: [DONE]\n\n"

    async def handler(request: httpx.Request) -> httpx.Response:
        seen["n"] += 1
        return httpx.Response(200, stream=_Body(stream(seen["n"] <= slow_after)))

    return handler


class _Body(httpx.AsyncByteStream):
    def __init__(self, gen):
        self._gen = gen

    async def __aiter__(self):
        async for chunk in self._gen:
            yield chunk


@pytest.fixture
def fake(monkeypatch):
    def install(slow_after: int):
        monkeypatch.setattr(loadgen, "_client", lambda target, n, timeout_s=600: httpx.AsyncClient(
            transport=httpx.MockTransport(_server(slow_after)), timeout=timeout_s))
    return install


def test_requests_running_past_the_drain_are_cut_off_as_timeouts(fake, monkeypatch):
    """On virtual time: seed 1's last arrival is at 0.989 s, and a real loop 11 ms late started
    it after the window, out of the measured requests."""
    fake(slow_after=5)
    run = virtual_time.run(lambda: open_loop(Target("http://x/v1", "k"), synthetic_lengths(8, 2), Window(0, 1.0),
                                             rate=20, seed=1, drain_s=0.5), monkeypatch, loadgen)
    summary = run.summary().to_json()
    hung = [r for r in run.results if r.error == "timeout"]
    assert summary["completed"] == 5 and len(hung) == len(run.results) - 5 > 0
    assert all(0 < r.e2e <= 3.0 for r in hung)  # cut off at window + drain (1.5 s), their wait recorded
    # the hung requests count in the TTFT tail at their wait, so it is not hidden
    assert summary["ttft_ms_with_timeouts"]["n"] == len(run.results)
    assert summary["ttft_ms_with_timeouts"]["p99"] >= 500
    assert summary["errors"] == {"200: timeout": len(hung)}  # every failure named, with its status


def test_without_a_drain_everything_is_awaited(fake, monkeypatch):
    fake(slow_after=10_000)
    run = virtual_time.run(lambda: open_loop(Target("http://x/v1", "k"), synthetic_lengths(8, 2), Window(0, 0.5),
                                             rate=20, seed=1), monkeypatch, loadgen)
    assert run.results and all(r.ok and r.ttft is not None for r in run.results)


def test_a_prompt_seed_changes_the_words_and_keeps_the_arrivals_and_lengths(monkeypatch):
    """Runs of one seed with their own prompt seeds share no prompt (vLLM's prefix cache would
    serve the later run's from the earlier's) and keep their schedule and lengths."""
    def run(prompt_seed):
        bodies = []

        async def handler(request: httpx.Request) -> httpx.Response:
            bodies.append(json.loads(request.content))
            return await _server(slow_after=10_000)(request)

        monkeypatch.setattr(loadgen, "_client", lambda target, n, timeout_s=600: httpx.AsyncClient(
            transport=httpx.MockTransport(handler), timeout=timeout_s))
        r = virtual_time.run(lambda: open_loop(Target("http://x/v1", "k"), synthetic_lengths(16, 8, 0.5, seed=3),
                                               Window(0, 0.6), rate=30, seed=1, prompt_seed=prompt_seed),
                             monkeypatch, loadgen)
        t0 = min(x.scheduled for x in r.results)
        return ([round(x.scheduled - t0, 6) for x in r.results], sorted(b["max_tokens"] for b in bodies),
                {b["prompt"] for b in bodies})

    a, b, again = run(10), run(11), run(10)
    assert len(a[0]) > 5 and a[0] == b[0] and a[1] == b[1]  # the same schedule and lengths
    assert not a[2] & b[2]  # and no prompt in common
    assert again[2] == a[2]  # a prompt seed is a seed
