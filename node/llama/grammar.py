r"""Bounds on a request's ``json_schema``, so that one request cannot take a model worker down.

A schema becomes a llama.cpp grammar in two steps, both in the worker:
llama-cpp-python's converter (``json_schema_to_gbnf``, Python) writes GBNF text,
and llama.cpp parses that into a grammar sampler. Both steps have limits a
client can reach with a few bytes. The converter spells repetition out: a
``minLength``/``maxLength``/``minItems``/``maxItems`` of N, or a ``{m,n}`` in a
``pattern``, becomes N copies or nested optional groups. Seen here with
llama-cpp-python 0.3.36: ``{"type": "string", "maxLength": 3000}`` (37 bytes)
turns into 24 KB of GBNF. llama.cpp refuses to parse it ("number of rules that
are going to be repeated multiplied by the new repetition exceeds sane
defaults"), llama-cpp-python then adds the NULL sampler to its chain, and the
worker dies of SIGSEGV (exit 139). At 100,000 the parser's recursion also
overflows the stack.

So the worker checks a schema before it converts it, and the grammar before
llama.cpp parses it. Anything over a bound gets 413 TOO_LARGE for that request
alone, and the message names the bound:

* ``check_schema``: at most ``MAX_SCHEMA_BYTES`` of JSON, ``MAX_SCHEMA_DEPTH``
  nested maps and lists, ``MAX_REPEAT`` for every repetition count, and for the
  product of a ``pattern``'s nested bounded repetitions (``nested_repeat``);
* ``check_grammar``: at most ``MAX_GRAMMAR_BYTES`` of GBNF, with groups nested
  at most ``MAX_GRAMMAR_NESTING`` deep (the depth of llama.cpp's parser recursion).

Nested repetitions are bounded by their product because llama.cpp's grammar
sampler keeps every way the text so far can be parsed (a "stack" each) and
checks each vocabulary token against every one of them at every step: text
that ``(a{0,64}){0,64}`` matches can be split into its groups in thousands of
ways, and one such request took 0.7 s per token, holding every other slot of
its worker; ``((a{0,256}){0,256}){0,256}`` never produced a token (found by a
break-it pass, 2026-12-07). The product does not see how broad a class is, nor
groups that can match nothing: ``([a-z ]{0,16}){0,16}`` passed it and took
minutes per token. A repeated group that can match nothing gets 413
(``repeated_nullable``), and the engine stops a grammar that takes too long over
one token (``node.llama.engine.GRAMMAR_BUDGET_S``, 413). A schema no value can
satisfy (``minLength`` above ``maxLength`` and the like) gets 400: the grammar
would force output that is not even JSON.

``schema_grammar`` converts with llama-cpp-python's converter, but writes its
literals (``const``, ``enum`` values, property names) as GBNF expects: the
converter puts JSON's own escapes (``\"``, ``\\``, ``\n``, ``\u00e9``)
into GBNF string literals, where llama.cpp reads them as GBNF escapes, so a
``"`` or ``\`` in a property name broke the grammar, a ``\n`` or a control
character came out raw (not JSON), a U+0000 crashed the worker (SIGABRT:
"Unexpected empty grammar stack"), and a character outside the BMP, escaped as
a UTF-16 surrogate pair, came out as six U+FFFD.

What a schema within these bounds costs in memory is small: the engine checks
the vocabulary in pieces (``node.engine.GRAMMAR_CHUNK``), so llama.cpp's
per-candidate vectors stay small, and the grammar itself is bounded here.
``node.capacity.plan.grammar_allowance`` plans it, and ``scripts/bench_grammar.py``
measures the largest schemas allowed here.
A grammar llama.cpp still cannot parse gets 400 (``node.llama.engine``).
"""

from __future__ import annotations

import ctypes
import json
import re
from typing import Any, TypeGuard

from llama_cpp.llama_grammar import BuiltinRule, SchemaConverter

from broker.errors import ProtocolError, TooLarge

#: Most bytes of a schema's compact JSON. The intent schema
#: (``fallback.intents.INTENT_SCHEMA``) has 799. The limit keeps the converter's
#: work and its output small.
MAX_SCHEMA_BYTES = 16 * 1024
#: Most nested maps and lists in a schema. An object level is two of them (the
#: object and its ``properties``), so this allows 15 nested objects around a string.
#: The converter recurses per level, and so does llama.cpp's grammar stack.
MAX_SCHEMA_DEPTH = 32
#: Largest repetition count: ``minLength``, ``maxLength``, ``minItems``,
#: ``maxItems``, and ``{m,n}`` in a ``pattern``. 3000 crashed a worker (see above).
MAX_REPEAT = 256
#: Most bytes of the GBNF grammar made from a schema. The intent schema's has 2461.
MAX_GRAMMAR_BYTES = 32 * 1024
#: Deepest nesting of ``( )`` groups in the grammar. ``MAX_REPEAT`` optional
#: repetitions nest that many groups; the margin covers a pattern's own groups.
MAX_GRAMMAR_NESTING = 2 * MAX_REPEAT

