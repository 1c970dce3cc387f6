"""What the load generator reads off the wire: a server-sent event stream's lines, and the
`Server-Timing` header poolserve's route writes; and whether a client to a URL takes the
environment's proxies."""

from __future__ import annotations

import ipaddress
import re
from typing import AsyncIterator

import httpx

_LINE_END = re.compile(rb"\r\n|\r|\n")


def trust_env(url: str) -> bool:
    """Whether an HTTP client to `url` takes its proxy settings from the environment: not for a
    loopback address, which no proxy can mean. httpx sent calls to 127.0.0.1, tenant and admin
    keys with them, to the `HTTP_PROXY` of the user's shell unless `NO_PROXY` named the address."""
    host = httpx.URL(url).host
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: the user's proxy settings decide, as for any client
        return True


async def sse_lines(resp: httpx.Response) -> AsyncIterator[str]:
    """A server-sent event stream's lines. They end at CR, LF or CRLF only, the SSE format's line
    ends: a JSON chunk may hold U+0085, U+2028 or U+2029 unescaped (vLLM's do), which httpx's
    `aiter_lines` takes for line ends too. A whole line is whole UTF-8 (no multi-byte character
    holds a CR or LF byte); bytes that are not UTF-8 are replaced, as httpx does."""
    rest = b""
    async for chunk in resp.aiter_bytes():
        data = rest + chunk
        held = data.endswith(b"\r")  # the first half of a CRLF, maybe: wait for the next byte
        *lines, rest = _LINE_END.split(data[:-1] if held else data)
        if held:
            rest += b"\r"
        for line in lines:
            yield line.decode(errors="replace")
    if rest:
        yield rest.removesuffix(b"\r").decode(errors="replace")


def parse_server_timing(header: str) -> dict[str, float]:
    """`router;dur=4.1, reach;dur=6.0` -> {"router": 4.1, "reach": 6.0}; entries without a
    duration are left out."""
    out = {}
    for entry in header.split(","):
        name, _, params = entry.strip().partition(";")
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if name and key == "dur":
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
    return out
