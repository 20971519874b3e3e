"""The bounds on a request's ``json_schema`` (node.llama.grammar): what is refused with 413, what
passes, and that the largest schemas allowed make grammars within the grammar bounds (the
real converter of llama-cpp-python, no model)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llama_cpp.llama_grammar import json_schema_to_gbnf

from broker.errors import ErrorCode, ProtocolError, TooLarge
from fallback.intents import INTENT_SCHEMA
from node.llama.grammar import (
    MAX_GRAMMAR_BYTES,
    MAX_GRAMMAR_NESTING,
    MAX_REPEAT,
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
    check_grammar,
    check_schema,
    grammar_nesting,
    nested_repeat,
    repeated_nullable,
    schema_grammar,
)


def nested(levels: int) -> dict[str, Any]:
    """``levels`` maps and lists in all: arrays of arrays around a string."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels - 1):
        schema = {"type": "array", "items": schema}
    return schema


def text(max_length: int) -> dict[str, Any]:
    return {"type": "object", "properties": {"text": {"type": "string", "maxLength": max_length}}}


def test_the_intent_schema_and_its_grammar_pass() -> None:
    # Passing = returning without raising (the checks return nothing).
    assert check_schema(INTENT_SCHEMA) is None  # type: ignore[func-returns-value]
    grammar = json_schema_to_gbnf(json.dumps(INTENT_SCHEMA))
    assert check_grammar(grammar) is None  # type: ignore[func-returns-value]


def test_depth_up_to_the_bound_passes_one_more_is_413() -> None:
    check_schema(nested(MAX_SCHEMA_DEPTH))
    with pytest.raises(TooLarge, match=f"more than {MAX_SCHEMA_DEPTH} levels") as info:
        check_schema(nested(MAX_SCHEMA_DEPTH + 1))
    assert info.value.code == ErrorCode.TOO_LARGE


def test_a_schema_deeper_than_pythons_recursion_limit_is_measured_not_crashed() -> None:
    deep: Any = {}
    for _ in range(5000):
        deep = {"items": deep}
    with pytest.raises(TooLarge, match="levels of maps and lists"):
        check_schema(deep)


def test_too_many_bytes_of_json_is_413() -> None:
    enum = [f"value-{i:05d}" for i in range(MAX_SCHEMA_BYTES // 10)]
    with pytest.raises(TooLarge, match=f"this node allows {MAX_SCHEMA_BYTES}"):
        check_schema({"type": "string", "enum": enum})


@pytest.mark.parametrize("key", ["minLength", "maxLength", "minItems", "maxItems"])
def test_repetition_counts_above_the_bound_are_413_and_say_where(key: str) -> None:
    check_schema({"type": "object", "properties": {"a": {key: MAX_REPEAT}}})
    with pytest.raises(TooLarge) as info:
        check_schema({"type": "object", "properties": {"a": {key: MAX_REPEAT + 1}}})
    assert f"{key} {MAX_REPEAT + 1} at /properties/a/{key}" in info.value.message


@pytest.mark.parametrize("quantifier", ["{300}", "{1,300}", "{300,}", "{ 2 , 999 }"])
def test_pattern_quantifiers_above_the_bound_are_413(quantifier: str) -> None:
    with pytest.raises(TooLarge, match="/pattern"):
        check_schema({"type": "string", "pattern": f"^a{quantifier}$"})


def test_pattern_quantifiers_within_the_bound_pass() -> None:
    pattern = f"^[a-z]{{1,{MAX_REPEAT}}}-[0-9]{{4}}$"
    assert check_schema({"type": "string", "pattern": pattern}) is None  # type: ignore[func-returns-value]


@pytest.mark.parametrize("quantifier", ["{3,2}", "{ 9 , 1 }"])
def test_a_quantifier_no_text_fits_is_400(quantifier: str) -> None:
    """``a{3,2}`` was written as ``a{3}`` by the converter: an answer the pattern refuses."""
    with pytest.raises(ProtocolError, match="no text fits"):
        check_schema({"type": "string", "pattern": f"^a{quantifier}$"})


def test_a_quantifier_of_equal_bounds_passes() -> None:
    assert check_schema({"type": "string", "pattern": "^a{2,2}b{0,0}$"}) is None  # type: ignore[func-returns-value]


@pytest.mark.parametrize(
    ("pattern", "product"),
    [
        ("^(a{0,16}){0,16}$", 256),
        ("^a{0,16}b{0,16}$", 16),
        ("^([a-z]{1,8}\\.){0,4}[a-z]{2,6}$", 32),
        ("^(?:ab){0,8}c$", 8),
        ("^(a{3}){4}$", 12),
        ("^(a+)+$", 1),
        ("^a{2,}$", 1),
        ("^[(]{0,9}$", 9),  # a parenthesis in a class opens no group
        ("^\\({0,9}$", 9),  # nor does an escaped one
        ("^((a{0,256}){0,256}){0,256}$", 256**3),
    ],
)
def test_nested_repeat_multiplies_bounded_counts_along_a_nesting(
    pattern: str, product: int
) -> None:
    assert nested_repeat(pattern) == product


@pytest.mark.parametrize(
    "pattern",
    ["^((a{0,256}){0,256}){0,256}$", "^(a{0,256}){0,256}$", "^(a{0,64}){0,64}$", "^(x{2}){200}$"],
)
def test_nested_repetitions_beyond_the_bound_are_413(pattern: str) -> None:
    """A break-it pass hung a worker with the first (every count within MAX_REPEAT):
    llama.cpp's grammar keeps every way to split the text between the groups."""
    with pytest.raises(TooLarge, match="nested repetitions in /properties/p/pattern multiply"):
        check_schema(
            {"type": "object", "properties": {"p": {"type": "string", "pattern": pattern}}}
        )


@pytest.mark.parametrize(
    ("low", "high"),
    [("minLength", "maxLength"), ("minItems", "maxItems"), ("minimum", "maximum")],
)
def test_a_schema_no_value_fits_is_400(low: str, high: str) -> None:
    """``minLength 10, maxLength 2`` made the grammar force output that was not JSON."""
    with pytest.raises(ProtocolError, match=f"{low} 10 is above {high} 2 at /") as info:
        check_schema({low: 10, high: 2})
    assert info.value.code == ErrorCode.BAD_REQUEST
    check_schema({low: 2, high: 2})


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "object", "properties": {"a": False}}, "/properties/a"),
        ({"type": "array", "items": True}, "/items"),
        ({"anyOf": [{"type": "null"}, True]}, "/anyOf/1"),
    ],
)
def test_a_boolean_subschema_is_400_naming_where(schema: dict[str, Any], where: str) -> None:
    """A break-it pass got Python's "'bool' object has no attribute 'get'" instead."""
    with pytest.raises(ProtocolError, match=f"a boolean subschema at {where} is not supported"):
        schema_grammar(schema)
    schema_grammar({"type": "object", "additionalProperties": False})  # the converter's own


