"""The admin API from Python: typed answers, and changes that return once they are in force.

One client for `poolserve calibrate`, the benchmarks and the integration tests. A pin or
unpin returns when every replica of the pool reports the change's epoch, never on a
guess from timestamps (a report made before a pin can show the pinned value while the
reply to it, computed before the pin, moves the replica elsewhere).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import httpx

from infra.wire import trust_env
from pools.control import DecisionJson, Describe, LendingResult, PinResult, PoolStatus, SloResult


class AdminError(RuntimeError):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message


class AdminClient:
    def __init__(self, base_url: str, admin_key: str, timeout_s: float = 30.0) -> None:
        self._base = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {admin_key}"}
        self._timeout = timeout_s

    def _call(self, method: str, path: str, **kw) -> dict | list:
        r = httpx.request(method, f"{self._base}{path}", headers=self._headers, timeout=self._timeout,
                          trust_env=trust_env(self._base), **kw)
        if r.status_code >= 400:
            try:
                err = r.json()["error"]
                raise AdminError(r.status_code, err.get("code", ""), err.get("message", r.text))
            except (ValueError, KeyError, TypeError):
                raise AdminError(r.status_code, "http_error", r.text[:500]) from None
        return r.json()

    def pools(self) -> dict[str, PoolStatus]:
        return {name: PoolStatus.model_validate(v) for name, v in self._call("GET", "/admin/pools").items()}

    def pool(self, name: str) -> PoolStatus:
        return self.pools()[name]

    def describe(self, pool: str) -> Describe:
        return Describe.model_validate(self._call("GET", f"/admin/pools/{pool}/describe"))

    def decisions(self, limit: int = 100) -> list[DecisionJson]:
        return [DecisionJson.model_validate(d) for d in self._call("GET", f"/admin/decisions?limit={limit}")]

    def pin(self, pool: str, seqs: int, calibrating: bool = False, wait_s: float = 30.0) -> PinResult:
        """Pin a pool's limit and wait until every replica applied it."""
        result = PinResult.model_validate(self._call(
            "POST", f"/admin/pools/{pool}/limits", json={"max_active_seqs": seqs, "calibrating": calibrating}))
        self.wait_applied(pool, result.epoch, wait_s)
        return result

    def unpin(self, pool: str, wait_s: float = 30.0) -> PinResult:
        result = PinResult.model_validate(self._call("DELETE", f"/admin/pools/{pool}/limits"))
        self.wait_applied(pool, result.epoch, wait_s)
        return result

    @contextlib.contextmanager
    def pinned(self, pool: str, seqs: int, calibrating: bool = True) -> Iterator[PinResult]:
        result = self.pin(pool, seqs, calibrating)
        try:
            yield result
        finally:
            self.unpin(pool)

    def set_slo(self, pool: str, ttft_p99_ms: float, tpot_p99_ms: float) -> SloResult:
        return SloResult.model_validate(self._call("PUT", f"/admin/pools/{pool}/slo",
                                                   json={"ttft_p99_ms": ttft_p99_ms, "tpot_p99_ms": tpot_p99_ms}))

    def set_lending(self, pool: str, enabled: bool) -> LendingResult:
        return LendingResult.model_validate(self._call("PUT", f"/admin/pools/{pool}/lending",
                                                       json={"enabled": enabled}))

    def wait_applied(self, pool: str, epoch: int | None, wait_s: float) -> PoolStatus:
        deadline = time.monotonic() + wait_s
        while True:
            status = self.pool(pool)
            if epoch is None or status.applied(epoch):
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"pool {pool} did not apply epoch {epoch} within {wait_s:g}s; replicas report "
                                   f"{[r.applied_epoch for r in status.replicas]}")
            time.sleep(0.2)
