"""Slots of one llama context, with the real model: a slot's output does not
depend on its neighbours, a cancel stops one slot and no other, and a reused
slot never shows its previous request (issue 10's engine tests).

Greedy sampling everywhere, so outputs compare exactly. llama.cpp's batched
kernels may round differently near a tie: a slot beside others may then pick
the other of two near-equal tokens. The neighbour test checks that every text
that differs does so first at a near tie, and allows ``NEAR_TIE_DIFFS`` of twenty.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import llama_cpp.llama_cpp as llama_c
import numpy as np
import pytest

import node.llama.engine
from broker.errors import Cancelled, EdgeNodeError
from node.engine import EngineSpec, Outcome
from node.llama.engine import SLOW_STEP_S, LlamaEngine
from node.llama.slots import batch_order
from node.llama.ubatch import DecodePlan
from node.model import resolve_model

pytestmark = [pytest.mark.system, pytest.mark.timeout(240)]

TOKENS = 48
#: Prompts of the twenty whose text beside neighbours may differ from their text
#: alone, each at a near tie (the issue's 19 of 20). Seen: 0 on an AMD EPYC (Zen 4),
#: every slot's logits bitwise its single-slot ones, since each prompt chunk is
#: evaluated whole (``node.llama.slots.batch_order``); before that, llama.cpp cut a
#: chunk beside a decoding slot and 2 of 20 differed there ("Step 1: open the
#: valve.", "In 1969, the first humans"), 1 of 20 on an AVX2 EPYC and a Xeon.
NEAR_TIE_DIFFS = 1
PROMPTS = [
    "Once upon a time",
    "The robot arm moved",
    "In the kitchen, the lights",
    "def fibonacci(n):",
    "Q: What is the capital of Italy?\nA:",
    "The weather today is",
    "List three colors:",
    "My favourite food is",
    "The gateway restarted because",
    "import numpy as np\n",
    "Dear customer, thank you for",
    "The history of the bicycle",
    "Temperature sensor readings:",
    "Step 1: open the valve.",
    "A haiku about the sea:",
    "The main function of the heart is",
    "To reset the device, press",
    "SELECT name FROM users WHERE",
    "The battery level dropped to",
    "In 1969, the first humans",
]


def spec(slots: int) -> EngineSpec:
    return EngineSpec(
        "llama", str(resolve_model("default")), n_ctx=2048, n_batch=512, threads=1, slots=slots
    )


@pytest.fixture(scope="module")
def one() -> Iterator[LlamaEngine]:
    engine = LlamaEngine(spec(1))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def four() -> Iterator[LlamaEngine]:
    engine = LlamaEngine(spec(4))
    yield engine
    engine.close()


def greedy(prompt: str, tokens: int = TOKENS) -> dict[str, Any]:
    return {"op": "generate", "prompt": prompt, "max_tokens": tokens, "temperature": 0.0}


def whole(prompt: str) -> dict[str, Any]:
    """``greedy(prompt)`` evaluated from its first token, whatever the slot cached."""
    return greedy(prompt) | {"cache_prompt": False}


def alone(engine: LlamaEngine, prompt: str, tokens: int = TOKENS) -> str:
    return str(engine.run(greedy(prompt, tokens), threading.Event(), lambda _: None)["text"])


@pytest.fixture(scope="module")
def solo(one: LlamaEngine) -> Callable[[str], str]:
    """``alone(one, prompt)``, each prompt's text computed once for the module: greedy
    decoding makes it a function of the prompt, and the cancel tests compare against
    prompts the twenty-prompt test has already run alone (48 tokens on one thread each)."""
    return functools.cache(lambda prompt: alone(one, prompt))


def step_until_idle(engine: LlamaEngine, ended: dict[int, Outcome]) -> None:
    while engine.busy:
        ended.update(engine.step())


def test_each_slot_writes_what_it_writes_alone(
    solo: Callable[[str], str],
    one: LlamaEngine,
    four: LlamaEngine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Twenty prompts through four slots, a new one joining every 5 steps while a
    slot is free: prompts are evaluated in the same batches as other slots'
    decode steps. A text that differs from its single-slot text must differ first
    at a near tie (both runs' two best logits within ``TIE_LOGITS``), where another
    batch shape's rounding may pick the other token; a neighbour's text leaking in
    would change confident tokens. At most ``NEAR_TIE_DIFFS`` such prompts."""
    expected = {i: solo(p) for i, p in enumerate(PROMPTS)}
    four_picks = slot_picks(four, monkeypatch)
    ended: dict[int, Outcome] = {}
    streamed: dict[int, list[str]] = {i: [] for i in range(len(PROMPTS))}
    waiting, steps = list(range(len(PROMPTS))), 0
    while waiting or four.busy:
        if waiting and four.busy < four.slots and steps % 5 == 0:
            i = waiting.pop(0)
            four.submit(i, greedy(PROMPTS[i]), threading.Event(), streamed[i].append)
        ended.update(four.step())
        steps += 1
    texts = {i: outcome["text"] for i, outcome in ended.items() if isinstance(outcome, dict)}
    assert len(texts) == len(PROMPTS)
    assert all("".join(streamed[i]) == texts[i] for i in texts)  # the stream is the text
    assert all(ended[i]["usage"]["completion_tokens"] == TOKENS for i in texts)  # type: ignore[index]
    differ = [i for i in texts if texts[i] != expected[i]]
    assert len(differ) <= NEAR_TIE_DIFFS, [(PROMPTS[i], expected[i], texts[i]) for i in differ]
    one_picks = slot_picks(one, monkeypatch)
    for i in differ:  # run alone again, recording its picks: greedy, so the same text
        one_picks.clear()
        assert alone(one, PROMPTS[i]) == expected[i]
        (solo_run,) = one_picks.values()
        at = next(
            k for k, (a, b) in enumerate(zip(solo_run, four_picks[i], strict=False)) if a[0] != b[0]
        )
        margins = (solo_run[at][1], four_picks[i][at][1])
        assert min(margins) < TIE_LOGITS, (PROMPTS[i], at, margins)