@pytest.mark.parametrize("pattern", [r"^\x00$", r"^\u0000$", r"^[\u0000-\u0001]$", r"^\U00000000$"])
def test_a_pattern_naming_nul_is_400(pattern: str) -> None:
    """The converter copies these escapes into the grammar, and the worker died of
    SIGABRT at the first token (a second break-it pass, after the const fix)."""
    with pytest.raises(ProtocolError, match="would name U\\+0000"):
        schema_grammar({"type": "string", "pattern": pattern})


def test_an_escaped_backslash_before_u0000_is_no_nul() -> None:
    assert r'"a\\u0000"' in schema_grammar({"type": "string", "pattern": r"^a\\u0000$"})


def test_a_nul_in_a_pattern_is_400() -> None:
    with pytest.raises(ProtocolError, match="U\\+0000 in /pattern"):
        check_schema({"type": "string", "pattern": "^a\x00b$"})


@pytest.mark.parametrize(
    ("value", "literal"),
    [
        ("a\x00b", r'"\"a\\u0000b\""'),  # JSON's escape, as text: no U+0000 in the grammar
        ("😀é", r'"\"😀é\""'),  # raw: no \u escape, no surrogate pair
        ('q"b\\s\n', r'"\"q\\\"b\\\\s\\n\""'),  # JSON's escapes, escaped for GBNF
    ],
)
def test_literals_are_the_json_text_escaped_for_gbnf(value: str, literal: str) -> None:
    """A const, an enum value and a property name: the grammar matches their JSON text
    (llama.cpp reads a GBNF literal's backslashes as its own escapes)."""
    assert f"root ::= {literal}\n" in schema_grammar({"const": value})
    assert f'root ::= {literal} | "1"\n' in schema_grammar({"enum": [value, 1]})
    keyed = schema_grammar({"type": "object", "properties": {value: {"type": "null"}}})
    assert f'::= {literal} space ":" space null\n' in keyed


#: A GBNF escape in a string literal (llama.cpp's ``parse_char``).
GBNF_ESCAPE = re.compile(r'\\(x[0-9a-fA-F]{2}|[\\"nrt])')


def gbnf_text(literal: str) -> str:
    """The text a GBNF string literal (quotes included) matches: the test's oracle."""
    assert literal[0] == literal[-1] == '"'
    plain = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"'}

    def one(m: re.Match[str]) -> str:
        code = m.group(1)
        return chr(int(code[1:], 16)) if code[0] == "x" else plain[code]

    return GBNF_ESCAPE.sub(one, literal[1:-1])


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=12))
def test_a_const_literal_matches_exactly_its_json_text(value: str) -> None:
    """Any string (controls, quotes, backslashes, astral characters): the grammar's
    literal matches the JSON text of the value, non-ASCII characters as they are."""
    grammar = schema_grammar({"const": value})
    literal = grammar.split("root ::= ", 1)[1].split("\n", 1)[0]
    assert gbnf_text(literal) == json.dumps(value, ensure_ascii=False)
    assert "\x00" not in grammar


