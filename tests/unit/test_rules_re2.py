"""Rules cannot hurt the rule worker (issue 11): matching runs on RE2, in linear time.

Before, patterns ran on Python's backtracking ``re``: ``(a+)+$`` against "aaaa...!" took time
exponential in the text while holding the GIL (the rule worker stopped heartbeating and was
lost). Each test here hung or failed on that code (the first until pytest-timeout).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fallback.compare import compare_outputs
from fallback.engine import MAX_MATCH_CHARS, RuleEngine
from fallback.rules import loads_rules

REPO = Path(__file__).resolve().parents[2]


def engine_for(toml: str) -> RuleEngine:
    return RuleEngine(loads_rules(toml, "test.toml"))


REDOS = RuleEngine(
    loads_rules(
        "[[rule]]\nname = \"redos\"\nregex = '''(a+)+$'''\ntext = \"a\"\nconfidence = 1\n"
        "[[rule]]\nname = \"nested\"\nregex = '''^(\\w+\\s?)*$'''\nnone = [\"hello\"]\n"
        'text = "w"\nconfidence = 1\n'
        '[[rule]]\nname = "greeting"\nany = ["hello"]\ntext = "hi"\nconfidence = 1\n',
        "redos.toml",
    )
)


def test_catastrophic_looking_patterns_run_in_linear_time() -> None:
    # Exponential for a backtracking engine (every split of the a's, then "!" fails);
    # RE2 reads the text once. The longest text the rules read at all.
    text = "hello " + "a" * (MAX_MATCH_CHARS - 7) + "!"
    found = REDOS.match(text)
    assert found is not None and found.rule.name == "greeting"
    ends_in_a = REDOS.match("a" * MAX_MATCH_CHARS)
    assert ends_in_a is not None and ends_in_a.rule.name == "redos"
    words = "word " * (MAX_MATCH_CHARS // 5 - 1) + "!"  # ^(\w+\s?)*$ on words, then "!"
    assert REDOS.match(words) is None


def test_not_regex_vetoes_a_rule() -> None:
    engine = engine_for(
        "[[rule]]\nname = \"move\"\nregex = '''\\bmove\\s+(?P<d>\\d+)'''\n"
        "not_regex = '''\\d\\s*(?:cm|ft)\\b'''\n"
        'text = "{d} m"\nconfidence = 1\n'
    )
    assert engine.answer({"op": "generate", "prompt": "move 3 metres"})["text"] == "3 m"
    assert engine.answer({"op": "generate", "prompt": "Move 30 CM"})["rule"] is None
    assert engine.answer({"op": "generate", "prompt": "move 3ft"})["rule"] is None


def test_keyword_boundaries_are_unicode_letters_and_digits() -> None:
    engine = engine_for(
        '[[rule]]\nname = "k"\nany = ["été", "fermer", "°c", "n°"]\ntext = "hit"\nconfidence = 1\n'
    )
    hits = ["l'été", "ÉTÉ!", "fermer la porte", "21°C", "n° 5"]
    misses = ["étés", "préété", "refermer", "fermeré", "un°"]
    assert [engine.match(t) is not None for t in hits] == [True] * len(hits)
    assert [engine.match(t) is not None for t in misses] == [False] * len(misses)


def test_deeply_nested_json_is_no_telemetry_and_no_error() -> None:
    engine = engine_for(
        '[[rule]]\nname = "hot"\nwhen = [{ field = "t", op = ">", value = 30 }]\n'
        'text = "hot"\nconfidence = 1\n'
    )
    deep = '{"t": 40, "x": ' + "[" * 4000 + "]" * 4000 + "}"
    assert len(deep) <= MAX_MATCH_CHARS
    answer = engine.answer({"op": "generate", "prompt": deep})
    assert answer["rule"] is None and answer["text"] == "no rule matched"


def test_without_re2_the_rules_fail_loudly_instead_of_using_re() -> None:
    code = "import sys; sys.modules['re2'] = None; import fallback.rules"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30
    )
    assert done.returncode != 0
    assert "ImportError: the rule engine needs RE2" in done.stderr
    assert "pip install google-re2" in done.stderr


def test_comparing_a_fenced_whitespace_run_is_linear() -> None:
    """Dual/shadow runs compare the model's output with the rules' in the broker's loop
    (the migration log). The code-fence regex backtracked in cubic time on a fence then a
    whitespace run (4,000 spaces: 78 s): this hung until pytest-timeout."""
    model = "```json" + " " * 20_000 + '{"intent": "robot_stop"}' + "\n" * 5_000 + "x"
    assert compare_outputs('{"intent":"robot_stop"}', model).kind == "mixed"
    fenced = "```json" + " " * 20_000 + '{"intent": "robot_stop"}' + "\n" * 5_000 + "```"
    assert compare_outputs('{"intent":"robot_stop"}', fenced).agree
