"""A plain `regex` and an EBNF `grammar` are bounded by the places they can leave out or repeat.

xgrammar keeps their `{m,n}` counts as one repetition (`[a-z]{1,32000}` compiled in 10 ms), but
their compile grows with their optional places as a JSON schema's pattern's does (`.?` x 128:
3.6 s; `[^"]?` x 128 in a grammar: 3.4 s, tiny model's tokenizer, one thread), on a worker every
structured request of the replica waits for. Both passed unread (found by a review), and a second
review found ways past the first reading of them, each compiling 3 s at 128 places and more
beyond (an empty string or group as an alternative: 75 s at 512)."""

from __future__ import annotations

import json

import pytest

from router.errors import ApiError
from router.grammar import GrammarLimits, check

JSON_EBNF = r'''# JSON, as grammars for llama.cpp write it
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [1-9] [0-9]{0,15})? ws
ws     ::= [ \t\n]{0,20}
'''
WIDE_OPTIONAL = '[^"]?'


def refused(body: dict) -> ApiError:
    with pytest.raises(ApiError) as e:
        check(body, GrammarLimits())
    return e.value


@pytest.mark.parametrize("body", [
    {"structured_outputs": {"regex": ".?" * 65}},
    {"structured_outputs": {"grammar": "root ::= " + " ".join([WIDE_OPTIONAL] * 65)}},
    # a quoted `[` or a comment's must not open a class that hides the rest from the count
    {"structured_outputs": {"grammar": 'root ::= "[" ' + " ".join([WIDE_OPTIONAL] * 65)}},
    {"structured_outputs": {"grammar": "# [\nroot ::= " + " ".join([WIDE_OPTIONAL] * 65)}},
    {"structured_outputs": {"grammar": 'root ::= "\\"[" ' + " ".join([WIDE_OPTIONAL] * 65)}},
    # a structural tag's formats, as an object or as text
    {"response_format": {"type": "structural_tag", "format": {"type": "grammar", "grammar": "root ::= " + " ".join(
        [WIDE_OPTIONAL] * 65)}}},
    {"structured_outputs": {"structural_tag": json.dumps({"type": "structural_tag", "format": {
        "type": "regex", "pattern": ".?" * 65}})}},
    {"structured_outputs": {"structural_tag": json.dumps({"type": "structural_tag", "format": {
        "type": "regex", "regex": ".?" * 65}})}},
    # a second review's: nothing read where xgrammar compiles an optional place, each 3-75 s
    {"structured_outputs": {"grammar": "root ::= " + " ".join(['([^"] | "")'] * 65)}},  # an empty string
    {"structured_outputs": {"grammar": "root ::= " + " ".join(['([^"] | ( ))'] * 65)}},  # an empty group
    {"structured_outputs": {"grammar": '// "\nstart: ' + "[^0]? " * 65 + ' // "'}},  # Lark's comment
    {"structured_outputs": {"grammar": "start: '[' " + "w? " * 65 + "\nw: [^0]"}},  # Lark's quote
    {"structured_outputs": {"regex": "(.|())" * 65}},
    {"structured_outputs": {"regex": "(.|(?:))" * 65}},
    {"structured_outputs": {"grammar": "root ::= " + " ".join(["w?"] * 64) + '\nw ::= [^"] [^"]'}},  # a rule
    {"structured_outputs": {"regex": "[\\s\\S]?" * 65}},  # wide classes that are not negated
    {"structured_outputs": {"grammar": "root ::= " + " ".join(["[\\x00-\\U0010FFFF]?"] * 65)}},
])
def test_a_regex_or_grammar_with_too_many_optional_places_is_refused(body):
    e = refused(body)
    assert e.status == 400 and e.code == "grammar_too_costly" and e.param in ("structured_outputs", "response_format")
    assert "router.max_pattern_repeats" in e.message, e.message


@pytest.mark.parametrize("body", [
    {"structured_outputs": {"regex": ".?" * 64}},  # 0.7 s: the bound, as for a schema's pattern
    {"structured_outputs": {"regex": "[a-z]{1,32000}"}},  # counts are one repetition here
    {"structured_outputs": {"regex": ".{0,2000}@[a-z]+\\.com"}},
    {"structured_outputs": {"grammar": JSON_EBNF}},
    {"structured_outputs": {"grammar": 'root ::= [^"]{0,2000}'}},
    {"structured_outputs": {"choice": ["yes", "no"] * 100}},
    {"structured_outputs": {"regex": "[\\x20-\\x7e]{0,500}"}},  # printable ASCII: a narrow class
    # a structural tag's regex format is a plain regex, whose counts cost nothing (84 ms)
    {"structured_outputs": {"structural_tag": json.dumps({"type": "structural_tag", "format": {
        "type": "regex", "pattern": ".{1,2000}"}})}},
])
def test_what_a_regex_or_grammar_usually_holds_passes(body):
    check(body, GrammarLimits())
