"""A calibration step reports its steady part only, not the unsteady time before it."""

import asyncio

import httpx

from infra import loadgen
from infra.loadgen import Target, closed_loop_until_steady
from infra.traffic import synthetic_lengths
from tests.unit import virtual_time
from tests.unit.test_loadgen_drain import _Body


def test_the_measurement_starts_where_the_output_rate_became_steady(monkeypatch):
    """On virtual time: with the real clock, late wake-ups on a loaded host lined the slow
    first second's waves up into two equal chunks, which looked steady."""
    t0 = 0.0

    async def stream():
        # the first second answers slowly (a cold engine), then at a steady pace
        await asyncio.sleep(0.15 if asyncio.get_running_loop().time() - t0 < 1.0 else 0.02)
        yield b'data: {"choices": [{"text": "a"}], "usage": {"prompt_tokens": 4, "completion_tokens": 4}}\n\n'
        yield b"data: [DONE]\n\n"

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=_Body(stream()))

    monkeypatch.setattr(loadgen, "_client", lambda target, n, timeout_s=600: httpx.AsyncClient(
        transport=httpx.MockTransport(handler), timeout=timeout_s))
    run = virtual_time.run(lambda: closed_loop_until_steady(Target("http://x/v1", "k"), 4, synthetic_lengths(8, 4),
                                                            warmup_s=0, check_s=0.25, min_s=0.5, cap_s=10),
                           monkeypatch, loadgen)
    assert run.steady
    assert run.measure_from - t0 >= 0.9, run.measure_from - t0  # not from the end of the warm-up
    assert abs(run.measure_s - 0.5) < 0.05


def test_steadiness_follows_the_engines_count_where_it_is_given(monkeypatch):
    """Whole responses of one length end in waves, so their completions are lumpy; the engines'
    own token count says whether generation is steady."""
    async def handler(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0.3)
        return httpx.Response(200, json={"choices": [{"text": "a"}], "usage": {"prompt_tokens": 4, "completion_tokens": 64}})

    monkeypatch.setattr(loadgen, "_client", lambda target, n, timeout_s=600: httpx.AsyncClient(
        transport=httpx.MockTransport(handler), timeout=timeout_s))
    target = Target("http://x/v1", "k", stream=False)

    def run(rate):
        return asyncio.run(closed_loop_until_steady(target, 2, synthetic_lengths(8, 64), warmup_s=0, check_s=0.2,
                                                    min_s=0.4, cap_s=1.5, output_rate=rate))
    assert run(lambda a, b: 400.0).steady  # the waves of 0.3 s never fill 0.2 s chunks evenly
    assert not run(lambda a, b: 400.0 if int(a * 5) % 2 else 100.0).steady
