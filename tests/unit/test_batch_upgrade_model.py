"""Batches across a RayService upgrade, on seeded random schedules. Two clusters share the
batch volume, each with its own job API that knows only its own jobs (a job of the other's is a
404, read as failed); both clusters' batch services poll, create and cancel, until the old
cluster is deleted and its jobs die. Jobs hold their output's lock as the real batch job does
(`deployments.batch_job.Output`), open it only once started, and may be reported stopped before
they exit; either service restarts, a job API's answer to a submit may be lost, inputs may
expire and be swept. Whatever the order: no line is answered twice, an accepted cancel ends
cancelled, a completed batch answered every line, a failed one failed by its jobs (never by its
input swept), and every batch ends once the faults end."""

from __future__ import annotations

import random
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from deployments.batch_job import Output, OutputBusy
from infra.batchfile import jsonl_lines, read_input, result_line
from router.batch_records import HELD_GRACE_S, TERMINAL
from router.batches import Batches, BatchSettings
from router.files import FileStore
from tests.unit.model_based import replayable, schedules
from tests.unit.test_batches import Clock, _line, _output_rows


class Job:
    """One batch job's process: it reads its input, then takes the output (refused if another
    job holds it), answers lines, and ends; told to stop, its API may say so before it exits."""

    def __init__(self, args: list[str]) -> None:
        opts = dict(zip(args[::2], args[1::2]))
        self.input, self.output_path = Path(opts["--input"]), Path(opts["--output"])
        self.state, self.out, self.todo = "PENDING", None, []

    def start(self) -> None:
        try:
            requests, _ = read_input(jsonl_lines(self.input.read_bytes()))
            self.out = Output(self.output_path, wait_s=0)
            self.state = "RUNNING"
            done = self.out.completed_ids()  # once, under the lock, as the real job reads them
            self.todo = [r.custom_id for r in requests if r.custom_id not in done]
        except OutputBusy:
            self.state = "FAILED"  # "another job is writing": exit 2
        except FileNotFoundError:
            self.state = "FAILED"  # its input or its batch's folder went meanwhile

    def answer(self, n: int) -> None:
        for custom_id in self.todo[:n]:
            self.out.write(result_line(custom_id, 200, {"text": custom_id}, "req"))
        self.todo = self.todo[n:]
        if not self.todo:
            self.exit("SUCCEEDED")

    def exit(self, state: str) -> None:
        if self.out is not None:
            self.out.close()
            self.out = None
        if self.state != "STOPPED":  # Ray's word stands
            self.state = state

    @property
    def alive(self) -> bool:
        return self.out is not None or self.state in ("PENDING", "RUNNING")


class Cluster:
    """One Ray cluster's job API."""

    def __init__(self) -> None:
        self.jobs: dict[str, Job] = {}
        self.up = True
        self.lose_answer = False  # the job starts, but the service never hears that it did (it died, say)

    def _check(self) -> None:
        if not self.up:
            raise ConnectionError("this cluster is gone")

    def submit(self, name: str, args: list[str]) -> str:
        self._check()
        self.jobs.setdefault(name, Job(args))
        if self.lose_answer:
            raise ConnectionError("the job API's answer was lost")
        return name

    def status(self, job_id: str) -> str:
        self._check()
        return self.jobs[job_id].state if job_id in self.jobs else "FAILED"  # a 404, as RayJobRunner reads it

    def stop(self, job_id: str) -> None:
        self._check()
        job = self.jobs.get(job_id)
        if job is not None and job.state in ("PENDING", "RUNNING"):
            job.state = "STOPPED"  # Ray says so at once; the process exits at a later step
            if job.out is None:
                job.exit("STOPPED")

    def logs(self, job_id: str) -> str:
        return ""


