"""The batch job: an OpenAI Batch input file in, one result line per input out, nothing lost.

Runs as a Ray job on the cluster (`poolserve batch submit`, `ray job submit`, or a KubeRay
RayJob) and sends every request through the router, under the tenant's key, to the
offline pool:

    python -m deployments.batch_job --input in.jsonl --output out.jsonl \
        --url http://127.0.0.1:8000 --pool offline        # key in POOLSERVE_KEY or --key-file

* Input lines: {"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
  "body"}. Invalid lines and duplicate custom_ids are reported up front with their line
  numbers, and the job refuses the file (unless --skip-invalid).
* Output lines: {"id", "custom_id", "response": {"status_code", "request_id", "body"} | null,
  "error": {"code", "message"} | null}, appended one whole line at a time; a partial last
  line left by a crash is cut off at the next start, so it never counts.
* Resumable: a rerun with the same output skips the custom_ids already written.
* 429, 502 and 503 are retried after `Retry-After` (plus jitter), with exponential back-off
  when there is none, capped, up to `--max-attempts`; a 429 of the tenant's own quota
  (`*_quota_exceeded`) or of a live pool's back-pressure (`queue_full`, `evicted`,
  `pool_busy`) is waited out without counting, as it only paces the job (the batch's window
  bounds it), and one the quota can never fit is not retried. Other failures, a line's own
  included, become error lines and the job goes on.
* The tenant's concurrent slots are shared by all its clients (its other batches, its chat): a
  job refused a slot keeps no more lines out than its others then out, waits for one of them to
  end rather than the Retry-After, probes once per Retry-After when it has none out, and lets
  one more out each time as many as it lets out are answered, up to `--concurrency`. A job the
  router answered nothing for as long as a line may be paced paces no line further: each fails
  at its next refusal.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import hashlib
import json
import os
import random
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import quote

from infra.batchfile import BatchRequest, completed_ids, jsonl_lines, read_input, result_line
from infra.wire import trust_env

RETRY_STATUSES = {429, 502, 503}  # 502: a pool that answered nothing. Not a 504: a whole answer that took
# longer than the router's idle bound would run, and be charged, as often as it is retried
# 429s that pace the job rather than fail its line: the tenant's own quota, and a live pool's
# back-pressure (its queue full, a more important request's eviction, no replica free to pick
# the request up); counted as attempts, they failed lines for good while the pool was busy
PACING = ("_quota_exceeded", "queue_full", "evicted", "pool_busy")


# -- retries (pure, clock and randomness injected) -------------------------------------------

@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 8
    base_s: float = 1.0
    cap_s: float = 60.0
    jitter: float = 0.25  # up to +25%: clients told the same Retry-After do not return together
    # a line paced this long in all fails with its last answer: a pool answering back-pressure
    # for good (a wedged engine whose replica still reports) held a job with no batch window for ever
    max_paced_s: float = 24 * 3600.0

    def delay(self, attempt: int, retry_after_s: float | None, rng: random.Random) -> float:
        """Seconds to wait before attempt `attempt + 1` (attempt counts from 1)."""
        base = retry_after_s if retry_after_s is not None else self.base_s * 2 ** (attempt - 1)
        return min(self.cap_s, base * (1 + self.jitter * rng.random()))


def error_code(body) -> str | None:
    """The OpenAI-style error's code of a response body, if it has one."""
    err = body.get("error") if isinstance(body, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, str) else None


def retry_after_of(headers) -> float | None:
    value = headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


# -- the job ------------------------------------------------------------------------------

@dataclass
class Progress:
    total: int
    skipped: int = 0
    done: int = 0
    failed: int = 0
    retried: int = 0
    tokens: int = 0
    started: float = field(default_factory=time.monotonic)

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        finished = self.done + self.failed
        left = self.total - self.skipped - finished
        rate = finished / elapsed
        eta = f"{left / rate:.0f}s" if rate > 0 else "?"
        return (f"progress: {finished + self.skipped}/{self.total} (done {self.done}, failed {self.failed}, "
                f"skipped {self.skipped}, retried {self.retried}) {self.tokens / elapsed:.0f} tok/s, ETA {eta}")


