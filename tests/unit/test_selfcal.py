"""Calibration that travels: which profile a pool runs on, and the background sweep of a pool that
has none for its set-up, on a fake engine whose throughput curve is known."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from autoscale.config import AutoscaleConfig
from autoscale.controller import Controller
from autoscale.profile import Fingerprint, KneeRule, SLOSpec, TrafficSpec, LengthStats
from autoscale.calibrate import build_profile
from autoscale.ranges import RESWEEP_AFTER_S, PoolSpec
from autoscale.selfcal import Calibrator
from autoscale.store import ProfileStore
from infra.state import DirStore, MemoryStore
from pools.config import CalibrationConfig
from pools.control import ReplicaStats
from pools.types import Admitted, EngineStats, Finished, GateStats, LatencySample, SafeRange, Usage
from tests.unit.knee_fixtures import batching
from tests.unit.virtual_time import run

LADDER = (1, 2, 4, 8, 16, 32, 64, 128)
CONFIGURED = SafeRange(LADDER, 1, 8, 100, 100_000)
FALLBACK = SafeRange(LADDER, 1, 16, 100, 100_000)
FP = dict(model="m", dtype="float32", quantization="none", max_model_len=2048, hardware="cpu:here",
          vllm_version="0.29.0", max_num_seqs=128, max_num_batched_tokens=4096, kv_cache_gb=1.0)
ELSEWHERE = {**FP, "hardware": "cpu:the machine it was measured on"}
LENGTHS = LengthStats(p50=1, p90=1, p99=1)
TRAFFIC = TrafficSpec(source="t", scale=1, seed=0, prompt_tokens=LENGTHS, output_tokens=LENGTHS, total_tokens=LENGTHS)
FAST = CalibrationConfig(lengths="8/4", stream=True, warmup_s=0.3, check_s=0.5, min_measure_s=1.5, cap_s=6,
                         quiet_s=0.2)


def configured_profile():
    rows = batching()[:4]
    return build_profile("p", rows, Fingerprint(**ELSEWHERE), SLOSpec(ttft_p99_ms=1000, tpot_p99_ms=100), TRAFFIC,
                         KneeRule(), (), "2026-11-30")


def spec(mode="auto", profile=True, sweep=(1, 2, 4, 8, 16, 32, 64, 128), calibration=FAST) -> PoolSpec:
    return PoolSpec("p", CONFIGURED, 1.0, 0.1, 128, fallback=FALLBACK,
                    profile=configured_profile() if profile else None,
                    calibration=calibration.model_copy(update={"mode": mode}), sweep=sweep, deployment="pool-p")


def report(c: Controller, fp=FP, active=0, tokens=0, own=0, borrowed=0) -> object:
    limits = c.allowed("p").limits_for(c.allowed("p").low)
    gate = GateStats(active=active, inflight_tokens=0, queued_by_class={"standard": own}, queued_tokens=0,
                     oldest_wait_s=0, limits=limits, admitted=0, rejected=0, cancelled=0, evicted=0, completed=0,
                     active_requests=active, borrowed_requests=borrowed)
    epoch = c.status("p").epoch if c.calibration("p").state != "unknown" else 0
    return c.report(ReplicaStats("p", "r1", time.time(), gate, EngineStats(generated_tokens=tokens), LatencySample(),
                                 limits_allowed(c), applied_epoch=epoch, fingerprint=fp))


def limits_allowed(c):
    return c.allowed("p") if c.calibration("p").state != "unknown" else FALLBACK


def controller(s: PoolSpec, profiles: ProfileStore | None = None, clock=time.monotonic) -> Controller:
    return Controller({"p": s}, AutoscaleConfig(), clock, profiles=profiles)


@pytest.mark.parametrize("mode, fp, state, allowed", [
    ("auto", ELSEWHERE, "profile", (1, 8)),  # measured on this set-up: the configured profile
    ("auto", FP, "calibrating", (1, 16)),  # another set-up: the fallback range, a sweep will run
    ("fallback", FP, "fallback", (1, 16)),
    ("strict", FP, "strict", (1, 1)),  # today's behaviour: the bottom of the configured range
    ("auto", {}, "profile", (1, 8)),  # no engine facts to compare: the configured profile
], ids=["matching", "auto", "fallback", "strict", "unchecked"])
def test_which_range_a_pool_runs_in(mode, fp, state, allowed):
    c = controller(spec(mode))
    d = report(c, fp)
    assert c.calibration("p").state == state and (d.allowed.low, d.allowed.high) == allowed
    assert c.views()["p"].calibrating is (state == "calibrating")  # no borrowing into or out of it meanwhile


@pytest.mark.parametrize("mode, state, allowed", [
    ("fallback", "manual", (1, 8)),  # the configured range, for good
    ("auto", "calibrating", (1, 16)),  # the range's steps up to `start` until a sweep measured the set-up
], ids=["kept", "calibrated"])
def test_a_configured_range_is_kept_or_calibrated(mode, state, allowed):
    c = controller(spec(mode, profile=False))
    report(c, FP)
    assert c.calibration("p").state == state and (c.allowed("p").low, c.allowed("p").high) == allowed
    assert c.needs_sweep() == (["p"] if state == "calibrating" else [])


class FakePool:
    """An engine whose iteration takes 20 + b ms for b sequences (the batching fixture's curve):
    each request streams 16 tokens. It reports to the controller every `every` seconds; `own`
    requests of the pool's own traffic can be made to appear."""

    def __init__(self, c: Controller, every: float = 0.05) -> None:
        self.c, self.active, self.tokens, self.own, self.seen_steps, self.serving = c, 0, 0.0, 0, [], []
        self.every = every

    def handle(self, name):
        return SimpleNamespace(generate=SimpleNamespace(remote=lambda call: self._stream(call)))

    async def _stream(self, call):
        self.active += 1
        try:
            yield Admitted("p", "r1", 0.0)
            for _ in range(call.max_tokens):
                await asyncio.sleep((20 + self.active) / 1e3)
                yield ["data: x"]
            yield Finished(Usage(call.prompt_tokens, call.max_tokens), None, 0.0)
        finally:
            self.active -= 1

    async def report_forever(self) -> None:
        while True:
            await asyncio.sleep(self.every)
            b = self.active
            self.tokens += self.every * (1000 * b / (20 + b))
            status = self.c.status("p")
            self.seen_steps.append(self.c.allowed("p").high if status.pinned else None)
            self.serving.append(status.serving_range)
            report(self.c, FP, active=b, tokens=int(self.tokens), own=self.own, borrowed=b)


def calibrate_itself(store: ProfileStore, s: PoolSpec, every: float = 0.05) -> tuple[Controller, FakePool]:
    """One background sweep of the fake pool, on virtual time."""
    async def go():
        clock = asyncio.get_running_loop().time
        c = controller(s, store, clock)
        pool = FakePool(c, every)
        report(c, FP)
        assert c.needs_sweep() == ["p"]
        reporter = asyncio.get_running_loop().create_task(pool.report_forever())
        cal = Calibrator(c, pool.handle, max_model_len=2048, clock=clock)
        try:
            await asyncio.wait_for(cal.step(), 600)  # virtual seconds: bounds a hang only
        finally:
            reporter.cancel()
        return c, pool

    return run(go)


def test_a_pool_without_a_profile_calibrates_itself_and_the_next_start_reuses_it(tmp_path):
    store = ProfileStore(DirStore(tmp_path))
    c, pool = calibrate_itself(store, spec(sweep=(1, 4, 16, 64, 128)))
    status = c.status("p")
    assert status.calibration.state == "profile" and "sweep of this set-up" in status.calibration.source
    assert status.safe_range == (1, 64) and status.pinned is None  # the knee of 20 + b ms: 128 is past it
    # while the sweep pinned its steps, the pool served (and the status said so) at its fallback
    assert set(pool.serving[:len(pool.serving) // 2]) == {(FALLBACK.low, FALLBACK.high)}
    assert status.serving_range == (1, 64)
    again = controller(spec(), store)  # a second start on the same set-up
    report(again, FP)
    assert again.calibration("p").state == "profile" and "profile store" in again.calibration("p").source
    assert again.allowed("p").high == 64


def test_own_traffic_stops_a_step_and_the_pool_serves_at_its_fallback_meanwhile(tmp_path):
    async def go():
        clock = asyncio.get_running_loop().time
        c = controller(spec(sweep=(1, 4)), ProfileStore(MemoryStore()), clock)
        pool = FakePool(c)
        report(c, FP)
        reporter = asyncio.get_running_loop().create_task(pool.report_forever())
        cal = asyncio.get_running_loop().create_task(Calibrator(c, pool.handle, 2048, clock=clock).step())
        while not c.status("p").pinned:
            await asyncio.sleep(0.01)
        pool.own = 3  # chat arrives during the first step
        while c.status("p").pinned:
            await asyncio.sleep(0.01)
        unpinned = c.allowed("p")
        await asyncio.sleep(0.5)
        pool.own = 0
        await asyncio.wait_for(cal, 60)
        reporter.cancel()
        return c, unpinned

    c, unpinned = run(go)
    assert (unpinned.low, unpinned.high) == (1, 16)  # the fallback range at once
    assert c.calibration("p").state == "profile"  # the step was measured again later


def test_unsteady_steps_are_measured_again_once(tmp_path):
    """A step that hit its time cap may say more about a busy host than about the set-up: its
    profile keeps the pool out of the fallback range until the next start measures again; a
    second unsteady sweep is the set-up's answer and is kept."""
    rows = batching()[:4]
    unsteady = build_profile("p", (*rows[:3], rows[3].model_copy(update={"steady": False})), Fingerprint(**FP),
                             SLOSpec(ttft_p99_ms=1000, tpot_p99_ms=100), TRAFFIC, KneeRule(), (), "2026-11-30")
    assert unsteady.unsteady == (8,) and unsteady.range == (1, 4)
    store = ProfileStore(DirStore(tmp_path))

    def start():
        c = controller(spec(sweep=(1, 2, 4, 8)), store)
        report(c, FP)
        return c

    c = start()
    assert c.needs_sweep() == ["p"]
    c.adopt("p", unsteady)
    assert c.calibration("p").state == "profile" and "measured again at the next start" in c.calibration("p").detail
    c = start()  # the next start runs in the provisional range while it measures again
    assert c.calibration("p").state == "calibrating" and "not steady" in c.calibration("p").source
    assert (c.allowed("p").low, c.allowed("p").high) == (1, 4) and c.needs_sweep() == ["p"]
    c.adopt("p", unsteady)  # unsteady again: kept for good
    assert c.calibration("p").state == "profile" and "measured again" not in c.calibration("p").detail
    c = start()
    assert c.calibration("p").state == "profile" and c.needs_sweep() == []
    steady = build_profile("p", rows, Fingerprint(**FP), SLOSpec(ttft_p99_ms=1000, tpot_p99_ms=100), TRAFFIC,
                           KneeRule(), (), "2026-12-01")
    c.adopt("p", steady)
    assert not store.get("p", Fingerprint(**FP)).provisional


@pytest.mark.parametrize("unsteady", [(0,), (1, 2), (0, 1, 2, 3)], ids=["lowest", "half", "all"])
def test_a_sweep_that_is_not_evidence_is_neither_kept_nor_adopted(unsteady):
    """A sweep whose lowest step, or half its steps, never measured steady would set the range
    from a busy host (the lowest step alone: batch size 1); the pool stays at its fallback and
    sweeps again, and gives up for this start after three such sweeps."""
    rows = [r.model_copy(update={"steady": i not in unsteady}) for i, r in enumerate(batching()[:4])]
    profile = build_profile("p", rows, Fingerprint(**FP), SLOSpec(ttft_p99_ms=1000, tpot_p99_ms=100), TRAFFIC,
                            KneeRule(), (), "2026-12-02")
    store, now = ProfileStore(MemoryStore()), [0.0]
    c = Controller({"p": spec(sweep=(1, 2, 4, 8))}, AutoscaleConfig(), lambda: now[0], profiles=store)
    report(c, FP)
    for attempt in (1, 2):
        c.adopt("p", profile)
        assert store.get("p", Fingerprint(**FP)) is None, f"sweep {attempt} was kept"
        assert c.calibration("p").state == "calibrating" and "discarded" in c.calibration("p").detail
        assert "the fallback range" in c.calibration("p").detail
        assert (c.allowed("p").low, c.allowed("p").high) == (FALLBACK.low, FALLBACK.high)
        assert c.needs_sweep() == []  # a busy host may be busy a while longer
        now[0] += RESWEEP_AFTER_S
        assert c.needs_sweep() == ["p"]
    c.adopt("p", profile)
    assert c.calibration("p").state == "failed" and c.needs_sweep() == []
    assert (c.allowed("p").low, c.allowed("p").high) == (FALLBACK.low, FALLBACK.high)
    assert store.get("p", Fingerprint(**FP)) is None


def test_a_profile_is_judged_at_the_pools_own_slo():
    """A profile's range was chosen at the SLO of its sweep; a pool run at a tighter one (in its
    config, or set at runtime) kept that range, steps whose measured P99 break its SLO included."""
    from autoscale.knee import find_knee
    from pools.control import SloJson

    rows = configured_profile().rows
    tight = SLOSpec(ttft_p99_ms=70, tpot_p99_ms=100)
    expected = find_knee(rows, tight, KneeRule()).high
    assert expected < 8, "the test needs an SLO that the measured rows break within the profile's range"
    c = controller(spec("auto").__class__(**{**spec("auto").__dict__, "ttft_slo_s": 0.07}))
    report(c, ELSEWHERE)
    assert c.calibration("p").state == "profile" and (c.allowed("p").low, c.allowed("p").high) == (1, expected)
    assert f"[1, {expected}]" in c.calibration("p").detail

    c = controller(spec("auto"))
    report(c, ELSEWHERE)
    assert (c.allowed("p").low, c.allowed("p").high) == (1, 8)
    c.set_slo("p", SloJson(ttft_p99_ms=70, tpot_p99_ms=100))
    assert (c.allowed("p").low, c.allowed("p").high) == (1, expected)
    assert (report(c, ELSEWHERE).allowed.high, c.status("p").safe_range) == (expected, (1, expected))
    c.set_slo("p", SloJson(ttft_p99_ms=1000, tpot_p99_ms=100))
    assert (c.allowed("p").low, c.allowed("p").high) == (1, 8)
    c.sweep_failed("p", "boom")  # a state of its own: its range is judged again, its detail stays
    c.set_slo("p", SloJson(ttft_p99_ms=70, tpot_p99_ms=100))
    assert (c.allowed("p").high, c.calibration("p").state) == (expected, "failed")
    assert "boom" in c.calibration("p").detail


def test_a_pool_with_no_replica_to_measure_yields_the_sweeper():
    """Sweeps run one at a time, and a step waited, without end, for a pool with no replica
    reporting (scaled to zero) or whose own traffic never paused: no other pool calibrated."""
    from autoscale.selfcal import WAIT_FOR_POOL_S

    now = [0.0]

    async def sleep(seconds):
        now[0] += seconds
        await asyncio.sleep(0)

    c = Controller({"p": spec("auto")}, AutoscaleConfig(), lambda: now[0])
    report(c, FP)  # the pool calibrates; then its replicas go, and report no more
    assert c.needs_sweep() == ["p"]
    cal = Calibrator(c, lambda name: None, 2048, clock=lambda: now[0], sleep=sleep)
    asyncio.run(asyncio.wait_for(cal.step(), 30))
    assert cal.running is None and WAIT_FOR_POOL_S <= now[0] <= 2 * WAIT_FOR_POOL_S
    assert "no replica" in c.calibration("p").detail and c.status("p").pinned is None
    waited = now[0]
    asyncio.run(asyncio.wait_for(cal.step(), 30))  # the other pools' turn: this one not before a minute
    assert now[0] == waited
    now[0] += RESWEEP_AFTER_S
    assert c.needs_sweep() == ["p"]


def test_the_fingerprint_tells_set_ups_apart_that_run_differently(monkeypatch):
    """The fingerprint named the model only by the id clients send, and the hardware by the
    machine's cores: new weights under the same id, eager mode, another KV block size, chunked
    prefill off, or an engine bound to four cores instead of one reused the old profile."""
    from pools.engine import setup_name

    llama = SimpleNamespace(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=4, intermediate_size=128, vocab_size=1000, name_or_path="/a")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    base = setup_name(llama, 16, False, True)
    fine_tune = SimpleNamespace(**{**vars(llama), "name_or_path": "/elsewhere/fine-tuned"})
    assert setup_name(fine_tune, 16, False, True) == base, "the same shape runs alike, wherever it is"
    deeper = SimpleNamespace(**{**vars(llama), "num_hidden_layers": 32})
    others = {setup_name(deeper, 16, False, True), setup_name(llama, 128, False, True),
              setup_name(llama, 16, True, True), setup_name(llama, 16, False, False)}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3")
    others.add(setup_name(llama, 16, False, True))
    assert len(others) == 5 and base not in others and "threads=4" in setup_name(llama, 16, False, True)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    assert setup_name(llama, 16, False, True) == base, "one core is one core, whichever"
    measured = Fingerprint(**{**FP, "engine": base})
    running = Fingerprint(**{**FP, "engine": setup_name(deeper, 16, False, True)})
    assert measured != running and measured.differences(running)[0].startswith("engine:")


@pytest.mark.parametrize("damage", ["missing field", "not yaml", "a list"])
def test_a_stored_profile_that_cannot_be_read_is_measured_again(tmp_path, damage):
    """The store outlives a version of poolserve, and its folder can be edited by hand: a stored
    profile that no longer reads made every report of the pool raise, and the pool never got a
    range. It is treated as missing, says why, and the sweep's profile replaces it."""
    import yaml

    store = ProfileStore(DirStore(tmp_path))
    store.put(configured_profile().model_copy(update={"fingerprint": Fingerprint(**FP)}))
    (path,) = tmp_path.rglob("*.yaml")
    data = yaml.safe_load(path.read_text())
    del data["reason"]
    path.write_text({"missing field": yaml.safe_dump(data), "not yaml": "rows: [1, 2\n", "a list": "- 1\n"}[damage])
    c = controller(spec(), store)
    d = report(c, FP)
    assert c.calibration("p").state == "calibrating" and (d.allowed.low, d.allowed.high) == (1, 16)
    why = {"missing field": "reason: Field required", "not yaml": "ParserError",
           "a list": "the file: Input should be a valid dictionary"}[damage]
    assert f"the stored one cannot be read ({why}" in c.calibration("p").source and c.needs_sweep() == ["p"]
    c.adopt("p", build_profile("p", batching()[:4], Fingerprint(**FP), SLOSpec(ttft_p99_ms=1000, tpot_p99_ms=100),
                               TRAFFIC, KneeRule(), (), "2026-12-04"))
    assert c.calibration("p").state == "profile" and store.get("p", Fingerprint(**FP)).created_at == "2026-12-04"


def test_a_profile_store_that_cannot_be_reached_is_asked_again_at_the_next_report(tmp_path, monkeypatch):
    """A volume's hiccup is no damaged profile: taken for one, a good profile was swept over
    (or, in `strict` mode, the pool sat at its bottom step for good). The report fails, and the
    next one finds the profile."""
    store = ProfileStore(DirStore(tmp_path))
    store.put(configured_profile().model_copy(update={"fingerprint": Fingerprint(**FP)}))

    def hiccup(self, key):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(DirStore, "get", hiccup)
    c = controller(spec(), store)
    with pytest.raises(OSError):
        report(c, FP)
    assert c.calibration("p").state == "unknown"
    monkeypatch.undo()
    report(c, FP)
    assert c.calibration("p").state == "profile" and c.needs_sweep() == []