#: Schema keywords that the converter spells out as repetitions.
REPEAT_KEYS = ("minLength", "maxLength", "minItems", "maxItems")
#: Keyword pairs whose lower bound must not exceed the upper: otherwise no value fits.
BOUND_PAIRS = (
    ("minLength", "maxLength"),
    ("minItems", "maxItems"),
    ("minProperties", "maxProperties"),
    ("minimum", "maximum"),
)
#: Keywords whose value is a subschema, a map of them or a list of them: the
#: converter takes each as a map, and ``true``/``false`` there (valid JSON Schema)
#: made it fail with "'bool' object has no attribute 'get'". ``additionalProperties``
#: is not here: the converter reads its booleans.
SUBSCHEMA_ONE = ("items", "not", "contains")
SUBSCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions")
SUBSCHEMA_LIST = ("prefixItems", "anyOf", "oneOf", "allOf")
#: A regex quantifier ``{m}``, ``{m,}`` or ``{m,n}`` in a ``pattern``.
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:(,)\s*(\d*)\s*)?\}")
#: Characters a GBNF string literal must escape (llama.cpp's grammar parser,
#: ``parse_char``: ``\\``, ``\"``, ``\n``, ``\r``, ``\t``, ``\xHH``).
_GBNF_SPECIAL = re.compile(r'[\\"\x00-\x1f\x7f]')
#: A character of a JSON string, in GBNF: anything but a quote, a backslash and
#: U+0001-U+001F unescaped (RFC 8259 §7; U+0000 no token holds, and naming it is
#: refused), or an escape. The converter's rule let control characters through raw,
#: and a plain ``{"type": "string"}`` answer held a raw newline: not JSON.
JSON_CHAR = (
    r'[^"\\\x01-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'
)
#: One escape in GBNF text: ``\xHH``, ``\uHHHH``, ``\UHHHHHHHH`` or a single character.
_GBNF_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)", re.DOTALL)
_GBNF_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def check_schema(schema: dict[str, Any]) -> None:
    """Refuse a schema beyond the bounds, before the converter sees it.

    Raises:
        TooLarge: too deep, too many bytes, or a repetition count too high. The
            message names the bound and where in the schema it was hit.
        ProtocolError: the schema is not JSON (bytes or other msgpack-only values).
    """
    _check_depth(schema)
    try:
        size = len(json.dumps(schema, separators=(",", ":")))
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"json_schema is not usable: not JSON ({exc})") from exc
    if size > MAX_SCHEMA_BYTES:
        raise TooLarge(f"json_schema has {size} bytes of JSON; this node allows {MAX_SCHEMA_BYTES}")
    for path, node in _maps(schema):
        for key in REPEAT_KEYS:
            count = node.get(key)
            if isinstance(count, int) and count > MAX_REPEAT:
                raise TooLarge(_repeat_message(f"{key} {count}", f"{path}/{key}"))
        for low, high in BOUND_PAIRS:
            a, b = node.get(low), node.get(high)
            if _number(a) and _number(b) and a > b:
                raise ProtocolError(
                    f"json_schema is not usable: {low} {a} is above {high} {b} at "
                    f"{path or '/'}; no value can satisfy it"
                )
        if booleans := _boolean_subschemas(node):
            raise ProtocolError(
                f"json_schema is not usable: a boolean subschema at {path}/{booleans[0]} is "
                "not supported (write {} for true; leave out what false forbids)"
            )
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            _check_pattern(pattern, f"{path}/pattern")


def _boolean_subschemas(node: dict[str, Any]) -> list[str]:
    """Where ``node`` has ``true`` or ``false`` in place of a subschema (pointer parts)."""
    found = [key for key in SUBSCHEMA_ONE if isinstance(node.get(key), bool)]
    for key in SUBSCHEMA_MAP:
        value = node.get(key)
        if isinstance(value, dict):
            found += [f"{key}/{k}" for k, v in value.items() if isinstance(v, bool)]
    for key in SUBSCHEMA_LIST:
        value = node.get(key)
        if isinstance(value, list):
            found += [f"{key}/{i}" for i, v in enumerate(value) if isinstance(v, bool)]
    return found


