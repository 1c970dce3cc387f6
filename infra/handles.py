"""Deployments of other Serve applications, found by name when a replica starts.

An application's graph binds only its own deployments. poolserve runs one application per
pool (each pool answers its own HTTP at its prefix) beside the control application (router,
autoscale controller, quota ledger): their replicas reach each other through a `Lookup`,
which becomes a handle in the replica that needs it. Deployed in any order (KubeRay starts
the applications of a serveConfigV2 together), a call to one not up yet fails and is retried
by its caller like any other failed call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Lookup:
    deployment: str
    app: str

    def handle(self) -> Any:
        from ray import serve

        return serve.get_deployment_handle(self.deployment, self.app, _check_exists=False)


def resolve(target: Any) -> Any:
    """A handle for a `Lookup`; anything else (a bound deployment's handle, a fake) as is."""
    return target.handle() if isinstance(target, Lookup) else target
