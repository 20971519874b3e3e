"""A request's ``json_schema`` against the real llama.cpp engine: schemas over node.llama.grammar's
bounds get 413, a grammar llama.cpp cannot parse gets 400, and neither costs the engine
anything. Before the bounds, both kinds crashed the worker with SIGSEGV (exit 139):
llama-cpp-python chains the NULL sampler llama.cpp returns for a grammar it refuses."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from broker.errors import ErrorCode, ProtocolError, TooLarge
from node.engine import EngineSpec
from node.llama.engine import GRAMMAR_BUDGET_S, LlamaEngine
from node.llama.grammar import MAX_REPEAT
from node.model import resolve_model

pytestmark = pytest.mark.system

#: The model must still write JSON for this after every refusal.
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture(scope="module")
def engine() -> Iterator[LlamaEngine]:
    spec = EngineSpec(
        kind="llama", model_path=str(resolve_model("default")), n_ctx=512, n_batch=512, threads=1
    )
    engine = LlamaEngine(spec)
    yield engine
    engine.close()


def run(engine: LlamaEngine, schema: dict[str, Any], op: str = "generate") -> dict[str, Any]:
    job: dict[str, Any] = {"op": op, "max_tokens": 12, "temperature": 0.0, "json_schema": schema}
    if op == "generate":
        job["prompt"] = "Answer in JSON:"
    else:
        job["messages"] = [{"role": "user", "content": "Answer in JSON."}]
    return engine.run(job, threading.Event(), lambda _: None)


def still_works(engine: LlamaEngine) -> None:
    assert run(engine, SMALL)["text"].replace(" ", "") in ('{"ok":true}', '{"ok":false}')


@pytest.mark.parametrize("op", ["generate", "chat"])
def test_the_string_that_crashed_a_worker_gets_413(engine: LlamaEngine, op: str) -> None:
    schema = {"type": "object", "properties": {"t": {"type": "string", "maxLength": 3000}}}
    with pytest.raises(TooLarge, match="maxLength 3000 at /properties/t/maxLength") as info:
        run(engine, schema, op)
    assert info.value.code == ErrorCode.TOO_LARGE
    still_works(engine)


def test_the_longest_string_allowed_is_served(engine: LlamaEngine) -> None:
    schema = {"type": "string", "maxLength": MAX_REPEAT}
    assert run(engine, schema)["text"].startswith('"')


def test_a_pattern_llama_cpp_cannot_parse_gets_400_with_its_reason(engine: LlamaEngine) -> None:
    # The converter copies \\d into the grammar, where llama.cpp knows no such escape.
    with pytest.raises(ProtocolError, match="cannot parse its grammar") as info:
        run(engine, {"type": "string", "pattern": "^\\d{4}$"})
    assert info.value.code == ErrorCode.BAD_REQUEST
    assert "failed to parse grammar" in info.value.message  # llama.cpp's logged reason
    still_works(engine)


def test_a_schema_the_converter_rejects_is_still_400(engine: LlamaEngine) -> None:
    with pytest.raises(ProtocolError, match="json_schema is not usable"):
        run(engine, {"$ref": "#/$defs/missing"})
    still_works(engine)


def as_json(engine: LlamaEngine, schema: dict[str, Any]) -> Any:
    """The model's whole answer under ``schema``, parsed as strict JSON."""
    job: dict[str, Any] = {
        "op": "generate",
        "prompt": "Answer in JSON:",
        "max_tokens": 32,
        "temperature": 0.0,
        "json_schema": schema,
    }
    outcome = engine.run(job, threading.Event(), lambda _: None)
    assert outcome["finish_reason"] == "stop", outcome
    return json.loads(outcome["text"])


@pytest.mark.parametrize(
    "value",
    ["a\x00b", "😀", "ключ 日本", 'q"b\\s\n', "\x01\x7f"],
    ids=["nul", "emoji", "non-ascii", "json-escapes", "controls"],
)
def test_a_const_comes_out_as_json_of_that_value(engine: LlamaEngine, value: str) -> None:
    """A break-it pass: a U+0000 in a const killed the worker (SIGABRT), an emoji came
    out as six U+FFFD, a quote or backslash broke the grammar, a control character
    came out raw (not JSON)."""
    assert as_json(engine, {"const": value}) == value
    assert as_json(engine, {"enum": [value]}) == value
    still_works(engine)


@pytest.mark.parametrize("key", ["a\x00", "k😀", 'a"b\\c\n', "a\x01"])
def test_a_property_name_comes_out_as_json_of_that_name(engine: LlamaEngine, key: str) -> None:
    schema = {"type": "object", "properties": {key: {"type": "boolean"}}, "required": [key]}
    answer = as_json(engine, schema)
    assert list(answer) == [key] and isinstance(answer[key], bool)


def test_nested_repetitions_that_hung_a_worker_get_413(engine: LlamaEngine) -> None:
    """Every count within MAX_REPEAT, yet the worker never produced a token (and every
    other slot of it waited): now refused before the grammar is made."""
    with pytest.raises(TooLarge, match="nested repetitions") as info:
        run(engine, {"type": "string", "pattern": "^((a{0,256}){0,256}){0,256}$"})
    assert info.value.code == ErrorCode.TOO_LARGE
    still_works(engine)


def test_nested_repetitions_within_the_bound_are_served(engine: LlamaEngine) -> None:
    text = run(engine, {"type": "string", "pattern": "^(a{1,16}){0,16}$"})["text"]
    assert text.startswith('"') and set(text.strip().strip('"')) <= {"a"}


