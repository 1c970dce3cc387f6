"""The error model: every refusal is an OpenAI-style JSON body with a clear message.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": "max_tokens_too_large"}}

Statuses (DESIGN §4): 400 bad input, 401 unknown key, 403 pool not allowed, 404 unknown
model / pool / path, 405 wrong method, 413 body too large, 429 quota or queue full
(with Retry-After), 502 a pool that answered nothing and 503 pool unavailable (with
Retry-After), 504 a pool silent past the idle bound. The router's reading of an input never
makes a 500; a 500 `engine_failed` is the engine failing on a whole answer it generated.
"""

from __future__ import annotations

import json
import math
from typing import Any

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


NO_RETRY = {"x-should-retry": "false"}  # the OpenAI Python SDK retries every 5xx unless told: each try is charged


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, param: str | None = None,
                 retry_after_s: float | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param
        self.retry_after_s = retry_after_s
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> Any:
        from starlette.responses import Response

        headers = dict(self.headers)
        if self.retry_after_s is not None:
            headers["retry-after"] = str(retry_after_header(self.retry_after_s))
        # ASCII, escaped: a message that repeats the client's text (vLLM's do) may hold a lone
        # surrogate, which Starlette's strict UTF-8 encoding turned into a 500
        return Response(json.dumps(self.body()), status_code=self.status, headers=headers,
                        media_type="application/json")


def retry_after_header(seconds: float) -> int:
    """Whole seconds, rounded up, at least 1: waiting that long is enough."""
    return max(1, math.ceil(seconds))


def sse_error(status: int, code: str, message: str) -> str:
    """An error event for a stream that already started (the status line is sent)."""
    return "data: " + json.dumps({"error": {"message": message, "type": TYPES.get(status, "server_error"),
                                            "param": None, "code": code}}) + "\n\n"