def _check_pattern(pattern: str, where: str) -> None:
    """Refuse a ``pattern`` whose repetitions, alone or nested, exceed ``MAX_REPEAT``,
    that holds a U+0000 (llama.cpp reads its grammar as a C string), or a ``{m,n}``
    with m above n.

    Raises:
        TooLarge: a quantifier's count, or the product along a nesting, is too high.
        ProtocolError: the pattern holds a U+0000, or a quantifier no text fits.
    """
    if "\x00" in pattern:
        raise ProtocolError(f"json_schema is not usable: a U+0000 in {where}")
    for match in _QUANTIFIER.finditer(pattern):
        low, high = match.group(1), match.group(3)
        if high and int(low) > int(high):
            # The converter wrote it as {low} and the answer did not fit the pattern.
            raise ProtocolError(
                f"json_schema is not usable: {match.group(0)} in {where} asks for at least "
                f"{low} and at most {high}; no text fits"
            )
        if max(int(n) for n in (low, high) if n) > MAX_REPEAT:
            raise TooLarge(_repeat_message(f"{match.group(0)}", where))
    product = nested_repeat(pattern)
    if product > MAX_REPEAT:
        raise TooLarge(
            f"json_schema repeats too often: nested repetitions in {where} multiply to "
            f"{product}; this node allows {MAX_REPEAT} (llama.cpp's grammar tracks every "
            "way to split the text between them)"
        )
    group = repeated_nullable(pattern)
    if group is not None:
        raise TooLarge(
            f"json_schema repeats a group that can match nothing: {group} in {where}. "
            "llama.cpp's grammar follows every way of splitting the text between such "
            "groups, empty ones included (minutes per token); let the group match at "
            "least one character, or write one repetition ([a-z ]{0,256} for "
            "([a-z ]{0,2}){0,128})"
        )


def nested_repeat(pattern: str) -> int:
    """The largest product of bounded repetition counts along one nesting of groups
    in a regex ``pattern``: 256 for ``(a{0,16}){0,16}``, 16 for ``a{0,16}b{0,16}``.

    A count is a quantifier's upper bound (``{m,n}``: n; ``{m}``: m). Unbounded
    quantifiers (``*``, ``+``, ``{m,}``) and ``?`` count 1: the converter writes
    them as GBNF repetition operators, whose parses do not multiply like the
    nested optional groups ``{m,n}`` is spelled out as. A rough reading of the
    regex (escapes and classes skipped, no validation): the converter and
    llama.cpp still judge the pattern itself.
    """
    inside = [1]  # per open group: the largest product seen inside it so far
    last = 1  # the product of the unit just read (what a quantifier applies to)
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i, last = i + 2, 1
        elif c == "[":
            i, last = _class_end(pattern, i), 1
        elif c == "(":
            inside.append(1)
            i, last = i + 1, 1
        elif c == ")" and len(inside) > 1:
            last = inside.pop()
            inside[-1] = max(inside[-1], last)
            i += 1
        elif (quantified := _quantifier(pattern, i))[2] > i:
            last *= max(quantified[1] or 1, 1)  # unbounded (None) and {0} count 1
            inside[-1] = max(inside[-1], last)
            i = quantified[2]
        else:
            i, last = i + 1, 1
    return max(inside)


def repeated_nullable(pattern: str) -> str | None:
    """The first group of a regex ``pattern`` that can match the empty string and is
    repeated (a quantifier above 1, or unbounded), as written; None if there is none.

    ``([a-z ]{0,2}){0,128}``, ``(a?){0,256}``, ``(a*)*``: llama.cpp's grammar
    sampler advances every parse through every run of empty groups, and one
    vocabulary token took 30 s to check (a break-it pass, session 18). A group can
    match nothing when one of its alternatives is a sequence of items that each can:
    a group that can, or anything quantified ``?``, ``*`` or ``{0,n}``. A rough
    reading, like ``nested_repeat``'s (escapes and classes are single items).
    """
    found: list[str] = []

    def alternation(i: int) -> tuple[bool, int]:
        nullable = False
        while True:
            empty, i = sequence(i)
            nullable |= empty
            if i < len(pattern) and pattern[i] == "|":
                i += 1
                continue
            return nullable, i

    def sequence(i: int) -> tuple[bool, int]:
        nullable = True
        while i < len(pattern) and pattern[i] not in "|)":
            start = i
            empty, group, i = item(i)
            low, high, i = _quantifier(pattern, i)
            if group and empty and (high is None or high > 1) and not found:
                found.append(pattern[start:i])
            nullable &= empty or low == 0
        return nullable, i

    def item(i: int) -> tuple[bool, bool, int]:  # (can match nothing, is a group, end)
        c = pattern[i]
        if c == "(":
            i += 3 if pattern.startswith("(?:", i) else 1
            empty, i = alternation(i)
            return empty, True, i + (i < len(pattern) and pattern[i] == ")")
        if c == "[":
            return False, False, _class_end(pattern, i)
        if c == "\\":
            return False, False, i + 2
        return c in "^$", False, i + 1

    i = 0
    while i < len(pattern):  # a stray ")" ends alternation(): read on after it
        _, i = alternation(i)
        i += 1
    return found[0] if found else None