def _one_schedule(root, seed: int) -> None:
    rng, clock = random.Random(seed), Clock()
    old, new = Cluster(), Cluster()
    attempts = 3 + seed % 3

    def service(cluster: Cluster) -> Batches:
        settings = BatchSettings(root, "http://router:8000", "offline", max_attempts=attempts, max_lines=100)
        return Batches(settings, FileStore(root, clock), cluster, clock)

    services = {"old": service(old), "new": service(new)}
    files = FileStore(root, clock)
    made: dict[str, int] = {}  # batch id: its lines
    cancelled: set[str] = set()
    for _ in range(rng.randrange(1, 4)):
        lines = rng.randint(1, 12)
        content = "".join(_line(i) + "\n" for i in range(lines)).encode()
        fid = files.create("acme", "in.jsonl", "batch", content, rng.choice((None, 3600)))["id"]  # may expire
        made[services["old"].create("acme", "sk", fid, "/v1/completions", "24h")["id"]] = lines
    jobs = lambda: [c.jobs[n] for c in (old, new) for n in sorted(c.jobs)]  # noqa: E731
    for step in range(rng.randrange(20, 120)):
        move, live = rng.random(), [j for j in jobs() if j.alive]
        if move < 0.35 and live:
            job = rng.choice(live)
            if job.state == "PENDING":
                job.start()
            elif job.out is not None and job.state == "RUNNING" and rng.random() < 0.8:
                job.answer(rng.randint(0, 4))
            else:
                job.exit("FAILED" if job.state == "RUNNING" else job.state)  # a crash; or a stopped job exits
        elif move < 0.75:
            name = rng.choice([n for n in services if n != "old" or old.up])
            services[name].poll()
            for batch_id in made:  # a batch ends only once no job writes its output, or an hour past its window
                record = services["new"].get("acme", batch_id)
                if record["status"] in TERMINAL and clock.now < record["expires_at"] + HELD_GRACE_S:
                    writing = [j for j in jobs() if j.out is not None and j.todo and batch_id in str(j.output_path)]
                    assert not writing, f"{batch_id} ended while a job still had lines to answer in its output"
        elif move < 0.8:
            batch_id = rng.choice(sorted(made))
            before = services["new"].get("acme", batch_id)["status"]
            after = services[rng.choice(["new", "old"] if old.up else ["new"])].cancel("acme", batch_id)["status"] \
                if before not in ("completed", "failed", "expired") else before
            if after in ("cancelling", "cancelled"):
                cancelled.add(batch_id)
        elif move < 0.85 and old.up and step > 10:  # the upgrade ends: the old cluster and its jobs go
            old.up = False
            for job in old.jobs.values():
                job.exit("FAILED")
        elif move < 0.9:
            name = rng.choice([n for n in services if n != "old" or old.up])
            services[name] = service(old if name == "old" else new)  # a service restarted
        elif move < 0.93:
            cluster = rng.choice((old, new))
            cluster.lose_answer = not cluster.lose_answer
        clock.now += rng.randint(0, 30) if rng.random() < 0.98 else rng.choice((24, 25)) * 3600  # past the window
    old.up, new.lose_answer = False, False
    for job in old.jobs.values():
        job.exit("FAILED")
    for _ in range(3 * attempts + 6):  # the faults end: every job runs to its end, the new service polls
        for job in [j for j in new.jobs.values() if j.alive]:
            if job.state == "PENDING":
                job.start()
            if job.state == "RUNNING":
                job.answer(100)
            job.exit(job.state if job.state != "RUNNING" else "SUCCEEDED")
        services["new"].poll()
    for batch_id, lines in made.items():
        record = services["new"].get("acme", batch_id)
        assert record["status"] in TERMINAL, f"{batch_id}: still {record['status']}"
        rows = _output_rows(files, "acme", record["output_file_id"]) + _output_rows(files, "acme",
                                                                                  record["error_file_id"])
        ids = [r["custom_id"] for r in rows]
        assert len(ids) == len(set(ids)), f"{batch_id}: a line answered twice: {sorted(ids)}"
        if batch_id in cancelled:
            assert record["status"] == "cancelled", f"{batch_id}: an accepted cancel ended {record['status']}"
        if record["status"] == "completed":
            assert sorted(ids) == sorted(f"req-{i}" for i in range(lines)), f"{batch_id}: completed, lines missing"
        if record["status"] == "failed":
            assert record["errors"]["data"][0]["code"] == "job_failed", record["errors"]
        assert record["request_counts"]["completed"] + record["request_counts"]["failed"] == len(ids)
    assert not [j for j in jobs() if j.alive], "a job outlived the schedule"


@pytest.mark.parametrize("block", range(4))
def test_batches_across_an_upgrade_never_answer_a_line_twice_and_always_end(tmp_path, monkeypatch, block):
    for seed in schedules(50)[block::4]:
        ids = random.Random(10**9 + seed)  # batch and file ids too, so that a seed replays
        seeded = SimpleNamespace(uuid4=lambda: uuid.UUID(int=ids.getrandbits(128)))
        monkeypatch.setattr("router.batches.uuid", seeded)
        monkeypatch.setattr("router.files.uuid", seeded)
        with replayable("test_batches_across_an_upgrade_never_answer_a_line_twice_and_always_end", seed):
            _one_schedule(tmp_path / str(seed), seed)