class Share:
    """How many of the job's lines may be out at once. Retrying each refused worker after the
    Retry-After kept every worker above the tenant's slots coming back each second for as long
    as the job ran: load on the router and the quota ledger that bought nothing."""

    def __init__(self, most: int, now: float) -> None:
        self.most = self.limit = most
        self.out = 0  # lines being sent or waiting to be sent again; not those waiting for their turn
        self._answers = 0  # since the limit last moved
        self._refused = 0  # lines waiting for their turn again: before any line not yet sent
        self._turn = asyncio.Condition()
        # when the router last answered a line (or the job began): with no answer for
        # `max_paced_s`, a line fails at its next refusal. Each line's own pacing alone let lines
        # cut back to one at a time pace the bound each in turn: 83 s for 8 lines paced 10 s
        self.answered_at = now

    async def take(self) -> None:
        async with self._turn:
            await self._turn.wait_for(lambda: self.out < self.limit and not self._refused)
            self.out += 1

    async def give(self) -> None:
        async with self._turn:
            self.out -= 1
            self._turn.notify_all()

    async def answered(self, now: float) -> None:
        """The router answered a line, neither refusing it a slot nor pacing it: one more may be
        out once as many lines as may be out now were answered (additive increase), at once."""
        self.answered_at = now
        if self.limit < self.most:
            self._answers += 1
            if self._answers >= self.limit:
                self._answers, self.limit = 0, self.limit + 1  # before any await: one answer grows it once
                async with self._turn:
                    self._turn.notify_all()

    async def refused(self) -> bool:
        """A slot refused: the tenant's are all held, at most `out - 1` of them by this job. True
        once another line's end gave the refused one its turn (before lines not yet sent: behind
        them it waited for as long as they came); False when this job has no other line out, so
        the one line left out waits the Retry-After."""
        held = self.out - 1
        self.limit, self._answers = max(1, held), 0
        if held < 1:
            return False
        async with self._turn:
            self.out -= 1
            self._refused += 1
            self._turn.notify_all()
            try:
                await self._turn.wait_for(lambda: self.out < self.limit)
            finally:  # its turn; or, cancelled, its worker gives it back
                self.out += 1
                self._refused -= 1
                self._turn.notify_all()
        return True


class OutputBusy(Exception):
    """Another job holds the output file."""


class Output:
    """The results file: readable by its owner only, held by one job at a time (an advisory
    lock, released by the kernel even when the job is killed), appended one whole line at a
    time (O_APPEND, under the lock), so a crash can tear at most the last line, which a rerun cuts off."""

    LOCK_WAIT_S = 0.5  # the batch service probes the lock for an instant (router.batch_records.output_held)

    def __init__(self, path: Path, wait_s: float = LOCK_WAIT_S) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(self._fd)
                    raise OutputBusy(f"another job is writing {path}; wait for it, stop it, or choose another "
                                     "output") from None
                time.sleep(0.05)
        os.fchmod(self._fd, 0o600)  # also a file an older job left readable

    def completed_ids(self) -> set[str]:
        return completed_ids(self.path)

    def write(self, line: str) -> None:
        data = memoryview(line.encode())
        while data:  # a write may take part of it (a filling volume, a signal): the line goes on whole
            data = data[os.write(self._fd, data):]

    def close(self) -> None:
        os.fsync(self._fd)
        os.close(self._fd)


def request_id(custom_id: str, limit: int = 256) -> str:
    """The `x-request-id` header for a custom_id: HTTP headers are ASCII, custom_ids need not be.
    One too long to quote whole keeps its start and ends in a digest of all of it, so two long
    ids never share a request id and no escape is cut in half."""
    quoted = quote(custom_id, safe="")
    if len(quoted) <= limit:
        return quoted
    digest = hashlib.sha256(custom_id.encode()).hexdigest()[:16]
    head, room = "", limit - len(digest) - 1
    for ch in custom_id:  # whole characters, so that no escape or UTF-8 sequence is cut
        part = quote(ch, safe="")
        if len(head) + len(part) > room:
            break
        head += part
    return f"{head}~{digest}"


async def run_one(client, base: str, key: str, req: BatchRequest, policy: RetryPolicy, rng: random.Random,
                  progress: Progress, sleep: Callable = asyncio.sleep, share: Share | None = None) -> str:
    import httpx

    url = f"{base}/{req.endpoint}"
    headers = {"Authorization": f"Bearer {key}", "x-request-id": request_id(req.custom_id)}
    # whole answers, as OpenAI's batches give; vLLM refuses stream_options without a stream
    payload = {k: v for k, v in req.body.items() if k != "stream_options"} | {"stream": False}
    attempt, paced = 0, 0.0  # failed attempts (waiting to be paced is not one), and the seconds paced
    while True:
        try:
            r = await client.post(url, json=payload, headers=headers)
        except httpx.HTTPError as e:
            status, body, wait, code, pacing = None, None, None, None, False
            error = {"code": "connection_error", "message": f"{type(e).__name__}: {e}"}
        else:
            status, wait, error = r.status_code, retry_after_of(r.headers), None
            try:
                body = r.json()
            except ValueError:
                body = {"error": {"message": r.text[:500], "type": "server_error"}}
            code = error_code(body)
            pacing = status == 429 and code is not None and code.endswith(PACING)
            if share is not None and not pacing:
                await share.answered(asyncio.get_running_loop().time())  # neither a refused slot nor paced
            if status not in RETRY_STATUSES or code == "request_too_large_for_quota":  # too large never fits
                if status == 200:
                    usage = body.get("usage") if isinstance(body, dict) else None
                    tokens = usage.get("total_tokens") if isinstance(usage, dict) else None
                    progress.done += 1
                    progress.tokens += tokens if isinstance(tokens, int) else 0
                else:
                    progress.failed += 1
                return result_line(req.custom_id, status, body, r.headers.get("x-request-id"))
        stalled = share is not None and asyncio.get_running_loop().time() - share.answered_at >= policy.max_paced_s
        if code == "concurrency_quota_exceeded" and share is not None and not stalled and await share.refused():
            progress.retried += 1
            continue
        if not pacing:
            attempt += 1
            if attempt >= policy.max_attempts:
                break
        elif paced >= policy.max_paced_s or stalled:
            break
        delay = policy.delay(max(1, attempt), wait, rng)
        paced += delay if pacing else 0.0
        progress.retried += 1
        await sleep(delay)
    progress.failed += 1
    if status is not None:
        return result_line(req.custom_id, status, body, None)
    return result_line(req.custom_id, None, None, None, error)


