"""*Pure.* A batch's record and its job's output as they lie on disk, read defensively: a
record of another version's shape, or a torn or foreign line of output, is passed over, never
raised, so one damaged batch cannot stop the others."""

from __future__ import annotations

import json
from pathlib import Path

TERMINAL = ("completed", "failed", "cancelled", "expired")
_MOVING = ("validating", "in_progress", "finalizing", "cancelling")
_SHAPE = {"id": str, "status": str, "_tenant": str, "input_file_id": str, "endpoint": str, "created_at": int,
          "expires_at": int, "_attempts": int, "request_counts": dict}  # what moving a batch on reads
_OPTIONAL = ("_job", "output_file_id", "error_file_id")  # ... and these, which may be null


def read_record(path: Path) -> dict | None:
    """A batch's record, or None: unreadable, or of a shape this service cannot move on
    (another version's, damaged)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not (isinstance(record, dict) and all(isinstance(record.get(k), t) for k, t in _SHAPE.items())
            and all(k in record and isinstance(record[k], (str, type(None))) for k in _OPTIONAL)
            and record["id"] == path.stem and record["status"] in (*TERMINAL, *_MOVING)
            and (record["status"] != "finalizing" or record.get("_final") in TERMINAL)):
        return None
    return record


def answered(row: dict) -> bool:
    return isinstance(response := row.get("response"), dict) and response.get("status_code") == 200


def output_rows(path: Path, start: int = 0):
    """The whole lines of a job's output from byte `start` (a torn last line is the job's to
    cut), each as (its row, or None when it is not the job's, the byte after it)."""
    if not path.exists():
        return
    with path.open("rb") as f:
        f.seek(start)
        for line in f:
            if not line.endswith(b"\n"):
                return
            start += len(line)
            try:
                row = json.loads(line.decode("utf-8", errors="replace")) if line.strip() else None
            except ValueError:
                row = None
            yield (row if isinstance(row, dict) and isinstance(row.get("custom_id"), str) else None), start
