"""``edgenode rules check|test`` through click's CliRunner (no node, no sockets)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from node.cli.rules import rules

SHIPPED = str(Path(__file__).resolve().parents[2] / "etc" / "rules.toml")


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(rules, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_check_counts_the_shipped_rules() -> None:
    code, out, err = run("check", SHIPPED)
    assert code == 0, err
    assert out == f"{SHIPPED}: 18 rules OK\n"


def test_check_prints_every_error_and_exits_1(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(
        '[[rule]]\nname = "a"\nregex = "(x"\ntext = "y"\nconfidence = 1\n'
        '[[rule]]\nname = "a"\nany = ["x"]\njson = { room = "{room}" }\nconfidence = 2\n'
    )
    code, out, err = run("check", str(bad))
    assert code == 1
    assert out == ""
    lines = err.splitlines()
    assert lines == [
        f"{bad}: 3 error(s)",
        '  rule #1 "a": regex: RE2 cannot compile it: missing ): (x',
        '  rule #2 "a": confidence: must be in [0, 1], got 2',
        '  rule #2 "a": name: duplicate of rule #1',
    ]


def test_check_missing_file_exits_1(tmp_path: Path) -> None:
    code, _, err = run("check", str(tmp_path / "absent.toml"))
    assert code == 1
    assert "cannot read the file" in err


def test_test_shows_rule_confidence_and_response() -> None:
    code, out, err = run("test", SHIPPED, "Turn on the kitchen lights")
    assert code == 0, err
    assert out.splitlines() == [
        "rule: lights_on",
        "confidence: 0.9",
        'response: {"intent":"lights_on","room":"kitchen"}',
    ]


def test_test_telemetry_and_no_match() -> None:
    _, out, _ = run("test", SHIPPED, '{"temperature_c": 35}')
    assert out.splitlines()[0] == "rule: telemetry_overheat"
    code, out, _ = run("test", SHIPPED, "don't stop believing")
    assert code == 0
    assert out.splitlines() == [
        "rule: (none: no rule matched)",
        "confidence: 0",
        'response: {"intent":"unknown"}',
    ]
    _, out, _ = run("test", "--no-schema", SHIPPED, "don't stop believing")
    assert out.splitlines()[-1] == "response: no rule matched"


def test_test_json_prints_the_whole_answer() -> None:
    code, out, _ = run("test", "--json", SHIPPED, "STOP")
    assert code == 0
    assert json.loads(out) == {
        "text": '{"intent":"robot_stop"}',
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 0, "completion_tokens": 0},
        "confidence": 0.95,
        "rule": "robot_stop",
    }


def test_test_with_an_invalid_file_exits_1(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[[rule]]\n")
    code, out, err = run("test", str(bad), "lights on")
    assert code == 1
    assert out == ""
    assert "rule #1: name: missing (required)" in err


def test_check_rejects_what_needs_backtracking_with_re2s_reason(tmp_path: Path) -> None:
    """Backreferences and lookaround need a backtracking engine (exponential time on a
    crafted text): RE2 refuses them, and so does ``check``, naming the rule and the key.
    Python's ``re`` accepted all of these."""
    bad = tmp_path / "redos.toml"
    bad.write_text(
        "[[rule]]\nname = \"twice\"\nregex = '''^(a+)+\\1$'''\ntext = \"x\"\nconfidence = 1\n"
        "[[rule]]\nname = \"not_after\"\nregex = '''(?<!don't )stop'''\ntext = \"x\"\n"
        "confidence = 1\n"
        "[[rule]]\nname = \"ahead\"\nregex = '''^(?=.*lights).*on'''\ntext = \"x\"\n"
        "confidence = 1\n"
        "[[rule]]\nname = \"units\"\nall = [\"move\"]\nnot_regex = '''\\d(?!m)'''\n"
        'text = "x"\nconfidence = 1\n'
    )
    code, out, err = run("check", str(bad))
    assert (code, out) == (1, "")
    lookaround = "(lookaround is not supported: use the rule's not_regex or none key, or match it)"
    assert err.splitlines() == [
        f"{bad}: 4 error(s)",
        '  rule #1 "twice": regex: RE2 cannot compile it: invalid escape sequence: \\1 '
        "(backreferences are not supported)",
        '  rule #2 "not_after": regex: RE2 cannot compile it: invalid perl operator: (?<! '
        + lookaround,
        f'  rule #3 "ahead": regex: RE2 cannot compile it: invalid perl operator: (?= {lookaround}',
        '  rule #4 "units": not_regex: RE2 cannot compile it: invalid perl operator: (?! '
        + lookaround,
    ]


def test_check_accepts_a_catastrophic_looking_pattern_re2_runs_in_linear_time(
    tmp_path: Path,
) -> None:
    redos = tmp_path / "redos.toml"
    redos.write_text("[[rule]]\nname = \"r\"\nregex = '''(a+)+$'''\ntext = \"x\"\nconfidence = 1\n")
    code, out, err = run("check", str(redos))
    assert (code, out, err) == (0, f"{redos}: 1 rule OK\n", "")
    code, out, _ = run("test", "--no-schema", str(redos), "a" * 4000 + "!")
    assert code == 0 and out.splitlines()[0] == "rule: (none: no rule matched)"
