"""The router's HTTP surface: paths, error handlers and the OpenAPI document.

`make_app()` builds the FastAPI app and `route_class(app, Router)` maps the Router's
methods onto its paths; the builder then hands both to `serve.ingress`. The OpenAPI
document describes the request bodies with the same models that validate them
(vLLM's, as ray.serve.llm uses), minus the fields tenants may not set.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from infra.handles import resolve
from router.app import Router
from router.errors import ApiError
from router.pricing import RESERVED_FIELDS

log = logging.getLogger("poolserve.router")

ROUTES: tuple[tuple[str, str, str], ...] = (
    ("post", "/v1/chat/completions", "chat_default"),
    ("post", "/v1/completions", "completions_default"),
    ("get", "/v1/models", "models_default"),
    ("get", "/v1/models/{model_id:path}", "model"),
    ("get", "/v1/usage", "usage"),
    ("post", "/v1/files", "files_upload"),
    ("get", "/v1/files", "files_list"),
    ("get", "/v1/files/{file_id}", "files_get"),
    ("delete", "/v1/files/{file_id}", "files_delete"),
    ("get", "/v1/files/{file_id}/content", "files_content"),
    ("post", "/v1/batches", "batches_create"),
    ("get", "/v1/batches", "batches_list"),
    ("get", "/v1/batches/{batch_id}", "batches_get"),
    ("post", "/v1/batches/{batch_id}/cancel", "batches_cancel"),
    ("get", "/healthz", "healthz"),
    ("post", "/{prefix}/v1/chat/completions", "chat"),
    ("post", "/{prefix}/v1/completions", "completions"),
    ("get", "/{prefix}/v1/models", "pool_models"),
    ("get", "/admin/pools", "admin_pools"),
    ("get", "/admin/decisions", "admin_decisions"),
    ("get", "/admin/pools/{pool}/describe", "admin_describe"),
    ("post", "/admin/pools/{pool}/limits", "admin_pin"),
    ("delete", "/admin/pools/{pool}/limits", "admin_unpin"),
    ("put", "/admin/pools/{pool}/slo", "admin_slo"),
    ("put", "/admin/pools/{pool}/lending", "admin_lending"),
)
BODIES = {"chat": "ChatCompletionRequest", "completions": "CompletionRequest"}
ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": "string"}}}},
}


def make_app(title: str = "poolserve") -> FastAPI:
    app = FastAPI(title=title, description="OpenAI-compatible endpoints per pool, with tenants, quotas and "
                                           "priorities. Authenticate with 'Authorization: Bearer <key>'.")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = f"no route for {request.method} {request.url.path}" if exc.status_code in (404, 405) \
            else str(exc.detail)
        return ApiError(exc.status_code, code, message).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ()))
        return ApiError(400, "invalid_request", f"{loc}: {first.get('msg', 'invalid')}",
                        str(first.get("loc", [None])[-1])).response()

    @app.exception_handler(ApiError)
    async def _refused(request: Request, exc: ApiError):  # a refusal raised outside the handlers' own try
        return exc.response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return ApiError(500, "internal_error", "internal error; it has been logged").response()

    app.openapi = lambda: _openapi(app)
    return app


class Endpoints(Router):
    """The Router's methods with the signatures FastAPI binds to paths."""

    async def chat(self, request: Request, prefix: str) -> Response:
        return await self.route(request, "chat", prefix)

    async def completions(self, request: Request, prefix: str) -> Response:
        return await self.route(request, "completions", prefix)

    async def chat_default(self, request: Request) -> Response:
        return await self.route(request, "chat", None)

    async def completions_default(self, request: Request) -> Response:
        return await self.route(request, "completions", None)

    async def models_default(self, request: Request) -> Response:
        return await self.models(request)

    async def pool_models(self, request: Request, prefix: str) -> Response:
        return await self.models(request, prefix)

    async def files_upload(self, request: Request) -> Response:
        return await self.batch_api.upload(request)

    async def files_list(self, request: Request) -> Response:
        return await self.batch_api.list_files(request)

    async def files_get(self, request: Request, file_id: str) -> Response:
        return await self.batch_api.get_file(request, file_id)

    async def files_delete(self, request: Request, file_id: str) -> Response:
        return await self.batch_api.delete_file(request, file_id)

    async def files_content(self, request: Request, file_id: str) -> Response:
        return await self.batch_api.file_content(request, file_id)

    async def batches_create(self, request: Request) -> Response:
        return await self.batch_api.create_batch(request)

    async def batches_list(self, request: Request) -> Response:
        return await self.batch_api.list_batches(request)

    async def batches_get(self, request: Request, batch_id: str) -> Response:
        return await self.batch_api.get_batch(request, batch_id)

    async def batches_cancel(self, request: Request, batch_id: str) -> Response:
        return await self.batch_api.cancel_batch(request, batch_id)

    async def admin_pools(self, request: Request) -> Response:
        return await self.admin.pools(request)

    async def admin_decisions(self, request: Request, limit: int = 100) -> Response:
        return await self.admin.decisions(request, limit)

    async def admin_describe(self, request: Request, pool: str) -> Response:
        return await self.admin.describe(request, pool)

    async def admin_pin(self, request: Request, pool: str) -> Response:
        return await self.admin.pin(request, pool)

    async def admin_unpin(self, request: Request, pool: str) -> Response:
        return await self.admin.unpin(request, pool)

    async def admin_slo(self, request: Request, pool: str) -> Response:
        return await self.admin.slo(request, pool)

    async def admin_lending(self, request: Request, pool: str) -> Response:
        return await self.admin.lending(request, pool)


