"""The operators' endpoints (admin key): pools' status, decisions, describe, pins, SLOs and
lending. Request bodies are pydantic models (a 400 names the field); answers are the
control plane's own typed models (`pools.control`), written as JSON. A controller (or pool)
that cannot be reached is a 503 with Retry-After, not a Ray traceback.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pools.control import LendingResult, PinResult, SloJson, SloResult
from router.auth import Auth
from router.body import BodyLimits, read_json
from router.errors import ApiError

log = logging.getLogger("poolserve.router")


class _Body(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class PinRequest(_Body):
    max_active_seqs: int = Field(ge=1)
    calibrating: bool = False


class LendingRequest(_Body):
    enabled: bool


class SloRequest(_Body):
    ttft_p99_ms: float = Field(gt=0, allow_inf_nan=False)  # (JSON's 1e999 reads as inf: no range is judged by it)
    tpot_p99_ms: float = Field(gt=0, allow_inf_nan=False)


class Admin:
    def __init__(self, auth: Auth, controller: Any, pools: dict[str, Any], limits: BodyLimits) -> None:
        self._auth, self._controller, self._pools, self._limits = auth, controller, pools, limits

    async def pools(self, request: Request) -> Response:
        return await self._run(request, lambda: self._controller.status.remote())

    async def decisions(self, request: Request, limit: int = 100) -> Response:
        return await self._run(request, lambda: self._controller.decisions.remote(limit))

    async def describe(self, request: Request, pool: str) -> Response:
        return await self._run(request, lambda: self._pools[self._known(pool)].describe.remote())

    async def pin(self, request: Request, pool: str) -> Response:
        async def run() -> PinResult:
            body = await self._body(request, PinRequest)
            result: PinResult = await self._controller.pin.remote(self._known(pool), body.max_active_seqs,
                                                                   body.calibrating)
            if result.error:
                raise ApiError(400, "outside_safe_range", result.error, "max_active_seqs")
            return result
        return await self._run(request, run)

    async def unpin(self, request: Request, pool: str) -> Response:
        return await self._run(request, lambda: self._controller.unpin.remote(self._known(pool)))

    async def lending(self, request: Request, pool: str) -> Response:
        async def run() -> LendingResult:
            body = await self._body(request, LendingRequest)
            await self._controller.set_lending.remote(self._known(pool), body.enabled)
            return LendingResult(pool=pool, lending=body.enabled)
        return await self._run(request, run)

    async def slo(self, request: Request, pool: str) -> Response:
        async def run() -> SloResult:
            body = await self._body(request, SloRequest)
            slo = SloJson(ttft_p99_ms=body.ttft_p99_ms, tpot_p99_ms=body.tpot_p99_ms)
            await self._controller.set_slo.remote(self._known(pool), slo)
            return SloResult(pool=pool, **slo.model_dump())
        return await self._run(request, run)

    # -- steps ------------------------------------------------------------------------

    async def _run(self, request: Request, action: Callable[[], Awaitable[Any]]) -> Response:
        try:
            self._auth.admin(request.headers)
            try:
                result = await action()
            except _unreachable() as e:  # the controller (or pool) is away: a restart, a lost node
                log.warning("admin %s %s: %r", request.method, request.url.path, e)
                raise ApiError(503, "control_plane_unavailable", "the autoscale controller (or the pool) did not "
                               f"answer ({type(e).__name__}); retry shortly", retry_after_s=5) from None
        except ApiError as e:
            return e.response()
        return JSONResponse(_json(result))

    async def _body(self, request: Request, model: type[_Body]) -> Any:
        data = await read_json(request, self._limits)
        try:
            return model.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(x) for x in err.get("loc", ())) or "body"
            raise ApiError(400, "invalid_value", f"{field}: {err.get('msg')}", field) from None

    def _known(self, pool: str) -> str:
        if pool not in self._pools:
            raise ApiError(404, "pool_not_found", f"unknown pool {pool!r}; pools are {', '.join(self._pools)}")
        return pool


def _unreachable() -> tuple[type[BaseException], ...]:
    """The errors of a handle call whose replica is not there to answer (anything else a handle
    raises is a bug, and stays a 500)."""
    from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

    return (RayActorError, ActorUnavailableError, GetTimeoutError, DeploymentUnavailableError,
            ReplicaUnavailableError, TimeoutError)


def _json(x: Any) -> Any:
    if isinstance(x, BaseModel):
        return x.model_dump(mode="json")
    if isinstance(x, dict):
        return {str(k): _json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json(v) for v in x]
    return x
