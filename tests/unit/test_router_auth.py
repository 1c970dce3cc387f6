"""The router's key check: hashes only, every tenant compared in constant time, no early exit."""

from __future__ import annotations

import hashlib
import hmac

import pytest
from starlette.requests import Request

from pools.types import PriorityClass
from router import app as router_app
from router.app import PoolRoute, Router, RouterSettings
from router.config import RouterConfig, TenantConfig
from router.errors import ApiError


def sha(k: str) -> str:
    return hashlib.sha256(k.encode()).hexdigest()


TENANTS = tuple(TenantConfig(name=f"t{i}", key_sha256=sha(f"key-{i}"), pools=("p",)) for i in range(5))


class FakeHandle:
    def options(self, **kw):
        return self


class FakeCounter:
    tokenizer = None


def router() -> Router:
    settings = RouterSettings("m", "/nowhere", 64, RouterConfig(admin_key_sha256=sha("admin")), TENANTS,
                              (PoolRoute("p", "p", 4, PriorityClass.STANDARD),))
    return Router(settings, {"p": FakeHandle()}, FakeHandle(), object(), counter=FakeCounter())


def request(auth: str | None) -> Request:
    headers = [] if auth is None else [(b"authorization", auth.encode())]
    return Request({"type": "http", "method": "GET", "path": "/", "headers": headers, "query_string": b""})


def test_every_tenant_is_compared_whoever_matches(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append(b)
        return real(a, b)

    monkeypatch.setattr(router_app.hmac, "compare_digest", counting)
    r = router()
    assert r._auth(request("Bearer key-0")).name == "t0"
    assert len(calls) == len(TENANTS)  # no early exit on the first match
    calls.clear()
    with pytest.raises(ApiError):
        r._auth(request("Bearer nope"))
    assert len(calls) == len(TENANTS)


@pytest.mark.parametrize("auth, code", [(None, "missing_api_key"), ("Basic key-0", "missing_api_key"),
                                        ("Bearer ", "missing_api_key"), ("Bearer key-9", "invalid_api_key")])
def test_bad_keys(auth, code):
    with pytest.raises(ApiError) as e:
        router()._auth(request(auth))
    assert e.value.status == 401 and e.value.code == code


def test_only_hashes_are_held():
    r = router()
    held = repr(r._tenants) + repr(r._s)
    assert "key-0" not in held and sha("key-0") in held
