"""Whether a sweep's step is steady is judged on the engines' counters as reported, whatever
the spacing of the reports."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from autoscale.config import AutoscaleConfig
from autoscale.profile import Fingerprint
from autoscale.selfcal import _Counters
from autoscale.store import ProfileStore
from infra.state import MemoryStore
from pools.config import CalibrationConfig
from tests.unit.test_selfcal import FP, calibrate_itself, spec


def test_a_step_is_steady_whatever_the_spacing_of_the_reports():
    """The defaults: reports every second, steadiness judged over 1.5 s chunks. A chunk read
    between the calibrator's own looks held one report's tokens or two, so a steady engine
    looked 33% unsteady and no step was ever used."""
    assert AutoscaleConfig().report_interval_s == 1.0 and CalibrationConfig().check_s == 1.5
    store = ProfileStore(MemoryStore())
    defaults = CalibrationConfig(lengths="8/4", quiet_s=0.2)
    c, _ = calibrate_itself(store, spec(sweep=(1, 4, 16, 64, 128), calibration=defaults), every=1.0)
    profile = store.get("p", Fingerprint(**FP))
    assert profile is not None and profile.unsteady == (), profile and profile.unsteady
    assert c.status("p").safe_range == (1, 64)


def reported(replica: str, tokens: int):
    return SimpleNamespace(replica=replica, engine=SimpleNamespace(generated_tokens=tokens))


def test_replicas_reporting_out_of_phase_add_up_and_one_that_joins_counts_from_its_first_report():
    counters = _Counters()
    for k in range(15):  # looks every 0.25 s; r1 reports 100 tok/s on the second, r2 50 tok/s on the half
        now = 0.5 + 0.25 * k
        t1, t2 = float(int(now)), int(now - 0.5) + 0.5
        counters.add([(t1, reported("r1", int(100 * t1))), (t2, reported("r2", int(50 * t2)))])
    assert counters.end() == 3.5  # r2's latest report
    for a in (0.6, 1.1, 1.9):  # chunks of 1.5 s at any phase to the reports: the sum
        assert counters.rate(a, a + 1.5) == pytest.approx(150)
    assert counters.rate(3.0, 4.5) is None  # beyond what every replica has reported
    counters.add([(4.0, reported("r1", 400)), (4.5, reported("r2", 225)), (4.5, reported("r3", 0))])
    counters.add([(5.0, reported("r1", 500)), (5.5, reported("r2", 275)), (5.5, reported("r3", 80))])
    assert counters.rate(1.0, 5.0) is None  # r3 joined at 4.5
    assert counters.covered(1.0, 9.0) == (4.5, 5.0)  # a capped step's window: what all three cover
    assert counters.rate(4.5, 5.0) == pytest.approx(230)


def test_a_step_whose_requests_the_pools_own_work_sent_home_is_measured_again():
    """Own work that came and went between two reports sends the step's queued requests home
    (`lender_busy`): counted as the step's errors, they made a step look past its knee."""
    import tests.unit.test_selfcal as test_selfcal
    from pools.types import Rejected
    from tests.unit.test_selfcal import FakePool

    class Interrupted(FakePool):
        calls = 0

        async def _stream(self, call):
            Interrupted.calls += 1
            if 40 <= Interrupted.calls < 60:  # during a step (the second)
                yield Rejected(429, "lender_busy", "sent home", 1.0)
                return
            async for item in super()._stream(call):
                yield item

    store = ProfileStore(MemoryStore())
    real = test_selfcal.FakePool
    test_selfcal.FakePool = Interrupted
    try:
        c, _ = calibrate_itself(store, spec(sweep=(1, 4, 16, 64, 128)))
    finally:
        test_selfcal.FakePool = real
    profile = store.get("p", Fingerprint(**FP))
    assert Interrupted.calls >= 60 and all(r.errors == 0 for r in profile.rows), [r.errors for r in profile.rows]
    assert c.status("p").safe_range == (1, 64)


ERROR = {"message": "no", "type": "BadRequestError", "param": None, "code": 400}


@pytest.mark.parametrize("ending", ["refused", "failed", "error-object", "error-event"])
def test_a_sweep_request_the_engine_refuses_or_fails_is_an_error_of_its_step(monkeypatch, ending):
    """The sweep's requests are poolserve's own, so an engine that refuses one (before any
    work, or as vLLM's serving layer does: an error in the answer's place) or fails one (after
    it) shows a fault: it counted as neither an answer nor an error, or as an answer of no
    tokens, and a refusal streamed in a token's place was read as its first token."""
    import tests.unit.test_selfcal as test_selfcal
    from pools.types import Admitted, Failed, Finished, Refused, Usage

    ended = {"refused": Refused("invalid_request", "no"), "failed": Failed("engine_failed", "no"),
             "error-object": SimpleNamespace(error=SimpleNamespace(**ERROR)),
             "error-event": [f"data: {json.dumps({'error': ERROR})}\n\n"]}[ending]

    class Faulty(test_selfcal.FakePool):
        calls = 0

        async def _stream(self, call):
            Faulty.calls += 1
            if 40 <= Faulty.calls < 60:  # during a step (the second)
                yield Admitted("p", "r1", 0.0)
                yield ended
                if not isinstance(ended, (Refused, Failed)):  # the pool settles an error in an answer's place
                    yield Finished(Usage(call.prompt_tokens, 0), None, 0.0)
                return
            async for item in super()._stream(call):
                yield item

    monkeypatch.setattr(test_selfcal, "FakePool", Faulty)
    store = ProfileStore(MemoryStore())
    c, _ = calibrate_itself(store, spec(sweep=(1, 4, 16, 64, 128)))
    profile = store.get("p", Fingerprint(**FP))
    assert [r.errors for r in profile.rows] == [0, 20, 0, 0, 0], [(r.max_active_seqs, r.errors) for r in profile.rows]
    assert c.status("p").safe_range == (1, 1)  # a step with errors is past the knee, as a shed one is