def _quantifier(pattern: str, i: int) -> tuple[int, int | None, int]:
    """The quantifier at ``pattern[i]``, if any: (least, most or None for unbounded,
    the index after it); (1, 1, i) without one. A lazy ``?`` after it is skipped."""
    c = pattern[i] if i < len(pattern) else ""
    if c in ("?", "*", "+"):
        low, high, end = {"?": (0, 1), "*": (0, None), "+": (1, None)}[c] + (i + 1,)
    elif (match := _QUANTIFIER.match(pattern, i)) is not None:
        low = int(match.group(1))
        high = None if match.group(2) and not match.group(3) else int(match.group(3) or low)
        end = match.end()
    else:
        return 1, 1, i
    return low, high, end + (end < len(pattern) and pattern[end] == "?")


def _class_end(pattern: str, start: int) -> int:
    """The index after the character class opening at ``start`` (or the end)."""
    i = start + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":  # a leading ] is a member
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1


def _number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Converter(SchemaConverter):
    r"""llama-cpp-python's converter, with its literals written as GBNF literals.

    The converter builds a literal from ``json.dumps`` output (JSON text, with
    JSON's escapes) and escapes only quotes and line breaks for GBNF. Here the
    JSON text keeps non-ASCII characters as they are (``ensure_ascii=False``:
    JSON needs no escape for them, and a surrogate pair is no GBNF code point),
    and every backslash, quote and control character is escaped for GBNF, so the
    grammar matches the JSON text itself: a U+0000 in a value stays the six
    characters ``\u0000``.
    """

    def _format_literal(self, literal: str) -> str:
        text = _raw_non_ascii(literal)
        return '"' + _GBNF_SPECIAL.sub(_gbnf_escape, text) + '"'

    def _generate_constant_rule(self, value: Any) -> str:
        return self._format_literal(json.dumps(value, ensure_ascii=False))

    def _add_primitive(self, name: str, rule: BuiltinRule) -> str:
        # A JSON string's unescaped characters (JSON_CHAR), not the converter's.
        return str(
            super()._add_primitive(name, BuiltinRule(JSON_CHAR, []) if name == "char" else rule)
        )


def _raw_non_ascii(literal: str) -> str:
    """``literal``, if it is JSON text as ``json.dumps`` writes it, with its
    non-ASCII characters unescaped (control characters stay escaped); else as is."""
    try:
        value = json.loads(literal)
    except ValueError:
        return literal
    if json.dumps(value) != literal:
        return literal
    return json.dumps(value, ensure_ascii=False)


def _gbnf_escape(match: re.Match[str]) -> str:
    # A U+0000 becomes \x00, which check_grammar refuses with the pattern's.
    ch = match.group(0)
    return _GBNF_ESCAPES.get(ch) or f"\\x{ord(ch):02x}"


def schema_grammar(schema: dict[str, Any]) -> str:
    """The GBNF grammar for ``schema``, within this module's bounds.

    Raises:
        TooLarge: the schema or its grammar is beyond a bound (413).
        ProtocolError: the converter cannot use the schema, or no value fits it (400).
    """
    check_schema(schema)
    try:
        # The converter's own entry point (json_schema_to_gbnf), with this subclass.
        converter = _Converter(  # type: ignore[no-untyped-call]
            prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False
        )
        resolved = converter.resolve_refs(json.loads(json.dumps(schema)), "stdin")
        converter.visit(resolved, "")  # type: ignore[no-untyped-call]
        gbnf: str = converter.format_grammar()  # type: ignore[no-untyped-call]
    except Exception as exc:  # the converter raises assorted types on bad schemas
        raise ProtocolError(f"json_schema is not usable: {exc}") from exc
    check_grammar(gbnf)
    return gbnf


