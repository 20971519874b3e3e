"""The JSON Schema of the default rule set's answers (``etc/rules.toml``).

A client that wants comparable answers from both engines sends ``INTENT_SCHEMA`` as the
request's ``json_schema``: the llama worker then constrains the model to it (a llama.cpp
grammar), and the rules answer with objects of the same shape, so shadow and dual runs can
compare them field by field (``fallback.compare``). Every enum below lists exactly the
values the default rules produce; a test keeps the two in step.

The schema uses only what llama.cpp's JSON-Schema-to-grammar converter supports: ``object``
with ``properties``/``required``/``additionalProperties: false``, ``string`` enums and
``number``.

The schema fixes the shape, not the meaning: a model also needs to be told which intent a
command is. ``INTENT_PROMPT`` is a few-shot system message for that (``INTENT_EXAMPLES``,
each exactly what the default rules answer).
"""

from __future__ import annotations

import json
from typing import Any

INTENTS = (
    "lights_on", "lights_off", "thermostat_set", "door_lock", "door_unlock", "robot_move",
    "robot_stop", "robot_dock", "status_query", "alert", "unknown",
)  # fmt: skip
ROOMS = (
    "kitchen", "living room", "bedroom", "bathroom", "hallway", "office", "garage",
    "dining room",
)  # fmt: skip
DOORS = ("front", "back", "garage", "patio", "side")
DIRECTIONS = ("forward", "backward", "left", "right")
#: What a ``status_query`` asks about.
TARGETS = ("battery", "door", "temperature", "lights")
#: What an ``alert`` (from telemetry) reports.
ALERTS = ("overheat", "freezing", "low_battery")


def _enum(values: tuple[str, ...]) -> dict[str, Any]:
    return {"type": "string", "enum": list(values)}


INTENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "intent": _enum(INTENTS),
        "room": _enum(ROOMS),
        "temperature_c": {"type": "number"},
        "door": _enum(DOORS),
        "direction": _enum(DIRECTIONS),
        "distance_m": {"type": "number"},
        "target": _enum(TARGETS),
        "alert": _enum(ALERTS),
        "battery_pct": {"type": "number"},
        "device": {"type": "string"},
    },
    "required": ["intent"],
    "additionalProperties": False,
}


def intent_errors(obj: Any, schema: dict[str, Any] = INTENT_SCHEMA) -> list[str]:
    """What makes ``obj`` invalid for ``schema`` (empty when valid).

    Checks the subset of JSON Schema that ``INTENT_SCHEMA`` uses: an object, required keys,
    no extra keys, string enums and numbers (booleans are not numbers). Useful to count how
    often the model's constrained output is still off-schema.
    """
    if not isinstance(obj, dict):
        return [f"not an object: {type(obj).__name__}"]
    props: dict[str, Any] = schema.get("properties", {})
    errors = [f"missing required {k!r}" for k in schema.get("required", []) if k not in obj]
    for key, value in obj.items():
        spec = props.get(key)
        if spec is None:
            if schema.get("additionalProperties", True) is False:
                errors.append(f"unexpected field {key!r}")
            continue
        if spec.get("type") == "number":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                errors.append(f"{key}: {value!r} is not a number")
        elif spec.get("type") == "string" and not isinstance(value, str):
            errors.append(f"{key}: {value!r} is not a string")
        elif "enum" in spec and value not in spec["enum"]:
            errors.append(f"{key}: {value!r} is not one of {spec['enum']}")
    return errors


#: Few-shot examples for ``INTENT_PROMPT``: (command, the default rules' answer). One or two
#: per intent family, worded unlike the commands a test or benchmark asks, so agreement
#: measures understanding rather than copying.
INTENT_EXAMPLES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("switch on the lights in the bathroom", {"intent": "lights_on", "room": "bathroom"}),
    ("turn off the office lights", {"intent": "lights_off", "room": "office"}),
    ("set the heating to 19 degrees", {"intent": "thermostat_set", "temperature_c": 19}),
    ("lock the patio door", {"intent": "door_lock", "door": "patio"}),
    ("unlock the garage door", {"intent": "door_unlock", "door": "garage"}),
    ("drive backward 3 meters",
     {"intent": "robot_move", "direction": "backward", "distance_m": 3}),
    ("turn right", {"intent": "robot_move", "direction": "right"}),
    ("robot, halt", {"intent": "robot_stop"}),
    ("head back to the charging station", {"intent": "robot_dock"}),
    ("how much battery is left?", {"intent": "status_query", "target": "battery"}),
    ("is the garage door locked?",
     {"intent": "status_query", "target": "door", "door": "garage"}),
)  # fmt: skip

#: System message of a chat request that asks a model for the rules' intents (send it with
#: ``json_schema=INTENT_SCHEMA``). Written for base models too: the node renders chat for a
#: model without a chat template as a plain "Q: ... / A: ..." transcript under the system
#: message, which these examples continue. Measured with the default Gemma 3 270M (base,
#: temperature 0): 7 of 12 commands of the default rule set answered exactly as the rules,
#: 8 of 12 with the same intent.
INTENT_PROMPT = (
    "Translate each smart-home or robot command into a JSON intent. "
    "Use only the fields the command mentions.\n\n"
    + "\n".join(
        f"Q: {command}\nA: {json.dumps(answer, separators=(',', ':'))}"
        for command, answer in INTENT_EXAMPLES
    )
)


#: A fixed evaluation set for dual-run agreement: commands of the default rule set,
#: none of them an example of ``INTENT_PROMPT`` (used by the real-model dual test and
#: scripts/bench_shadow.py, so their figures compare).
EVAL_COMMANDS = [
    "Turn on the kitchen lights",
    "Turn off the bedroom lights.",
    "Set the thermostat to 21 degrees",
    "Lock the front door",
    "please unlock the back door",
    "move forward 2 meters",
    "turn left",
    "stop the robot now",
    "return to base",
    "what's the battery level?",
]