class PoolEndpoints:
    """The paths a pool replica answers itself, under its pool's prefix (which Serve strips):
    the route runs in the pool's own process. The class that mixes this in sets `router` (a
    Router whose pool of that name is the replica itself) and `prefix`."""

    router: Router
    prefix: str

    async def chat_here(self, request: Request) -> Response:
        return await self.router.route(request, "chat", self.prefix)

    async def completions_here(self, request: Request) -> Response:
        return await self.router.route(request, "completions", self.prefix)

    async def models_here(self, request: Request) -> Response:
        return await self.router.models(request, self.prefix)

    async def healthz_here(self, request: Request) -> Response:
        """This replica's own views: it decides borrowing and shedding for its requests."""
        return await self.router.healthz(request)


POOL_ROUTES: tuple[tuple[str, str, str], ...] = (
    ("post", "/v1/chat/completions", "chat_here"),
    ("post", "/v1/completions", "completions_here"),
    ("get", "/v1/models", "models_here"),
    ("get", "/healthz", "healthz_here"),
)


def routed(app: FastAPI, cls: type, routes: tuple[tuple[str, str, str], ...], **extra) -> type:
    """A subclass of `cls` whose methods named in `routes` are registered on `app` (Serve's
    class-based views), with `extra` attributes."""
    methods = dict(extra)
    for verb, path, name in routes:
        methods[name] = getattr(app, verb)(path, include_in_schema=True, name=name)(getattr(cls, name))
    out = type(cls.__name__, (cls,), methods)
    out.__qualname__ = cls.__qualname__
    return out


def route_class(app: FastAPI, cls: type = Endpoints) -> type:
    """The router's class on `app`, warmed in its constructor (Serve awaits an async one) so a
    first request costs no more than the next. Deployments of other applications (the pools)
    come as `infra.handles.Lookup`s."""

    async def __init__(self, settings, pools, controller, ledger, llm_config, batches=None) -> None:
        from pools.llm import PromptRenderer

        cls.__init__(self, settings, {name: resolve(p) for name, p in pools.items()}, resolve(controller),
                     resolve(ledger), PromptRenderer(llm_config), batches=batches)
        await self.warm()

    return routed(app, cls, ROUTES, __init__=__init__)


def _openapi(app: FastAPI) -> dict:
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi
    from pydantic.json_schema import models_json_schema

    from pools.llm import request_models

    chat, completions = request_models()
    schema = get_openapi(title=app.title, version="1", description=app.description, routes=app.routes)
    _, defs = models_json_schema([(chat, "validation"), (completions, "validation")],
                                 ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {})
    components.setdefault("schemas", {}).update(defs.get("$defs", {}))
    components["schemas"]["Error"] = ERROR_SCHEMA
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    schema["security"] = [{"bearer": []}]
    for model in BODIES.values():
        props = components["schemas"][model].get("properties", {})
        for field in RESERVED_FIELDS:
            props.pop(field, None)
    for path, ops in schema["paths"].items():
        for verb, op in ops.items():
            kind = "chat" if path.endswith("/chat/completions") else "completions" if path.endswith("/completions") \
                else None
            if kind and verb == "post":
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{BODIES[kind]}"}}}}
            op.setdefault("responses", {})
            for status in ("400", "401", "403", "404", "413", "429", "503"):
                op["responses"][status] = {"description": "error", "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/Error"}}}}
    app.openapi_schema = schema
    return schema
