"""`poolserve batch submit|status|logs|stop`: batch files as Ray jobs (JobSubmissionClient).

`submit` is the same as

    ray job submit --address http://127.0.0.1:8265 \
        --runtime-env-json '{"env_vars": {"POOLSERVE_KEY": "sk-batch-dev"}}' -- \
        python -m deployments.batch_job --input /abs/in.jsonl --output /abs/out.jsonl

The job runs on the cluster: input and output paths must be visible there (absolute local
paths on a one-machine cluster; a shared volume on Kubernetes). The key travels in the job's
runtime environment, which anyone with access to the dashboard can read; on shared clusters
put it in a file (`--key-file`) or a Kubernetes Secret instead.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from deployments.batch_job import at_least_one
from infra.wire import no_proxy_to_loopback, trust_env

DEFAULT_ADDRESS = "http://127.0.0.1:8265"


def ray_token() -> str | None:
    """The cluster's token, found where Ray's own CLI finds it: `RAY_AUTH_TOKEN`, the file
    `RAY_AUTH_TOKEN_PATH` names, or `~/.ray/auth_token` (where a local Ray writes it)."""
    if token := os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return token
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _client(address: str):
    from ray.job_submission import JobSubmissionClient

    if not trust_env(address):
        no_proxy_to_loopback()
    token = ray_token()  # Ray's token authentication is on by default for a cluster ray.init() starts
    return JobSubmissionClient(address, headers={"Authorization": f"Bearer {token}"} if token else None)


class RayJobRunner:
    """`router.batches.JobRunner` on Ray's job API: the Batch API's batches as Ray jobs. One
    client while the API answers: making one asks the API its version, and where `RAY_ADDRESS`
    is set (every KubeRay pod) the GCS where the API is, which at every poll was two calls more
    per batch. A call that fails otherwise than with Ray's answer makes the next one anew (the
    head may have restarted elsewhere)."""

    _jobs = None  # the client; calls come one at a time (the batch service's turn). A class default:
    # a runner pickled by a version before this one (a replica restarted on new code) has none

    def __init__(self, address: str) -> None:
        self._address = address

    def _call(self, method: str, *args, **kwargs):
        if self._jobs is None:
            self._jobs = _client(self._address)
        try:
            return getattr(self._jobs, method)(*args, **kwargs)
        except RuntimeError:  # Ray's job API answered (a 404, a refused name...)
            raise
        except Exception:
            self._jobs = None
            raise

    def submit(self, name: str, args: list[str]) -> str:
        try:
            return self._call("submit_job", entrypoint=shlex.join([sys.executable, "-m", "deployments.batch_job",
                                                                    *args]),
                              submission_id=name, metadata={"poolserve": "batch-api"})
        except RuntimeError:
            try:  # submitted before a crash kept the batch's record from saying so: Ray refuses a second one
                return self._call("get_job_info", name).submission_id
            except RuntimeError:
                pass
            raise

    def status(self, job_id: str) -> str:
        try:
            return self._call("get_job_status", job_id).value
        except RuntimeError as e:
            if _lost(e):  # ended without a result: the batch resumes it in a new job
                return "FAILED"
            raise

    def stop(self, job_id: str) -> None:
        try:
            self._call("stop_job", job_id)
        except RuntimeError as e:
            if not _lost(e):
                raise

    def logs(self, job_id: str) -> str:
        try:
            return self._call("get_job_logs", job_id)
        except RuntimeError as e:
            if _lost(e):  # else the batch whose last attempt Ray lost could not fail: it waited out its window
                return f"(Ray no longer knows job {job_id}: its logs are lost)"
            raise


def _lost(e: RuntimeError) -> bool:
    """Ray's job API answered 404: it does not know the job (a head restarted without its GCS)."""
    return "status code 404" in str(e)


def entrypoint(input_path: str, output_path: str, url: str, pool: str, concurrency: int,
               key_file: str | None = None, python: str = "python") -> str:
    parts = [python, "-m", "deployments.batch_job", "--input", input_path, "--output", output_path,
             "--url", url, "--pool", pool, "--concurrency", str(concurrency)]
    if key_file:
        parts += ["--key-file", key_file]
    return shlex.join(parts)  # a path with spaces stays one argument; nothing in it runs


def _cmd_submit(a) -> int:
    inp, out = str(Path(a.input).resolve()), str(Path(a.output).resolve())
    key = a.tenant_key or os.environ.get("POOLSERVE_KEY")
    if not key and not a.key_file:
        raise SystemExit("batch submit: give --tenant-key, --key-file or POOLSERVE_KEY")
    runtime_env = {"env_vars": {"POOLSERVE_KEY": key}} if key and not a.key_file else {}
    job_id = _client(a.address).submit_job(
        entrypoint=entrypoint(inp, out, a.url, a.pool, a.concurrency, a.key_file, python=sys.executable),
        runtime_env=runtime_env or None, submission_id=a.job_id,
        metadata={"poolserve": "batch", "input": inp, "output": out})
    print(job_id)
    return 0


def _cmd_status(a) -> int:
    info = _client(a.address).get_job_info(a.job_id)
    print(f"{a.job_id}: {info.status}" + (f" ({info.message})" if info.message else ""))
    return 0


def _cmd_logs(a) -> int:
    print(_client(a.address).get_job_logs(a.job_id), end="")
    return 0


def _cmd_stop(a) -> int:
    stopped = _client(a.address).stop_job(a.job_id)
    print(f"{a.job_id}: {'stopping' if stopped else 'not running'}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("batch", help="submit and watch batch files as Ray jobs")
    bsub = p.add_subparsers(dest="batch_cmd", required=True)
    s = bsub.add_parser("submit", help="submit INPUT.jsonl (OpenAI Batch format) to the running cluster")
    s.add_argument("input")
    s.add_argument("--output", required=True)
    s.add_argument("--tenant-key", help="the tenant's API key (or POOLSERVE_KEY)")
    s.add_argument("--key-file", help="a file on the cluster holding the key, instead of passing it")
    s.add_argument("--url", default="http://127.0.0.1:8000", help="the router, as the cluster sees it")
    s.add_argument("--pool", default="offline")
    s.add_argument("--concurrency", type=at_least_one, default=64)
    s.add_argument("--job-id", help="a submission id of your choice")
    s.set_defaults(fn=_cmd_submit)
    for name, fn, text in (("status", _cmd_status, "a job's status"), ("logs", _cmd_logs, "a job's logs"),
                           ("stop", _cmd_stop, "stop a job (rerun with the same output to resume)")):
        c = bsub.add_parser(name, help=text)
        c.add_argument("job_id")
        c.set_defaults(fn=fn)
    for parser in [s] + [bsub.choices[n] for n in ("status", "logs", "stop")]:
        parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS", DEFAULT_ADDRESS),
                            help="the Ray dashboard (job server) address")
