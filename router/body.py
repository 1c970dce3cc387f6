"""Reading a request body: bounded in size, in time and in JSON nesting, before any parsing.

A body larger than `max_bytes` is refused (413) as soon as its declared or streamed size
says so; one that does not arrive within `timeout_s` is refused (408), so a slow upload
cannot hold the router; JSON nested deeper than `max_depth` is refused (400) instead of
exhausting the parser's recursion.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from infra.bounds import Overdue, within
from router.errors import ApiError


_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # an escape in the surrogates' range: checked after parsing


@dataclass(frozen=True)
class BodyLimits:
    max_bytes: int
    timeout_s: float
    max_depth: int


def depth(value: Any) -> int:
    """How deeply lists and objects nest in a parsed JSON value (a scalar is 0)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        deepest = max(deepest, d)
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


async def read_json(request: Request, limits: BodyLimits) -> dict:
    raw = await read(request, limits)
    try:
        data = json.loads(raw)
    except RecursionError:  # nested deeper than the parser's own recursion allows
        raise _too_deep(limits.max_depth) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, "invalid_json", f"the request body is not valid JSON: {e}")
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_json", "the request body must be a JSON object")
    if depth(data) > limits.max_depth:
        raise _too_deep(limits.max_depth)
    if _maybe_surrogates(raw) and not _unicode(data):
        raise ApiError(400, "invalid_json", "the request body holds a lone UTF-16 surrogate (an escape from \\ud800 "
                                            "to \\udfff outside a pair), which is no Unicode text: send UTF-8")
    return data


def _maybe_surrogates(raw: bytes) -> bool:
    """Whether a body may hold a lone surrogate: an escape in their range, bytes that are not
    UTF-8 (json reads a surrogate's own bytes all the same), or zero bytes (json reads UTF-16
    and UTF-32 without a byte-order mark too, and its escapes then hide between them)."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return b"\x00" in raw or _SURROGATE.search(raw) is not None


def _unicode(data: Any) -> bool:
    """Whether every string in a parsed body is Unicode text: JSON's escapes may make a lone
    surrogate, which no encoder takes (a grammar's size check raised on one: a 500)."""
    try:
        json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


def _too_deep(limit: int) -> ApiError:
    return ApiError(400, "json_too_deep", f"the request body nests lists and objects more than {limit} levels "
                                          "deep (router.max_json_depth); flatten it")


async def read(request: Request, limits: BodyLimits) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_bytes:
        raise ApiError(413, "body_too_large", f"request body is {declared} bytes; the limit is {limits.max_bytes}")
    try:
        return await within(limits.timeout_s, _collect(request, limits.max_bytes))
    except Overdue:
        raise ApiError(408, "body_timeout", f"the request body did not arrive within {limits.timeout_s:g}s "
                                            "(router.body_timeout_s)") from None


async def _collect(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "body_too_large", f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
