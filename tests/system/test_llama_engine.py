"""The llama.cpp engine's own parts, with the real model: the token -> text path
(special tokens, UTF-8 split over byte tokens), the sampler chain's mask,
llama.cpp's log, and the KV cache type reaching llama.cpp."""

from __future__ import annotations

import ctypes
import dataclasses
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp.llama_cpp as llama_c
import numpy as np
import pytest

from node.capacity.gguf import read_gguf_meta
from node.capacity.plan import kv_bytes_per_token, kv_cells
from node.engine import EngineSpec
from node.llama.engine import LlamaEngine
from node.model import resolve_model

pytestmark = pytest.mark.system

#: Special tokens of the default model (Gemma 3) with text: the GGUF marks the
#: image markers and [multimodal] user-defined, which llama.cpp renders even
#: without ``special``; <start_of_turn> and <unused0> are control/unused.
MARKERS = ("<start_of_image>", "<end_of_image>", "[multimodal]", "<start_of_turn>", "<unused0>")


@pytest.fixture(scope="module")
def engine() -> Iterator[LlamaEngine]:
    spec = EngineSpec(
        kind="llama",
        model_path=str(resolve_model("default")),
        n_ctx=512,
        n_batch=512,
        threads=1,
    )
    engine = LlamaEngine(spec)
    yield engine
    engine.close()


def token_of(engine: LlamaEngine, text: str) -> int:
    (token,) = engine.llm.tokenize(text.encode(), add_bos=False, special=True)
    return int(token)


def test_special_tokens_have_no_text_on_the_way_out(engine: LlamaEngine) -> None:
    words = engine.llm.tokenize(b"look here", add_bos=False)
    for marker in MARKERS:
        ids = [*words[:1], token_of(engine, marker), *words[1:]]
        assert engine.detokenize(ids) == b"look here"


def greedy_pick(engine: LlamaEngine, logits: np.ndarray, job: dict[str, Any]) -> int:
    """The token a request's own sampler chain picks from ``logits`` (one per
    vocabulary token): llama.cpp's samplers applied to a candidate array."""
    chain = engine._sampler(job)
    try:
        n = len(logits)
        data = (llama_c.llama_token_data * n)()
        for token in range(n):
            data[token].id, data[token].logit, data[token].p = token, float(logits[token]), 0.0
        array = llama_c.llama_token_data_array(data, n, -1, False)
        llama_c.llama_sampler_apply(chain, ctypes.byref(array))
        return int(data[array.selected].id)
    finally:
        llama_c.llama_sampler_free(chain)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sampling_never_picks_a_special_token(engine: LlamaEngine, temperature: float) -> None:
    logits = np.zeros(engine.llm.n_vocab(), dtype=np.single)
    markers = [token_of(engine, m) for m in MARKERS]
    logits[markers] = 100.0  # the model's favourites
    assert greedy_pick(engine, logits, {"temperature": temperature}) not in markers
    logits[engine.llm.token_eos()] = 50.0
    job = {"temperature": temperature, "seed": 1}
    assert greedy_pick(engine, logits, job) == engine.llm.token_eos()  # ending stays possible


def byte_tokens(engine: LlamaEngine, text: str) -> list[int]:
    """The byte-fallback tokens spelling ``text`` (Gemma: <0x00> is token 238)."""
    first = engine.llm.tokenize(b"<0x00>", add_bos=False, special=True)
    base = 238 if len(first) != 1 else int(first[0])
    assert engine.llm.detokenize([base + 0x41]) == b"A"
    return [base + b for b in text.encode()]


def test_byte_tokens_of_one_character_join_into_it(engine: LlamaEngine) -> None:
    ids = byte_tokens(engine, "✓")
    assert [engine.llm.detokenize([t]) for t in ids] == [b"\xe2", b"\x9c", b"\x93"]
    assert engine.llm.detokenize(ids).decode() == "✓"


def test_a_character_split_over_byte_tokens_streams_whole(engine: LlamaEngine) -> None:
    # Under a grammar the model spells "✓" with byte tokens (seen here): no
    # piece may carry half a character or a replacement character.
    pieces: list[str] = []
    job = {
        "op": "generate",
        "prompt": "Say it:",
        "max_tokens": 32,
        "temperature": 0.0,
        "json_schema": {"type": "string", "enum": ["ok ✓ 日本語"]},
    }
    result = engine.run(job, threading.Event(), pieces.append)
    assert result["text"] == '"ok ✓ 日本語"'
    assert "".join(pieces) == result["text"] and "✓" in pieces
    assert result["usage"]["completion_tokens"] > len(pieces)  # some piece spans tokens


