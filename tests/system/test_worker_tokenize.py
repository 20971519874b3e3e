"""The worker tokenizes a prompt in time linear in its length, with the real model.

A prompt the broker cannot decide cheaply (over 4 KiB and not provably too
large) goes to a worker, which tokenized it whole inside llama-cpp-python.
llama.cpp's special-token partition (``tokenizer_st_partition`` in
``src/llama-vocab.cpp``) is quadratic in the matches of user-defined tokens
(Gemma 3: newlines, tabs, HTML tags): 64 KB of ``"a\\n"`` took 52 s here, of
``"<b><i>"`` 4.8 s, of random words 0.05 s. With a large context such a prompt
outlived the stall timeout, the worker was killed, and the request killed the
next one too. The engine now counts first (a lower bound from the bytes),
then tokenizes in pieces cut where no token can span (``node.llama.boundaries``).
"""

from __future__ import annotations

import random
import string
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from broker.errors import Cancelled, TooLarge
from node.engine import EngineSpec
from node.llama.engine import LlamaEngine
from node.llama.vocab import PromptCounter, make_token_counter
from node.model import resolve_model

pytestmark = pytest.mark.system

#: Large enough that random words pass their lower bound (~9,700 tokens, count
#: ~31,000): the engine must tokenize them to refuse them, the baseline the
#: comparisons need. The broker's bound leaves ``<b><i>`` (~6,800 of 21,847)
#: to the worker too.
N_CTX = 16_384
SIZE = 64 * 1024  # bytes of each prompt


@pytest.fixture(scope="module")
def engine() -> Iterator[LlamaEngine]:
    spec = EngineSpec(
        kind="llama", model_path=str(resolve_model("default")), n_ctx=N_CTX, n_batch=512, threads=1
    )
    engine = LlamaEngine(spec)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def counter() -> PromptCounter:
    return make_token_counter(str(resolve_model("default")))


def random_words(size: int, seed: int = 5) -> str:
    """``size`` bytes of random lowercase words: ordinary text whose count needs
    tokenizing (each word is 1-4 tokens, its bound 1)."""
    rng = random.Random(seed)
    words: list[str] = []
    while len(words) * 7 < size:  # 6 letters and a space on average
        words.append("".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 9))))
    return " ".join(words)[:size]


