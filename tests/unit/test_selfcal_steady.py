"""Whether a sweep's step is steady is judged on the engines' counters as reported, whatever
the spacing of the reports."""

from __future__ import annotations

from autoscale.config import AutoscaleConfig
from autoscale.profile import Fingerprint
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
