"""Calibration profiles kept per fingerprint, so a pool that starts on set-up it has been
calibrated on finds its range at once, and one that starts on a new set-up knows it must
calibrate (the design's rule: a new model, quantisation, hardware or engine invalidates
the calibration). The backend is a folder (a volume; on one machine, the project's cache)
or Ray's GCS key-value store."""

from __future__ import annotations

import hashlib
import json
import logging

import yaml
from pydantic import ValidationError

from autoscale.profile import Fingerprint, Profile
from infra.state import StateStore

log = logging.getLogger("poolserve.autoscale")


def fingerprint_digest(fingerprint: Fingerprint) -> str:
    return hashlib.sha256(json.dumps(fingerprint.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:16]


class ProfileStore:
    def __init__(self, backend: StateStore) -> None:
        self._backend = backend
        self.unreadable: dict[str, str] = {}  # key -> why its stored profile did not read

    @staticmethod
    def key(pool: str, fingerprint: Fingerprint) -> str:
        return f"profiles/{pool}/{fingerprint_digest(fingerprint)}"

    def get(self, pool: str, fingerprint: Fingerprint) -> Profile | None:
        """The profile stored for this set-up; one that no longer reads (written by another
        version, edited by hand) counts as missing, so the set-up is measured again and the
        sweep's profile replaces it; `unreadable` says why."""
        key = self.key(pool, fingerprint)
        try:
            data = self._backend.get(key)
            profile = None if data is None else Profile.model_validate(data)
        except (ValueError, yaml.YAMLError) as e:  # pydantic's and json's errors are ValueErrors; an OSError
            # (a volume's hiccup) is raised: the pool's next report looks again, no sweep replaces a good profile
            if key not in self.unreadable:
                log.warning("profile store: %s cannot be read, so counts as missing: %s", key, e)
            self.unreadable[key] = _why(e)
            return None
        if data is None:
            self.unreadable.pop(key, None)
        if profile is None or profile.fingerprint != fingerprint:  # a digest collision is not a match
            return None
        return profile

    def put(self, profile: Profile) -> None:
        key = self.key(profile.pool, profile.fingerprint)
        self._backend.put(key, profile.model_dump(mode="json"))
        self.unreadable.pop(key, None)


def _why(e: Exception) -> str:
    if isinstance(e, ValidationError):
        return "; ".join(f"{'.'.join(map(str, err['loc'])) or 'the file'}: {err['msg']}" for err in e.errors()[:3])
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