def slot_picks(
    engine: LlamaEngine, monkeypatch: pytest.MonkeyPatch
) -> dict[int, list[tuple[int, float]]]:
    """Records each request's logits rows as ``engine`` samples them: per rid, (the
    row's best token, the margin in logits between its two highest)."""
    picks: dict[int, list[tuple[int, float]]] = {}
    sample = engine._sample

    def recorded(slot: Any, logits: np.ndarray) -> Any:
        second, first = np.partition(logits, -2)[-2:]
        picks.setdefault(slot.job.rid, []).append((int(np.argmax(logits)), float(first - second)))
        return sample(slot, logits)

    monkeypatch.setattr(engine, "_sample", recorded)
    return picks


def test_a_short_prompt_arriving_during_a_long_prompts_evaluation_starts_at_the_next_step(
    four: LlamaEngine,
) -> None:
    """Shortest remaining prompt first: a short prompt that arrives while a long one
    is being evaluated gets its first token at the next step, not after the long
    one's last chunk (a new user saw two short streams wait 22 s behind an
    1,800-token prompt, the worker's slots free)."""
    long_text = " ".join(["orange mango"] * 700)  # ~1,400 tokens: three n_batch chunks
    ended: dict[int, Outcome] = {}
    streams: dict[int, list[str]] = {0: [], 1: []}
    four.submit(0, greedy(long_text, 2), threading.Event(), streams[0].append)
    ended.update(four.step())  # the long prompt's first chunk
    four.submit(1, greedy("The weather today is", 4), threading.Event(), streams[1].append)
    ended.update(four.step())
    assert streams[1], "the short prompt waited for the long one's evaluation"
    assert not streams[0] and 0 not in ended  # the long one is still being evaluated
    step_until_idle(four, ended)
    long_done, short_done = ended[0], ended[1]
    assert isinstance(long_done, dict) and isinstance(short_done, dict)
    assert long_done["usage"]["prompt_tokens"] > 2 * four.n_batch
    assert short_done["usage"]["completion_tokens"] == 4


