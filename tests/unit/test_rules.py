"""The rule engine: the default rule set as a table, validation, matchers, comparison."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from broker.errors import Cancelled, ConfigError, ProtocolError
from fallback.compare import compare_json, compare_outputs, compare_text, token_f1
from fallback.engine import MAX_MATCH_CHARS, RuleEngine, condition_holds, field_value
from fallback.intents import (
    DOORS,
    INTENT_EXAMPLES,
    INTENT_PROMPT,
    INTENT_SCHEMA,
    ROOMS,
    intent_errors,
)
from fallback.rule_keys import Condition
from fallback.rules import RulesError, load_rules, loads_rules
from fallback.template import Unconvertible, parse_json_template, parse_template, render_json

SHIPPED = Path(__file__).resolve().parents[2] / "etc" / "rules.toml"
ENGINE = RuleEngine.from_file(SHIPPED)
UNKNOWN = {"intent": "unknown"}

#: Command text -> (rule expected to answer, its JSON). ``None`` rule: nothing may match.
COMMANDS: list[tuple[str, str | None, dict[str, Any]]] = [
    # lights
    ("Turn on the kitchen lights", "lights_on", {"intent": "lights_on", "room": "kitchen"}),
    ("turn on the kitchen lights", "lights_on", {"intent": "lights_on", "room": "kitchen"}),
    ("switch the living room lamp on please", "lights_on",
     {"intent": "lights_on", "room": "living room"}),
    ("turn the living  room lights on", "lights_on",
     {"intent": "lights_on", "room": "living room"}),
    ("lights on", "lights_on", {"intent": "lights_on"}),
    ("Turn off the bedroom lights.", "lights_off", {"intent": "lights_off", "room": "bedroom"}),
    ("turn the light on the porch off", "lights_off", {"intent": "lights_off"}),  # a place
    ("kill the lights in the hallway", "lights_off", {"intent": "lights_off", "room": "hallway"}),
    ("lights out", "lights_off", {"intent": "lights_off"}),
    # thermostat
    ("Set the thermostat to 21 degrees", "thermostat_set",
     {"intent": "thermostat_set", "temperature_c": 21}),
    ("set the bedroom temperature to 22.5°C", "thermostat_set",
     {"intent": "thermostat_set", "temperature_c": 22.5, "room": "bedroom"}),
    ("Set the thermostat to 21 \u2103", "thermostat_set",
     {"intent": "thermostat_set", "temperature_c": 21}),
    ("heat the kitchen to 23", "thermostat_set",
     {"intent": "thermostat_set", "temperature_c": 23, "room": "kitchen"}),
    ("set the heating to 20,5", "thermostat_set",
     {"intent": "thermostat_set", "temperature_c": 20.5}),
    # doors
    ("Lock the front door", "door_lock", {"intent": "door_lock", "door": "front"}),
    ("lock all the doors", "door_lock", {"intent": "door_lock"}),
    ("lock up", "door_lock", {"intent": "door_lock"}),
    ("please unlock the back door", "door_unlock", {"intent": "door_unlock", "door": "back"}),
    # robot
    ("move forward 2 meters", "robot_move_forward",
     {"intent": "robot_move", "direction": "forward", "distance_m": 2}),
    ("Robot, go backwards 1.5 m", "robot_move_backward",
     {"intent": "robot_move", "direction": "backward", "distance_m": 1.5}),
    ("back up", "robot_move_backward", {"intent": "robot_move", "direction": "backward"}),
    ("turn left", "robot_move_left", {"intent": "robot_move", "direction": "left"}),
    ("drive the robot to the right 3 metres", "robot_move_right",
     {"intent": "robot_move", "direction": "right", "distance_m": 3}),
    ("move back 0.5 m", "robot_move_backward",
     {"intent": "robot_move", "direction": "backward", "distance_m": 0.5}),
    ("move forward 9999.99 m", "robot_move_forward",
     {"intent": "robot_move", "direction": "forward", "distance_m": 9999.99}),
    ("move forward 2m now", "robot_move_forward",
     {"intent": "robot_move", "direction": "forward", "distance_m": 2}),
    ("STOP!", "robot_stop", {"intent": "robot_stop"}),
    ("robot, stop", "robot_stop", {"intent": "robot_stop"}),
    ("emergency stop", "robot_stop", {"intent": "robot_stop"}),
    ("stop the robot now", "robot_stop", {"intent": "robot_stop"}),
    ("go back to your dock", "robot_dock", {"intent": "robot_dock"}),
    ("return to base", "robot_dock", {"intent": "robot_dock"}),
    ("dock", "robot_dock", {"intent": "robot_dock"}),
    # status questions
    ("what's the battery level?", "status_battery",
     {"intent": "status_query", "target": "battery"}),
    ("Is the front door locked?", "status_door",
     {"intent": "status_query", "target": "door", "door": "front"}),
    ("What\u2019s the temperature in the living room?", "status_temperature",
     {"intent": "status_query", "target": "temperature", "room": "living room"}),
    ("how warm is it in the bedroom", "status_temperature",
     {"intent": "status_query", "target": "temperature", "room": "bedroom"}),
    ("are the kitchen lights on?", "status_lights",
     {"intent": "status_query", "target": "lights", "room": "kitchen"}),
    # telemetry (the request text is a JSON object)
    ('{"device": "greenhouse-1", "temperature_c": 34.5}', "telemetry_overheat",
     {"intent": "alert", "alert": "overheat", "temperature_c": 34.5, "device": "greenhouse-1"}),
    ('{"temperature_c": -3}', "telemetry_freezing",
     {"intent": "alert", "alert": "freezing", "temperature_c": -3}),
    ('{"battery_pct": 9, "device": 7}', "telemetry_low_battery",
     {"intent": "alert", "alert": "low_battery", "battery_pct": 9, "device": "7"}),
    # near misses: nothing may match (word boundaries are not meaning; see etc/rules.toml)
    ("don't stop believing", None, UNKNOWN),  # "stop" is a word here, but not a command
    ("the bus stop is on the left", None, UNKNOWN),
    ("stopwatch", None, UNKNOWN),
    ("don't turn on the kitchen lights", None, UNKNOWN),  # negated command
    ("set the thermostat to 70 F", None, UNKNOWN),  # Fahrenheit is not converted
    ("set the thermostat to 21.5 f", None, UNKNOWN),
    ("set the thermostat to 100", None, UNKNOWN),  # not a room temperature
    ("move forward 50 cm", None, UNKNOWN),  # only metres
    ("move forward 50cm", None, UNKNOWN),
    # a move's every number is a distance in metres, at most 4 integer digits and 2
    # decimals (etc/rules.toml): anything else matches nothing, never a move without it
    ("robot move forward 10 km", None, UNKNOWN),
    ("robot move forward 3 miles", None, UNKNOWN),
    ("move forward 5 nautical miles", None, UNKNOWN),
    ("move forward 1e3 meters", None, UNKNOWN),
    ("move forward -5 meters", None, UNKNOWN),
    ("move forward 2.5.3 meters", None, UNKNOWN),
    ("robot move forward " + "9" * 400 + " meters", None, UNKNOWN),
    ("move forward 20 meters per second", None, UNKNOWN),  # a speed
    ("move forward 12000 m", None, UNKNOWN),
    ("move forward 1.234 m", None, UNKNOWN),
    ("move forward 5 ft", None, UNKNOWN),
    ("move forward five feet", None, UNKNOWN),  # units with spelt-out numbers too
    ("move forward two meters", None, UNKNOWN),
    ("move forward 5", None, UNKNOWN),  # 5 what?
    ("turn left 90 degrees", None, UNKNOWN),
    ("go backwards 3 yards", None, UNKNOWN),
    ("turn right 2 mi", None, UNKNOWN),
    # two conflicting commands in one prompt: neither is carried out
    ("turn on the kitchen lights and turn off the bedroom lights", None, UNKNOWN),
    ("turn the kitchen lights on and the bedroom lights off", None, UNKNOWN),
    ("unlock the back door and lock the front door", None, UNKNOWN),
    ("lock the front door and unlock the back door", None, UNKNOWN),
    ("turn on the tv", None, UNKNOWN),
    ("I left my keys in the kitchen", None, UNKNOWN),
    ("go back to the kitchen", None, UNKNOWN),  # navigation is not a move
    ("unlock", None, UNKNOWN),
    ("what's the weather like?", None, UNKNOWN),
    ('{"temperature_c": 30}', None, UNKNOWN),  # > 30, not >= 30
    ('{"temperature_c": "hot"}', None, UNKNOWN),  # a string is not a number
    ('{"temperature_c": true}', None, UNKNOWN),  # nor is a boolean
]  # fmt: skip


def ask(text: str, **extra: Any) -> dict[str, Any]:
    return ENGINE.answer({"op": "generate", "prompt": text, "json_schema": INTENT_SCHEMA, **extra})


def engine_for(toml: str) -> RuleEngine:
    return RuleEngine(loads_rules(toml, "test.toml"))


# --------------------------------------------------------------------------- default rule set


@pytest.mark.parametrize(("text", "rule", "expected"), COMMANDS, ids=[c[0][:60] for c in COMMANDS])
def test_default_rules_answer_commands(
    text: str, rule: str | None, expected: dict[str, Any]
) -> None:
    answer = ask(text)
    assert answer["rule"] == rule
    assert json.loads(answer["text"]) == expected
    assert (answer["confidence"] > 0) is (rule is not None)


def test_default_rule_set_is_covered_by_the_table() -> None:
    names = {r.name for r in ENGINE.rules.rules}
    assert len(COMMANDS) >= 25
    assert names == {c[1] for c in COMMANDS if c[1] is not None}


@pytest.mark.parametrize(("text", "rule", "expected"), COMMANDS, ids=[c[0][:60] for c in COMMANDS])
def test_default_answers_fit_the_intent_schema(
    text: str, rule: str | None, expected: dict[str, Any]
) -> None:
    assert intent_errors(json.loads(ask(text)["text"])) == []


@pytest.mark.parametrize("room", ROOMS)
def test_every_schema_room_is_understood(room: str) -> None:
    answer = ask(f"turn off the {room} lights")
    assert json.loads(answer["text"]) == {"intent": "lights_off", "room": room}


@pytest.mark.parametrize("door", DOORS)
def test_every_schema_door_is_understood(door: str) -> None:
    assert json.loads(ask(f"lock the {door} door")["text"]) == {"intent": "door_lock", "door": door}


@pytest.mark.parametrize(("text", "expected"), INTENT_EXAMPLES, ids=[e[0] for e in INTENT_EXAMPLES])
def test_the_model_prompt_teaches_what_the_rules_answer(
    text: str, expected: dict[str, Any]
) -> None:
    answer = ask(text)["text"]
    assert json.loads(answer) == expected and intent_errors(expected) == []
    assert f"Q: {text}\nA: {answer}" in INTENT_PROMPT  # compact, as the rules write it
    assert text not in {c[0] for c in COMMANDS}


def test_intent_schema_checker_rejects_off_schema_output() -> None:
    assert intent_errors({"intent": "dance"}) == [
        f"intent: 'dance' is not one of {list(INTENT_SCHEMA['properties']['intent']['enum'])}"
    ]
    assert intent_errors({"room": "kitchen", "colour": "red"}) == [
        "missing required 'intent'",
        "unexpected field 'colour'",
    ]
    assert intent_errors({"intent": "thermostat_set", "temperature_c": True}) == [
        "temperature_c: True is not a number"
    ]
    assert intent_errors([1]) == ["not an object: list"]
    assert intent_errors({"intent": "alert", "device": 7}) == ["device: 7 is not a string"]


# --------------------------------------------------------------------------- answer shape


def test_answer_has_the_model_engines_final_fields() -> None:
    answer = ask("lights on")
    assert answer == {
        "text": '{"intent":"lights_on"}',
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 0, "completion_tokens": 0},
        "confidence": 0.9,
        "rule": "lights_on",
    }


def test_chat_uses_the_last_user_message() -> None:
    answer = ENGINE.answer(
        {
            "op": "chat",
            "messages": [
                {"role": "system", "content": "You control a house."},
                {"role": "user", "content": "lock up"},
                {"role": "assistant", "content": "Done."},
                {"role": "user", "content": "Turn on the kitchen lights"},
            ],
            "json_schema": INTENT_SCHEMA,
        }
    )
    assert answer["rule"] == "lights_on"
    system_only = ENGINE.answer({"op": "chat", "messages": [{"role": "system", "content": "x"}]})
    assert system_only["rule"] is None


def test_no_match_answer() -> None:
    answer = ask("sing me a song")
    assert answer["rule"] is None
    assert answer["confidence"] == 0.0
    assert answer["text"] == '{"intent":"unknown"}'
    plain = ENGINE.answer({"op": "generate", "prompt": "sing me a song"})
    assert plain["text"] == "no rule matched"  # no json_schema: the no_match text


def test_default_no_match_without_a_no_match_table() -> None:
    engine = engine_for('[[rule]]\nname = "a"\nany = ["x"]\ntext = "y"\nconfidence = 1\n')
    for schema in ({}, {"json_schema": INTENT_SCHEMA}):
        answer = engine.answer({"op": "generate", "prompt": "zzz", **schema})
        assert (answer["text"], answer["rule"], answer["confidence"]) == (
            "no rule matched",
            None,
            0.0,
        )


def test_text_and_json_responses_are_chosen_by_json_schema() -> None:
    engine = engine_for(
        '[[rule]]\nname = "hi"\nany = ["hello"]\ntext = "Hello!"\n'
        "json = { greeting = true }\nconfidence = 0.5\n"
        '[[rule]]\nname = "json_only"\nany = ["bye"]\njson = { bye = 1 }\nconfidence = 0.5\n'
    )
    assert engine.answer({"op": "generate", "prompt": "hello"})["text"] == "Hello!"
    with_schema = {"op": "generate", "prompt": "hello", "json_schema": {}}
    assert engine.answer(with_schema)["text"] == '{"greeting":true}'
    assert engine.answer({"op": "generate", "prompt": "bye"})["text"] == '{"bye":1}'


def test_bad_requests_raise_protocol_errors() -> None:
    with pytest.raises(ProtocolError, match="not 'ping'"):
        ENGINE.answer({"op": "ping"})
    with pytest.raises(ProtocolError, match="prompt"):
        ENGINE.answer({"op": "generate"})
    with pytest.raises(ProtocolError, match="messages"):
        ENGINE.answer({"op": "chat", "messages": "lights on"})


def test_over_long_text_matches_nothing() -> None:
    assert ask("lights on " + "x" * MAX_MATCH_CHARS)["rule"] is None


def test_run_fits_the_worker_engine_seam() -> None:
    chunks: list[str] = []
    result = ENGINE.run({"op": "generate", "prompt": "STOP"}, threading.Event(), chunks.append)
    assert chunks == [result["text"]] == ['{"intent":"robot_stop"}']
    assert (ENGINE.kind, ENGINE.model) == ("rules", "rules:rules.toml")
    cancelled = threading.Event()
    cancelled.set()
    with pytest.raises(Cancelled):
        ENGINE.run({"op": "generate", "prompt": "STOP"}, cancelled, chunks.append)


# --------------------------------------------------------------------------- matchers


def test_keywords_match_on_word_boundaries() -> None:
    engine = engine_for(
        '[[rule]]\nname = "k"\nany = ["stop", "°c", "turn  on"]\ntext = "hit"\nconfidence = 1\n'
    )
    hits = ["Stop!", "robot, stop", "don't stop believing", "23°C", "turn\ton"]
    misses = ["stopwatch", "stops", "nonstopping", "return on"]
    assert [engine.answer({"op": "generate", "prompt": t})["rule"] for t in hits] == ["k"] * 5
    assert [engine.answer({"op": "generate", "prompt": t})["rule"] for t in misses] == [None] * 4


def test_all_and_none_keywords() -> None:
    engine = engine_for(
        '[[rule]]\nname = "k"\nall = ["red", "green"]\nnone = ["blue"]\n'
        'text = "hit"\nconfidence = 1\n'
    )
    match = engine.match
    assert match("green and red") is not None
    assert match("red only") is None
    assert match("red green blue") is None


def test_regex_named_groups_fill_templates() -> None:
    engine = engine_for(
        "[[rule]]\n"
        'name = "pair"\n'
        "regex = '''(?P<a>\\d+) (?:and (?P<b>\\w+))?'''\n"
        'text = "a={a} b={b} {{literal}}"\n'
        'json = { a = "{a:int}", b = "{b}", both = "{a}/{b}", list = ["{b}", "{a:number}"] }\n'
        "confidence = 0.7\n"
    )
    full = engine.match("12 and Foo")
    assert full is not None
    assert full.values == {"a": "12", "b": "foo"}  # captures come from the normalised text
    assert full.text == "a=12 b=foo {literal}"
    assert full.json == {"a": 12, "b": "foo", "both": "12/foo", "list": ["foo", 12]}
    partial = engine.match("7 items")
    assert partial is not None
    assert partial.text == "a=7 b= {literal}"
    assert partial.json == {"a": 7, "both": "7/", "list": [7]}  # absent group: key left out


def test_extract_is_optional_and_first_capture_wins() -> None:
    engine = engine_for(
        "[[rule]]\n"
        'name = "x"\n'
        'any = ["go"]\n'
        "extract = ['''(?P<n>\\d+)''', '''#(?P<n>\\w+)''', '''(?P<c>red|blue)''']\n"
        'json = { n = "{n}", c = "{c}" }\n'
        "confidence = 1\n"
    )
    assert engine.match("go 5 #abc")
    assert engine.answer({"op": "generate", "prompt": "go #abc 5"})["text"] == '{"n":"5"}'
    assert engine.answer({"op": "generate", "prompt": "go blue"})["text"] == '{"c":"blue"}'
    assert engine.answer({"op": "generate", "prompt": "go"})["text"] == "{}"


def test_unconvertible_capture_falls_through_to_the_next_rule() -> None:
    engine = engine_for(
        "[[rule]]\n"
        'name = "number"\n'
        "regex = '''set (?P<v>\\S+)'''\n"
        'json = { v = "{v:number}" }\n'
        "confidence = 1\n"
        "[[rule]]\n"
        'name = "anything"\n'
        'any = ["set"]\n'
        'text = "fallback"\n'
        "confidence = 0.1\n"
    )
    assert engine.answer({"op": "generate", "prompt": "set 4"})["rule"] == "number"
    assert engine.answer({"op": "generate", "prompt": "set warm"})["rule"] == "anything"


TELEMETRY = """
[[rule]]
name = "hot_and_on"
when = [
  { field = "sensor.temp", op = ">=", value = 30 },
  { field = "state", op = "==", value = "ON" },
]
capture = ["device", "sensor.unit"]
json = { alert = "hot", t = "{sensor.temp}", device = "{device}", unit = "{sensor.unit}" }
confidence = 1
[[rule]]
name = "kind_in"
when = [{ field = "kind", op = "in", value = ["door", "window", 3] }]
text = "kind {kind}"
confidence = 1
[[rule]]
name = "flag_missing"
when = [{ field = "flag", op = "exists", value = false }, { field = "n", op = "!=", value = 1 }]
text = "no flag, n={n}"
confidence = 1
[[rule]]
name = "low"
when = [{ field = "n", op = "<", value = 0 }]
text = "low"
confidence = 1
"""


@pytest.mark.parametrize(
    ("doc", "rule", "text"),
    [
        ({"sensor": {"temp": 30}, "state": "on", "device": "d1"}, "hot_and_on",
         '{"alert":"hot","t":30,"device":"d1"}'),
        ({"sensor": {"temp": 31.5, "unit": "C"}, "state": "On"}, "hot_and_on",
         '{"alert":"hot","t":31.5,"unit":"C"}'),  # JSON values keep their case and type
        ({"sensor": {"temp": 29.9}, "state": "on", "flag": 1}, None, ""),
        ({"sensor": {"temp": "31"}, "state": "on", "flag": 1}, None, ""),  # string, not number
        ({"sensor": 31, "state": "on", "flag": 1}, None, ""),  # path runs into a non-object
        ({"kind": "Window", "flag": 1}, "kind_in", "kind Window"),
        ({"kind": 3.0, "flag": 1}, "kind_in", "kind 3.0"),
        ({"kind": True, "flag": 1}, None, ""),  # booleans never equal numbers
        ({"n": 2}, "flag_missing", "no flag, n=2"),
        ({"n": 1}, None, ""),
        ({"flag": None, "n": -1}, "flag_missing", "no flag, n=-1"),  # null counts as missing
        ({"flag": 1, "n": -1}, "low", "low"),
        ({"flag": 1, "n": False}, None, ""),
    ],
)  # fmt: skip
def test_json_field_conditions(doc: dict[str, Any], rule: str | None, text: str) -> None:
    engine = engine_for(TELEMETRY)
    answer = engine.answer({"op": "generate", "prompt": json.dumps(doc)})
    assert answer["rule"] == rule
    if rule is not None:
        assert answer["text"] == text


@pytest.mark.parametrize("prompt", ["[1, 2]", '{"n": -1', "n is -1", '"{}"'])
def test_field_rules_need_a_json_object(prompt: str) -> None:
    assert engine_for(TELEMETRY).answer({"op": "generate", "prompt": prompt})["rule"] is None


# --------------------------------------------------------------------------- validation

RULE = 'name = "{name}"\nany = ["x"]\ntext = "y"\nconfidence = 0.5\n'
MATCHERS = ("any", "all", "regex", "when")


def second_rule(body: str) -> str:
    """A valid rule named "second" made invalid by ``body`` (a key it lacks is filled in)."""
    key = body.split("=")[0].strip()
    fill = "" if key in MATCHERS else 'all = ["x"]\n'
    fill += "" if key in ("text", "json") else 'text = "y"\n'
    return f'[[rule]]\nname = "second"\nconfidence = 0.5\n{fill}{body}\n'


def errors_of(toml: str) -> list[str]:
    with pytest.raises(RulesError) as info:
        loads_rules(toml, "bad.toml")
    assert isinstance(info.value, ConfigError)
    assert info.value.message.startswith(f"bad.toml: {len(info.value.errors)} error(s)")
    return list(info.value.errors)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('colour = "red"', "unknown key 'colour'"),
        ("regex = '(?P<room>kitchen'", "regex: RE2 cannot compile it: missing ): (?P<room>kitchen"),
        ("regex = '(?P<a b>x)'", "regex: RE2 cannot compile it: invalid named capture group"),
        # What needs backtracking is refused, with RE2's reason and what to do instead.
        ("regex = '(?<!not )on'",
         "regex: RE2 cannot compile it: invalid perl operator: (?<! (lookaround is not "
         "supported: use the rule's not_regex or none key, or match it)"),
        ("regex = 'on(?= now)'", "regex: RE2 cannot compile it: invalid perl operator: (?="),
        ("not_regex = '(?!x)'", "not_regex: RE2 cannot compile it: invalid perl operator: (?!"),
        ("extract = ['(?P<a>x)(?<=x)']", "extract[0]: RE2 cannot compile it: invalid perl"),
        ("regex = '(a)\\1'",
         "regex: RE2 cannot compile it: invalid escape sequence: \\1 (backreferences are not "
         "supported)"),
        ("regex = 'on\\Z'", "invalid escape sequence: \\Z (RE2 spells the end of the text \\z)"),
        ("regex = 'x{1001}'", "regex: RE2 cannot compile it: invalid repetition size: {1001}"),
        ("extract = ['(x)']", "extract[0]: has no named group (?P<name>...) to capture"),
        ("extract = '(?P<x>x)'", "extract: must be a non-empty array of regular expressions"),
        ('any = ["ok", ""]', "any[1]: must be a non-empty string"),
        ("all = []", "all: must be a non-empty array of strings"),
        ('json = { room = "{room}" }',
         "json: placeholder {room} is not captured by any matcher"),
        ('text = "in {place}"', "text: placeholder {place} is not captured by any matcher"),
        ('json = { t = "{t:celsius}" }', "json.t: {t:celsius}: unknown converter 'celsius'"),
        ('json = { t = "a { b" }', "json.t: lone '{' at position 2; write {{"),
        ('json = { t = "{-x}" }', "json.t: bad placeholder {-x}"),
        ('json = { t = 1979-05-27 }', "json.t: date values cannot appear in JSON"),
        ("json = [1]", "json: must be a table (a JSON object template)"),
        ('when = [{ field = "t", op = "=>", value = 1 }]', "when[0].op: must be one of"),
        ('when = [{ field = "t", op = ">", value = "30" }]',
         "when[0].value: must be a number for '>', got str"),
        ('when = [{ field = "t", op = ">" }]', "when[0].value: missing (required)"),
        ('when = [{ field = "t", op = "in", value = [] }]', "when[0].value: must be a non-empty"),
        ('when = [{ field = "t", op = "exists", value = 1 }]', "when[0].value: must be true"),
        ('when = [{ field = "a..b", op = "exists" }]', "when[0].field: must be a JSON field"),
        ('when = [{ field = "t", op = "==", value = 1, unit = "C" }]',
         "when[0]: unknown key 'unit'"),
        ('capture = ["ok", 3]', "capture[1]: must be a JSON field name"),
        ("description = 3", "description: must be a string, got int"),
        ("regex = ''", "regex: must be a non-empty string (an RE2 regular expression)"),
        ("capture = []", "capture: must be a non-empty array of JSON field names"),
        ("when = { field = 't' }", "when: must be a non-empty array of {field, op, value}"),
        ('when = [{ field = "t", op = "==", value = [1] }]',
         "when[0].value: must be a string, number or boolean, got list"),
        ("text = 3", "text: must be a string, got int"),
        ('text = "}"', "text: lone '}' at position 0; write }}"),
    ],
)  # fmt: skip
def test_validation_errors_name_rule_and_key(body: str, expected: str) -> None:
    errors = errors_of("[[rule]]\n" + RULE.format(name="first") + second_rule(body))
    assert len(errors) == 1, errors
    assert errors[0].startswith('rule #2 "second": ')
    assert expected in errors[0]


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        ('name = "c"\nany = ["x"]\ntext = "y"\nconfidence = 1.5',
         'rule #1 "c": confidence: must be in [0, 1], got 1.5'),
        ('name = "c"\nany = ["x"]\ntext = "y"\nconfidence = -0.1',
         'rule #1 "c": confidence: must be in [0, 1], got -0.1'),
        ('name = "c"\nany = ["x"]\ntext = "y"\nconfidence = true',
         'rule #1 "c": confidence: must be a number in [0, 1], got bool'),
        ('name = "c"\nany = ["x"]\ntext = "y"', 'rule #1 "c": confidence: missing (required)'),
        ('any = ["x"]\ntext = "y"\nconfidence = 1', "rule #1: name: missing (required)"),
        ('name = "has space"\nany = ["x"]\ntext = "y"\nconfidence = 1',
         'rule #1 "has space": name: must be 1-64 letters, digits or _ . : - and start with'),
        ('name = "c"\nnone = ["x"]\ntext = "y"\nconfidence = 1',
         'rule #1 "c": needs at least one matcher: any, all, regex or when'),
        ('name = "c"\nany = ["x"]\nconfidence = 1', 'rule #1 "c": needs a response'),
    ],
)  # fmt: skip
def test_rule_level_errors(rule: str, expected: str) -> None:
    errors = errors_of(f"[[rule]]\n{rule}\n")
    assert len(errors) == 1 and errors[0].startswith(expected), errors


def test_duplicate_names_and_every_error_are_reported() -> None:
    errors = errors_of(
        "[[rule]]\n" + RULE.format(name="a")
        + "[[rule]]\n" + RULE.format(name="b") + "regex = '('\n"
        + "[[rule]]\n" + RULE.format(name="a")
        + "[[rule]]\n" + RULE.format(name="d").replace("0.5", "2")
    )  # fmt: skip
    assert errors == [
        'rule #2 "b": regex: RE2 cannot compile it: missing ): (',
        'rule #3 "a": name: duplicate of rule #1',
        'rule #4 "d": confidence: must be in [0, 1], got 2',
    ]


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("", "no rules: the file defines no [[rule]] table"),
        ('rule = "x"', "'rule' must be an array of tables"),
        ("[[rule]]\n" + RULE.format(name="a") + "[extra]\nx = 1\n",
         "unknown top-level key 'extra'"),
        ("[no_match]\ncolour = 1\n[[rule]]\n" + RULE.format(name="a"),
         "no_match: unknown key 'colour'"),
        ("no_match = { json = [1] }\n[[rule]]\n" + RULE.format(name="a"),
         "no_match: json: must be a table"),
        ("[[rule]\n", "not valid TOML"),
        ('no_match = "none"\n[[rule]]\n' + RULE.format(name="a"),
         "no_match: must be a table with 'text' and/or 'json'"),
        ("no_match = { text = 1 }\n[[rule]]\n" + RULE.format(name="a"),
         "no_match: text: must be a string"),
    ],
)  # fmt: skip
def test_file_level_errors(toml: str, expected: str) -> None:
    errors = errors_of(toml)
    assert any(expected in e for e in errors), errors


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(RulesError, match="cannot read the file"):
        load_rules(tmp_path / "absent.toml")
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b'[[rule]]\nname = "caf\xe9"\n')
    with pytest.raises(RulesError, match="not UTF-8"):
        load_rules(latin1)


@pytest.mark.parametrize(
    ("op", "value", "field", "holds"),
    [
        (">", 30, 30.5, True), (">", 30, 30, False),
        (">=", 30, 30, True), (">=", 30, 29.9, False),
        ("<", 2, 1, True), ("<", 2, 2, False),
        ("<=", 2, 2, True), ("<=", 2, 2.1, False),
        ("<=", 2, True, False), ("<", 2, float("nan"), False), ("<", 2, "1", False),
        ("==", "on", "ON", True), ("==", 1, 1.0, True), ("==", 1, True, False),
        ("==", True, True, True), ("==", "1", 1, False),
        ("!=", "on", "off", True), ("!=", "on", "On", False),
        ("in", ("a", 2), "A", True), ("in", ("a", 2), 2.0, True), ("in", ("a", 2), "b", False),
        ("exists", True, 0, True), ("exists", False, 0, False),
    ],
)  # fmt: skip
def test_condition_operators(op: str, value: Any, field: Any, holds: bool) -> None:
    assert condition_holds(Condition("f", op, value), field_value({"f": field}, "f")) is holds


def test_conditions_on_missing_and_null_fields() -> None:
    missing = field_value({"a": {"b": 1}}, "a.c")
    for op, value in (("==", 1), ("!=", 1), (">", 0), ("in", (1,)), ("exists", True)):
        assert not condition_holds(Condition("a.c", op, value), missing)
        assert not condition_holds(Condition("a.c", op, value), None)
    assert condition_holds(Condition("a.c", "exists", False), missing)
    assert field_value({"a": {"b": 1}}, "a.b") == 1


@pytest.mark.parametrize(
    ("template", "value", "expected"),
    [
        ("{v}", "Kitchen", "Kitchen"), ("{v:lower}", "Kitchen", "kitchen"),
        ("{v:str}", 7, "7"), ("{v:str}", True, "true"), ("x{v}", 1.5, "x1.5"),
        ("{v:int}", "12", 12), ("{v:int}", 12, 12), ("{v:int}", 12.0, 12),
        ("{v:number}", "21", 21), ("{v:number}", "21,5", 21.5), ("{v:number}", ".5", 0.5),
        ("{v:number}", 3.25, 3.25), ("{v:number}", -4, -4),
    ],
)  # fmt: skip
def test_template_converters(template: str, value: Any, expected: Any) -> None:
    tree = parse_json_template({"k": template}, "json")
    assert render_json(tree, {"v": value}) == {"k": expected}


@pytest.mark.parametrize(
    ("template", "value"),
    [("{v:int}", "1.5"), ("{v:int}", 1.5), ("{v:int}", True), ("{v:number}", "warm"),
     ("{v:number}", False), ("{v:number}", [1])],
)  # fmt: skip
def test_template_converters_refuse(template: str, value: Any) -> None:
    with pytest.raises(Unconvertible):
        render_json(parse_json_template({"k": template}, "json"), {"v": value})


def test_template_escapes_and_whole_placeholders() -> None:
    assert parse_template("{{x}}").parts == ("{x}",)
    assert parse_template("{a:number}").whole is not None
    assert parse_template(" {a}").whole is None


# --------------------------------------------------------------------------- compare


def test_compare_json_field_by_field() -> None:
    c = compare_outputs(
        '{"intent":"lights_on","room":"kitchen"}', '{"room": " Kitchen ", "intent": "LIGHTS_ON"}'
    )
    assert (c.kind, c.agree, c.ratio, c.fields, c.disagree) == (
        "json",
        True,
        1.0,
        ("intent", "room"),
        (),
    )


def test_compare_json_disagreeing_and_missing_fields() -> None:
    c = compare_outputs(
        '{"intent":"thermostat_set","temperature_c":21,"room":"kitchen"}',
        '{"intent":"thermostat_set","temperature_c":21.0,"room":"bedroom","extra":1}',
    )
    assert c.kind == "json" and not c.agree
    assert c.disagree == ("extra", "room")
    assert c.ratio == 0.5
    assert c.to_dict() == {
        "kind": "json",
        "agree": False,
        "ratio": 0.5,
        "fields": ["extra", "intent", "room", "temperature_c"],
        "disagree": ["extra", "room"],
    }


def test_compare_json_types_nesting_and_lists() -> None:
    assert not compare_json({"on": True}, {"on": 1}).agree  # a boolean is not a number
    assert compare_json({"on": None}, {"on": None}).agree
    nested = compare_json({"a": {"b": 1, "c": "X"}}, {"a": {"b": 1, "c": "y"}})
    assert nested.fields == ("a.b", "a.c") and nested.disagree == ("a.c",)
    assert compare_json({"l": ["A", 1]}, {"l": ["a", 1.0]}).agree
    assert not compare_json({"l": [1, 2]}, {"l": [1]}).agree
    assert compare_json({"l": [{"A": "x"}]}, {"l": [{"A": " X"}]}).agree
    assert not compare_json({"l": [{"a": 1}]}, {"l": [{"b": 1}]}).agree
    assert compare_json({}, {}).ratio == 1.0


def test_compare_reads_fenced_model_json() -> None:
    model = '```json\n{"intent": "robot_stop"}\n```'
    assert compare_outputs('{"intent":"robot_stop"}', model).agree


def test_compare_text_and_mixed() -> None:
    same = compare_text("Turning on the lights.", "  turning ON the   lights. ")
    assert same.agree and same.ratio == 1.0 and same.kind == "text"
    partial = compare_text("the kitchen lights are on", "kitchen lights on")
    assert not partial.agree
    assert partial.ratio == pytest.approx(2 * (3 / 5) * 1.0 / (3 / 5 + 1.0))
    assert token_f1("", "") == 1.0 and token_f1("a", "") == 0.0 and token_f1("a", "b") == 0.0
    mixed = compare_outputs('{"intent":"lights_on"}', "The intent is lights_on")
    assert (mixed.kind, mixed.agree, mixed.disagree) == ("mixed", False, ("intent",))
    assert mixed.ratio == token_f1('{"intent":"lights_on"}', "The intent is lights_on")
    assert mixed.ratio == pytest.approx(2 / 3)  # precision 2/2, recall 2/4
    assert compare_outputs("[1, 2]", "[1, 2]").kind == "text"  # only objects are JSON here
    assert compare_outputs("{not json", "{not json").kind == "text"


def test_the_dual_run_evaluation_set_is_understood_and_not_a_prompt_example() -> None:
    from fallback.intents import EVAL_COMMANDS, INTENT_PROMPT

    engine = RuleEngine(load_rules(SHIPPED))
    for command in EVAL_COMMANDS:
        assert engine.match(command) is not None, command
        assert f"Q: {command}\n" not in INTENT_PROMPT
