"""Capacity model: the textbook example, the default model's real metadata, KV byte math,
padding, shared vs private weights, refusals that name the knob, the budget from fake
cgroup trees (v2, v1, hybrid, nested, container mounts), and the CLI."""

from __future__ import annotations

import dataclasses
import json
import os
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from broker.errors import ConfigError
from capacitykit import TEXTBOOK, GiB, MiB, cgroup_memory_limit, config, fake_host, run_cli
from node.capacity.gguf import ModelMeta, read_gguf_meta
from node.capacity.plan import (
    Plan,
    advice,
    attention_scratch,
    bytes_per_element,
    check_fits,
    config_plan,
    kv_bytes_per_token,
    kv_cells,
)
from node.config import from_dict
from node.engine import FLASH_PROMPT_ROWS
from node.sandbox.cgroupfs import Host
from node.units import parse_size


def textbook(**changes: Any) -> Plan:
    args: dict[str, Any] = {
        "budget": parse_size("8G"),
        "reserve": parse_size("1.5G"),
        "weights": parse_size("4.2G"),
        "kv_per_seq": parse_size("256M"),
        "workers": 2,
    }
    return Plan(**(args | changes))


# ---------------------------------------------------------------- the textbook example


def test_textbook_example_leaves_2_3_gib_and_fits_9_sequences_before_the_margin() -> None:
    plan = textbook()
    assert abs(plan.left - 2.3 * GiB) < 1  # 8 - 4.2 - 1.5, in GiB
    assert plan.fits_before_margin == 9  # 2.3 GiB / 256 MiB = 9.2
    assert plan.fits_safe == 8  # each budgeted at 256 MiB x 1.1 = 281.6 MiB
    assert plan.runtime_per_worker == 0
    assert plan.total == parse_size("4.2G") + 2 * 256 * MiB
    assert plan.fits


