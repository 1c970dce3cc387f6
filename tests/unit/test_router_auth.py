"""The router's key check: hashes only, every tenant compared in constant time, no early exit."""

from __future__ import annotations

import hmac

import pytest

from router import auth as auth_module
from router.auth import Auth
from router.config import TenantConfig
from router.errors import ApiError
from tests.unit.router_harness import sha

TENANTS = tuple(TenantConfig(name=f"t{i}", key_sha256=sha(f"key-{i}"), pools=("p",)) for i in range(5))


def headers(value: str | None) -> dict[str, str]:
    return {} if value is None else {"authorization": value}


def test_every_tenant_is_compared_whoever_matches(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append(b)
        return real(a, b)

    monkeypatch.setattr(auth_module.hmac, "compare_digest", counting)
    a = Auth(TENANTS, None)
    assert a.tenant(headers("Bearer key-0")).name == "t0"
    assert len(calls) == len(TENANTS)  # no early exit on the first match
    calls.clear()
    with pytest.raises(ApiError):
        a.tenant(headers("Bearer nope"))
    assert len(calls) == len(TENANTS)


@pytest.mark.parametrize("value, code", [(None, "missing_api_key"), ("Basic key-0", "missing_api_key"),
                                         ("Bearer ", "missing_api_key"), ("Bearer key-9", "invalid_api_key")])
def test_bad_keys(value, code):
    with pytest.raises(ApiError) as e:
        Auth(TENANTS, None).tenant(headers(value))
    assert e.value.status == 401 and e.value.code == code


@pytest.mark.parametrize("admin_hash, value, status", [
    (None, "Bearer admin", 403), (sha("admin"), None, 401), (sha("admin"), "Bearer key-0", 401),
    (sha("admin"), "Bearer admin", None)], ids=["disabled", "no-key", "tenant-key", "admin"])
def test_the_admin_key_is_checked_the_same_way(admin_hash, value, status):
    a = Auth(TENANTS, admin_hash)
    if status is None:
        a.admin(headers(value))
    else:
        with pytest.raises(ApiError) as e:
            a.admin(headers(value))
        assert e.value.status == status


def test_only_hashes_are_held():
    a = Auth(TENANTS, sha("admin"))
    held = repr(vars(a))
    assert "key-0" not in held and sha("key-0") in held and "'admin'" not in held
