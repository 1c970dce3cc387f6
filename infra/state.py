"""State that must outlive a replica: small JSON documents by key.

`GcsStore` keeps them in Ray's GCS key-value store, which a restarted replica reads back
and which KubeRay's GCS fault tolerance backs with Redis (so they survive a head restart
too). `DirStore` keeps them as YAML files in a folder (a volume, or the project's cache on
one machine), which outlive the cluster itself. `MemoryStore` is for tests.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Protocol

import yaml


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


class DirStore:
    """One YAML file per key under `root` (a key's slashes become folders)."""

    def __init__(self, root: str | Path) -> None:
        self._root = Path(root)

    def _path(self, key: str) -> Path:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*", key) or ".." in key:
            raise ValueError(f"state key {key!r}: letters, digits, '_', '.', '-' and '/' only")
        return self._root / f"{key}.yaml"

    def get(self, key: str) -> Any | None:
        path = self._path(key)
        return yaml.safe_load(path.read_text()) if path.is_file() else None

    def put(self, key: str, value: Any) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(yaml.safe_dump(value, sort_keys=False, width=100))
        os.replace(tmp, path)  # readers never see half a file