def test_sizes_are_binary_which_is_what_makes_the_example_come_out_at_9() -> None:
    assert parse_size("8G") == 8 * GiB and parse_size("256M") == 256 * MiB
    si_left = 8e9 - 4.2e9 - 1.5e9
    assert int(si_left // 256e6) == 8  # in SI units the same numbers would give 8


def test_limits_follow_the_documented_formula_and_never_reach_into_the_reserve() -> None:
    plan = textbook(workers=8, runtime_overhead=10 * MiB)
    per_worker = 266 * MiB
    assert plan.per_worker == per_worker
    assert plan.memory_max == -(-int(per_worker * 1.1) // 4096) * 4096
    assert plan.memory_high == -(-int(per_worker * 1.05) // 4096) * 4096
    assert plan.fits_safe * plan.memory_max <= plan.left
    assert plan.memory_high < plan.memory_max


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"margin": 1.0}, "safety_margin"),
        ({"margin": -0.1}, "safety_margin"),
        ({"kv_per_seq": 0}, "per-sequence size must be positive"),
        ({"reserve": -1}, "must not be negative"),
    ],
)
def test_impossible_plan_inputs_are_config_errors(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        textbook(**changes)


# ---------------------------------------------------------------- KV cache math


def test_default_model_metadata_gives_18432_bytes_of_f16_kv_per_token(gemma: ModelMeta) -> None:
    assert (gemma.n_layer, gemma.n_head, gemma.key_length, gemma.value_length) == (18, 4, 256, 256)
    assert gemma.n_head_kv == (1,) * 18
    assert kv_bytes_per_token(gemma) == 18 * 1 * (256 + 256) * 2 == 18_432
    assert gemma.weights_bytes == 246_587_904  # sum of the 236 tensors' n_bytes (235.2 MiB)


def test_quantized_kv_types_use_ggml_block_sizes(gemma: ModelMeta) -> None:
    assert bytes_per_element("f16") == 2
    assert bytes_per_element("q8_0") == Fraction(34, 32)
    assert bytes_per_element("q4_0") == Fraction(18, 32)
    assert kv_bytes_per_token(gemma, "q8_0") == 18 * (256 + 256) * 34 // 32 == 9_792
    assert kv_bytes_per_token(gemma, "q4_0") == 18 * (256 + 256) * 18 // 32 == 5_184
    assert kv_bytes_per_token(gemma, "f16", "q8_0") == 18 * (256 * 2 + 256 * 34 // 32)
    with pytest.raises(ConfigError, match="kv type must be one of"):
        bytes_per_element("q3_k")


@pytest.mark.parametrize(
    ("n_ctx", "cells"), [(1, 256), (256, 256), (257, 512), (1000, 1024), (2048, 2048)]
)
def test_context_is_padded_to_a_multiple_of_256(n_ctx: int, cells: int) -> None:
    assert kv_cells(n_ctx) == cells


def test_kv_per_sequence_uses_the_padded_context(gemma: ModelMeta) -> None:
    plan, _ = config_plan(config(model={"n_ctx": 1000}))
    assert plan.kv_per_seq == 18_432 * 1024
    plan, _ = config_plan(config())
    assert plan.kv_per_seq == 18_432 * 2048 == 36 * MiB


def test_attention_scratch_grows_with_context_and_micro_batch(gemma: ModelMeta) -> None:
    assert attention_scratch(gemma, 2048, 512) == 2 * 4 * 4 * 512 * 2048 == 32 * MiB
    assert attention_scratch(gemma, 2048, 128) == 8 * MiB  # n_ubatch follows n_batch down
    assert attention_scratch(gemma, 2048, 4096) == 32 * MiB  # ... but not above 512
    assert attention_scratch(gemma, 200, 512) == 2 * 4 * 4 * 200 * 256  # n_ubatch <= n_ctx


def test_flash_attention_scratch_has_no_kq(gemma: ModelMeta) -> None:
    # Fitted on the default model's private memory after a full prompt in 512-row
    # chunks, n_ctx 1024-4096: the rows are n_ubatch when the slots may fill it.
    assert attention_scratch(gemma, 2048, 512, True, slots=9) == 4 * 512 * (2048 + 4 * 4 * 256)
    assert attention_scratch(gemma, 2048, 512, True, slots=9) == 12 * MiB
    assert attention_scratch(gemma, 4096, 512, True, slots=9) == 16 * MiB  # vs 64 without


def test_flash_attention_scratch_counts_the_rows_a_step_carries(gemma: ModelMeta) -> None:
    # Each slot's prompt chunk stays under ggml's 64-row tile (FLASH_PROMPT_ROWS).
    row = 4 * (2048 + 4 * 4 * 256)
    assert attention_scratch(gemma, 2048, 512, flash_attn=True) == FLASH_PROMPT_ROWS * row
    assert attention_scratch(gemma, 2048, 512, True, slots=4) == 4 * FLASH_PROMPT_ROWS * row
    assert attention_scratch(gemma, 2048, 128, True, slots=4) == 128 * row  # n_batch caps it


def test_a_quantized_kv_type_plans_flash_attention_even_when_it_is_turned_off(
    gemma: ModelMeta,
) -> None:
    f16, _ = config_plan(config(model={"flash_attn": False}))
    q8, _ = config_plan(config(model={"kv_type": "q8_0", "flash_attn": False}))
    assert not f16.flash_attn and q8.flash_attn and q8.as_dict()["flash_attn"]
    assert q8.kv_per_seq == 9_792 * 2048
    scratch = FLASH_PROMPT_ROWS * 4 * (2048 + 4 * 4 * 256)  # one slot's 63 rows, 1.5 MiB
    assert q8.runtime_per_worker == 88 * MiB + scratch
    assert f16.runtime_per_worker == 88 * MiB + 32 * MiB


def test_flash_attention_is_planned_when_turned_on(gemma: ModelMeta) -> None:
    assert from_dict({}).model.flash_attn  # on by default: see node.engine.flash_attn_on
    plan, _ = config_plan(config(model={"flash_attn": True}))
    scratch = FLASH_PROMPT_ROWS * 4 * (2048 + 4 * 4 * 256)
    assert plan.flash_attn and plan.runtime_per_worker == 88 * MiB + scratch
    again, _ = config_plan(config(), kv_type="q8_0")  # a quantized replan turns it on
    assert again.flash_attn and again.kv_per_seq == 9_792 * 2048


def test_default_config_plans_the_real_default_model(gemma: ModelMeta) -> None:
    plan, meta = config_plan(config())
    assert meta == gemma
    assert plan.kv_per_token == 18_432 and plan.kv_type == "f16" and plan.n_ctx == 2048
    assert plan.runtime_per_worker == 88 * MiB + 32 * MiB
    # node.capacity.plan.grammar_allowance: one filter call's candidates, one grammar
    assert plan.grammar == 512 * 704 + 2 * MiB
    assert plan.per_worker == 36 * MiB + 120 * MiB + plan.grammar
    assert plan.total == gemma.weights_bytes + 2 * plan.per_worker
    assert plan.budget == 8 * GiB and plan.budget_source == "capacity.memory_budget"


# ---------------------------------------------------------------- weights: shared or private


def test_mmapped_weights_are_counted_once_repacked_ones_per_worker() -> None:
    shared = textbook(workers=3, weights=GiB, kv_per_seq=100 * MiB)
    private = textbook(workers=3, weights=GiB, kv_per_seq=100 * MiB, weights_shared=False)
    assert shared.total == GiB + 3 * 100 * MiB
    assert private.total == 3 * (GiB + 100 * MiB)
    assert shared.left == 8 * GiB - parse_size("1.5G") - GiB
    assert private.left == 8 * GiB - parse_size("1.5G")
    assert private.per_worker == GiB + 100 * MiB
    assert shared.fits_before_margin > private.fits_before_margin


def test_model_repack_makes_the_weights_private(gemma: ModelMeta) -> None:
    shared, _ = config_plan(config())
    private, _ = config_plan(config(model={"repack": True}))
    assert shared.weights_shared and not private.weights_shared
    assert private.per_worker - shared.per_worker == gemma.weights_bytes
    assert private.total - shared.total == gemma.weights_bytes  # 2 copies instead of 1


# ---------------------------------------------------------------- refusing what cannot fit


def test_check_fits_returns_the_plan_when_it_fits(gemma: ModelMeta) -> None:
    plan = check_fits(config())
    assert plan.fits and plan.workers == 2


def test_check_fits_refuses_too_many_workers_and_names_the_knobs(gemma: ModelMeta) -> None:
    with pytest.raises(ConfigError) as info:
        check_fits(config(workers={"count": 3}, capacity={"memory_budget": "1700M"}))
    message = info.value.message
    assert "3 worker(s) do not fit" in message and "so 2 fit" in message
    assert "workers.count = 2" in message
    assert "model.n_ctx = 1280" in message
    assert 'capacity.memory_budget = "1782M"' in message


def test_check_fits_suggests_a_smaller_kv_type_when_that_is_enough(gemma: ModelMeta) -> None:
    # n_ctx 8192: 362.3 MiB per worker with f16 (no room for 2), 169.8 MiB with q8_0
    # (half the KV, and flash attention: 24 MiB of scratch instead of 128).
    cfg = config(model={"n_ctx": 8192}, capacity={"memory_budget": "1900M"})
    with pytest.raises(ConfigError) as info:
        check_fits(cfg)
    assert 'model.kv_type = "q8_0"' in info.value.message
    assert check_fits(
        config(model={"n_ctx": 8192, "kv_type": "q8_0"}, capacity={"memory_budget": "1900M"})
    )


def test_check_fits_refuses_when_the_weights_alone_do_not_fit(gemma: ModelMeta) -> None:
    with pytest.raises(ConfigError) as info:
        check_fits(config(capacity={"memory_budget": "1G", "reserve": "900M"}))
    message = info.value.message
    assert "so 0 fit" in message and "workers.count" not in message
    assert "capacity.memory_budget" in message


def test_check_fits_suggests_turning_repack_off(gemma: ModelMeta) -> None:
    # Shared: 1 GiB + 235 MiB + 2 x 174 MiB fits 1700M; two private copies do not.
    with pytest.raises(ConfigError, match=r"model\.repack = false"):
        check_fits(config(model={"repack": True}, capacity={"memory_budget": "1700M"}))
    assert check_fits(config(capacity={"memory_budget": "1700M"}))


def test_the_test_engine_reads_no_model() -> None:
    plan = check_fits(config(workers={"engine": "test"}, model={"path": "/nonexistent.gguf"}))
    assert plan.weights == 0 and plan.kv_per_seq == 0 and plan.per_worker == 88 * MiB


@pytest.mark.parametrize(
    ("section", "named"),
    [
        ({"reserve": "lots"}, "capacity.reserve"),
        ({"memory_budget": "8X"}, "capacity.memory_budget"),
        ({"runtime_overhead": "-5M"}, "capacity.runtime_overhead"),
    ],
)
def test_bad_sizes_are_config_errors_naming_the_key(section: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        config_plan(config(workers={"engine": "test"}, capacity=section))


def test_bad_kv_type_is_a_config_error(gemma: ModelMeta) -> None:
    with pytest.raises(ConfigError, match="kv type must be one of f16, q8_0, q4_0"):
        check_fits(config(model={"kv_type": "f32"}))


# ---------------------------------------------------------------- reading GGUF files


def write_gguf(path: Path, **extra: Any) -> Path:
    """A tiny GGUF: 4 layers, 8 heads, per-layer KV heads, no key_length (E/H = 32),
    a 5000-entry vocabulary (skipped by the reader) and f32, f16 and q8_0 tensors."""
    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(4)
    w.add_embedding_length(256)
    w.add_head_count(8)
    w.add_head_count_kv([2, 2, 0, 2])
    w.add_token_list([f"t{i}" for i in range(5000)])
    w.add_token_scores([0.0] * 5000)
    for key, value in extra.items():
        w.add_uint32(key, value)
    w.add_tensor("a", np.zeros((4, 64), dtype=np.float32))
    w.add_tensor("b", np.zeros((8, 32), dtype=np.float16))
    w.add_tensor("c", np.zeros((2, 68), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_reader_agrees_with_gguf_reader_on_a_small_file(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "tiny.gguf")
    meta = read_gguf_meta(path)
    reference = GGUFReader(path)
    assert meta.weights_bytes == sum(int(t.n_bytes) for t in reference.tensors) == 1024 + 512 + 136
    assert meta.n_head_kv == (2, 2, 0, 2)
    assert meta.key_length == meta.value_length == 256 // 8  # default: embedding / heads
    assert kv_bytes_per_token(meta) == (2 + 2 + 0 + 2) * (32 * 2 + 32 * 2)
    assert meta.name == "tiny" and meta.n_layer == 4


def test_reader_refuses_what_the_formula_does_not_cover(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "mla.gguf", **{"llama.attention.kv_lora_rank": 512})
    with pytest.raises(ConfigError, match="MLA"):
        read_gguf_meta(path)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(ConfigError, match="GGUF"):
        read_gguf_meta(junk)


# ---------------------------------------------------------------- budget detection

V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNTS = (
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
)
HYBRID_UNIFIED = "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
V1_UNLIMITED = "9223372036854771712"  # LONG_MAX rounded down to a 4 KiB page


def test_v2_limit_is_the_smallest_on_the_path_and_max_is_none(tmp_path: Path) -> None:
    service = "sys/fs/cgroup/system.slice/edgenode.service"
    files = {
        "sys/fs/cgroup/system.slice/memory.max": str(GiB),
        f"{service}/memory.max": "max",
        f"{service}/node/memory.max": "max",  # the node's own leaf, nested
    }
    host = fake_host(tmp_path, V2_MOUNT, "0::/system.slice/edgenode.service/node\n", files)
    assert cgroup_memory_limit(host) == GiB
    (tmp_path / "sys/fs/cgroup/system.slice/memory.max").write_text("max\n")
    assert cgroup_memory_limit(host) is None


def test_v1_unlimited_is_none_and_an_ancestor_limit_counts(tmp_path: Path) -> None:
    files = {
        "sys/fs/cgroup/memory/memory.limit_in_bytes": V1_UNLIMITED,
        "sys/fs/cgroup/memory/x/memory.limit_in_bytes": V1_UNLIMITED,
        "sys/fs/cgroup/memory/x/y/memory.limit_in_bytes": V1_UNLIMITED,
    }
    proc = "4:memory:/x/y\n2:cpu,cpuacct:/x/y\n0::/\n"
    host = fake_host(tmp_path, V1_MOUNTS + HYBRID_UNIFIED, proc, files)
    assert cgroup_memory_limit(host) is None
    (tmp_path / "sys/fs/cgroup/memory/x/memory.limit_in_bytes").write_text(str(512 * MiB))
    assert cgroup_memory_limit(host) == 512 * MiB


def test_a_hybrid_host_reads_v1_memory_not_the_empty_v2_mount(tmp_path: Path) -> None:
    files = {
        "sys/fs/cgroup/memory/x/memory.limit_in_bytes": str(256 * MiB),
        "sys/fs/cgroup/unified/x/memory.max": str(128 * MiB),  # not the memory hierarchy
    }
    host = fake_host(tmp_path, V1_MOUNTS + HYBRID_UNIFIED, "4:memory:/x\n0::/x\n", files)
    assert cgroup_memory_limit(host) == 256 * MiB


def test_a_co_mounted_v1_memory_controller_is_found_where_it_is(tmp_path: Path) -> None:
    mounts = "35 23 0:32 / /sys/fs/cgroup/cpu,memory rw - cgroup cgroup rw,cpu,memory\n"
    files = {"sys/fs/cgroup/cpu,memory/x/memory.limit_in_bytes": str(300 * MiB)}
    host = fake_host(tmp_path, mounts, "3:cpu,memory:/x\n", files)
    assert cgroup_memory_limit(host) == 300 * MiB


def test_a_container_mount_shows_the_hierarchy_from_its_own_root(tmp_path: Path) -> None:
    # Without a cgroup namespace /proc/self/cgroup shows the host's full path,
    # while the container's /sys/fs/cgroup shows only /docker/abc and below.
    mounts = "30 23 0:26 /docker/abc /sys/fs/cgroup ro - cgroup2 cgroup2 rw\n"
    files = {
        "sys/fs/cgroup/memory.max": str(2 * GiB),  # the container's limit
        "sys/fs/cgroup/app/memory.max": str(GiB),
        "sys/fs/cgroup/app/node/memory.max": "max",
    }
    host = fake_host(tmp_path, mounts, "0::/docker/abc/app/node\n", files)
    assert cgroup_memory_limit(host) == GiB
    (tmp_path / "sys/fs/cgroup/app/memory.max").write_text("max\n")
    assert cgroup_memory_limit(host) == 2 * GiB


def test_no_cgroup_files_means_no_limit(tmp_path: Path) -> None:
    assert cgroup_memory_limit(Host(root=tmp_path, proc=tmp_path / "proc")) is None
    host = fake_host(tmp_path, V2_MOUNT, "0::/a\n", {"sys/fs/cgroup/a/memory.max": "junk"})
    assert cgroup_memory_limit(host) is None


# ---------------------------------------------------------------- the CLI


def test_cli_reproduces_the_textbook_example(tmp_path: Path) -> None:
    result = run_cli(tmp_path, *TEXTBOOK)
    assert result.exit_code == 0, result.output
    assert "- reserve 1.5 GiB - shared weights 4.2 GiB = 2.3 GiB left" in result.output
    assert "9 sequences before the margin (2.3 GiB / 256 MiB = 9.2)" in result.output
    assert "8 worker(s) x 1 slot = 8 sequences with the 10% safety margin" in result.output
    assert "layout      2 worker(s) x 1 slot = 2 sequences (workers.slots = 1)" in result.output
    assert "per worker  KV 1 x 256 MiB + runtime 0 B = 256 MiB" in result.output


def test_cli_textbook_json(tmp_path: Path) -> None:
    result = run_cli(tmp_path, *TEXTBOOK, "--workers", "12", "--json")
    assert result.exit_code == 1  # 12 asked, 8 fit
    data = json.loads(result.output)
    assert data["fits_before_margin"] == 9 and data["fits_safe"] == 8 and not data["fits"]
    assert any("workers.count = 8" in tip for tip in data["advice"])


def test_cli_prints_the_default_models_real_numbers(tmp_path: Path, gemma: ModelMeta) -> None:
    toml = '[capacity]\nmemory_budget = "8G"\nruntime_overhead = "88M"\n'
    result = run_cli(tmp_path, toml=toml)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "18 layers x 1 KV head(s) x (256 + 256) x 2 B (f16) = 18,432 B" in out
    assert "2048 cells (n_ctx 2048, padded to 256) = 36 MiB" in out
    assert "weights     235.2 MiB, shared" in out
    assert "verdict     OK: 2 worker(s) asked" in out


def test_cli_overrides_and_knobs_when_it_does_not_fit(tmp_path: Path, gemma: ModelMeta) -> None:
    toml = '[capacity]\nruntime_overhead = "88M"\n'
    result = run_cli(tmp_path, "--memory", "2G", "--workers", "6", "--n-ctx", "1000", toml=toml)
    assert result.exit_code == 1
    assert "1024 cells (n_ctx 1000" in result.output
    assert "DOES NOT FIT: 6 worker(s) asked" in result.output
    assert "turn a knob: workers.count = " in result.output


def test_cli_rejects_bad_sizes_and_half_manual_mode(tmp_path: Path) -> None:
    bad = run_cli(tmp_path, "--memory", "8X", "--weights", "1G", "--kv-per-seq", "1M")
    assert bad.exit_code == 2 and "not a size" in bad.output
    half = run_cli(tmp_path, "--weights", "1G")
    assert half.exit_code == 2 and "--weights and --kv-per-seq go together" in half.output
    mixed = run_cli(tmp_path, *TEXTBOOK, "--n-ctx", "4096")
    assert mixed.exit_code == 2 and "apply to the model" in mixed.output


#: A core this process may not run on (one past the highest it may).
OUTSIDE = max(os.sched_getaffinity(0)) + 1


@pytest.mark.parametrize(
    ("toml", "said"),
    [
        (f"[node]\ncpus = [{OUTSIDE}]\n", f"node.cpus names core(s) {OUTSIDE}, but this process"),
        (f"[workers]\ncpus = [{OUTSIDE}]\n", f"workers.cpus names core(s) {OUTSIDE}, but"),
    ],
    ids=["node", "workers"],
)
@pytest.mark.parametrize("by_hand", [False, True], ids=["model", "by-hand"])
def test_cli_refuses_the_cores_start_refuses(
    tmp_path: Path, toml: str, said: str, by_hand: bool
) -> None:
    # The test engine reads no model: only the core plan can refuse here.
    toml += '\n[workers]\nengine = "test"\n' if "[workers]" not in toml else 'engine = "test"\n'
    result = run_cli(tmp_path, *(TEXTBOOK if by_hand else []), toml=toml)
    assert result.exit_code == 1, result.output
    assert f"Error: {said}" in result.output and "verdict" not in result.output, result.output


def test_check_fits_refuses_a_worker_limit_below_one_workers_need() -> None:
    config = from_dict({"workers": {"memory_max": "100M", "slots": 1}})
    # 36 MiB of KV + 88 + 1.5 MiB (flash attention's scratch, the default) + 2.3 of grammar
    with pytest.raises(ConfigError, match=r"workers.memory_max 100 MiB is below the 127.8 MiB"):
        check_fits(config)


def test_advice_under_a_cgroup_limit_names_the_limit_not_the_budget_key(
    gemma: ModelMeta,
) -> None:
    # A memory_budget above the node's cgroup limit is cut to it: advising a larger
    # one would be advice that cannot work (break-it, under a 700M parent cgroup).
    bounded = Plan(
        budget=700 * MiB,
        reserve=0,
        weights=0,
        kv_per_seq=36 * MiB,
        workers=4,
        runtime_overhead=300 * MiB,
        budget_cap="/sys/fs/cgroup/memory/p/memory.limit_in_bytes",
    )
    tips = advice(bounded, None)
    assert "capacity.memory_budget =" not in tips[-1]
    assert "in /sys/fs/cgroup/memory/p/memory.limit_in_bytes" in tips[-1]
    free = dataclasses.replace(bounded, budget_cap="")
    assert 'capacity.memory_budget = "' in advice(free, None)[-1]
