"""An async load generator over the OpenAI streaming API (httpx).

Modes: closed loop (a fixed number of requests outstanding) and open loop (Poisson
arrivals at a rate, or the arrival times of a trace). Request lengths come from the
Azure 2023 conversation trace, scaled to the model's context, or from a seeded synthetic
distribution. Warm-up and measurement windows are separate: only requests that *start*
inside the measurement window count.

Per request (all times in seconds, measured at the client):
    TTFT = first content token received - request sent
    E2E  = last content token received - request sent (as vLLM's bench: the closing usage
           chunk and [DONE] are not counted); for a whole response, the response received
    TPOT = (E2E - TTFT) / (output tokens - 1)        (undefined for one output token)
Summary:
    req/s          = completed requests / measurement window
    input tok/s    = sum(prompt tokens of completed) / window
    output tok/s   = sum(output tokens of completed) / window
    goodput req/s  = completed requests with TTFT <= SLO TTFT and TPOT <= SLO TPOT / window
    error rate     = non-2xx (other than 429) or broken streams / requests sent
    rejection rate = 429 responses / requests sent
Output tokens come from the server's `usage` (stream_options.include_usage), so the
counts are the engine's, not a count of SSE chunks.

The generator must not be the bottleneck it measures: its connection pool is larger than
the requests it keeps outstanding, each traffic class gets its own client (run a flood in
its own process: `python -m infra.loadgen ...`), and it reports its own event-loop lag.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import httpx

from infra.results import Result, Run
from infra.stats import percentile
from infra.traffic import Lengths, make_prompt, poisson_arrivals, synthetic_lengths, trace_lengths
from infra.wire import parse_server_timing, sse_lines, trust_env


# -- one request --------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    base_url: str  # e.g. http://127.0.0.1:8000/online/v1
    api_key: str
    model: str = "tiny-llama"
    chat: bool = False
    headers: tuple[tuple[str, str], ...] = ()
    stream: bool = True  # False: whole responses, as a batch job sends them (no TTFT then)
    extra_body: str = ""  # JSON object merged into every body, e.g. '{"priority": 0}'


async def send(client: httpx.AsyncClient, target: Target, prompt: str, max_tokens: int,
               res: Result | None = None) -> Result:
    """One request; its timings go into `res` as they arrive (so a caller that cancels it
    still has what was measured)."""
    body = {"model": target.model, "max_tokens": max_tokens, "stream": target.stream, "ignore_eos": True,
            **(json.loads(target.extra_body) if target.extra_body else {})}
    if target.stream:
        body["stream_options"] = {"include_usage": True}
    if target.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        url = f"{target.base_url}/chat/completions"
    else:
        body["prompt"] = prompt
        url = f"{target.base_url}/completions"
    headers = {"Authorization": f"Bearer {target.api_key}", **dict(target.headers)}
    res = res or Result(start=time.monotonic())
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            res.status = resp.status_code
            res.pool = resp.headers.get("x-poolserve-pool", "")
            res.borrowed = resp.headers.get("x-poolserve-borrowed") == "true"
            res.retry_after = resp.headers.get("retry-after")
            res.server_timing = parse_server_timing(resp.headers.get("server-timing", ""))
            if resp.status_code != 200 or not target.stream:
                await resp.aread()
                if resp.status_code != 200:
                    res.error = resp.text[:200]
                else:
                    usage = resp.json().get("usage") or {}
                    res.prompt_tokens = usage.get("prompt_tokens", 0)
                    res.output_tokens = usage.get("completion_tokens", 0)
                    res.e2e = time.monotonic() - res.start
                return res
            async for line in sse_lines(resp):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    res.error = str(data["error"].get("message", "stream error"))[:200]
                    break
                if data.get("usage"):
                    res.prompt_tokens = data["usage"]["prompt_tokens"]
                    res.output_tokens = data["usage"]["completion_tokens"]
                if _has_token(data):
                    res.e2e = time.monotonic() - res.start
                    if res.ttft is None:
                        res.ttft = res.e2e
    except httpx.TimeoutException:
        res.error = "timeout"
    except (httpx.HTTPError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
    return res


def _has_token(chunk: dict) -> bool:
    for c in chunk.get("choices") or []:
        if c.get("text") or (c.get("delta") or {}).get("content"):
            return True
    return False


# -- loops --------------------------------------------------------------------------

@dataclass(frozen=True)
class Window:
    warmup_s: float
    measure_s: float


class LoopLag:
    """How late the event loop wakes up: a lagging loop would inflate every latency."""

    def __init__(self, every_s: float = 0.05) -> None:
        self.every_s, self.samples = every_s, []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(self.every_s)
            self.samples.append(time.monotonic() - t - self.every_s)

    def __enter__(self):
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc):
        self._task.cancel()

    def summary(self) -> dict:
        if not self.samples:
            return {"p99_ms": 0.0, "max_ms": 0.0}
        return {"p99_ms": percentile(self.samples, 99) * 1e3, "max_ms": max(self.samples) * 1e3}


def _client(target: Target, outstanding: int, timeout_s: float = 600) -> httpx.AsyncClient:
    # A pool larger than what is kept outstanding: requests never wait for a connection here.
    n = outstanding + 32
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30), trust_env=trust_env(target.base_url),
                             limits=httpx.Limits(max_connections=n, max_keepalive_connections=n))


async def closed_loop(target: Target, concurrency: int, lengths: Lengths, window: Window, seed: int = 0,
                      max_requests: int | None = None, abandon: bool = False,
                      stop: asyncio.Event | None = None) -> "Run":
    """`concurrency` workers, each sending its next request as soon as the last ends, until
    the window ends, `max_requests` were sent or `stop` is set. With `abandon`, the requests
    still running when the window ends are cancelled (the server sees the disconnects)
    instead of awaited."""
    rng = random.Random(seed)
    results: list[Result] = []
    t0 = time.monotonic()
    end = t0 + window.warmup_s + window.measure_s
    sent = 0

    async def worker(client):
        nonlocal sent
        while time.monotonic() < end and (max_requests is None or sent < max_requests) \
                and not (stop and stop.is_set()):
            sent += 1
            p, o = lengths.sample(rng)
            results.append(await send(client, target, make_prompt(p, rng), o))

    async with _client(target, concurrency) as client:
        with LoopLag() as lag:
            workers = [asyncio.get_running_loop().create_task(worker(client)) for _ in range(concurrency)]
            if abandon:
                await asyncio.sleep(max(0.0, end - time.monotonic()))
                for w in workers:
                    w.cancel()
            await asyncio.gather(*workers, return_exceptions=abandon)
    return Run(results, t0 + window.warmup_s, window.measure_s, lag.summary(), "closed", concurrency)


async def closed_loop_until_steady(target: Target, concurrency: int, lengths: Lengths, warmup_s: float,
                                  check_s: float, min_s: float, cap_s: float, tolerance: float = 0.1,
                                  seed: int = 0, output_rate: Callable[[float, float], float | None] | None = None,
                                  rate_lag_s: float = 0.0) -> "Run":
    """A closed loop that runs past its warm-up until output throughput is steady: the last
    max(2, min_s / check_s) chunks of `check_s` each within `tolerance` of their mean. The run
    reports those steady chunks only, not the time before them. At most `cap_s` after the
    warm-up; then `Run.steady` is False and the whole time after the warm-up is reported.

    Throughput is `output_rate(a, b)` where given (the engines' own token counters, known
    `rate_lag_s` late; None where it does not know yet), else the tokens of the responses
    completed in each chunk: lumpy for whole responses of one length, which a pool's slots
    finish in waves, so such a loop seldom looks steady by completions."""
    rng = random.Random(seed)
    results: list[Result] = []
    stop = asyncio.Event()
    start = time.monotonic() + warmup_s
    needed = max(2, round(min_s / check_s))

    async def worker(client):
        while not stop.is_set():
            p, o = lengths.sample(rng)
            results.append(await send(client, target, make_prompt(p, rng), o))

    def completions(a: float, b: float) -> float:
        return sum(r.output_tokens for r in results if r.ok and r.e2e and a <= r.start + r.e2e < b) / (b - a)

    def rate(a: float, b: float) -> float | None:
        return output_rate(a, b) if output_rate is not None else completions(a, b)

    async with _client(target, concurrency) as client:
        with LoopLag() as lag:
            workers = [asyncio.get_running_loop().create_task(worker(client)) for _ in range(concurrency)]
            await asyncio.sleep(warmup_s)
            window, steady = (start, start), False
            while not steady and time.monotonic() - start < cap_s:
                await asyncio.sleep(check_s)
                now = time.monotonic() - rate_lag_s
                edges = [now - k * check_s for k in range(needed, -1, -1)]
                if edges[0] < start:
                    continue
                chunks = [rate(a, b) for a, b in zip(edges, edges[1:])]
                if None in chunks:
                    continue
                mean = sum(chunks) / len(chunks)
                steady = mean > 0 and all(abs(c - mean) <= tolerance * mean for c in chunks)
                window = (edges[0], now)
            if not steady:
                window = (start, time.monotonic() - rate_lag_s)
            stop.set()
            await asyncio.gather(*workers)
    run = Run(results, window[0], window[1] - window[0], lag.summary(), "closed", concurrency)
    run.steady = steady
    return run


async def open_loop(target: Target, lengths: Lengths, window: Window, rate: float | None = None,
                    speedup: float = 1.0, seed: int = 0, max_outstanding: int = 2000,
                    timeout_s: float = 600, drain_s: float | None = None, prompt_seed: int | None = None) -> "Run":
    """Poisson arrivals at `rate` per second, or the trace's own arrivals sped up `speedup` times.
    With `drain_s`, the requests still running `drain_s` after the window are cancelled: one
    with no first token yet counts as a timeout, its wait so far a lower bound on its TTFT.
    With `prompt_seed`, the prompts' words come from their own generator: runs of one `seed`
    keep their arrivals and lengths and share no prompt (no prefix-cache hits between them)."""
    rng = random.Random(seed)
    words = rng if prompt_seed is None else random.Random(prompt_seed)
    results: list[Result] = []
    t0 = time.monotonic()
    horizon = window.warmup_s + window.measure_s
    if rate is not None:
        times = poisson_arrivals(rate, horizon, rng)
    else:
        times = [a / speedup for a in lengths.arrivals if a / speedup < horizon]
    tasks = []
    async with _client(target, max_outstanding, timeout_s) as client:
        with LoopLag() as lag:
            for i, at in enumerate(times):
                delay = t0 + at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                p, o = lengths.pairs[i % len(lengths.pairs)] if rate is None else lengths.sample(rng)

                async def one(p=p, o=o, at=at):
                    res = Result(start=time.monotonic(), scheduled=t0 + at)
                    results.append(res)
                    try:
                        await send(client, target, make_prompt(p, words), o, res)
                    except asyncio.CancelledError:
                        res.error = "timeout" if res.ttft is None else "cut off at the drain deadline"
                        res.e2e = res.e2e if res.ttft is not None else time.monotonic() - res.start
                        raise
                tasks.append(asyncio.get_running_loop().create_task(one()))
            if drain_s is None:
                await asyncio.gather(*tasks)
            elif tasks:
                _, pending = await asyncio.wait(tasks, timeout=max(0.0, t0 + horizon + drain_s - time.monotonic()))
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
    label = f"poisson {rate}/s" if rate is not None else f"trace x{speedup}"
    return Run(results, t0 + window.warmup_s, window.measure_s, lag.summary(), label, len(times),
               timeout_s=timeout_s)


def write_raw(path: str | Path, results: list[Result]) -> None:
    with gzip.open(path, "wt") as f:
        for r in results:
            f.write(json.dumps(asdict(r)) + "\n")


def read_raw(path: str | Path) -> list[Result]:
    with gzip.open(path, "rt") as f:
        return [Result(**json.loads(line)) for line in f if line.strip()]


# -- CLI: one traffic class per process ---------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infra.loadgen", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="e.g. http://127.0.0.1:8000/offline/v1")
    p.add_argument("--key", required=True)
    p.add_argument("--chat", action="store_true")
    p.add_argument("--no-stream", action="store_true", help="whole responses, as a batch job sends them")
    p.add_argument("--concurrency", type=int, help="closed loop: requests kept outstanding")
    p.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second")
    p.add_argument("--trace-speedup", type=float, help="open loop: replay the trace's arrivals this much faster")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--spread", type=float, default=0.0)
    p.add_argument("--trace", action="store_true", help="lengths from the Azure trace, scaled to --max-model-len")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--warmup", type=float, default=5)
    p.add_argument("--duration", type=float, default=30)
    p.add_argument("--requests", type=int, help="closed loop: stop after sending this many")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-seed", type=int, help="open loop: draw the prompts' words apart from --seed")
    p.add_argument("--header", action="append", default=[], help="extra header NAME:VALUE")
    p.add_argument("--ttft-slo-ms", type=float)
    p.add_argument("--tpot-slo-ms", type=float)
    p.add_argument("--out", help="write the JSON result here (default: stdout)")
    p.add_argument("--body", default="", help="JSON merged into every request body, e.g. '{\"priority\": 0}'")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--split", help="also summarise consecutive sub-windows of the measurement, e.g. 10,40,20")
    p.add_argument("--timeout", type=float, default=600, help="open loop: seconds a request may take")
    p.add_argument("--drain", type=float, help="open loop: seconds to wait after the window for requests still "
                                               "running; then they are cancelled (timeouts, lower bounds)")
    p.add_argument("--abandon", action="store_true", help="closed loop: cancel what still runs at the end")
    p.add_argument("--raw", help="also write every request's timings here (JSON lines, gzip; times are "
                                 "time.monotonic(), which every process on the machine shares)")
    a = p.parse_args(argv)
    lengths = trace_lengths(a.max_model_len) if a.trace else synthetic_lengths(a.prompt, a.output, a.spread,
                                                                               seed=a.seed)
    headers = tuple(tuple(h.split(":", 1)) for h in a.header)
    target = Target(a.url, a.key, model=a.model, chat=a.chat, headers=headers, stream=not a.no_stream,
                    extra_body=a.body)
    window = Window(a.warmup, a.duration)
    if a.concurrency:
        async def closed() -> Run:
            stop = asyncio.Event()  # SIGTERM: send nothing more, finish what runs, report
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
            return await closed_loop(target, a.concurrency, lengths, window, a.seed, max_requests=a.requests,
                                     abandon=a.abandon, stop=stop)
        run = asyncio.run(closed())
    else:
        run = asyncio.run(open_loop(target, lengths, window, rate=a.rate, speedup=a.trace_speedup or 1.0,
                                    seed=a.seed, timeout_s=a.timeout, drain_s=a.drain, prompt_seed=a.prompt_seed))
    slo = (a.ttft_slo_ms / 1e3 if a.ttft_slo_ms else None, a.tpot_slo_ms / 1e3 if a.tpot_slo_ms else None)
    out = {"mode": run.mode, "load": run.load, "lengths": lengths.source, **run.summary(*slo).to_json()}
    if a.split:
        out["windows"] = [w.summary(*slo).to_json() for w in run.split([float(x) for x in a.split.split(",")])]
    out["window"] = {"from": run.measure_from, "seconds": run.measure_s}
    if a.raw:
        write_raw(a.raw, run.results)
    text = json.dumps(out, indent=2)
    if a.out:
        Path(a.out).write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