async def run(requests: list[BatchRequest], output: Path, base: str, key: str, concurrency: int,
              policy: RetryPolicy, progress_every_s: float = 10.0, seed: int = 0) -> Progress:
    import httpx

    writer = Output(output)  # held before anything is read: a second job on this output stops here
    done_ids = writer.completed_ids()
    todo = [r for r in requests if r.custom_id not in done_ids]
    progress = Progress(total=len(requests), skipped=len(requests) - len(todo))
    print(f"batch: {len(requests)} requests, {progress.skipped} already in {output}, {len(todo)} to send "
          f"to {base} with concurrency {concurrency}", flush=True)
    rng, share = random.Random(seed), Share(concurrency, asyncio.get_running_loop().time())
    queue: asyncio.Queue[BatchRequest] = asyncio.Queue()
    for r in todo:
        queue.put_nowait(r)

    async def worker(client):
        while not queue.empty():
            await share.take()
            try:
                if queue.empty():  # taken by another worker while this one waited its turn
                    return
                req = queue.get_nowait()
                try:
                    line = await run_one(client, base, key, req, policy, rng, progress, share=share)
                except Exception as e:  # this line's, not the job's: it is answered with the error, the others go on
                    traceback.print_exc()  # in the job's logs
                    progress.failed += 1
                    line = result_line(req.custom_id, None, None, None,
                                       {"code": "request_failed", "message": f"{type(e).__name__}: {e}"})
                writer.write(line)
            finally:
                await share.give()

    async def report():
        while True:
            await asyncio.sleep(progress_every_s)
            print(progress.line(), flush=True)

    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=30), limits=limits,
                                 trust_env=trust_env(base)) as client:
        reporter = asyncio.get_running_loop().create_task(report())
        try:
            await asyncio.gather(*(worker(client) for _ in range(min(concurrency, max(1, len(todo))))))
        finally:
            reporter.cancel()
            writer.close()
    print(progress.line(), flush=True)
    return progress


def at_least_one(text: str) -> int:
    """A count of 1 or more: 0 workers answered no line and succeeded, 0 attempts retried for ever."""
    if not (text.strip().isdigit() and int(text) >= 1):
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number, 1 or more")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deployments.batch_job", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the router")
    p.add_argument("--pool", default="offline", help="route prefix of the pool ('' for the tenant's default)")
    p.add_argument("--key-file", help="file with the tenant key (default: $POOLSERVE_KEY)")
    p.add_argument("--concurrency", type=at_least_one, default=64)
    p.add_argument("--max-attempts", type=at_least_one, default=8)
    p.add_argument("--retry-cap", type=float, default=60.0)
    p.add_argument("--skip-invalid", action="store_true", help="send the valid lines of a file with problems")
    p.add_argument("--progress-every", type=float, default=10.0)
    a = p.parse_args(argv)
    key = Path(a.key_file).read_text().strip() if a.key_file else os.environ.get("POOLSERVE_KEY", "")
    if not key:
        print("batch: no tenant key: set POOLSERVE_KEY or pass --key-file", file=sys.stderr)
        return 2
    requests, problems = read_input(jsonl_lines(Path(a.input).read_bytes()))
    if problems:
        print(f"batch: {a.input} has {len(problems)} problem(s):", file=sys.stderr)
        for prob in problems:
            print(f"  {prob}", file=sys.stderr)
        if not a.skip_invalid:
            print("batch: nothing sent; fix the lines above or pass --skip-invalid", file=sys.stderr)
            return 2
    # `ray job stop` sends SIGTERM: stop at once; every line already written stays valid.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
    base = f"{a.url.rstrip('/')}/{a.pool.strip('/')}/v1" if a.pool else f"{a.url.rstrip('/')}/v1"
    try:
        progress = asyncio.run(run(requests, Path(a.output), base, key, a.concurrency,
                                   RetryPolicy(a.max_attempts, cap_s=a.retry_cap), a.progress_every))
    except OutputBusy as e:
        print(f"batch: {e}", file=sys.stderr)
        return 2
    summary = {"total": progress.total, "done": progress.done, "failed": progress.failed,
               "skipped": progress.skipped, "retried": progress.retried, "output": a.output}
    print("batch summary: " + json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
