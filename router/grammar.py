"""*Pure.* What a request asks the engine to turn into a grammar, bounded before anything parses it.

vLLM converts a structured-output spec (a JSON schema, a structural tag, the forced tools' schemas)
into an xgrammar grammar while it validates the request, on the event loop of the process that
serves the pool's HTTP; the engine then compiles it again. xgrammar expands each `{m,n}` of a JSON
schema's regular expressions in time that grows with the square of the count: a 150-byte request
with `".{1,8000}"` stalled every other request of its pool for 19 s (bench/notes.md). So the
repetitions of a request's patterns are counted here, from the raw body, and the spec's size too:
what it costs does not depend on the tenant's quota, so it is bounded for everyone alike.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterator

from router.errors import ApiError

SPEC_FIELDS = ("response_format", "structured_outputs")  # what a body may ask the engine to compile
_QUANTIFIER = re.compile(r"\{(\d*)(?:(,)(\d*))?\}")
_HUGE = 10 ** 9  # a bound written with more digits than this counts as this (and is refused)


@dataclass(frozen=True)
class GrammarLimits:
    max_bytes: int = 64 << 10
    max_repeats: int = 512


def check(data: dict, limits: GrammarLimits) -> None:
    """A 400 naming the field if the body's structured-output specs are too large to convert."""
    try:
        sizes = [(param, len(json.dumps(spec, separators=(",", ":"), default=str))) for param, spec in specs(data)]
    except RecursionError:
        raise ApiError(400, "json_too_deep", "the structured-output spec nests too deeply to read; flatten it")
    if (size := sum(n for _, n in sizes)) > limits.max_bytes:
        param = max(sizes, key=lambda s: s[1])[0]
        raise ApiError(400, "grammar_too_large",
                       f"the structured-output spec ({param}) is {size:,} bytes and at most {limits.max_bytes:,} "
                       "are accepted (router.max_grammar_bytes): the engine compiles all of it before the first "
                       "token; send a smaller schema", param)
    counted = [(param, sum(repeats(p) for p in patterns(spec))) for param, spec in specs(data, every_tool=True)]
    if (total := sum(n for _, n in counted)) > limits.max_repeats:
        param = max(counted, key=lambda c: c[1])[0]
        raise ApiError(400, "grammar_too_costly",
                       f"the regular expressions in {param} repeat {total:,} times in all ({{m,n}} counts summed) "
                       f"and at most {limits.max_repeats:,} are accepted (router.max_pattern_repeats): each count "
                       "costs the engine its square to convert; bound a string's length with minLength and "
                       "maxLength, which cost nothing, instead of a counted pattern", param)


def specs(data: dict, every_tool: bool = False) -> Iterator[tuple[str, Any]]:
    """The body's fields the engine turns into a grammar, with the field's name: the tools when
    `tool_choice` forces a call (their schemas then become the grammar), or `every_tool` (a tool
    parser may build a structural tag of them under `auto` too)."""
    for key in SPEC_FIELDS:
        if data.get(key) is not None:
            yield key, data[key]
    choice = data.get("tool_choice")
    if data.get("tools") is not None and (every_tool or choice == "required" or isinstance(choice, dict)):
        yield "tools", data["tools"]


def patterns(spec: Any) -> Iterator[str]:
    """Every regular expression of a JSON schema in a spec: `pattern` values, `patternProperties`
    keys, and the same inside JSON carried as a string (a `json` schema or a structural tag sent
    as text). A plain `regex` is not one: xgrammar converts those apart, in linear time. Walked
    with a stack of its own, as JSON inside a string is nested as deep as its sender likes."""
    stack = [spec]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                if key == "pattern" and isinstance(value, str):
                    yield value
                    continue
                if key == "patternProperties" and isinstance(value, dict):
                    yield from (k for k in value if isinstance(k, str))
                stack.append(value)
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str) and item[:1] in ("{", "["):
            try:
                stack.append(json.loads(item))
            except (ValueError, RecursionError):
                pass  # not JSON the engine can read either: vLLM refuses it with its own message


def repeats(pattern: str) -> int:
    """The counts of a regular expression's `{m}`, `{m,}`, `{m,n}` and `{,n}`, each its larger
    bound, summed. Escaped braces and braces in a character class are literals; reading a
    literal brace as a count only ever refuses more, never less."""
    total, i, in_class = 0, 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            i += 1 + (pattern[i + 1:i + 2] == "^")
            i += pattern[i:i + 1] == "]"  # a `]` first in a class is one of its characters
            continue
        elif c == "{" and (m := _QUANTIFIER.match(pattern, i)) and (m.group(1) or m.group(3)):
            total += max(_count(m.group(1)), _count(m.group(3)))
            i = m.end()
            continue
        i += 1
    return total


def _count(digits: str | None) -> int:
    if not digits:
        return 0
    return _HUGE if len(digits) > 9 else int(digits)
