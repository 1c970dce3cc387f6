"""The background sweep's pins hold the pool only while a step measures it."""

from __future__ import annotations

import asyncio
import time

from autoscale.selfcal import Calibrator
from autoscale.store import ProfileStore
from deployments.admin_client import AdminClient
from infra.state import MemoryStore
from tests.unit.test_selfcal import FP, FakePool, controller, report, spec
from tests.unit.virtual_time import run


def test_own_traffic_between_two_steps_is_not_held_at_the_last_steps_pin():
    """Own traffic arriving as a step ended was served at its pin (here 1 sequence) while the sweep
    waited for quiet before the next step: until the traffic stopped, or for two minutes."""
    async def go():
        c = controller(spec(sweep=(1, 4)), ProfileStore(MemoryStore()))
        pool = FakePool(c)
        report(c, FP)
        reporter = asyncio.get_running_loop().create_task(pool.report_forever())
        cal = Calibrator(c, pool.handle, 2048)
        c.sweep_pin("p", 1)  # as the first step left it
        pool.own = 3
        while not any(r.gate.own_work for r in c.replica_stats("p")):  # its report is in
            await asyncio.sleep(0.01)
        waiting = asyncio.get_running_loop().create_task(cal._quiet("p", time.monotonic()))
        await asyncio.sleep(0.5)
        during = c.status("p").pinned, c.allowed("p")
        pool.own = 0
        await asyncio.wait_for(waiting, 10)
        reporter.cancel()
        return during

    pinned, allowed = asyncio.run(go())
    assert pinned is None and (allowed.low, allowed.high) == (1, 16)  # its fallback range


def test_a_pin_is_in_force_only_once_every_replica_echoes_its_epoch(monkeypatch):
    """`poolserve calibrate` measures a step only after its pin is applied. A report made before
    the pin (here: every report until the third poll) must not count, whatever it shows."""
    c = controller(spec())
    report(c, FP)
    polls = []

    def call(self, method, path, **kw):
        if method == "POST":
            return c.pin("p", kw["json"]["max_active_seqs"], kw["json"]["calibrating"]).model_dump(mode="json")
        polls.append(path)
        if len(polls) == 3:
            report(c, FP)  # the replica's first report after the pin echoes its epoch
        return {"p": c.status("p").model_dump(mode="json")}

    monkeypatch.setattr(AdminClient, "_call", call)
    monkeypatch.setattr("deployments.admin_client.time.sleep", lambda s: None)
    before = c.status("p").epoch
    result = AdminClient("http://admin", "k").pin("p", 4, calibrating=True)
    assert result.epoch == before + 1 and len(polls) == 3
    assert c.status("p").applied(result.epoch) and not c.status("p").applied(result.epoch + 1)


def test_an_operators_pin_holds_against_a_background_sweep():
    """A sweep's pin beat the operator's: a pool pinned at 2 while it needed a sweep was swept
    through its ladder (the sweep took precedence, and a new one started whenever it was quiet)."""
    c = controller(spec())
    report(c, FP)
    assert c.calibration("p").state == "calibrating" and c.needs_sweep() == ["p"]
    c.sweep_pin("p", 8)
    c.pin("p", 2)
    d = report(c, FP)
    assert (c.status("p").pinned, d.limits.max_active_seqs, d.reason) == (2, 2, "pinned")
    assert c.needs_sweep() == []
    c.sweep_pin("p", None)
    c.unpin("p")
    assert c.needs_sweep() == ["p"]


def test_a_sweep_stops_when_the_operator_pins_its_pool():
    """It measured its steps at the operator's limit, not its own."""
    async def go():
        clock = asyncio.get_running_loop().time
        c = controller(spec(sweep=(1, 4, 16, 64, 128)), ProfileStore(MemoryStore()), clock)
        pool = FakePool(c)
        report(c, FP)
        reporter = asyncio.get_running_loop().create_task(pool.report_forever())
        sweep = asyncio.get_running_loop().create_task(Calibrator(c, pool.handle, 2048, clock=clock).step())
        while c.status("p").pinned != 4:  # the second step measures
            await asyncio.sleep(0.05)
        c.pin("p", 2)
        await asyncio.wait_for(sweep, 600)  # virtual seconds: bounds a hang only
        reporter.cancel()
        return c

    c = run(go)
    calibration = c.calibration("p")
    assert calibration.state == "calibrating" and "the operator pinned it at 2" in calibration.detail, calibration
    assert c.status("p").pinned == 2 and c.needs_sweep() == []
