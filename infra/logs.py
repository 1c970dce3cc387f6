"""Logging for poolserve's processes: one `poolserve.*` handler at INFO, once per process.

Prompts and completions are never logged here; the router logs them only when
`router.log_prompts` is on.
"""

from __future__ import annotations

import logging
import sys


def configure_logging(level: int = logging.INFO) -> None:
    root = logging.getLogger("poolserve")
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