def check_grammar(gbnf: str) -> None:
    r"""Refuse a GBNF grammar too large or nested too deep for llama.cpp's parser, or
    one that names the code point U+0000.

    A U+0000 in a grammar (a pattern's ``\x00`` or ``\u0000``, which the converter
    copies into the grammar as written, alone or in a class) killed the worker with
    SIGABRT at the first token, as a U+0000 in a ``const`` did ("Unexpected empty
    grammar stack after accepting piece: <pad>").

    Raises:
        TooLarge: over ``MAX_GRAMMAR_BYTES`` or ``MAX_GRAMMAR_NESTING``.
        ProtocolError: the grammar names U+0000.
    """
    # Left to right, so that an escaped backslash is never read as an escape's start.
    codes = [m.group(1) for m in _GBNF_ESCAPE.finditer(gbnf)]
    if "\x00" in gbnf or any(len(c) > 1 and int(c[1:], 16) == 0 for c in codes):
        raise ProtocolError(
            "json_schema is not usable: its grammar would name U+0000 (a pattern's "
            "\\x00 or \\u0000), which llama.cpp cannot match"
        )
    size = len(gbnf.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise TooLarge(
            f"json_schema makes a {size}-byte grammar; this node allows {MAX_GRAMMAR_BYTES}"
            " (fewer properties, alternatives or repetitions make it smaller)"
        )
    depth = grammar_nesting(gbnf)
    if depth > MAX_GRAMMAR_NESTING:
        raise TooLarge(
            f"json_schema makes a grammar with groups nested {depth} deep; this node allows "
            f"{MAX_GRAMMAR_NESTING}"
        )


def grammar_nesting(gbnf: str) -> int:
    """The deepest nesting of ``( )`` groups in GBNF text.

    Parentheses inside string literals (``"..."``) and character classes
    (``[...]``) do not count, and neither do escaped characters in them.
    """
    depth = deepest = 0
    closing = ""  # the quote or bracket that ends the literal we are in, if any
    escaped = False
    for ch in gbnf:
        if closing:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == closing:
                closing = ""
        elif ch == '"':
            closing = '"'
        elif ch == "[":
            closing = "]"
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth -= 1
    return deepest


def _check_depth(schema: Any) -> None:
    """Iterative, so that a schema deeper than Python's recursion limit is measured too."""
    todo: list[tuple[Any, int]] = [(schema, 1)]
    while todo:
        node, depth = todo.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise TooLarge(
                f"json_schema nests more than {MAX_SCHEMA_DEPTH} levels of maps and lists; "
                f"this node allows {MAX_SCHEMA_DEPTH}"
            )
        children = node.values() if isinstance(node, dict) else node
        if isinstance(node, (dict, list)):
            todo += [(c, depth + 1) for c in children if isinstance(c, (dict, list))]


def _maps(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every map in the schema with its JSON pointer ("" = the root)."""
    found: list[tuple[str, dict[str, Any]]] = []
    todo: list[tuple[str, Any]] = [("", schema)]
    while todo:
        path, node = todo.pop()
        if isinstance(node, dict):
            found.append((path, node))
            todo += [(f"{path}/{k}", v) for k, v in node.items()]
        elif isinstance(node, list):
            todo += [(f"{path}/{i}", v) for i, v in enumerate(node)]
    return found


def _repeat_message(what: str, where: str) -> str:
    return (
        f"json_schema repeats too often: {what} at {where or '/'}; this node allows "
        f"{MAX_REPEAT} (llama.cpp grammars spell every repetition out)"
    )


def trim_heap() -> bool:
    """Give the C heap's free memory back to the system (glibc's ``malloc_trim(0)``).

    A model worker calls this after every request that ran under a grammar.
    At each sampled token llama.cpp's grammar sampler fills vectors of up to
    32 B x n_vocab (llama-grammar.cpp: 8 MiB each for the default model's
    262,144 tokens, two per code point matched). Once glibc has raised its mmap
    threshold (it does so each time a mapped block is freed, up to 32 MiB;
    mallopt(3)), these come from the heap, and their freed pages stay
    resident; this call gives them back, at the same peak and speed (measured:
    docs/bench/figures.md §node.llama.grammar, ``scripts/bench_grammar.py``).

    Not done instead: pinning the mmap threshold to 128 KiB (``mallopt``), which
    unmaps every vector at once: a lower peak, but every constrained token
    faults its pages in afresh and is much slower (same section).

    Returns False where the C library has no ``malloc_trim`` (not glibc).
    """
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim(0)
    return True