def load_counter(model_path: str) -> subprocess.CompletedProcess[str]:
    """Build the node's prompt-token counter in a fresh interpreter; its fd 2 captured."""
    code = (
        "import sys, types\n"
        "from node.engine import EngineSpec, make_token_counter\n"
        "spec = EngineSpec('llama', sys.argv[1], n_ctx=2048, n_batch=512, threads=1)\n"
        "count = make_token_counter(spec)\n"
        "print(count(types.SimpleNamespace(prompt='hello world', messages=None)))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, model_path], capture_output=True, text=True, timeout=60
    )


def test_the_node_side_token_counter_loads_quietly() -> None:
    done = load_counter(str(resolve_model("default")))
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == 3  # <bos> hello world
    assert "n_ctx_train" not in done.stderr
    assert done.stderr == ""


def test_the_token_counter_still_shows_llama_cpp_errors(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 64)
    done = load_counter(str(junk))
    assert done.returncode != 0
    assert "error loading model" in done.stderr  # llama.cpp's own words, level ERROR


def test_a_worker_load_logs_llama_cpp_warnings_but_not_its_info(
    capfd: pytest.CaptureFixture[str],
) -> None:
    spec = EngineSpec("llama", str(resolve_model("default")), n_ctx=256, n_batch=256, threads=1)
    LlamaEngine(spec).close()
    err = capfd.readouterr().err
    assert "using full-size SWA cache" in err  # ggml level WARN (3)
    assert "n_ctx_seq" not in err and "KV buffer size" not in err  # level INFO (2)


def test_kv_type_reaches_llama_cpp_which_allocates_what_the_plan_says() -> None:
    path = resolve_model("default")
    meta = read_gguf_meta(path)
    reported: dict[str, int] = {}
    for kv_type in ("f16", "q8_0", "q4_0"):
        spec = EngineSpec("llama", str(path), n_ctx=2048, n_batch=512, threads=1, kv_type=kv_type)
        engine = LlamaEngine(spec)
        try:
            job = {"op": "generate", "prompt": "The capital of France is", "max_tokens": 4}
            result = engine.run(job | {"temperature": 0.0}, threading.Event(), lambda _: None)
        finally:
            engine.close()
        assert result["usage"]["completion_tokens"] == 4 and result["text"].strip()
        assert engine.kv_cache_bytes is not None  # from llama.cpp's "KV buffer size" lines
        reported[kv_type] = engine.kv_cache_bytes
        planned = kv_bytes_per_token(meta, kv_type) * kv_cells(2048)
        assert abs(reported[kv_type] - planned) <= 0.01 * 2**20  # llama.cpp prints 2 decimals
    # ggml's q8_0 is 34 bytes per 32 elements, q4_0 18: 34/64 and 18/64 of f16.
    assert reported["q8_0"] / reported["f16"] == pytest.approx(34 / 64, abs=0.001)
    assert reported["q4_0"] / reported["f16"] == pytest.approx(18 / 64, abs=0.001)


@pytest.mark.parametrize(("kv_type", "asked", "on"), [("f16", False, False), ("f16", True, True)])
def test_model_flash_attn_reaches_llama_cpp(kv_type: str, asked: bool, on: bool) -> None:
    spec = EngineSpec(
        "llama",
        str(resolve_model("default")),
        n_ctx=512,
        n_batch=512,
        threads=1,
        kv_type=kv_type,
        flash_attn=asked,
    )
    engine = LlamaEngine(spec)
    try:
        job = {"op": "generate", "prompt": "The capital of France is", "max_tokens": 4}
        result = engine.run(job | {"temperature": 0.0}, threading.Event(), lambda _: None)
        wanted = (
            llama_c.LLAMA_FLASH_ATTN_TYPE_ENABLED if on else llama_c.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        assert engine.llm.context_params.flash_attn_type == wanted
    finally:
        engine.close()
    assert result["usage"]["completion_tokens"] == 4 and result["text"].strip()


def test_a_named_chat_format_renders_the_prompt_and_stops_at_its_turn_end() -> None:
    spec = EngineSpec(
        "llama",
        str(resolve_model("default")),
        n_ctx=512,
        n_batch=512,
        threads=1,
        chat_format="gemma",
    )
    engine = LlamaEngine(spec)
    try:
        messages = [{"role": "user", "content": "Say hello."}]
        job = {"op": "chat", "messages": messages, "max_tokens": 24, "temperature": 0.0}
        result = engine.run(job, threading.Event(), lambda _: None)
        rendered = b"<start_of_turn>user\nSay hello.<end_of_turn>\n<start_of_turn>model\n"
        expected = [engine.llm.token_bos(), *engine.llm.tokenize(rendered, False, True)]
        assert result["usage"]["prompt_tokens"] == len(expected)
        assert "<end_of_turn>" not in result["text"]
    finally:
        engine.close()
    with pytest.raises(ValueError, match="not a llama-cpp-python format"):
        LlamaEngine(dataclasses.replace(spec, chat_format="no-such-format"))