def test_prompts_evaluated_together_are_cut_where_they_are_cut_alone(
    four: LlamaEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three long prompts arriving beside a generating slot: each is evaluated in the
    chunks it gets alone (``prompt_rows`` each, the last shorter), so it rounds alike.
    The step's budget beside generating slots (``PROMPT_BESIDE_DECODE``) used to give
    the third prompt the two rows left after the first two's chunks: its prompt was
    then cut in other places than alone."""
    calls: list[list[tuple[int, int]]] = []
    decode = llama_c.llama_decode

    def recorded(ctx: Any, batch: Any) -> int:
        calls.append([(batch.seq_id[i][0], batch.pos[i]) for i in range(batch.n_tokens)])
        return int(decode(ctx, batch))

    monkeypatch.setattr(llama_c, "llama_decode", recorded)
    ended: dict[int, Outcome] = {}
    four.submit(0, whole(PROMPTS[1]), threading.Event(), lambda _: None)
    while not any(s.job is not None and s.job.next_token is not None for s in four._slots):
        ended.update(four.step())
    words = {1: 70, 2: 80, 3: 90}  # two tokens a word: 141-181 tokens, three chunks each
    for rid, n in words.items():
        four.submit(rid, whole(" ".join(["orange mango"] * n)), threading.Event(), lambda _: None)
    seq_of = {s.job.rid: s.seq for s in four._slots if s.job is not None}
    calls.clear()
    step_until_idle(four, ended)
    rows = four.prompt_rows
    for rid in words:
        length = ended[rid]["usage"]["prompt_tokens"]  # type: ignore[index]
        chunks = [
            n for n in (sum(q == seq_of[rid] and p < length for q, p in c) for c in calls) if n
        ]
        expected = [rows] * (length // rows) + ([length % rows] if length % rows else [])
        assert chunks == expected, (rid, length)


def test_after_a_starved_step_a_decode_step_can_be_aborted_inside_llama_decode(
    four: LlamaEngine,
) -> None:
    """A step slower than SLOW_STEP_S (a host starving the worker's threads) puts the
    abort callback back on decode-only steps, so a cancel is seen after a graph node,
    not after a step of seconds: a starved worker whose step outlasted the broker's
    cancel grace was killed as hung and reloaded."""
    ended: dict[int, Outcome] = {}
    for i in (0, 1):
        four.submit(i, greedy(PROMPTS[i + 1]), threading.Event(), lambda _: None)
    for _ in range(4):  # the prompts, then decode-only steps
        ended.update(four.step())
    four.last_step_s = 0.0  # the last step was fast (set, not timed: the test may be slow)
    before = four.steps
    ended.update(four.step())
    assert four.steps == before + 1  # a decode step after a fast one: no callback inside it
    four.last_step_s = SLOW_STEP_S  # as if the host had starved the last step
    before = four.steps
    ended.update(four.step())
    # ggml called the callback after each of the step's graph nodes (it counts them).
    assert four.steps > before + 100
    step_until_idle(four, ended)
    assert not any(isinstance(outcome, EdgeNodeError) for outcome in ended.values())


def run_with_a_cancel(
    engine: LlamaEngine, prompts: list[str], victim: str, when: str
) -> dict[int, Outcome]:
    """``prompts`` in flight together, each evaluated whole (``cache_prompt: false``:
    what the slots cached in earlier tests must not change the rounding); ``victim``
    (its index in ``prompts``) is cancelled after 10 decode steps (``when =
    "decoding"``), or while its long prompt is being evaluated, inside
    ``llama_decode`` (``"prefill"``)."""
    ended: dict[int, Outcome] = {}
    flags = {i: threading.Event() for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        if i != prompts.index(victim) or when == "decoding":
            engine.submit(i, whole(prompt), flags[i], lambda _: None)
    for _ in range(10):
        ended.update(engine.step())
    victim_id = prompts.index(victim)
    if when == "decoding":
        flags[victim_id].set()
    else:
        engine.submit(victim_id, whole(victim), flags[victim_id], lambda _: None)
        # The victim's first chunk (512 tokens) takes seconds on one thread.
        threading.Timer(0.3, flags[victim_id].set).start()
    step_until_idle(engine, ended)
    return ended


@pytest.mark.parametrize("when", ["decoding", "prefill"])
def test_cancelling_one_slot_leaves_the_others_unchanged(
    one: LlamaEngine, four: LlamaEngine, when: str
) -> None:
    others = [PROMPTS[1], PROMPTS[2], PROMPTS[12]]
    victim = PROMPTS[4] if when == "decoding" else " ".join(["word"] * 1500)
    expected = [one.run(whole(p), threading.Event(), lambda _: None)["text"] for p in others]
    aborts = four.aborts
    ended = run_with_a_cancel(four, [*others, victim], victim, when)
    cancelled = ended[3]
    assert isinstance(cancelled, Cancelled)
    if when == "decoding":
        solo = one.run(whole(victim), threading.Event(), lambda _: None)["text"]
        assert cancelled.partial_text and solo.startswith(cancelled.partial_text)
    else:
        assert "prompt evaluation" in cancelled.message
        assert four.aborts == aborts + 1  # stopped inside llama_decode, others rolled back
    for i, text in enumerate(expected):
        outcome = ended[i]
        assert isinstance(outcome, dict) and outcome["text"] == text, (others[i], outcome)
    assert four.busy == 0


def test_a_reused_slot_never_shows_its_previous_request(one: LlamaEngine) -> None:
    secret = "Repeat after me: PINEAPPLE PINEAPPLE PINEAPPLE PINEAPPLE PINEAPPLE"
    question = "The capital of France is"
    clean = alone(one, question)
    assert "PINEAPPLE" in alone(one, secret, 16)
    result = one.run(greedy(question), threading.Event(), lambda _: None)
    assert result["text"] == clean and "PINEAPPLE" not in result["text"]
    assert result["usage"]["cached_tokens"] == 1  # BOS: nothing of the secret


#: Logits; a greedy pick whose two best logits are closer than this is a near tie, which
#: the rounding of another chunking may flip. Reuse moved the logits by 0.01-0.15 on an
#: AVX-512 machine (2026-12-02, below); a slot holding a wrong prefix moves them by whole
#: units and changes confident tokens.
TIE_LOGITS = 0.25


def greedy_picks(
    engine: LlamaEngine, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[int | None, float]]:
    """Records each greedy pick of ``engine`` (one slot): (token, the margin in logits
    between its row's two highest logits)."""
    picks: list[tuple[int | None, float]] = []
    argmax = engine._argmax

    def recorded(logits: np.ndarray) -> int | None:
        token = argmax(logits)
        second, first = np.partition(logits, -2)[-2:]
        picks.append((token, float(first - second)))
        return token

    monkeypatch.setattr(engine, "_argmax", recorded)
    return picks


def test_a_shared_prefix_is_reused_and_changes_an_answer_only_at_a_near_tie(
    one: LlamaEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fresh prompt (~100 tokens) and the reused one's tail (~10) take the same
    flash-attention kernel (``node.engine.FLASH_PROMPT_ROWS``: the texts differed at
    confident tokens when a whole prompt went in one tiled chunk), but not the same
    rounding everywhere: on an AVX-512 machine 2 of 8 reused greedy answers changed
    with flash attention (none without, none with prompt chunks of at most 7 rows),
    both at near ties (margins 0.154 / 0.012 and 0.127 / 0.117 logits). So where the
    texts differ, both runs' first different pick must have been a near tie."""
    system = "You are the controller of a greenhouse. Answer in one short sentence. " * 6
    shared = len(one.vocab.tokenize(system.encode(), special=True))
    picks = greedy_picks(one, monkeypatch)
    for before, question in (
        ("Is it too hot?", "Should I water?"),
        ("Is it night?", "Open the vents?"),
    ):
        prompt = system + f"Q: {question}\nA:"
        alone(one, "Unrelated text to empty the cache of its prefix.", 4)
        picks.clear()
        fresh = one.run(greedy(prompt), threading.Event(), lambda _: None)
        fresh_picks = list(picks)
        assert fresh["usage"]["cached_tokens"] <= 1
        alone(one, system + f"Q: {before}\nA:", 8)
        picks.clear()
        reused = one.run(greedy(prompt), threading.Event(), lambda _: None)
        assert reused["usage"]["cached_tokens"] >= shared  # BOS + the system prompt
        pairs = zip(fresh_picks, picks, strict=False)
        differ = [i for i, (a, b) in enumerate(pairs) if a[0] != b[0]]
        if differ:
            at = differ[0]
            margins = (fresh_picks[at][1], picks[at][1])
            assert min(margins) < TIE_LOGITS, (question, at, margins)
        else:
            assert reused["text"] == fresh["text"]


def test_cache_prompt_false_evaluates_the_whole_prompt_and_repeats_its_answer(
    one: LlamaEngine,
) -> None:
    """A reused prefix leaves only the tail to evaluate, in other chunks than the
    whole prompt's: near a tie that changes a greedy answer (README "Workers and
    slots"). Seen here, with "Once upon a time in a small village": after 7 of 8
    previous requests sharing 5-8 of its tokens (itself included) the reused answer
    was "a young man named John ..." or differed later, not the fresh "a family of
    four ...". Without reuse it is evaluated the same way whatever the slot held."""
    prompt = "Once upon a time in a small village"
    request = whole(prompt)
    first = one.run(request, threading.Event(), lambda _: None)
    assert first["usage"]["cached_tokens"] == 0
    for before in ("Once upon a time in a small town", prompt, "Once upon"):
        alone(one, before, 8)
        reused = one.run(greedy(prompt), threading.Event(), lambda _: None)
        assert reused["usage"]["cached_tokens"] >= 5  # the slot held a shared prefix
        alone(one, before, 8)
        again = one.run(request, threading.Event(), lambda _: None)
        assert again["usage"]["cached_tokens"] == 0
        assert again["text"] == first["text"], before


def test_a_full_engine_refuses_and_a_failed_prompt_keeps_the_slot_free(one: LlamaEngine) -> None:
    flag = threading.Event()
    one.submit(1, greedy("Hello", 4), flag, lambda _: None)
    with pytest.raises(EdgeNodeError, match="no free slot"):
        one.submit(2, greedy("Hello"), threading.Event(), lambda _: None)
    flag.set()
    assert dict(one.step())[1].code == 499  # type: ignore[union-attr]
    with pytest.raises(EdgeNodeError, match="json_schema"):
        one.submit(
            3,
            greedy("Hi") | {"json_schema": {"type": "string", "pattern": "\\d"}},
            threading.Event(),
            lambda _: None,
        )
    assert one.busy == 0


def fast_and_chain(
    engine: LlamaEngine,
    monkeypatch: pytest.MonkeyPatch,
    fast: str,
    requests: list[dict[str, Any]],
) -> list[tuple[int | None, int]]:
    """Run ``requests`` in ``engine``'s slots together until all end. At every
    token, (what the engine's fast path ``fast`` picked: a method whose last
    argument is the row's logits, None if it declined; what ``llama_sampler_sample``
    picks from the same batch row with a twin of the request's chain). A twin is
    made from the same request (same seed) and draws once per token, as the
    request's own chain does on either path, so the two stay in step."""
    twins = [engine._sampler(request) for request in requests]
    pairs: list[tuple[int | None, int]] = []
    current = [0, 0]  # the rid being sampled and its batch row (_logits, then _sample)
    sample, method, logits_of = engine._sample, getattr(engine, fast), engine._logits

    def logits_noting(row: int) -> Any:
        current[1] = row
        return logits_of(row)

    def sample_noting(slot: Any, logits: np.ndarray) -> Any:
        current[0] = slot.job.rid
        return sample(slot, logits)

    def both(*args: Any) -> int | None:
        token: int | None = method(*args)
        twin = twins[current[0]]
        pairs.append((token, llama_c.llama_sampler_sample(twin, engine._ctx, current[1])))
        return token

    monkeypatch.setattr(engine, "_logits", logits_noting)
    monkeypatch.setattr(engine, "_sample", sample_noting)
    monkeypatch.setattr(engine, fast, both)
    ended: dict[int, Outcome] = {}
    try:
        for rid, request in enumerate(requests):
            engine.submit(rid, request, threading.Event(), lambda _: None)
        step_until_idle(engine, ended)
    finally:
        for twin in twins:
            llama_c.llama_sampler_free(twin)
    assert len(ended) == len(requests)
    return pairs


def test_the_greedy_argmax_picks_what_the_sampler_chain_picks(
    four: LlamaEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A greedy request's token comes from ``LlamaEngine._argmax`` (one argmax over
    its logits row), not ``llama_sampler_sample``: at every step of four slots
    decoded together, the greedy chain (special-token mask, greedy) picks the
    same token from the same row."""
    requests = [greedy(prompt, 64) for prompt in PROMPTS[:4]]
    pairs = fast_and_chain(four, monkeypatch, "_argmax", requests)
    assert len(pairs) >= 4 * 64
    assert [fast for fast, _ in pairs] == [slow for _, slow in pairs]


#: (seed, temperature, top_p) per slot: cool and hot, with and without a top_p cut.
SETTINGS = [
    [(1, 0.8, 0.95), (7, 1.0, 1.0), (42, 1.5, 0.9), (1234, 0.3, 0.5)],
    [(99, 0.8, 0.95), (5, 2.0, 1.0), (31337, 0.6, 0.8), (2, 1.2, 0.99)],
]


@pytest.mark.parametrize("settings", SETTINGS)
def test_the_top_k_candidates_give_what_the_whole_chain_gives(
    four: LlamaEngine,
    monkeypatch: pytest.MonkeyPatch,
    settings: list[tuple[int, float, float]],
) -> None:
    """A sampled request without a schema runs its chain over its row's 40 highest
    unmasked logits (``LlamaEngine._top_k``), not the whole vocabulary: at every
    step of four slots decoded together, each with its own seed, temperature and
    top_p, a twin of its chain given the whole row picks the same token. The
    fast path must really be taken: it declines only on a NaN or a tie."""
    requests = [
        {"op": "generate", "prompt": prompt, "max_tokens": 72, "temperature": temperature}
        | {"seed": seed, "top_p": top_p}
        for prompt, (seed, temperature, top_p) in zip(PROMPTS[4:8], settings, strict=True)
    ]
    pairs = fast_and_chain(four, monkeypatch, "_top_k", requests)
    assert len(pairs) >= 4 * 64
    taken = [(fast, slow) for fast, slow in pairs if fast is not None]
    assert len(taken) >= 0.9 * len(pairs)
    assert [fast for fast, _ in taken] == [slow for _, slow in taken]


def test_a_schema_requests_grammar_judges_the_top_k_token(
    four: LlamaEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``json_schema`` request takes the top-K path as any sampled request does, and
    its grammar judges the token after (llama.cpp's common sampler: the whole chain
    with the grammar only when the grammar refuses that token); its answer fits."""
    fast: list[int] = []
    top_k = four._top_k

    def noting(job: Any, logits: np.ndarray) -> int | None:
        fast.append(job.rid)
        return top_k(job, logits)

    monkeypatch.setattr(four, "_top_k", noting)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    ask = {"op": "generate", "prompt": "A JSON object:", "max_tokens": 48, "temperature": 0.8,
           "seed": 7}  # fmt: skip
    four.submit(1, ask | {"json_schema": schema}, threading.Event(), lambda _: None)
    four.submit(2, ask, threading.Event(), lambda _: None)
    ended: dict[int, Outcome] = {}
    step_until_idle(four, ended)
    assert set(ended) == {1, 2} and not isinstance(ended[1], EdgeNodeError)
    assert set(fast) == {1, 2}
    answer = ended[1]
    assert isinstance(answer, dict) and answer["finish_reason"] == "stop", answer
    assert isinstance(json.loads(answer["text"])["n"], int)


def test_costly_grammars_in_one_step_take_turns_and_each_answer_still_fits(
    four: LlamaEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One step runs at most one grammar once its grammars took ``GRAMMAR_STEP_S``;
    the others sample from a copy of their row at a later step, longest waiting
    first. Three requests each too costly to filter in the same step paused a
    neighbour's stream 3.2 s (break-it pass, session 18): the pause was one budget
    per costly request. With the bound at 0 every grammar after a step's first waits,
    as a costly one's would; the answers still fit their schema."""
    monkeypatch.setattr(node.llama.engine, "GRAMMAR_STEP_S", 0.0)
    per_step: list[list[int]] = []
    grammar_sample, step = four._grammar_sample, four.step

    def noting(job: Any, logits: np.ndarray) -> int:
        per_step[-1].append(job.rid)
        return grammar_sample(job, logits)

    def stepping() -> list[tuple[int, Outcome]]:
        per_step.append([])
        return step()

    monkeypatch.setattr(four, "_grammar_sample", noting)
    monkeypatch.setattr(four, "step", stepping)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
        "required": ["name", "n"],
    }
    before = four.grammar_deferrals
    for rid in (1, 2, 3):
        ask = greedy(f"{PROMPTS[rid]} As JSON:", 40) | {"json_schema": schema}
        four.submit(rid, ask, threading.Event(), lambda _: None)
    four.submit(4, greedy(PROMPTS[0], 40), threading.Event(), lambda _: None)
    ended: dict[int, Outcome] = {}
    while four.busy:
        ended.update(four.step())
    assert four.grammar_deferrals - before >= 20
    assert max(len(rids) for rids in per_step) == 1
    ran = [rid for rids in per_step for rid in rids]
    # Each waited its turn: while all three ran, no request had two samples in a row
    # of three (longest waiting first).
    while_all = ran[: 3 * min(ran.count(rid) for rid in (1, 2, 3))]
    assert all(len(set(while_all[i : i + 3])) == 3 for i in range(0, len(while_all) - 2, 3))
    for rid in (1, 2, 3):
        answer = ended[rid]
        assert isinstance(answer, dict) and answer["finish_reason"] == "stop", answer
        value = json.loads(answer["text"])
        assert isinstance(value["name"], str) and isinstance(value["n"], int), value
    plain = ended[4]
    assert isinstance(plain, dict) and plain["usage"]["completion_tokens"] == 40, plain


def test_the_decode_plan_comes_from_the_load_timings_and_orders_a_decode_step(
    four: LlamaEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine timed a ubatch of each size 1..4 at load, its plan is the one
    those timings give, and a step of four decoding slots is ordered by it: each
    piece one ubatch (``node.llama.ubatch``; which plan depends on the CPU)."""
    assert sorted(four.ubatch_s) == [1, 2, 3, 4]
    assert all(0 < s < 5 for s in four.ubatch_s.values())
    assert four.plan == DecodePlan.from_costs(four.ubatch_s)
    orders: list[list[int]] = []
    decode = llama_c.llama_decode

    def recorded(ctx: Any, batch: Any) -> int:
        orders.append([batch.seq_id[i][0] for i in range(batch.n_tokens)])
        return int(decode(ctx, batch))

    monkeypatch.setattr(llama_c, "llama_decode", recorded)
    ended: dict[int, Outcome] = {}
    for rid in range(4):
        four.submit(rid, greedy(PROMPTS[rid], 8), threading.Event(), lambda _: None)
    step_until_idle(four, ended)
    assert len(ended) == 4
    four_decoding = [o for o in orders if sorted(o) == [0, 1, 2, 3]]
    assert four_decoding, orders
    assert all(o == batch_order(dict.fromkeys(range(4), 1), four.plan) for o in four_decoding)