def repeated(unit: str, size: int) -> str:
    return (unit * (size // len(unit) + 1))[:size]


def seconds_to_413(engine: LlamaEngine, job: dict[str, Any]) -> float:
    """Seconds ``engine.run`` takes to refuse ``job`` as too large (TooLarge, 413)."""
    started = time.perf_counter()
    with pytest.raises(TooLarge, match=f"exceed context window of {N_CTX}"):
        engine.run(job | {"max_tokens": 4}, threading.Event(), lambda _: None)
    return time.perf_counter() - started


def generate(prompt: str) -> dict[str, Any]:
    return {"op": "generate", "prompt": prompt}


def chat(content: str) -> dict[str, Any]:
    return {"op": "chat", "messages": [{"role": "user", "content": content}]}


@pytest.mark.parametrize(
    "job",
    [
        generate(repeated("<b><i>", SIZE)),
        generate(repeated("a\n", SIZE)),
        generate(repeated("\n\t", SIZE)),
        generate(repeated("</td><td>1", SIZE)),
        chat(repeated("<b><i>", SIZE)),
    ],
    ids=["b-i-tags", "a-newline", "newline-tab", "table-cells", "chat-b-i-tags"],
)
def test_a_prompt_dense_in_user_defined_tokens_is_refused_as_fast_as_words(
    engine: LlamaEngine, job: dict[str, Any]
) -> None:
    """The time to the 413 of a prompt dense in user-defined tokens, against the
    same size of random words (both over the context, neither refused by the
    bound alone): a ratio measured in the same run, the best of two each."""
    ordinary = generate(random_words(SIZE))
    ordinary_s = min(seconds_to_413(engine, ordinary) for _ in range(2))
    hostile_s = min(seconds_to_413(engine, job) for _ in range(2))
    assert hostile_s <= 5 * ordinary_s, (
        f"{hostile_s * 1000:.0f} ms to refuse {SIZE} bytes dense in user-defined tokens, "
        f"{ordinary_s * 1000:.0f} ms for random words"
    )


@pytest.mark.parametrize("unit", ["<b><i>", "a\n", "\n\t", "</td><td>1", "<start_of_turn><b>"])
def test_a_prompt_dense_in_user_defined_tokens_tokenizes_as_fast_as_words(
    engine: LlamaEngine, unit: str
) -> None:
    """What a prompt costs to tokenize the way the engine does (``Vocab.tokenize``,
    which a chat template's prompt goes through too), against the same size of
    random words."""

    def seconds(text: str) -> float:
        started = time.perf_counter()
        engine.vocab.tokenize(text.encode(), special=True)
        return time.perf_counter() - started

    ordinary_s = min(seconds(random_words(SIZE)) for _ in range(2))
    hostile_s = min(seconds(repeated(unit, SIZE)) for _ in range(2))
    assert hostile_s <= 5 * ordinary_s, (
        f"{hostile_s * 1000:.0f} ms to tokenize {SIZE} bytes of {unit!r} repeated, "
        f"{ordinary_s * 1000:.0f} ms for random words"
    )


def random_text(rng: random.Random, parts: int) -> str:
    """A mix of what makes tokenizing differ: words, runs of spaces, newlines and
    tabs, HTML tags next to each other, digits, CJK, emoji, a literal ▁,
    control-token text, long-token text (em dashes), and long stretches no
    token boundary is forced in."""
    pieces = [
        "hello", " world", "  ", " " * 40, "\n", "\n\n\n", "\t", "<b>", "</td>", "<td>",
        "2024", "日本語の", "😀", "▁", "<start_of_turn>", "<end_of_turn>", "<pad>",
        "<unused7>", "<bos>", "—" * 20, ".", ", ", "café", "x", "def f(x):", "\r\n",
        "a\n", "<b><i>" * 60, "\n" * 300, " " * 90, "\t" * 40, "1234567890" * 30,
        "<table><tr><td>", "[multimodal]", "<start_of_image>", "<",  ">", "<<b>>",
    ]  # fmt: skip
    return "".join(rng.choices(pieces, k=parts))


def test_pieces_give_the_ids_the_whole_text_gives(engine: LlamaEngine) -> None:
    """Token ids, not counts: with and without parse_special, through the
    vocabulary and through the engine's prompt ids (with BOS) against
    llama-cpp-python's own whole-text tokenizing."""
    vocab = engine.vocab
    assert vocab.pair_max is not None  # Gemma 3 qualifies
    rng = random.Random(17)
    for i in range(100):
        text = random_text(rng, rng.randint(1, 1000 if i % 10 == 0 else 200)).encode()
        for special in (False, True):
            whole = engine.llm._model.tokenize(text, add_bos=False, special=special)
            assert vocab.tokenize(text, special) == whole, (special, text)
        with_bos = engine.llm._model.tokenize(text, add_bos=True, special=True)
        assert engine.prompt_ids(text.decode(), threading.Event()) == with_bos, text


def test_the_model_sees_the_ids_of_the_whole_prompt_after_one_bos(engine: LlamaEngine) -> None:
    """The ids the engine evaluates are those llama-cpp-python makes of the text
    itself (``Llama._create_completion``: BOS, then the text's ids), and evaluating
    the same prompt again reuses the slot's KV cache."""
    prompt = random_text(random.Random(3), 60).replace("<bos>", "")
    expected = [engine.llm.token_bos(), *engine.llm._model.tokenize(prompt.encode(), False, True)]
    assert len(prompt.encode()) > 1000 and len(expected) < N_CTX // 4

    def run() -> dict[str, Any]:
        job = {"op": "generate", "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
        return engine.run(job, threading.Event(), lambda _: None)

    first = run()
    assert first["usage"]["prompt_tokens"] == len(expected)
    assert any(cached[: len(expected)] == expected for cached in engine.cached())
    again = run()
    assert again["usage"]["prompt_tokens"] == len(expected)
    # Not evaluated again but for its last token, whose logits the sampler needs.
    assert again["usage"]["cached_tokens"] == len(expected) - 1


def test_a_cancel_is_seen_while_a_prompt_is_tokenized(engine: LlamaEngine) -> None:
    """Between pieces: nothing is evaluated, and the KV cache is kept."""
    job = {"op": "generate", "prompt": "The capital of France is", "max_tokens": 1}
    engine.run(job, threading.Event(), lambda _: None)
    evaluated = engine.cached()
    cancelled = threading.Event()
    cancelled.set()
    with pytest.raises(Cancelled):
        engine.run(generate(random_words(SIZE)) | {"max_tokens": 4}, cancelled, lambda _: None)
    assert engine.cached() == evaluated and any(evaluated)


def test_a_prompt_that_fits_by_its_bound_but_not_by_its_count_gets_413(
    counter: PromptCounter, engine: LlamaEngine
) -> None:
    """Random words over the context: the broker's bound leaves them to the
    worker, which refuses them with llama-cpp-python's words (its 413)."""
    prompt = random_words(SIZE)
    low = counter.vocab.lower_bound(prompt.encode())
    assert low is not None and low < N_CTX < counter.vocab.count(prompt.encode())
    seconds_to_413(engine, generate(prompt))
