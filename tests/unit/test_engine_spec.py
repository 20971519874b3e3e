"""What a model worker is told to build: the engine spec the pool derives from the config."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from node.config import from_dict
from node.engine import EngineSpec, flash_attn_on
from node.pool import WorkerPool


@pytest.mark.parametrize("kv_type", ["f16", "q8_0", "q4_0"])
def test_the_pool_passes_model_kv_type_to_every_model_worker(tmp_path: Path, kv_type: str) -> None:
    config = from_dict({"model": {"kv_type": kv_type}, "workers": {"count": 2, "sandbox": "off"}})
    pool = WorkerPool(config, "model.gguf", None, tmp_path)
    assert [s.engine.kv_type for s in pool.specs] == [kv_type, kv_type]
    # Workers get the spec as JSON on their command line.
    assert EngineSpec(**json.loads(json.dumps(asdict(pool.specs[0].engine)))).kv_type == kv_type


def test_flash_attention_is_asked_for_or_forced_by_a_quantized_kv_cache() -> None:
    assert flash_attn_on("f16", True) and not flash_attn_on("f16", False)
    assert flash_attn_on("q8_0", False) and flash_attn_on("q4_0", False)
    assert EngineSpec(kind="llama", model_path="m", n_ctx=1, n_batch=1, threads=1).flash_attn
