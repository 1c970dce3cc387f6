"""Bearer authentication: API key -> tenant, and the admin key.

Keys are never held, only their SHA-256 hashes, compared in constant time with every
candidate (no early exit on a match), so timing says nothing about which key is close.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
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


# Keys this project ships in examples, test configs and the embedded default: never a real key.
SHIPPED_KEYS = ("poolserve-admin-dev", "sk-chat-dev", "sk-batch-dev", "sk-acme-dev", "test-admin", "sk-test-chat",
                "sk-test-batch", "sk-test-limited", "sk-test-other", "admin-CHANGE-ME", "sk-chat-team-CHANGE-ME",
                "sk-batch-team-CHANGE-ME", "sk-admin-CHANGE-ME", "CHANGE-ME")
KEY_FIX = "make one with `poolserve hash-key $(openssl rand -hex 24)` and keep the key itself secret"


def shipped(key: str) -> bool:
    return key in SHIPPED_KEYS or "CHANGE-ME" in key


def keys_from_dir(tenants: tuple[TenantConfig, ...], admin_sha256: str | None, keys_dir: str | None
                  ) -> tuple[tuple[TenantConfig, ...], str | None]:
    """Tenants and admin hash with the keys of `keys_dir` (files named after each tenant, and
    `admin`, as a mounted Secret has them) hashed in; a tenant with no key anywhere, or a key
    the project ships as an example, is an error."""
    def read(name: str) -> str | None:
        path = Path(keys_dir, name) if keys_dir else None
        key = path.read_text().strip() if path is not None and path.is_file() else ""
        if key and shipped(key):
            raise ValueError(f"{path} holds an example key poolserve ships, which anyone can read: replace it in "
                             f"the Secret ({KEY_FIX.replace('make one', 'make a key')})")
        return sha256_hex(key) if key else None

    out = tuple(t.model_copy(update={"key_sha256": read(t.name) or t.key_sha256}) for t in tenants)
    missing = [t.name for t in out if t.key_sha256 is None]
    if missing:
        raise ValueError(f"no key for tenant(s) {missing}: set tenants[].key_sha256 or put a file named after "
                         f"each in router.keys_dir ({keys_dir})")
    admin = read("admin") or admin_sha256
    holders = [t.name for t in out] + ["admin"] * (admin is not None)
    digests = [t.key_sha256 for t in out] + [admin] * (admin is not None)
    if shared := sorted({h for h, d in zip(holders, digests) if digests.count(d) > 1}):
        raise ValueError(f"{', '.join(shared)} share one key (router.keys_dir {keys_dir}, or the config's hashes): "
                         "a request would be taken for whichever comes first; give each its own")
    return out, admin
