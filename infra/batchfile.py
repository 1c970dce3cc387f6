"""The OpenAI Batch file format: input lines checked with their line numbers, result lines,
and what a (possibly crashed) output file already holds. Pure: no network, no Ray."""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENDPOINTS = {"/v1/chat/completions": "chat/completions", "/v1/completions": "completions"}


@dataclass(frozen=True)
class BatchRequest:
    line: int
    custom_id: str
    endpoint: str  # "chat/completions" | "completions"
    body: dict


@dataclass(frozen=True)
class LineProblem:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


def parse_line(number: int, text: str) -> BatchRequest | LineProblem:
    try:
        item = json.loads(text, parse_constant=_not_json, parse_float=_finite)
    except json.JSONDecodeError as e:
        # json's "Unterminated string starting at" names the column itself
        return LineProblem(number, f"not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno})")
    except ValueError as e:  # NaN or Infinity, which Python's json takes and no request can be sent with
        return LineProblem(number, str(e))
    try:  # a lone surrogate (an escape from \ud800 to \udfff outside a pair) made the job raise sending it
        json.dumps(item, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return LineProblem(number, "holds a lone UTF-16 surrogate escape, which is no Unicode text")
    if not isinstance(item, dict):
        return LineProblem(number, "must be a JSON object with custom_id, method, url and body")
    cid = item.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return LineProblem(number, "custom_id must be a non-empty string")
    if item.get("method", "POST") != "POST":
        return LineProblem(number, f"method {item.get('method')!r}: only POST is supported")
    url = item.get("url")
    if url not in ENDPOINTS:
        return LineProblem(number, f"url {url!r}: use one of {sorted(ENDPOINTS)}")
    body = item.get("body")
    if not isinstance(body, dict):
        return LineProblem(number, "body must be a JSON object (the request body)")
    return BatchRequest(number, cid, ENDPOINTS[url], body)


def _not_json(name: str) -> None:
    raise ValueError(f"{name} is not JSON: send a number, or leave the field out")


def _finite(text: str) -> float:
    if not math.isfinite(value := float(text)):
        raise ValueError(f"{text} is too large for a number: send a smaller one")
    return value


def jsonl_lines(data: bytes, errors: str = "strict") -> list[str]:
    """A JSON Lines file's lines: they end at LF (or CRLF) only. Read from bytes, because a JSON
    string may hold U+0085, U+2028 or U+2029 unescaped, which `str.splitlines` takes for line
    ends, and text mode reads a lone CR as one. A leading byte-order mark (Windows editors write
    one) is no part of the first line. Not UTF-8: `UnicodeDecodeError` (or replaced)."""
    lines = data.decode("utf-8-sig", errors=errors).split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def read_input(lines: list[str]) -> tuple[list[BatchRequest], list[LineProblem]]:
    """Every valid request, and every problem (bad lines, duplicate ids) with line numbers."""
    requests, problems, seen = [], [], {}
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        parsed = parse_line(number, text)
        if isinstance(parsed, LineProblem):
            problems.append(parsed)
        elif parsed.custom_id in seen:
            problems.append(LineProblem(number, f"duplicate custom_id {parsed.custom_id!r} (first on line "
                                                f"{seen[parsed.custom_id]})"))
        else:
            seen[parsed.custom_id] = number
            requests.append(parsed)
    return requests, problems


def completed_ids(path: Path) -> set[str]:
    """custom_ids already written; a trailing partial line (a crash mid-write) is cut off. A
    line that is not a result (damaged in the middle of the file) answers nothing: its request
    is asked again, where raising here failed every attempt of the job."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(keep)
        data = data[:keep]
    done = set()
    for line in jsonl_lines(data, errors="replace"):
        try:
            row = json.loads(line) if line.strip() else None
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("custom_id"), str):
            done.add(row["custom_id"])
    return done


def result_line(custom_id: str, status: int | None, body: Any, request_id: str | None,
                error: dict | None = None) -> str:
    response = None if status is None else {"status_code": status, "request_id": request_id, "body": body}
    return json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response,
                       "error": error}) + "\n"