@pytest.mark.parametrize("pattern", ["^([a-z ]{0,16}){0,16}$", "^([a-z ]{0,2}){0,128}$"])
def test_a_repeated_group_that_can_match_nothing_gets_413(
    engine: LlamaEngine, pattern: str
) -> None:
    """Within MAX_REPEAT (product 256), yet llama.cpp's grammar followed every run of
    empty groups: filtering the vocabulary took minutes per token, one token 30 s,
    and the worker was killed as stalled with its other slots' streams (break-it
    passes, sessions 17 and 18). Now refused before the grammar is made."""
    with pytest.raises(TooLarge, match="repeats a group that can match nothing"):
        run(engine, {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}})
    still_works(engine)


def test_a_grammar_too_costly_to_follow_ends_its_request_with_413(engine: LlamaEngine) -> None:
    """``([a-z ]{1,16}){0,16}`` passes the schema bounds, but its text splits between
    the groups in ever more ways as it grows: filtering the vocabulary took 3 s for an
    early token and minutes later on. The filter stops at its CPU budget."""
    job: dict[str, Any] = {
        "op": "generate",
        "prompt": "Write a sentence in JSON:",
        "max_tokens": 64,
        "temperature": 0.0,
        "json_schema": {"type": "string", "pattern": "^([a-z ]{1,16}){0,16}$"},
    }
    with pytest.raises(TooLarge, match="too costly to follow") as info:
        engine.run(job, threading.Event(), lambda _: None)
    assert f"{round(GRAMMAR_BUDGET_S * 1000)} ms" in info.value.message
    still_works(engine)


def test_a_grammar_costly_to_accept_ends_its_request_with_413(engine: LlamaEngine) -> None:
    """Twelve adjacent ``[a-z]{0,256}`` runs (no repeated group, within every bound) and a
    prompt the model copies: the grammar never refuses a token, so it never filters, but
    judging and accepting each token grew to 2-6 s after 250 characters, with every other
    slot waiting (break-it pass, session 18). The budget counts that work too."""
    word = "internationalizationcharacterization" * 8
    job: dict[str, Any] = {
        "op": "generate",
        "prompt": "Records:\n" + f'{{"name": "{word}"}}\n' * 6,
        "max_tokens": 250,
        "temperature": 0.0,
        "json_schema": {
            "type": "object",
            "properties": {"name": {"type": "string", "pattern": "^" + "[a-z]{0,256}" * 12 + "$"}},
            "required": ["name"],
        },
    }
    with pytest.raises(TooLarge, match="too costly to follow") as info:
        engine.run(job, threading.Event(), lambda _: None)
    assert info.value.partial_text.startswith('{"name": "internationalization')
    still_works(engine)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_token_the_grammar_refuses_is_drawn_again_from_the_tokens_it_admits(
    engine: LlamaEngine, temperature: float
) -> None:
    """The grammar judges the chain's token first and filters the whole vocabulary
    only when it refuses it (as llama.cpp's sampler does). The model wants capitals
    and punctuation here, so refusals happen; every answer still fits the pattern."""
    pattern = "^[a-z]{1,8}( [a-z]{1,8}){0,3}$"
    for seed in range(4):
        job: dict[str, Any] = {
            "op": "generate",
            "prompt": "Write the title of a news story, in JSON:",
            "max_tokens": 48,
            "temperature": temperature,
            "seed": seed,
            "json_schema": {"type": "string", "pattern": pattern},
        }
        answer = engine.run(job, threading.Event(), lambda _: None)
        assert answer["finish_reason"] == "stop", answer
        assert re.fullmatch(pattern, json.loads(answer["text"])), answer


def test_a_schema_no_value_fits_gets_400(engine: LlamaEngine) -> None:
    with pytest.raises(ProtocolError, match="minLength 10 is above maxLength 2"):
        run(engine, {"type": "string", "minLength": 10, "maxLength": 2})
    still_works(engine)


def test_a_pattern_naming_nul_gets_400_not_a_crash(engine: LlamaEngine) -> None:
    """``\x00`` in a pattern reached llama.cpp as U+0000, which no token can match: the
    sampler fell back to <pad> and accepting it aborted the worker (SIGABRT)."""
    with pytest.raises(ProtocolError, match="would name U\\+0000"):
        run(engine, {"type": "string", "pattern": r"^\x00$"})
    still_works(engine)


@pytest.mark.parametrize("pattern", ["^[z-a]$", "^a[b-a]c$"])
def test_a_grammar_that_admits_nothing_ends_its_request_not_the_worker(
    engine: LlamaEngine, pattern: str
) -> None:
    """A second break-it pass: with every logit at -inf the chain chose token 0, and
    llama.cpp's grammar threw accepting it (SIGABRT, every slot of the worker lost)."""
    with pytest.raises(ProtocolError, match="admits no next character"):
        run(engine, {"type": "string", "pattern": pattern})
    still_works(engine)


@pytest.mark.parametrize(
    ("prompt", "schema"),
    [
        ('Line one\nLine two\n"', {"type": "string", "maxLength": 20}),
        ("<html>", {"type": "string"}),
    ],
)
def test_a_string_never_holds_a_raw_control_character(
    engine: LlamaEngine, prompt: str, schema: dict[str, Any]
) -> None:
    """A second break-it pass: the converter's string rule let a raw newline into a
    string (a quote, a newline, a quote): not JSON."""
    job: dict[str, Any] = {"op": "generate", "prompt": prompt, "max_tokens": 24}
    job.update(json_schema=schema, temperature=0.0)
    text = engine.run(job, threading.Event(), lambda _: None)["text"]
    assert not [c for c in text if ord(c) < 0x20], text
