"""Oversized prompts must cost the broker little and never its workers' lives.

Found by a break-it session: 16 prompts of ~256 KiB (43,000 tokens each) were
tokenized back to back on the broker's loop; heartbeats waited 5 s behind them
and the node killed every healthy worker as dead. A second one: even with the
loop's turns bounded, 60 such prompts (each refused 413) cost 12.5 s of broker
CPU and pushed ping p99 to 853 ms. Now the counter refuses what its lower bound
already puts over the context without tokenizing, and tokenizes at most
``LOOP_BYTES`` of a prompt on the loop.
"""

from __future__ import annotations

import random
import string
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import llama_cpp.llama_cpp as llama_c
import pytest

from broker.client_request import ClientRequest
from broker.errors import TooLarge
from node.llama.vocab import LOOP_BYTES, PromptCounter, make_token_counter
from node.model import resolve_model
from node.testing import Collector, NodeProcess, wait_for

pytestmark = pytest.mark.system

NodeFactory = Callable[..., NodeProcess]
LIMIT = 2048 - 4  # prompt tokens that fit the default context with max_tokens 4


def counting(node: NodeProcess) -> NodeProcess:
    """``node`` once its broker's token counter is loaded: it loads after the workers
    are ready (``node.engine.BackgroundCounter``), and these tests are about the
    broker's own size check."""
    wait_for(lambda: node.status()["token_counter"] == "loaded", timeout=60, every=0.1)
    return node


@pytest.fixture(scope="module")
def counter() -> Iterator[PromptCounter]:
    yield make_token_counter(str(resolve_model("default")))


@pytest.fixture(scope="module")
def llama_one(make_module_node: NodeFactory) -> NodeProcess:
    """A node of one model worker, the default context, for the tests that only send it
    requests (a model node's start costs seconds), its token counter loaded."""
    return counting(make_module_node(workers={"engine": "llama", "count": 1}))


def generate(prompt: str) -> ClientRequest:
    return ClientRequest(id=1, op="generate", prompt=prompt, max_tokens=4)


def test_a_burst_of_huge_prompts_gets_413s_and_kills_no_worker(make_node: NodeFactory) -> None:
    node = counting(
        make_node(
            workers={"engine": "llama", "count": 2},
            broker={"heartbeat_interval_ms": 1000, "stall_timeout_ms": 15000},
        )
    )
    col = Collector(node.frontend)
    try:
        col.send(
            id="stream",
            op="generate",
            prompt="Once upon a time",
            max_tokens=48,
            stream=True,
            route="llm",
        )
        huge = "hello " * 43_000
        for i in range(16):
            col.send(id=f"huge-{i}", op="generate", prompt=huge, max_tokens=4)
        started = time.monotonic()
        with node.client(wait_ms=5000) as c:
            c.ping()
        ping_s = time.monotonic() - started
        col.collect(timeout=60)
        col.assert_exactly_one_final_each()
        assert {col.final(f"huge-{i}")["code"] for i in range(16)} == {413}
        assert col.final("stream")["status"] == "ok"
        status = node.status()
        assert status["counters"].get("workers_lost", 0) == 0
        assert all(p["restarts"] == 0 for p in status["processes"])
        assert ping_s < 3.0  # liveness is 3 s: the loop never stalled that long
    finally:
        col.close()


def cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` has used, in nanosecond resolution (psutil's are
    10 ms ticks): its CPU-time clock, as glibc's clock_getcpuclockid(3) names it
    (``MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)`` in the kernel's posix-timers.h)."""
    return time.clock_gettime(((~pid) << 3) | 2)


def hostile_prompts() -> list[str]:
    """Prompts none of which fits a 2048-token context, and each of which took the
    broker's tokenizer 0.15 s to 0.75 s: ~250 KB of repeated or random words (the
    break-it sessions' bodies) or digits, and shorter text that makes llama.cpp's
    special-token partition quadratic (every newline and HTML tag is a
    user-defined token of Gemma 3's vocabulary)."""
    rng = random.Random(7)
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(500)]
    return (
        ["hello " * 41_000] * 8
        + [" ".join(rng.choices(vocab, k=45_000))[:250_000]] * 8
        + ["".join(rng.choices(string.digits, k=250_000))] * 4
        + ["a\n" * 6_000] * 4
        + ["<b><i>" * 5_000] * 4
    )


def burst_cpu_s(node: NodeProcess, bodies: list[dict[str, Any]]) -> tuple[float, Collector]:
    """Broker CPU seconds spent answering ``bodies`` (sent at once), and their replies."""
    assert node.proc is not None
    col = Collector(node.frontend)
    before = cpu_s(node.proc.pid)
    for body in bodies:
        col.send(**body)
    col.collect(timeout=45, linger=0.05)
    spent = cpu_s(node.proc.pid) - before
    col.close()
    return spent, col


def test_refusing_huge_prompts_costs_the_broker_next_to_nothing(
    llama_one: NodeProcess, counter: PromptCounter
) -> None:
    """The same bodies twice: with a bad field (400 before any size check), then
    valid (413). The difference is what the size check cost the broker; it is
    compared with what tokenizing the prompts costs, measured in the same run,
    so neither the machine's speed nor its load matters. Before the bound, the
    difference was all of it (6.1 s for these 28 prompts, against 9 ms)."""
    node = llama_one
    prompts = hostile_prompts()
    tokenizing_s = 0.0
    for prompt, times in Counter(prompts).items():
        started = time.process_time()
        assert counter(generate(prompt)) > LIMIT
        tokenizing_s += (time.process_time() - started) * times
    malformed = [
        {"id": f"bad-{i}", "op": "generate", "prompt": p, "max_tokens": 4, "priority": "urgent"}
        for i, p in enumerate(prompts)
    ]
    huge = [
        {"id": f"huge-{i}", "op": "generate", "prompt": p, "max_tokens": 4}
        for i, p in enumerate(prompts)
    ]
    burst_cpu_s(node, malformed[:4])  # warm-up: first-touch costs go to neither side
    bad_s, bad = burst_cpu_s(node, malformed)
    huge_s, col = burst_cpu_s(node, huge)
    bad.assert_exactly_one_final_each()
    col.assert_exactly_one_final_each()
    assert {bad.final(b["id"])["code"] for b in malformed} == {400}
    assert {col.final(b["id"])["reason"] for b in huge} == {"too_large"}  # the broker's 413
    assert huge_s - bad_s < 0.05 * tokenizing_s, (
        f"refusing {len(huge)} oversized prompts cost the broker {huge_s * 1000:.0f} ms of "
        f"CPU, the same bodies malformed {bad_s * 1000:.0f} ms; tokenizing them "
        f"{tokenizing_s * 1000:.0f} ms"
    )


def test_a_prompt_too_costly_to_count_on_the_loop_is_left_to_its_worker(
    llama_one: NodeProcess, counter: PromptCounter
) -> None:
    """18 KB of HTML tags: 6001 tokens, but nothing in the bytes forces a token
    boundary, so the bound is ~1900 tokens; counting it takes 0.6 s. The worker
    counts it (it would anyway) and refuses it; the next request is served."""
    prompt = "<b><i>" * 3_000
    found = counter.bounded(generate(prompt), LIMIT)
    assert not found.exact and found.tokens <= LIMIT  # what makes this the case
    with llama_one.client(wait_ms=30_000) as c:
        with pytest.raises(TooLarge, match="exceed context window of 2048"):
            c.generate(prompt, max_tokens=4)
        assert c.generate("Once upon a time", max_tokens=4).text


def test_gemma_3s_vocabulary_bounds_tokens_from_bytes(counter: PromptCounter) -> None:
    """The facts the bound draws on: no token is longer than 48 bytes (16 em
    dashes), none holds a letter or digit before a space, and newlines and tabs
    join nothing but themselves."""
    vocab = counter.vocab
    assert vocab.longest == 48 and vocab.added == 1  # BOS
    assert vocab.pair_max is not None
    for x in (string.ascii_letters + string.digits).encode():
        assert vocab.pair_max[x * 256 + ord(" ")] == 1
    for x in b"\n\t":
        joined = [y for y in range(256) if vocab.pair_max[x * 256 + y] > 1]
        assert joined == [x]


def random_text(rng: random.Random) -> str:
    """Up to ~3 KB of a mix of what makes tokenizing differ: words, runs of
    spaces, newlines and tabs, HTML tags, digits, CJK, emoji, a literal ▁,
    control-token text (one token each, as the worker parses it), long-token
    text (em dashes)."""
    parts = [
        "hello", " world", "  ", " " * 40, "\n", "\n\n\n", "\t", "<b>", "</td>", "2024",
        "日本", "😀", "▁", "<start_of_turn>", "—" * 20, ".", ", ",
        "café", "x", "def f(x):", "\r\n", "<unused7>", "a\n",
        "<end_of_turn>", "<pad>", "<bos>", "<eos>", "<unk>", "<mask>", "<start_of_image>",
        "[multimodal]", "<start_of_turn>user\n", "<pad>" * 40, "<", ">", "<<b>>", "<unused7>0",
    ]  # fmt: skip
    return "".join(rng.choices(parts, k=rng.randint(1, 300)))


#: The control-token texts of ``random_text`` (one token each with parse_special).
CONTROLS = [c.encode() for c in ("<start_of_turn>", "<end_of_turn>", "<pad>", "<bos>", "<eos>")]
CONTROLS += [c.encode() for c in ("<unk>", "<mask>", "<unused7>")]


def whole_count(counter: PromptCounter, text: bytes) -> int:
    """What the worker counts: llama_tokenize of the whole text with BOS and
    parse_special, as ``Llama.tokenize(text, special=True)`` does for a str prompt."""
    vocab = counter.vocab._vocab
    n = llama_c.llama_tokenize(vocab, text, len(text), None, 0, True, True)
    return -int(n) if n < 0 else int(n)


def test_the_bound_never_exceeds_the_count_and_pieces_add_up(counter: PromptCounter) -> None:
    """Against the count the worker makes (control-token text parsed): the
    bound's reasoning holds for it too, since a control token covers exactly
    its text's bytes. Control-token text is counted on the loop unless it is
    too dense (a tokenize call per 16 bytes at most)."""
    vocab = counter.vocab
    rng = random.Random(11)
    with_controls = 0
    for _ in range(300):
        text = random_text(rng).encode()
        exact = whole_count(counter, text)
        assert vocab.count(text) == exact, text
        low = vocab.lower_bound(text)
        assert low is not None and low <= exact, text
        for limit in (exact - 1, exact, 10**6):
            found = vocab.bounded(text, limit)
            if found.exact:
                assert found.tokens == exact, text
            else:
                assert found.tokens <= exact, text
        controls = any(c in text for c in CONTROLS)
        if len(text) <= LOOP_BYTES and not controls:  # and no stretch is too long to cut
            assert vocab.bounded(text, 10**6).exact, text
        with_controls += controls and vocab.bounded(text, 10**6).exact
    assert with_controls >= 200, with_controls  # 275 here


def test_a_huge_prompt_is_refused_without_tokenizing(
    counter: PromptCounter, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_tokenizing(text: bytes, *_: bool) -> int:
        raise AssertionError(f"tokenized {len(text)} bytes")

    monkeypatch.setattr(counter.vocab, "_tokens", no_tokenizing)
    for prompt in set(hostile_prompts()):
        found = counter.bounded(generate(prompt), LIMIT)
        assert not found.exact and found.tokens > LIMIT


def test_control_token_text_is_counted_as_the_worker_counts_it(
    make_node: NodeFactory, counter: PromptCounter
) -> None:
    """A Gemma transcript near the context's limit: ``<start_of_turn>`` is one
    token to the worker (llama-cpp-python tokenizes a str prompt with
    parse_special) and was 6 to the broker's counter, which refused the prompt
    413 though the worker would serve it. The broker's count now equals the
    worker's ``usage.prompt_tokens``, within its budget."""
    n_ctx, max_tokens = 768, 4
    turn = "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\nhello<end_of_turn>\n"
    prompt = turn * (LOOP_BYTES // len(turn))
    limit = n_ctx - max_tokens
    as_text = counter.vocab.added + counter.vocab._tokens(prompt.encode(), parse_special=False)
    assert as_text > limit  # what the broker counted
    found = counter.bounded(generate(prompt), limit)
    assert found.exact and found.tokens == whole_count(counter, prompt.encode())
    assert limit * 3 // 4 < found.tokens <= limit
    node = counting(make_node(workers={"engine": "llama", "count": 1}, model={"n_ctx": n_ctx}))
    with node.client(wait_ms=30_000) as c:
        reply = c.generate(prompt, max_tokens=max_tokens, temperature=0.0)
    assert reply.usage["prompt_tokens"] == found.tokens == counter(generate(prompt))
