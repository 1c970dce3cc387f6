"""Calibration profiles kept per fingerprint, so a pool that starts on set-up it has been
calibrated on finds its range at once, and one that starts on a new set-up knows it must
calibrate (the design's rule: a new model, quantisation, hardware or engine invalidates
the calibration). The backend is a folder (a volume; on one machine, the project's cache)
or Ray's GCS key-value store."""

from __future__ import annotations

import hashlib
import json

from autoscale.profile import Fingerprint, Profile
from infra.state import StateStore


def fingerprint_digest(fingerprint: Fingerprint) -> str:
    return hashlib.sha256(json.dumps(fingerprint.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:16]


class ProfileStore:
    def __init__(self, backend: StateStore) -> None:
        self._backend = backend

    @staticmethod
    def key(pool: str, fingerprint: Fingerprint) -> str:
        return f"profiles/{pool}/{fingerprint_digest(fingerprint)}"

    def get(self, pool: str, fingerprint: Fingerprint) -> Profile | None:
        data = self._backend.get(self.key(pool, fingerprint))
        if data is None:
            return None
        profile = Profile.model_validate(data)
        return profile if profile.fingerprint == fingerprint else None  # a digest collision is not a match

    def put(self, profile: Profile) -> None:
        self._backend.put(self.key(profile.pool, profile.fingerprint), profile.model_dump(mode="json"))