def test_the_3000_character_string_that_crashed_a_worker_is_refused_before_conversion() -> None:
    with pytest.raises(TooLarge, match="maxLength 3000 at /properties/text/maxLength"):
        check_schema(text(3000))


def test_a_schema_that_is_not_json_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="not JSON") as info:
        check_schema({"type": "string", "const": b"\x00bytes"})
    assert info.value.code == ErrorCode.BAD_REQUEST


def test_nesting_counts_groups_but_not_parentheses_in_literals_or_classes() -> None:
    assert grammar_nesting('root ::= ("a" ("b")?)?') == 2
    assert grammar_nesting('root ::= "((((" [()] "\\"(" ("x")') == 1
    assert grammar_nesting('root ::= [\\]()] ("y")*') == 1
    assert grammar_nesting("root ::= x") == 0


def test_grammar_size_and_nesting_bounds_are_413() -> None:
    check_grammar("root ::= " + "(" * MAX_GRAMMAR_NESTING + '"a"' + ")" * MAX_GRAMMAR_NESTING)
    deep = "root ::= " + "(" * (MAX_GRAMMAR_NESTING + 1) + '"a"' + ")" * (MAX_GRAMMAR_NESTING + 1)
    with pytest.raises(TooLarge, match=f"nested {MAX_GRAMMAR_NESTING + 1} deep"):
        check_grammar(deep)
    with pytest.raises(TooLarge, match=f"this node allows {MAX_GRAMMAR_BYTES}"):
        check_grammar('root ::= "' + "a" * MAX_GRAMMAR_BYTES + '"')


def test_the_longest_string_allowed_makes_a_grammar_within_the_grammar_bounds() -> None:
    gbnf = json_schema_to_gbnf(json.dumps(text(MAX_REPEAT)))
    check_grammar(gbnf)
    assert MAX_REPEAT <= grammar_nesting(gbnf) <= MAX_GRAMMAR_NESTING


#: In a child (the heap is the process's): 100 MiB of 64 KiB blocks, below glibc's mmap
#: threshold so they come from the heap, freed but for the last one, which keeps the heap's
#: top in use, so that only malloc_trim can give their pages back.
TRIM_CHILD = """
import ctypes
from node.llama.grammar import trim_heap
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def anon():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("RssAnon"))
blocks = [libc.malloc(65536) for _ in range(1600)]
for block in blocks:
    ctypes.memset(block, 1, 65536)
last = blocks.pop()
for block in blocks:
    libc.free(block)
before = anon()
print(trim_heap(), before - anon())
"""


def test_trim_heap_gives_freed_heap_pages_back() -> None:
    out = subprocess.run(
        [sys.executable, "-c", TRIM_CHILD], capture_output=True, text=True, check=True
    )
    trimmed, released = out.stdout.split()
    assert trimmed == "True" and int(released) > 64 * 2**20


@pytest.mark.parametrize(
    ("pattern", "group"),
    [
        ("^([a-z ]{0,2}){0,128}$", "([a-z ]{0,2}){0,128}"),  # one token took 30 s
        ("^([a-z ]{0,16}){0,16}$", "([a-z ]{0,16}){0,16}"),  # minutes per token
        ("^(a?){0,256}$", "(a?){0,256}"),
        ("^(a*)*$", "(a*)*"),
        ("^(a|){0,8}$", "(a|){0,8}"),
        ("^x(a|b?)+y$", "(a|b?)+"),
        ("^((a?)(b?)){2}$", "((a?)(b?)){2}"),
        ("^(?:(a?)){0,4}$", "(?:(a?)){0,4}"),
    ],
)
def test_a_repeated_group_that_can_match_nothing_is_413(pattern: str, group: str) -> None:
    assert repeated_nullable(pattern) == group
    with pytest.raises(TooLarge, match=re.escape(f"can match nothing: {group} in /pattern")):
        check_schema({"type": "string", "pattern": pattern})


@pytest.mark.parametrize(
    "pattern",
    [
        "^(a{1,16}){0,16}$",  # each group takes a character
        "^([a-z]{1,16} ){0,16}$",
        "^([0-9]{1,3}\\.){3}[0-9]{1,3}$",
        "^((a?)b){0,8}$",  # b is not optional
        "^(a?)$",  # not repeated
        "^(a?){1}$",
        "^(a+)+$",
        "^(a|aa|aaa)*$",
        "^[(]{0,9}(x?)$",  # a parenthesis in a class opens no group
        "^\\((x?)\\){0,9}$",  # nor does an escaped one
    ],
)
def test_groups_that_take_a_character_or_are_not_repeated_pass(pattern: str) -> None:
    assert repeated_nullable(pattern) is None
    assert check_schema({"type": "string", "pattern": pattern}) is None  # type: ignore[func-returns-value]
