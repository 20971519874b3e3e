"""Bounds on a request's ``json_schema``, so that one request cannot take a model worker down.

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
  nested maps and lists, and ``MAX_REPEAT`` for every repetition count;
* ``check_grammar``: at most ``MAX_GRAMMAR_BYTES`` of GBNF, with groups nested
  at most ``MAX_GRAMMAR_NESTING`` deep (the depth of llama.cpp's parser recursion).

What a schema within these bounds costs in memory is mostly the vocabulary's,
not the schema's: ``node.capacity.plan.grammar_allowance`` plans it, and
``scripts/bench_grammar.py`` measures the largest schemas allowed here.
A grammar llama.cpp still cannot parse gets 400 (``node.llama.engine``).
"""

from __future__ import annotations

import ctypes
import json
import re
from typing import Any

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
#: A regex quantifier ``{m}``, ``{m,}`` or ``{m,n}`` in a ``pattern``.
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


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
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            for match in _QUANTIFIER.finditer(pattern):
                if max(int(n) for n in match.groups() if n) > MAX_REPEAT:
                    raise TooLarge(_repeat_message(f"{match.group(0)}", f"{path}/pattern"))


def check_grammar(gbnf: str) -> None:
    """Refuse a GBNF grammar too large or nested too deep for llama.cpp's parser.

    Raises:
        TooLarge: over ``MAX_GRAMMAR_BYTES`` or ``MAX_GRAMMAR_NESTING``.
    """
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
