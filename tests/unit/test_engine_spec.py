"""What a model worker is told to build: the engine spec the pool derives from the config."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from node.config import from_dict
from node.engine import EngineSpec, needs_flash_attn
from node.pool import WorkerPool


@pytest.mark.parametrize("kv_type", ["f16", "q8_0", "q4_0"])
def test_the_pool_passes_model_kv_type_to_every_model_worker(tmp_path: Path, kv_type: str) -> None:
    config = from_dict({"model": {"kv_type": kv_type}, "workers": {"count": 2, "sandbox": "off"}})
    pool = WorkerPool(config, "model.gguf", None, tmp_path)
    assert [s.engine.kv_type for s in pool.specs] == [kv_type, kv_type]
    # Workers get the spec as JSON on their command line.
    assert EngineSpec(**json.loads(json.dumps(asdict(pool.specs[0].engine)))).kv_type == kv_type


def test_only_a_quantized_kv_cache_needs_flash_attention() -> None:
    assert not needs_flash_attn("f16")
    assert needs_flash_attn("q8_0") and needs_flash_attn("q4_0")
