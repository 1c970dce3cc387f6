"""What the load generator reads off the wire: a server-sent event stream's lines, and the
`Server-Timing` header poolserve's route writes; and whether a client to a URL takes the
environment's proxies."""

from __future__ import annotations

import ipaddress
import os
import re
from typing import AsyncIterator, MutableMapping

import httpx

_LINE_END = re.compile(rb"\r\n|\r|\n")


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "0.0.0.0")


def no_proxy_to_loopback(environ: MutableMapping[str, str] = os.environ) -> None:
    """Name this machine's addresses in `NO_PROXY`, for a client poolserve does not build itself
    (Ray's job client uses `requests`): a proxy in the user's shell got the Ray job API's calls to
    127.0.0.1, Ray's token with them. Both spellings get the union of both (`requests` reads
    `no_proxy` first and would lose what only `NO_PROXY` named)."""
    names = [n.strip() for key in ("no_proxy", "NO_PROXY") for n in environ.get(key, "").split(",") if n.strip()]
    merged = ",".join(dict.fromkeys(names + list(LOOPBACK_NAMES)))
    environ["no_proxy"] = environ["NO_PROXY"] = merged


def http_url(host: str, port: int) -> str:
    """`http://host:port`, an IPv6 host in brackets (`http://::1:8000` names no port)."""
    return f"http://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"http://{host}:{port}"


def trust_env(url: str) -> bool:
    """Whether an HTTP client to `url` takes its proxy settings from the environment: not for a
    loopback address, which no proxy can mean. httpx sent calls to 127.0.0.1, tenant and admin
    keys with them, to the `HTTP_PROXY` of the user's shell unless `NO_PROXY` named the address."""
    host = httpx.URL(url).host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):  # RFC 6761: always this machine
        return False
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:  # a name: the user's proxy settings decide, as for any client
        return True
    ip = getattr(ip, "ipv4_mapped", None) or ip
    return not (ip.is_loopback or ip.is_unspecified)  # 0.0.0.0: a server's bind address, this machine


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
