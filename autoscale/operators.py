"""What operators set on a pool (pins, SLOs, lending, the epoch), as the controller keeps it in
a `StateStore` across its restarts, and how a saved record is read back. Pure: no Ray."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from infra.state import StateStore
from pools.control import SloJson

log = logging.getLogger("poolserve.autoscale")


@dataclass(frozen=True)
class Operator:
    """What operators set on a pool: kept across controller restarts."""

    pinned: int | None = None
    calibrating: bool = False
    lending: bool = True
    slo: SloJson | None = None  # None: the config's
    epoch: int = 0  # the highest epoch handed out, so a restarted controller never reuses one


def restore(store: StateStore, name: str) -> Operator:
    try:
        return _operator(name, store.get(f"pool/{name}"))
    except (ValueError, TypeError, OSError) as e:  # pydantic's and json's errors are ValueErrors
        log.warning("pool %s: the saved operator settings (pool/%s) cannot be read, so the config's hold: %s",
                    name, name, e)
        return Operator()


def _operator(name: str, saved: Any) -> Operator:
    """Operator settings as `Controller._set` saved them; ValueError for any other shape (another
    version's, a damaged key): read as they are, a text pin made every report raise."""
    if not saved:
        return Operator()
    if not isinstance(saved, dict):
        raise ValueError(f"a {type(saved).__name__}, not a mapping")
    pinned, epoch = saved.get("pinned"), saved.get("epoch", 0)
    flags = {k: saved.get(k, default) for k, default in (("calibrating", False), ("lending", True))}
    if pinned is not None and (type(pinned) is not int or pinned < 1):
        raise ValueError(f"pinned {pinned!r} is not a batch size")
    if type(epoch) is not int or epoch < 0:
        raise ValueError(f"epoch {epoch!r} is not a count")
    if not all(isinstance(v, bool) for v in flags.values()):
        raise ValueError(f"calibrating and lending must be true or false: {flags}")
    if flags["calibrating"] and pinned is None:  # a sweep's range is for its pins alone
        raise ValueError("calibrating without a pin")
    slo = SloJson.model_validate(saved["slo"]) if saved.get("slo") is not None else None
    op = Operator(pinned=pinned, epoch=epoch, slo=slo, **flags)
    log.info("pool %s: restored operator settings %s", name, op)
    return op
