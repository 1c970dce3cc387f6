"""Seeded random schedules for model-based tests: many short runs, each replayable by its seed.

    for seed in schedules("gate"):
        run_one(random.Random(seed))

`POOLSERVE_SCHEDULES=N` changes how many seeds run (default: `default`); `POOLSERVE_SEED=S`
runs that one seed alone, which is how a failure is replayed. A failing run names its seed.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator


def schedules(default: int) -> list[int]:
    if os.environ.get("POOLSERVE_SEED"):
        return [int(os.environ["POOLSERVE_SEED"])]
    return list(range(int(os.environ.get("POOLSERVE_SCHEDULES", default))))


@contextlib.contextmanager
def replayable(name: str, seed: int) -> Iterator[None]:
    """Re-raise a failure with the command that replays it."""
    try:
        yield
    except Exception as e:
        raise AssertionError(f"{name}: schedule {seed} failed: {e!r}\n"
                             f"replay: POOLSERVE_SEED={seed} python -m pytest {_caller_file()} -k {name}") from e


def _caller_file() -> str:
    import inspect

    for frame in inspect.stack()[2:]:
        if frame.filename.endswith(".py") and "/tests/" in frame.filename:
            return os.path.relpath(frame.filename)
    return "tests/unit"
