"""*Pure.* What a request asks the engine to turn into a grammar, bounded before anything parses it.

vLLM converts a structured-output spec (a JSON schema, a structural tag, the forced tools' schemas)
into an xgrammar grammar while it validates the request, on the event loop of the process that
serves the pool's HTTP; the engine then compiles it, with no time limit. xgrammar converts each
`{m,n}` of a JSON schema's regular expressions in time that grows with the square of the count (a
150-byte request with `".{1,8000}"` stalled every other request of its pool for 19 s), and
compiles in time that grows faster than the places a pattern can leave out or repeat
(bench/notes.md). A plain `regex` or an EBNF `grammar` converts its counts in no time, but compiles
in time that grows as fast with the places it can leave out or repeat (`.?` x 128: 3.6 s, on a
worker every structured request of the replica waits for). So each pattern's and grammar's `Shape`
is read here, from the raw body, in one linear pass, with the spec's size: what it costs does not depend on the tenant's quota, so it is bounded for
everyone alike. A bound on the text is not a bound on time: see bench/notes.md.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Iterator

from router.errors import ApiError

SPEC_FIELDS = ("response_format", "structured_outputs")  # what a body may ask the engine to compile
_QUANTIFIER = re.compile(r"\{ *+(\d*+) *+(?:(,) *+(\d*+) *+)?\}")  # possessive: no backtracking
_NAME = re.compile(r"[A-Za-z_][\w.-]*")  # a rule's name, in EBNF or Lark
_HUGE = 10 ** 9  # a bound written with more digits than this counts as this (and is refused)
MAX_GROUP_DEPTH = 16  # 500 nested optional groups with no count compiled for 19 s
MAX_PATTERN_CHARS = 4096
MAX_COUNT = 512  # the count converted in 74 ms; the counts' squares may add up to its square
WIDE = 4  # `.?` x 64 compiled 13 times as long as `[a-z]?` x 64
WIDE_RANGE = 256  # a class's range wider than this is read as `.` (`[\x00-\U0010FFFF]?` x 256: 16.5 s)
RULE = 2 * WIDE  # a rule's name in a grammar: `w?` x 64 of a rule of 32 `[^"]` compiled 3.2 s, `[^"]?` x 64 0.7
_RULE = "\x00"  # how `_ebnf_atoms` writes one (a grammar holds none: a literal NUL is not EBNF)
_CLASS_CHAR = re.compile(r"\\x[0-9a-fA-F]{2}|\\u[0-9a-fA-F]{4}|\\U[0-9a-fA-F]{8}|\\.|.", re.S)


@dataclass(frozen=True)
class GrammarLimits:
    max_bytes: int = 64 << 10
    max_repeats: int = 256


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
    shapes: list[tuple[str, Shape]] = []
    for param, spec in specs(data):
        for text, kind in patterns(spec):
            if kind != GRAMMAR and len(text) > MAX_PATTERN_CHARS:
                raise _costly(param, f"a regular expression in {param} is {len(text):,} characters and at most "
                                     f"{MAX_PATTERN_CHARS:,} are accepted")
            shapes.append((param, shape(_ebnf_atoms(text) if kind == GRAMMAR else text, counted=kind == PATTERN)))
    if (deep := max(shapes, key=lambda s: s[1].depth, default=None)) and deep[1].depth > MAX_GROUP_DEPTH:
        raise _costly(deep[0], f"a regular expression in {deep[0]} nests its groups {deep[1].depth} deep and at most "
                               f"{MAX_GROUP_DEPTH} are accepted: the engine's compile grows with the nesting; "
                               "flatten it")
    param = max(shapes, key=lambda s: s[1].places + s[1].squares, default=("", None))[0]
    if (places := sum(s.places for _, s in shapes)) > limits.max_repeats:
        raise _costly(param, f"the regular expressions in {param} can leave out or repeat {places:,} places in all "
                             f"(?, *, +, empty alternatives, each {{m,n}}'s n - m in a JSON schema's pattern and "
                             f"one elsewhere, four times on `.` or a negated "
                             f"class, times those of the groups around them) and at most {limits.max_repeats:,} are "
                             "accepted (router.max_pattern_repeats): the engine's compile grows faster than they do")
    if (squares := sum(s.squares for _, s in shapes)) > MAX_COUNT ** 2:
        raise _costly(param, f"the {{m,n}} counts in {param} cost as much to convert as one count of "
                             f"{math.isqrt(squares):,} and at most {MAX_COUNT} is accepted: xgrammar converts a count "
                             "in time growing with its square")


def _costly(param: str, why: str) -> ApiError:
    return ApiError(400, "grammar_too_costly", f"{why}; in a JSON schema, bound a string's length with minLength and "
                                               "maxLength, which cost nothing, instead of a counted pattern; "
                                               "elsewhere, make fewer places optional", param)


def specs(data: dict) -> Iterator[tuple[str, Any]]:
    """The body's fields the engine turns into a grammar, with the field's name: the tools only
    when `tool_choice` forces a call (their schemas then become the grammar, as vLLM builds it)."""
    for key in SPEC_FIELDS:
        if data.get(key) is not None:
            yield key, data[key]
    choice = data.get("tool_choice")
    if data.get("tools") is not None and (choice == "required" or isinstance(choice, dict)):
        yield "tools", data["tools"]


PATTERN, REGEX, GRAMMAR = "pattern", "regex", "grammar"  # a JSON schema's, a plain one, EBNF


def patterns(spec: Any) -> Iterator[tuple[str, str]]:
    """Every regular expression and grammar in a spec, with its kind: a JSON schema's `pattern`
    values and `patternProperties` keys (PATTERN), a plain `regex` (REGEX) and an EBNF `grammar`
    (GRAMMAR), at the top or in a structural tag's formats, and the same inside JSON carried as a
    string (a `json` schema or a structural tag sent as text). A key of these names with text for
    its value counts wherever it is: more refused, never less. Walked with a stack of its own, as
    JSON inside a string is nested as deep as its sender likes."""
    stack = [spec]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                if key in (PATTERN, REGEX, GRAMMAR) and isinstance(value, str):  # a tag's regex format: a plain one
                    yield value, REGEX if key == PATTERN and item.get("type") == REGEX else key
                    continue
                if key == "patternProperties" and isinstance(value, dict):
                    yield from ((k, PATTERN) for k in value if isinstance(k, str))
                stack.append(value)
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str) and item.strip()[:1] in ("{", "[", '"'):  # JSON as text, even twice over
            try:
                stack.append(json.loads(item))
            except (ValueError, RecursionError):
                pass  # not JSON the engine can read either: vLLM refuses it with its own message


@dataclass(frozen=True)
class Shape:
    """What a regular expression asks of xgrammar, read as xgrammar reads a pattern (`[^]` and
    `[]` are whole classes; a count may hold spaces); a literal brace read as a count only ever
    refuses more, never less."""

    places: int  # it can leave out or repeat: `?`, `*`, `+`, an empty alternative, each `{m,n}`'s
    # n - m; on a wide atom (`.`, `[^...]`, `\S`) times WIDE; a quantified group's times what its
    # inside holds (the engine's compile multiplies them)
    squares: int  # each count's larger bound squared, summed: xgrammar converts a count in that time
    depth: int  # how deeply its groups nest


def shape(pattern: str, counted: bool = True) -> Shape:
    """One pass over the pattern, linear in its length. Its `{m,n}` counts cost as much as their
    span in a JSON schema's pattern (`counted`), and as one `*` elsewhere (xgrammar keeps a plain
    regex's or a grammar's count as one repetition)."""
    frames = [[0, False, 1, 0]]  # per open group: its places, whether an alternative is empty, its width,
    # where its inside starts
    squares = deepest = i = 0
    while i < len(pattern):
        c, weight, inner = pattern[i], 1, 0  # what a quantifier here multiplies; a closed group's own places
        if c == "\\":
            weight = WIDE if pattern[i + 1:i + 2] in ("S", "W", "D") else 1
            i += 2
        elif c == "[":
            negated = pattern[i + 1:i + 2] == "^"
            start = i + 1 + negated
            i = _closing(pattern, start, "]")  # `[]` and `[^]` end there
            weight = WIDE if negated or _wide_class(pattern[start:i]) else 1
            i += 1
        elif c == "(":
            i += 1 + (pattern[i + 1:i + 2] == "?")  # a group's kind, not a quantifier
            frames.append([0, pattern[i:i + 1] == "|", 1, i])
            deepest = max(deepest, len(frames) - 1)
            continue
        elif c == "|":
            frames[-1][1] |= pattern[i - 1:i] in ("", "|") or pattern[i + 1:i + 2] in ("", "|", ")")
            i += 1
            continue
        elif c == ")" and len(frames) > 1:
            inner, empty, width, start = frames.pop()
            weight = max(inner, width)
            frames[-1][1] |= not pattern[start:i].lstrip(":=!")  # `()`, `(?:)`: an empty alternative, or as good
            i += 1
            if _quantifier(pattern, i, counted) is None:  # an empty alternative leaves the group out, as `?` does
                frames[-1][0] += inner + empty * weight
                frames[-1][2] = max(frames[-1][2], width)
                continue
        elif (stray := _quantifier(pattern, i, counted)) is not None:  # one after another, or first: counted alone
            frames[-1][0] += stray[0]
            squares += stray[1] ** 2
            i = stray[2]
            continue
        else:
            weight = WIDE if c == "." else RULE if c == _RULE else 1
            i += 1
        frames[-1][2] = max(frames[-1][2], weight)
        if (quantity := _quantifier(pattern, i, counted)) is not None:
            frames[-1][0] += inner + quantity[0] * weight
            squares += quantity[1] ** 2
            i = quantity[2]  # a `?` after it (lazy to xgrammar) is read as one more place: never fewer
    return Shape(sum(f[0] + f[1] * f[2] for f in frames), squares, deepest)


def _closing(text: str, i: int, end: str) -> int:
    """Where the first `end` from `i` is that no backslash escapes (past the text if none)."""
    while i < len(text) and text[i] != end:
        i += 2 if text[i] == "\\" else 1
    return i


def _wide_class(inside: str) -> bool:
    """Whether a class takes most of the vocabulary, as a negated one does: it holds a negated
    shorthand (`[\\s\\S]`) or a range of more than WIDE_RANGE code points."""
    if re.search(r"\\[SWD]", inside):
        return True
    chars = _CLASS_CHAR.findall(inside)
    return any(dash == "-" and _code(b) - _code(a) > WIDE_RANGE for a, dash, b in zip(chars, chars[1:], chars[2:]))


def _code(char: str) -> int:
    return int(char[2:], 16) if len(char) > 2 else ord(char[-1])


def _quantifier(pattern: str, i: int, counted: bool = True) -> tuple[int, int, int] | None:
    """The places a quantifier at `i` adds, its larger bound, and where it ends; or None."""
    c = pattern[i:i + 1]
    if c in ("?", "*", "+"):
        return 1, 0, i + 1
    if c == "{" and (m := _QUANTIFIER.match(pattern, i)) and (m.group(1) or m.group(2)):  # `{,}` is `*`
        low, high = _count(m.group(1)), _count(m.group(3))
        unbounded = m.group(2) is not None and not m.group(3)
        if not counted:
            return 1, 0, m.end()
        return (1 if unbounded else max(high - low, 0)) if m.group(2) else 0, max(low, high), m.end()
    return None


def _count(digits: str | None) -> int:
    if not digits:
        return 0
    return _HUGE if len(digits) > 9 else int(digits)


def _ebnf_atoms(grammar: str) -> str:
    """A grammar as `shape` reads it, EBNF or Lark (vLLM converts a grammar with no `::=` from
    Lark): a quoted string (either quote) one literal, an empty one nothing (`| ""` is an empty
    alternative); a rule's name `_RULE`, weighed as a wide rule; comments (`#`, `//`) and
    spaces left out (`( )` is an empty group); a character class kept whole. A `[` or `(` in a
    string or a comment must not open what hides the rest."""
    out, i, n = [], 0, len(grammar)
    while i < n:
        c = grammar[i]
        if c in "\"'":
            start, i = i + 1, _closing(grammar, i + 1, c)
            out.append("a" if i > start else "")
            i += 1
        elif c == "#" or grammar.startswith("//", i):
            while i < n and grammar[i] not in "\r\n":
                i += 1
        elif c == "[":
            start, i = i, _closing(grammar, i + 1 + (grammar[i + 1:i + 2] == "^"), "]")
            out.append(grammar[start:i + 1])
            i += 1
        elif c.isspace():
            i += 1
        elif (name := _NAME.match(grammar, i)) is not None:
            out.append(_RULE)
            i = name.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)
