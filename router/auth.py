"""Bearer authentication: API key -> tenant, and the admin key.

Keys are never held, only their SHA-256 hashes, compared in constant time with every
candidate (no early exit on a match), so timing says nothing about which key is close.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Mapping

from router.config import TenantConfig
from router.errors import ApiError


def sha256_hex(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def bearer(headers: Mapping[str, str]) -> str | None:
    """The key of an `Authorization: Bearer <key>` header, or None."""
    header = headers.get("authorization", "")
    key = header[7:].strip() if header[:7].lower() == "bearer " else ""
    return key or None


def _matches(key: str, digests: list[str]) -> list[bool]:
    digest = sha256_hex(key)
    return [hmac.compare_digest(digest, d) for d in digests]


class Auth:
    def __init__(self, tenants: tuple[TenantConfig, ...], admin_key_sha256: str | None) -> None:
        self._tenants = tenants
        self._admin = admin_key_sha256

    def tenant(self, headers: Mapping[str, str]) -> TenantConfig:
        key = bearer(headers)
        if key is None:
            raise ApiError(401, "missing_api_key", "no API key: send 'Authorization: Bearer <key>'")
        found = [t for t, ok in zip(self._tenants, _matches(key, [t.key_sha256 for t in self._tenants])) if ok]
        if not found:
            raise ApiError(401, "invalid_api_key", "the API key is not valid")
        return found[0]

    def admin(self, headers: Mapping[str, str]) -> None:
        if self._admin is None:
            raise ApiError(403, "admin_disabled", "the admin API is off: set router.admin_key_sha256")
        key = bearer(headers)
        if key is None or not _matches(key, [self._admin])[0]:
            raise ApiError(401, "invalid_admin_key", "admin endpoints need 'Authorization: Bearer <admin key>'")
