"""The capacity plan's grammar allowance: one filter call's candidates x GRAMMAR_BYTES_PER_TOKEN
and GRAMMAR_STATE_BYTES per slot, per worker, in
the per-worker estimate, memory.max and memory.high, the refusal, the CLI line and --json;
none for the test engine or for sizes given by hand; n_vocab read from the GGUF header."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFWriter

from broker.errors import ConfigError
from capacitykit import config, with_layout
from node.capacity.gguf import ModelMeta, read_gguf_meta
from node.capacity.plan import (
    GRAMMAR_BYTES_PER_TOKEN,
    GRAMMAR_STATE_BYTES,
    PAGE,
    Plan,
    breakdown,
    check_fits,
    config_plan,
    grammar_allowance,
)
from node.cli.capacity import capacity

MiB, GiB = 1 << 20, 1 << 30
GEMMA_VOCAB = 262_144
#: The default model's allowance for one slot: 512 candidates x 704 B + 2 MiB, 2.3 MiB.
GRAMMAR_1 = 512 * 704 + 2 * MiB


def test_the_allowance_is_one_filter_calls_candidates_and_a_grammar_per_slot() -> None:
    assert grammar_allowance(0) == 0  # no vocabulary, no grammar
    assert grammar_allowance(300) == 300 * GRAMMAR_BYTES_PER_TOKEN + GRAMMAR_STATE_BYTES
    assert grammar_allowance(GEMMA_VOCAB) == GRAMMAR_1  # node.engine.GRAMMAR_CHUNK = 512
    assert grammar_allowance(GEMMA_VOCAB, slots=4) == GRAMMAR_1 + 3 * GRAMMAR_STATE_BYTES


def test_every_worker_of_the_default_model_plans_the_allowance(gemma: ModelMeta) -> None:
    plan, meta = config_plan(config())
    assert meta is not None and meta.n_vocab == plan.n_vocab == GEMMA_VOCAB
    assert plan.grammar == GRAMMAR_1
    per_worker = 36 * MiB + 120 * MiB + GRAMMAR_1  # KV + runtime + grammar
    assert plan.per_worker == per_worker
    assert plan.memory_max == math.ceil(per_worker * 1.1 / PAGE) * PAGE
    assert plan.memory_high == math.ceil(per_worker * 1.05 / PAGE) * PAGE
    assert plan.total == gemma.weights_bytes + 2 * per_worker


def test_the_allowance_does_not_depend_on_context_or_kv_type(gemma: ModelMeta) -> None:
    small, _ = config_plan(config(model={"n_ctx": 512, "kv_type": "q8_0"}))
    large, _ = config_plan(config(model={"n_ctx": 8192}))
    assert small.grammar == large.grammar == GRAMMAR_1


def test_the_test_engine_and_sizes_by_hand_plan_no_grammar() -> None:
    plan = check_fits(config(workers={"engine": "test"}, model={"path": "/nonexistent.gguf"}))
    assert plan.grammar == 0 and plan.per_worker == 88 * MiB
    by_hand = Plan(budget=8 * GiB, reserve=GiB, weights=GiB, kv_per_seq=256 * MiB, workers=2)
    assert by_hand.grammar == 0 and by_hand.per_worker == 256 * MiB
    assert "grammar" not in breakdown(by_hand)


def test_a_limit_that_holds_kv_and_runtime_but_not_the_grammar_is_refused(
    gemma: ModelMeta,
) -> None:
    # 157 MiB holds KV and runtime (156 MiB); the grammar's 2.3 MiB does not fit.
    with pytest.raises(ConfigError) as info:
        check_fits(config(workers={"memory_max": "157M"}))
    message = info.value.message
    assert "workers.memory_max 157 MiB is below the 158.3 MiB one worker needs" in message
    assert "(KV 1 x 36 MiB + runtime 120 MiB + grammar 2.3 MiB)" in message


def test_the_cli_prints_the_grammar_line_and_json_fields(tmp_path: Path, gemma: ModelMeta) -> None:
    path = tmp_path / "edgenode.toml"
    path.write_text(with_layout('[capacity]\nmemory_budget = "8G"\nruntime_overhead = "88M"\n'))
    text = CliRunner().invoke(capacity, [], obj={"config": str(path)})
    assert text.exit_code == 0, text.output
    assert (
        f"grammar     512 candidate tokens x {GRAMMAR_BYTES_PER_TOKEN} B + 1 x 2 MiB = 2.3 MiB"
        " per worker" in text.output
    )
    per_worker = "per worker  KV 1 x 36 MiB + runtime 120 MiB + grammar 2.3 MiB = 158.3 MiB"
    assert per_worker in text.output
    data = json.loads(CliRunner().invoke(capacity, ["--json"], obj={"config": str(path)}).output)
    assert (data["grammar"], data["n_vocab"]) == (GRAMMAR_1, GEMMA_VOCAB)
    assert data["per_worker"] == 36 * MiB + 120 * MiB + GRAMMAR_1


def write_gguf(path: Path, vocab: int | None) -> Path:
    """A tiny llama GGUF with ``vocab`` tokens (None: no tokenizer at all)."""
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_head_count(2)
    if vocab is not None:
        w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_tensor("a", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(("vocab", "expected"), [(5000, 5000), (12, 12), (None, 0)])
def test_the_reader_counts_the_vocabulary_without_keeping_it(
    tmp_path: Path, vocab: int | None, expected: int
) -> None:
    assert read_gguf_meta(write_gguf(tmp_path / "v.gguf", vocab)).n_vocab == expected
