"""``workers.slots``: S sequences per worker in the capacity plan (S x KV, the runtime and
the grammar allowance once per worker), "auto" sized from the plan and the threads, the
refusal's knobs, ``edgenode capacity --slots``, and the slots the pool hands its workers."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from broker.errors import ConfigError
from capacitykit import TEXTBOOK, GiB, MiB, config, run_cli
from node.capacity.gguf import ModelMeta
from node.capacity.plan import (
    AUTO_SLOTS_PER_THREAD,
    PAGE,
    Plan,
    auto_slots,
    breakdown,
    check_fits,
    config_plan,
    resolve_slots,
)
from node.cli.capacity import slots_setting
from node.config import MAX_SLOTS, from_dict
from node.pool import RULES_WORKER, WorkerPool
from node.sandbox.cgroups import limits_for

#: Slots per thread x ``workers.threads``, whatever cores the test host has.
pytestmark = pytest.mark.usefixtures("many_cores")

#: The default model's worker, one slot: KV 36 MiB + runtime 120 MiB + grammar 2.3 MiB.
KV, RUNTIME = 36 * MiB, 120 * MiB


def grammar(slots: int) -> int:
    """The default model's grammar allowance (``grammar_allowance``): one filter call's
    512 candidates at 704 B, once, and 2 MiB per slot for its grammar."""
    return 512 * 704 + slots * 2 * MiB


def echo_engine(**workers: Any) -> Any:
    """The test engine (no model, no KV: only the runtime is planned)."""
    return config(workers={"engine": "test", **workers}, model={"path": "/nonexistent.gguf"})


def page_up(n: float) -> int:
    return math.ceil(n / PAGE) * PAGE


# ---------------------------------------------------------------- the arithmetic


SLOT = 262_144 * 16  # the default model's vocabulary x SLOT_BYTES_PER_TOKEN


def test_a_worker_pays_kv_and_a_grammar_per_slot_and_the_runtime_once(gemma: ModelMeta) -> None:
    one, _ = config_plan(config())
    four, _ = config_plan(config(workers={"slots": 4}))
    assert one.slots == 1 and four.slots == 4
    assert four.kv_per_seq == one.kv_per_seq == KV  # per slot: model.n_ctx cells each
    assert four.kv_per_worker == 4 * KV
    assert one.runtime_per_worker == RUNTIME
    # Each slot beyond the first: a logits row and a candidate array, 16 B per token.
    assert four.runtime_per_worker == RUNTIME + 3 * SLOT == RUNTIME + 12 * MiB
    # The filter's candidates once per worker (one slot at a time), a grammar per slot.
    assert (one.grammar, four.grammar) == (grammar(1), grammar(4))
    per_worker = 4 * KV + RUNTIME + 3 * SLOT + grammar(4)
    assert four.per_worker == per_worker == int(284.34375 * MiB)
    assert four.per_worker - one.per_worker == 3 * (KV + SLOT + 2 * MiB)
    assert four.memory_max == page_up(per_worker * 1.1)
    assert four.total == gemma.weights_bytes + 2 * per_worker


def test_sequences_are_workers_times_slots_and_fits_safe_counts_workers() -> None:
    plan = Plan(budget=8 * GiB, reserve=GiB, weights=GiB, kv_per_seq=256 * MiB, workers=3, slots=4)
    assert plan.sequences == 12
    assert plan.per_worker == GiB  # 4 x 256 MiB, no runtime by hand
    assert plan.left == 6 * GiB
    assert plan.fits_before_margin == 6  # workers of 4 slots: 24 sequences
    assert plan.fits_safe == 5  # 6 GiB / 1.1 GiB
    assert plan.fits
    assert not dataclasses.replace(plan, workers=6).fits


def test_four_slots_in_one_worker_cost_less_than_half_of_four_workers(gemma: ModelMeta) -> None:
    # The memory target of issue 10, as planned: 4 sequences in one worker against 4 workers.
    four_workers, _ = config_plan(config(workers={"count": 4}))
    one_worker, _ = config_plan(config(workers={"count": 1, "slots": 4}))
    assert four_workers.sequences == one_worker.sequences == 4
    workers_side = four_workers.total - four_workers.shared_weights
    slots_side = one_worker.total - one_worker.shared_weights
    assert slots_side == 4 * KV + RUNTIME + 3 * SLOT + grammar(4)
    assert workers_side == 4 * (KV + RUNTIME + grammar(1))
    assert slots_side <= workers_side / 2  # 284.3 against 633.4 MiB


@pytest.mark.parametrize("slots", [0, -1, MAX_SLOTS + 1])
def test_a_plan_refuses_slots_outside_1_to_64(slots: int) -> None:
    with pytest.raises(ConfigError, match=r"workers\.slots must be in \[1, 64\]"):
        Plan(budget=GiB, reserve=0, weights=0, kv_per_seq=MiB, workers=1, slots=slots)


def test_the_json_fields_carry_slots_and_sequences() -> None:
    data = Plan(budget=GiB, reserve=0, weights=0, kv_per_seq=MiB, workers=2, slots=3).as_dict()
    assert (data["slots"], data["sequences"], data["kv_per_worker"]) == (3, 6, 3 * MiB)
    assert data["per_worker"] == 3 * MiB


def test_the_breakdown_shows_slots_times_kv() -> None:
    plan = Plan(budget=GiB, reserve=0, weights=0, kv_per_seq=36 * MiB, workers=1, slots=4)
    assert breakdown(plan) == "KV 4 x 36 MiB + runtime 0 B"


# ---------------------------------------------------------------- "auto"


@pytest.mark.parametrize(("threads", "slots"), [(1, 4), (2, 8), (3, 12), (16, 64), (40, 64)])
def test_auto_without_kv_is_four_slots_per_thread_capped_at_64(threads: int, slots: int) -> None:
    cfg = echo_engine(slots="auto", threads=threads)
    assert AUTO_SLOTS_PER_THREAD == 4
    assert resolve_slots(cfg) == slots == config_plan(cfg)[0].slots


def test_auto_counts_the_threads_a_worker_really_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # workers.cpus = [1]: both workers share core 1 and run one thread each
    # (status's THR 1), whatever workers.threads allows.
    monkeypatch.setattr("node.sandbox.cores.allowed_cores", lambda: (0, 1, 2, 3))
    cfg = echo_engine(count=2, slots="auto", threads=2, cpus=[1], sandbox="off")
    assert resolve_slots(cfg) == 4 == config_plan(cfg)[0].slots
    pool = WorkerPool(cfg, "test", None, tmp_path)
    assert [(s.engine.threads, s.slots) for s in pool.specs] == [(1, 4), (1, 4)]
    assert slots_setting(cfg, workers=2) == (
        'workers.slots = "auto": the most that fit, at most 4 per thread x 1 thread(s)'
    )
    toml = '[workers]\nengine = "test"\nslots = "auto"\nthreads = 2\ncpus = [1]\n'
    result = run_cli(tmp_path, "--memory", "8G", "--weights", "0", "--kv-per-seq", "1M", toml=toml)
    assert result.exit_code == 0, result.output
    assert "x 4 slots" in result.output and "at most 4 per thread x 1 thread(s)" in result.output


def test_auto_is_the_most_slots_that_fit_the_budget(gemma: ModelMeta) -> None:
    # 1780M - 1G reserve - 235.2 MiB weights = 520.8 MiB for 2 workers. Each worker's
    # memory.max: 2 slots (72 + 124 + 4.3) x 1.1 = 220.4 MiB (x 2 = 440.8 fits); 3 slots
    # (108 + 128 + 6.3) x 1.1 = 266.6 MiB (x 2 = 533.1 does not).
    cfg = config(workers={"slots": "auto", "threads": 2}, capacity={"memory_budget": "1780M"})
    plan = check_fits(cfg)
    assert resolve_slots(cfg) == plan.slots == 2
    assert plan.per_worker == 2 * KV + RUNTIME + SLOT + grammar(2) and plan.sequences == 4
    assert not config_plan(cfg, slots=3)[0].fits
    # One worker instead of two leaves room for the cap, 4 per thread x 2 threads.
    assert resolve_slots(cfg, workers=1) == 8


def test_auto_keeps_one_slot_when_nothing_fits_and_start_refuses(gemma: ModelMeta) -> None:
    cfg = config(workers={"slots": "auto"}, capacity={"memory_budget": "1500M"})
    assert resolve_slots(cfg) == 1
    with pytest.raises(ConfigError, match=r"2 worker\(s\) do not fit"):
        check_fits(cfg)


def test_auto_keeps_a_worker_within_a_fixed_memory_max(gemma: ModelMeta) -> None:
    # 16 slots would fit 8G, but 42 MiB x S + 116.3 MiB <= 600 MiB only up to S = 11.
    fixed = config(workers={"slots": "auto", "threads": 4, "memory_max": "600M"})
    assert resolve_slots(fixed) == 11
    check_fits(fixed)  # and start accepts it
    planned = config(workers={"slots": "auto", "threads": 4, "memory_max": "auto"})
    assert resolve_slots(planned) == 16


def test_auto_slots_stops_at_the_first_plan_that_fails() -> None:
    asked: list[int] = []

    def plan_for(s: int) -> Plan:
        asked.append(s)
        return Plan(budget=10 * GiB, reserve=0, weights=0, kv_per_seq=GiB, workers=2, slots=s)

    # 2 workers x 4 GiB x 1.1 = 8.8 GiB fits 10 GiB; 5 slots (11 GiB) does not.
    assert auto_slots(plan_for, 64).slots == 4
    assert asked == [1, 2, 3, 4, 5]
    assert auto_slots(plan_for, 3).slots == 3
    assert auto_slots(plan_for, 64, limit=2 * GiB).slots == 2


def test_an_integer_is_taken_as_it_is_without_reading_the_model() -> None:
    cfg = config(workers={"slots": 3}, model={"path": "/nonexistent.gguf"})
    assert resolve_slots(cfg) == 3
    assert resolve_slots(cfg, slots=5) == 5
    with pytest.raises(ConfigError):  # "auto" needs the model's sizes
        resolve_slots(cfg, slots="auto")


# ---------------------------------------------------------------- refusals name the slots


def test_a_refusal_says_slots_and_suggests_fewer(gemma: ModelMeta) -> None:
    # 2G - 1G - 235.2 MiB = 788.8 MiB: two 1-slot workers (2 x 174.2 MiB) fit, two of
    # 8 slots (2 x 497.6 MiB) do not.
    with pytest.raises(ConfigError) as info:
        check_fits(config(workers={"slots": 8}, capacity={"memory_budget": "2G"}))
    message = info.value.message
    assert "2 worker(s) of 8 slots do not fit" in message
    assert "(KV 8 x 36 MiB + runtime 148 MiB + grammar 16.3 MiB)" in message
    assert "workers.count = 1 (--workers)" in message
    assert "workers.slots = 5 (--slots; fewer sequences per worker)" in message
    assert check_fits(config(workers={"slots": 1}, capacity={"memory_budget": "2G"}))


def test_a_one_slot_refusal_does_not_suggest_slots(gemma: ModelMeta) -> None:
    with pytest.raises(ConfigError) as info:
        check_fits(config(workers={"count": 3}, capacity={"memory_budget": "1700M"}))
    assert "3 worker(s) do not fit" in info.value.message
    assert "workers.slots" not in info.value.message


def test_a_fixed_limit_below_a_multi_slot_worker_names_the_slots(gemma: ModelMeta) -> None:
    with pytest.raises(ConfigError) as info:
        check_fits(config(workers={"slots": 8, "memory_max": "400M"}))
    message = info.value.message
    assert "workers.memory_max 400 MiB is below the 452.3 MiB one worker needs" in message
    assert "or lower model.n_ctx or workers.slots (now 8)" in message


def test_the_planned_cgroup_limit_follows_the_slots(gemma: ModelMeta) -> None:
    cfg = config(workers={"slots": 4, "memory_max": "auto"})
    plan = check_fits(cfg)
    limits = limits_for(cfg.workers, plan=plan)
    per_worker = 4 * KV + RUNTIME + 3 * SLOT + grammar(4)
    assert limits.memory_max == plan.memory_max == page_up(per_worker * 1.1)
    assert limits.memory_high == plan.memory_high == page_up(per_worker * 1.05)


# ---------------------------------------------------------------- edgenode capacity --slots


MODEL_TOML = '[capacity]\nmemory_budget = "8G"\nruntime_overhead = "88M"\n'


def test_cli_shows_workers_times_slots(tmp_path: Path, gemma: ModelMeta) -> None:
    result = run_cli(tmp_path, "--slots", "4", toml=MODEL_TOML)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "layout      2 worker(s) x 4 slots = 8 sequences (workers.slots = 4)" in out
    assert "per worker  KV 4 x 36 MiB + runtime 132 MiB + grammar 8.3 MiB = 284.3 MiB" in out
    # The runtime line adds up: overhead + scratch + each further slot's logits and candidates.
    runtime = "runtime     88 MiB overhead + 32 MiB attention scratch + 3 x 4 MiB per further slot"
    assert runtime in out
    assert "= 132 MiB per worker" in out
    assert "for 2 worker(s) x 4 slots = 8 sequences" in out
    assert "verdict     OK: 2 worker(s) asked, 22 fit (of 4 slots each)" in out
    data = json.loads(run_cli(tmp_path, "--slots", "4", "--json", toml=MODEL_TOML).output)
    per_worker = 4 * KV + RUNTIME + 3 * SLOT + grammar(4)
    assert (data["slots"], data["sequences"], data["per_worker"]) == (4, 8, per_worker)


def test_cli_slots_auto_from_the_config(tmp_path: Path, gemma: ModelMeta) -> None:
    toml = MODEL_TOML + '[workers]\nslots = "auto"\nthreads = 2\n'
    result = run_cli(tmp_path, toml=toml)
    assert result.exit_code == 0, result.output
    assert (
        'layout      2 worker(s) x 8 slots = 16 sequences (workers.slots = "auto": the most '
        "that fit, at most 4 per thread x 2 thread(s))"
    ) in result.output
    assert json.loads(run_cli(tmp_path, "--json", toml=toml).output)["slots"] == 8


def test_cli_slots_with_sizes_by_hand(tmp_path: Path) -> None:
    two = run_cli(tmp_path, *TEXTBOOK, "--slots", "2")
    assert two.exit_code == 0, two.output
    assert "per worker  KV 2 x 256 MiB + runtime 0 B = 512 MiB" in two.output
    assert "4 worker(s) x 2 slots = 8 sequences before the margin" in two.output
    # "auto": 2 workers x 4 slots x 256 MiB x 1.1 = 2.2 GiB fits the 2.3 GiB left; with
    # 3 workers, 2 slots (1.65 GiB) fit and 3 (2.5 GiB) do not.
    auto = json.loads(run_cli(tmp_path, *TEXTBOOK, "--slots", "auto", "--json").output)
    assert auto["slots"] == 4 and auto["fits"]
    three = json.loads(
        run_cli(tmp_path, *TEXTBOOK, "--slots", "auto", "--workers", "3", "--json").output
    )
    assert three["slots"] == 2 and three["sequences"] == 6


def test_cli_a_plan_that_does_not_fit_suggests_fewer_slots(tmp_path: Path) -> None:
    result = run_cli(tmp_path, *TEXTBOOK, "--slots", "8", "--json")
    assert result.exit_code == 1
    data = json.loads(result.output)
    assert not data["fits"] and data["fits_safe"] == 1
    assert "workers.slots = 4 (--slots; fewer sequences per worker)" in data["advice"]


@pytest.mark.parametrize("bad", ["0", "65", "many", "2.5"])
def test_cli_rejects_bad_slots(tmp_path: Path, bad: str) -> None:
    result = run_cli(tmp_path, *TEXTBOOK, "--slots", bad)
    assert result.exit_code == 2
    assert "Invalid value for '--slots'" in result.output and "[1, 64]" in result.output


# ---------------------------------------------------------------- the pool


def test_the_pool_gives_model_workers_the_slots_and_the_rule_worker_one(tmp_path: Path) -> None:
    cfg = from_dict({"workers": {"count": 2, "slots": 3, "sandbox": "off"}})
    pool = WorkerPool(cfg, "model.gguf", "rules.toml", tmp_path)
    slots = {s.worker_id: (s.slots, s.engine.slots) for s in pool.specs}
    assert slots == {"llm-0": (3, 3), "llm-1": (3, 3), RULES_WORKER: (1, 1)}


def test_the_pool_takes_the_plans_resolved_slots(tmp_path: Path) -> None:
    cfg = echo_engine(count=1, slots="auto", sandbox="off", threads=2)
    plan = check_fits(cfg)
    assert plan.slots == 8
    pool = WorkerPool(cfg, "test", None, tmp_path, plan, slots=plan.slots)
    assert [(s.slots, s.engine.slots) for s in pool.specs] == [(8, 8)]
    # Without the plan's count, the pool resolves "auto" the same way.
    assert WorkerPool(cfg, "test", None, tmp_path).slots == 8
