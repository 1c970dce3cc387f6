"""Typed configuration of the autoscale controller (the `autoscale:` key)."""

from __future__ import annotations

from pydantic import Field, model_validator

from pools.config import Frozen


class AutoscaleConfig(Frozen):
    interval_s: float = Field(5.0, gt=0, description="Seconds between decisions (a deep queue is decided at the "
                                                    "report that shows it).")
    report_interval_s: float = Field(1.0, gt=0, description="Seconds between replica reports (a replica also "
                                                            "reports at once when its own queue turns as deep as "
                                                            "its batch).")
    cooldown_s: float = Field(30.0, ge=0, description="Minimum time after any change (but an up move on a deep "
                                                     "queue right after an up move waits none, once: that move was too "
                                                     "small).")
    reversal_cooldown_s: float = Field(90.0, ge=0, description="Minimum time before reversing direction.")
    stats_max_age_s: float = Field(10.0, gt=0, description="Older reports count as missing: hold.")
    latency_window_s: float = Field(
        30.0, gt=0, description="P99s are over the requests that finished in this many seconds; a move that rests on "
                                "latency waits this long after a change, so that its evidence postdates it (an up move on a deep "
                                "queue waits its cooldown at most).")
    min_step_gain: float = Field(
        0.1, ge=0, lt=1, description="A second step down for the same SLO breach needs the first to have lowered "
                                     "that P99 by this fraction; otherwise the limit holds.")
    min_samples: int = Field(5, ge=1, description="Fewer latency samples than this cannot prove an SLO breach.")
    kv_watermark: float = Field(0.9, gt=0, le=1)
    headroom: float = Field(0.7, gt=0, lt=1, description="Step up only while P99s are below headroom x SLO.")
    queue_persist_ticks: int = Field(2, ge=1, description="Ticks a queue of the pool's own requests must persist "
                                     "before stepping up; one at least as deep as the batch steps up at the report "
                                     "that shows it. Borrowed work waiting is no reason to grow.")
    decision_log_size: int = Field(500, ge=10)
    dry_run: bool = False

    @model_validator(mode="after")
    def _coherent(self) -> "AutoscaleConfig":
        if self.reversal_cooldown_s < self.cooldown_s:
            raise ValueError(f"reversal_cooldown_s ({self.reversal_cooldown_s}) must be >= cooldown_s "
                             f"({self.cooldown_s}): a reversal waits at least as long as any change")
        if self.stats_max_age_s < 2 * self.report_interval_s:
            raise ValueError(f"stats_max_age_s ({self.stats_max_age_s}) must be >= 2 x report_interval_s "
                             f"({self.report_interval_s}), or every report looks stale")
        return self
