"""*Pure.* What a request asks the engine to turn into a grammar, bounded before anything parses it.

vLLM converts a structured-output spec (a JSON schema, a structural tag, the forced tools' schemas)
into an xgrammar grammar while it validates the request, on the event loop of the process that
serves the pool's HTTP; the engine then compiles it, with no time limit. xgrammar converts each
`{m,n}` of a JSON schema's regular expressions in time that grows with the square of the count (a
150-byte request with `".{1,8000}"` stalled every other request of its pool for 19 s), and
compiles in time that grows faster than the places a pattern can repeat or leave out (bench/notes.md).
So those places are counted here, from the raw body, with the nesting of groups and the spec's size:
what it costs does not depend on the tenant's quota, so it is bounded for everyone alike. A bound
on the text is not a bound on time: see "Found and left" in bench/notes.md.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterator

from router.errors import ApiError

SPEC_FIELDS = ("response_format", "structured_outputs")  # what a body may ask the engine to compile
_QUANTIFIER = re.compile(r"\{\s*(\d*)\s*(?:(,)\s*(\d*)\s*)?\}")
_HUGE = 10 ** 9  # a bound written with more digits than this counts as this (and is refused)
MAX_GROUP_DEPTH = 16  # 500 nested optional groups with no count compiled for 19 s


@dataclass(frozen=True)
class GrammarLimits:
    max_bytes: int = 64 << 10
    max_repeats: int = 64


def check(data: dict, limits: GrammarLimits) -> None:
    """A 400 naming the field if the body's structured-output specs are too large to convert."""
    try:
        sizes = [(param, len(json.dumps(spec, separators=(",", ":"), ensure_ascii=False, default=str).encode()))
                 for param, spec in specs(data)]
    except RecursionError:
        raise ApiError(400, "json_too_deep", "the structured-output spec nests too deeply to read; flatten it")
    if (size := sum(n for _, n in sizes)) > limits.max_bytes:
        param = max(sizes, key=lambda s: s[1])[0]
        raise ApiError(400, "grammar_too_large",
                       f"the structured-output spec ({param}) is {size:,} bytes and at most {limits.max_bytes:,} "
                       "are accepted (router.max_grammar_bytes): the engine compiles all of it before the first "
                       "token; send a smaller schema", param)
    found = [(param, list(patterns(spec))) for param, spec in specs(data, every_tool=True)]
    for param, regexes in found:
        if (deepest := max(map(depth, regexes), default=0)) > MAX_GROUP_DEPTH:
            raise ApiError(400, "grammar_too_costly", f"a regular expression in {param} nests its groups {deepest} "
                                                      f"deep and at most {MAX_GROUP_DEPTH} are accepted: the engine's "
                                                      "compile grows with the nesting; flatten it", param)
    counted = [(param, sum(map(repeats, regexes))) for param, regexes in found]
    if (total := sum(n for _, n in counted)) > limits.max_repeats:
        param = max(counted, key=lambda c: c[1])[0]
        raise ApiError(400, "grammar_too_costly",
                       f"the regular expressions in {param} can repeat or leave out {total:,} places in all "
                       f"({{m,n}} counts, ?, * and +, times those of the groups around them) and at most "
                       f"{limits.max_repeats:,} are accepted (router.max_pattern_repeats): the engine converts and "
                       "compiles each place before the first token; bound a string's length with minLength and "
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
        elif isinstance(item, str) and item.strip()[:1] in ("{", "[", '"'):  # JSON as text, even twice over
            try:
                stack.append(json.loads(item))
            except (ValueError, RecursionError):
                pass  # not JSON the engine can read either: vLLM refuses it with its own message


def repeats(pattern: str) -> int:
    """How many places a regular expression can repeat or leave out: each quantifier's larger
    bound (`{m}`, `{m,}`, `{m,n}`, `{,n}`, spaces allowed as xgrammar allows them) or 1 (`?`,
    `*`, `+`), a quantified group's times what its inside counts (xgrammar's compile multiplies
    them: `((.{1,16}){1,16}){1,16}` took 23 s), summed. Read as xgrammar reads a pattern (`[^]`
    and `[]` are whole classes); a literal brace read as a count only ever refuses more."""
    frames, inner, i = [0], 0, 0  # counts of the open groups; what the atom just read holds
    while i < len(pattern):
        c, quantity = pattern[i], None
        if c == "\\":
            i += 2
        elif c == "[":
            i += 1 + (pattern[i + 1:i + 2] == "^")
            if pattern[i:i + 1] != "]":  # `[]` and `[^]` end there; other classes at the next `]`
                while i < len(pattern) and pattern[i] != "]":
                    i += 2 if pattern[i] == "\\" else 1
            i += 1
        elif c == "(":
            frames.append(0)
            i += 1 + (pattern[i + 1:i + 2] == "?")  # a group's kind, not a quantifier
            continue
        elif c == ")":
            inner = frames.pop() if len(frames) > 1 else 0
            i += 1
            quantity = _quantifier(pattern, i)
            if quantity is None:
                frames[-1] += inner
                continue
        elif (stray := _quantifier(pattern, i)) is not None:  # after another, or first: counted alone
            frames[-1] += stray[0]
            i = stray[1]
            continue
        else:
            i += 1
        if quantity is None:
            quantity = _quantifier(pattern, i)
            inner = 0
        if quantity is not None:
            bound, i = quantity
            frames[-1] += bound * max(inner, 1)
            i += pattern[i:i + 1] in ("?", "+")  # lazy or possessive: the same count
    return sum(frames)


def depth(pattern: str) -> int:
    """How deeply a regular expression's groups nest (escapes and classes aside)."""
    deepest = level = 0
    for c in re.sub(r"\\.|\[\^?\]?[^\]]*\]", "", pattern):
        level += (c == "(") - (c == ")" and level > 0)
        deepest = max(deepest, level)
    return deepest


def _quantifier(pattern: str, i: int) -> tuple[int, int] | None:
    """The count of a quantifier at `i` and where it ends, or None."""
    c = pattern[i:i + 1]
    if c in ("?", "*", "+"):
        return 1, i + 1
    if c == "{" and (m := _QUANTIFIER.match(pattern, i)) and (m.group(1) or m.group(3)):
        return max(_count(m.group(1)), _count(m.group(3))), m.end()
    return None


def _count(digits: str | None) -> int:
    if not digits:
        return 0
    return _HUGE if len(digits) > 9 else int(digits)
