"""The autoscale controller as Serve deploys it: a `Controller`, its tick loop, its metrics,
and the background calibration of pools that have no profile for their set-up."""

from __future__ import annotations

import logging
import time

from autoscale.config import AutoscaleConfig
from autoscale.controller import Controller, PoolSpec
from autoscale.selfcal import Calibrator
from autoscale.store import ProfileStore
from infra.state import StateStore
from pools.control import DecisionJson, LimitsDirective, PinResult, PoolStatus, PoolView, ReplicaStats, SloJson


class ControllerService:
    """What Serve deploys: a Controller plus its tick loop and metrics."""

    def __init__(self, specs: dict[str, PoolSpec], config: AutoscaleConfig, max_model_len: int,
                 store: StateStore | None = None, profiles: StateStore | None = None) -> None:
        from infra.logs import configure_logging
        from infra.loops import Loops
        from infra.metrics import ControllerMetrics

        configure_logging()
        # Serve's own notes on the sweep's requests it cancels (dozens a step) would flood the console
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
        if any(s.calibration.mode == "auto" for s in specs.values()):
            from pools.llm import request_models

            request_models()  # a sweep's requests need vLLM's protocol module: seconds to import, not in the loop
        self.controller = Controller(specs, config, time.monotonic, store=store,
                                     profiles=ProfileStore(profiles) if profiles is not None else None)
        self._metrics = ControllerMetrics()
        self._calibrator = Calibrator(self.controller, self._pool_handle, max_model_len)
        self._loops = Loops("autoscale controller")
        self._loops.start("tick", self._tick, config.interval_s, first_delay_s=config.interval_s)
        self._loops.start("calibration", self._calibrator.step, 2.0, first_delay_s=2.0)

    async def close(self) -> None:
        await self._loops.stop()

    async def _tick(self) -> None:
        for d in self.controller.tick():
            self._metrics.decision(d.pool, d.action, d.code, d.new if d.applied else d.old)
        for name in self.controller.views():
            self._metrics.calibration(name, self.controller.calibration(name).measured)

    def _pool_handle(self, pool: str):
        from ray import serve

        spec = self.controller.spec(pool)
        app = spec.app or serve.get_replica_context().app_name
        return serve.get_deployment_handle(spec.deployment, app).options(stream=True)

    async def report(self, stats: ReplicaStats) -> LimitsDirective:
        return self.controller.report(stats)

    async def views(self) -> dict[str, PoolView]:
        return self.controller.views()

    async def status(self) -> dict[str, PoolStatus]:
        return {name: self.controller.status(name) for name in self.controller.views()}

    async def decisions(self, limit: int = 100) -> list[DecisionJson]:
        return self.controller.decisions(limit)

    async def pin(self, pool: str, seqs: int, calibrating: bool = False) -> PinResult:
        return self.controller.pin(pool, seqs, calibrating)

    async def unpin(self, pool: str) -> PinResult:
        return self.controller.unpin(pool)

    async def set_slo(self, pool: str, slo: SloJson) -> None:
        self.controller.set_slo(pool, slo)

    async def set_lending(self, pool: str, enabled: bool) -> None:
        self.controller.set_lending(pool, enabled)
