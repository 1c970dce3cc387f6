"""State that must outlive a replica: small JSON documents by key.

`GcsStore` keeps them in Ray's GCS key-value store, which a restarted replica reads back
and which KubeRay's GCS fault tolerance backs with Redis (so they survive a head restart
too). `MemoryStore` is for tests and for processes without Ray.
"""

from __future__ import annotations

import json
from typing import Any, Protocol


class StateStore(Protocol):
    def get(self, key: str) -> Any | None: ...

    def put(self, key: str, value: Any) -> None: ...


class MemoryStore:
    def __init__(self) -> None:
        self._data: dict[str, str] = {}

    def get(self, key: str) -> Any | None:
        return json.loads(self._data[key]) if key in self._data else None

    def put(self, key: str, value: Any) -> None:
        self._data[key] = json.dumps(value)


class GcsStore:
    """Ray's GCS key-value store, in a namespace of its own (needs a connected Ray)."""

    def __init__(self, namespace: str) -> None:
        self._namespace = namespace

    def get(self, key: str) -> Any | None:
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(key, namespace=self._namespace)
        return None if raw is None else json.loads(raw)

    def put(self, key: str, value: Any) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        _internal_kv_put(key, json.dumps(value), overwrite=True, namespace=self._namespace)
