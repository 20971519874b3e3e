"""The llama.cpp engine (llama-cpp-python), with ``node.llama_log`` and ``node.llama_vocab``.

One ``Llama`` context, one sequence at a time (the object is not thread-safe;
llama-cpp-python#1529). Cancellation works at two depths:

* during decoding, generation is a Python generator: the stopping criterion
  checks the cancel flag after every sampled token and ends the loop;
* during prompt evaluation there is no Python hook, so llama.cpp's abort
  callback (``llama_set_abort_callback``, checked by ggml-cpu after each graph
  node) makes ``llama_decode`` return 2, which the wrapper raises as a
  ``RuntimeError``; the context is then reset and stays usable.

Special tokens never reach a client's text: they are masked at sampling (all
but end-of-generation; ``node.llama_vocab.special_tokens`` says which) and have
no text on the way out (``_TextTokenizer``).

Prompts are tokenized in pieces (``node.llama_vocab.Vocab.pieces``, cut by
``node.llama_pieces``), in time linear in their length: whole, llama.cpp's
special-token partition takes time growing with the square of the user-defined
tokens in them (64 KB of ``"a\\n"`` took 52 s inside ``Llama.tokenize``, long
enough for the broker to declare the worker stalled). A prompt is counted before
it is evaluated: one over the context is refused from its bytes or first pieces.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import llama_cpp.llama_cpp as llama_c
import numpy as np
from llama_cpp.llama_grammar import LlamaGrammar, json_schema_to_gbnf
from llama_cpp.llama_tokenizer import LlamaTokenizer

from broker.errors import Cancelled, InternalError, ProtocolError, TooLarge
from node.engine import Emit, EngineSpec, needs_flash_attn
from node.grammar import check_grammar, check_schema, trim_heap
from node.llama_log import LLAMA_LOG as _LOG
from node.llama_log import LOG_QUIET
from node.llama_pieces import PIECE_BYTES
from node.llama_vocab import TooManyTokens, Vocab, around_text, special_tokens

#: ``model.kv_type`` -> ggml_type (ggml.h), as llama_context_params.type_k/type_v take it.
KV_GGML_TYPES = {
    "f16": llama_cpp.GGML_TYPE_F16,
    "q8_0": llama_cpp.GGML_TYPE_Q8_0,
    "q4_0": llama_cpp.GGML_TYPE_Q4_0,
}
#: One line per KV cache (src/llama-kv-cache.cpp): "CPU KV buffer size =    30.00 MiB".
_KV_BUFFER = re.compile(r"KV buffer size\s*=\s*([0-9.]+) MiB")


def kv_buffer_bytes(load_log: str) -> int | None:
    """Bytes of KV cache llama.cpp reports in a context's load log (all caches:
    Gemma 3 has a sliding-window one and a full one), to 0.01 MiB; None if none."""
    sizes = [float(m) for m in _KV_BUFFER.findall(load_log)]
    return round(sum(sizes) * 2**20) if sizes else None


class LlamaEngine:
    """Runs ``generate`` and ``chat`` requests on a GGUF model.

    Args:
        spec: model path, ``n_ctx`` (tokens), ``n_batch`` (tokens), ``threads``
            (the cores this worker may really use: llama-cpp-python's default of
            ``cpu_count()//2`` ignores affinity and CPU quotas) and ``kv_type``
            (K and V cache type; a quantized one turns on flash attention,
            ``node.engine.needs_flash_attn``).

    ``kv_cache_bytes`` is the KV cache llama.cpp allocated, from its load log
    (None if it printed none).

    Raises:
        ValueError: llama.cpp could not load the model.
    """

    kind = "llama"

    def __init__(self, spec: EngineSpec) -> None:
        self.model = Path(spec.model_path).name
        if spec.kv_type not in KV_GGML_TYPES:
            raise ValueError(f"kv_type must be one of {', '.join(KV_GGML_TYPES)}")
        kv = KV_GGML_TYPES[spec.kv_type]
        with _model_params(use_extra_bufts=spec.repack), _LOG.capture() as load_log:
            # Typed as Any: the wrapper's return types are unions of str and dicts.
            self.llm: Any = llama_cpp.Llama(
                model_path=spec.model_path,
                n_ctx=spec.n_ctx,
                n_batch=spec.n_batch,
                n_threads=spec.threads,
                n_threads_batch=spec.threads,
                chat_format=spec.chat_format or None,
                type_k=kv,
                type_v=kv,
                flash_attn=needs_flash_attn(spec.kv_type),
                verbose=False,
            )
        self.kv_cache_bytes = kv_buffer_bytes("".join(load_log))
        self.n_ctx = self.llm.n_ctx()
        hidden, self._masked = special_tokens(self.llm)
        # ~0.6 s for Gemma 3: the tables that let prompts be tokenized in pieces.
        self.vocab = Vocab(llama_cpp.llama_model_get_vocab(self.llm.model))
        trim_heap()  # reading them freed ~6 MiB of heap that would stay resident
        self.llm.tokenizer_ = _TextTokenizer(self.llm, hidden, self.vocab)
        # A base model has no chat template; llama-cpp-python would then fall
        # back to the llama-2 format, which such models answer with nothing.
        has_template = "tokenizer.chat_template" in self.llm.metadata
        self.plain_chat = not spec.chat_format and not has_template
        self._cancelled: threading.Event | None = None
        self.steps = 0
        # Keep a reference: ctypes frees the trampoline when the object dies.
        self._abort_cb = llama_cpp.ggml_abort_callback(self._should_abort)
        llama_cpp.llama_set_abort_callback(self.llm.ctx, self._abort_cb, ctypes.c_void_p())

    def _should_abort(self, _data: ctypes.c_void_p) -> bool:
        # ggml-cpu calls this after every graph node: it doubles as the proof
        # that computation advances (measured: no slowdown of decode or prompt
        # evaluation on the default model, ~460 calls per token).
        self.steps += 1
        flag = self._cancelled
        return flag is not None and flag.is_set()

    def mask_special(self, input_ids: Any, scores: Any) -> Any:
        """Logits processor: special tokens other than end-of-generation cannot be sampled.

        ``scores`` is indexed by token id (llama-cpp-python hands the processors
        the candidates in vocabulary order, as its own ``logit_bias`` assumes).
        """
        scores[self._masked] = -np.inf
        return scores

    def run(self, job: dict[str, Any], cancelled: threading.Event, emit: Emit) -> dict[str, Any]:
        """See ``node.engine.Engine.run``.

        Raises:
            Cancelled: ``cancelled`` was set (partial text attached).
            TooLarge: the prompt does not fit ``n_ctx``.
            InternalError: llama.cpp failed otherwise.
        """
        counter = _TokenCounter(cancelled)
        kwargs: dict[str, Any] = {
            "max_tokens": job.get("max_tokens", 128),
            "stream": True,
            "logits_processor": llama_cpp.LogitsProcessorList([counter.count, self.mask_special]),
        }
        for name in ("temperature", "top_p", "seed", "stop"):
            if name in job:
                kwargs[name] = job[name]
        if "json_schema" in job:
            grammar = self.schema_grammar(job["json_schema"])  # bounded on every path
            if job["op"] == "generate" or self.plain_chat:
                kwargs["grammar"] = grammar
        pieces: list[str] = []
        finish = "stop"
        self._cancelled = cancelled
        try:
            for text, reason in self._stream(job, kwargs):
                if text:
                    pieces.append(text)
                    emit(text)
                if reason:
                    finish = reason
        except _CancelledInEngine:
            pass  # handled below with the partial text
        except ValueError as exc:
            if "exceed context window" in str(exc):
                raise TooLarge(f"{exc}: shorten the prompt or raise model.n_ctx") from exc
            raise InternalError(f"llama.cpp rejected the request: {exc}") from exc
        except RuntimeError as exc:
            self.llm.reset()  # an aborted decode leaves half-evaluated state behind
            if cancelled.is_set():
                raise Cancelled(
                    "cancelled during prompt evaluation", partial_text="".join(pieces)
                ) from exc
            raise InternalError(f"llama.cpp decode failed: {exc}") from exc
        finally:
            self._cancelled = None
            if "json_schema" in job:
                trim_heap()  # else the grammar sampler's freed vectors stay resident
        if cancelled.is_set():
            raise Cancelled("cancelled", partial_text="".join(pieces))
        usage = {
            "prompt_tokens": counter.prompt_tokens,
            "completion_tokens": counter.completion_tokens(finish),
        }
        return {"text": "".join(pieces), "finish_reason": finish, "usage": usage}

    def schema_grammar(self, schema: dict[str, Any]) -> LlamaGrammar:
        """A llama.cpp grammar that admits only JSON valid for ``schema``.

        The schema and its grammar must stay within ``node.grammar``'s bounds,
        and llama.cpp must parse the grammar: llama-cpp-python adds whatever
        ``llama_sampler_init_grammar`` returns to its sampler chain, NULL
        included, and the worker then crashes at the first token (SIGSEGV).

        Raises:
            TooLarge: the schema or its grammar is beyond a bound (413).
            ProtocolError: the converter or llama.cpp cannot use the schema (400).
        """
        check_schema(schema)
        try:
            gbnf = json_schema_to_gbnf(json.dumps(schema))
        except Exception as exc:  # the converter raises assorted types on bad schemas
            raise ProtocolError(f"json_schema is not usable: {exc}") from exc
        check_grammar(gbnf)
        with _LOG.at_level(LOG_QUIET), _LOG.capture() as lines:
            sampler = llama_cpp.llama_sampler_init_grammar(
                self.llm._model.vocab, gbnf.encode(), b"root"
            )
        if not sampler:
            # The parser's own message goes to fd 2 (the worker's log), not to the callback.
            why = " ".join(line.strip() for line in lines)[:200] or "no reason given"
            raise ProtocolError(
                f"json_schema is not usable: llama.cpp cannot parse its grammar ({why}; "
                "the worker's log has the details). A pattern's \\d, \\w or \\s is a "
                "common cause: write [0-9], [a-zA-Z0-9_] or [ \\t\\n] instead"
            )
        llama_cpp.llama_sampler_free(sampler)
        return LlamaGrammar.from_string(gbnf, verbose=False)

    def _stream(self, job: dict[str, Any], kwargs: dict[str, Any]) -> Iterator[tuple[str, str]]:
        """(text, finish_reason) per chunk of the llama-cpp-python stream."""
        if job["op"] == "chat" and self.plain_chat:
            kwargs["stop"] = [*job.get("stop", []), *QA_STOPS]
            first = True
            prompt = self._prompt(qa_prompt(job["messages"]))
            for chunk in self.llm.create_completion(prompt, **kwargs):
                choice = chunk["choices"][0]
                text = choice.get("text") or ""
                if first and text:
                    text, first = text.lstrip(), False
                yield text, choice.get("finish_reason") or ""
        elif job["op"] == "chat":
            if "json_schema" in job:
                kwargs["response_format"] = {"type": "json_object", "schema": job["json_schema"]}
            for chunk in self.llm.create_chat_completion(messages=job["messages"], **kwargs):
                choice = chunk["choices"][0]
                yield choice["delta"].get("content") or "", choice.get("finish_reason") or ""
        else:
            for chunk in self.llm.create_completion(self._prompt(job["prompt"]), **kwargs):
                choice = chunk["choices"][0]
                yield choice.get("text") or "", choice.get("finish_reason") or ""

    def _prompt(self, text: str) -> str | list[int]:
        """What ``create_completion`` gets for ``text``: its token ids, tokenized in
        pieces (``Vocab.pieces``, parse_special as llama-cpp-python does for a str
        prompt) with the tokens ``around_text`` says go around them, or ``text``
        itself when the vocabulary does not qualify.

        Given ids, llama-cpp-python adds no BOS and refuses as for text (ids >=
        n_ctx, ``Llama._create_completion``), and ``Llama.generate`` reuses the
        KV cache's common prefix with them as with text. Each piece is a compute
        step (the worker's progress) and a point where a cancel is seen.

        Raises:
            TooLarge: the prompt leaves no room in ``n_ctx`` (413), found from
                its bytes or its first pieces before anything is evaluated.
            _CancelledInEngine: the request was cancelled meanwhile.
        """
        if self.vocab.pair_max is None:
            return text
        head, tail = around_text(self.llm)
        room = self.n_ctx - 1 - len(head) - len(tail)  # at least one token to generate
        ids = list(head)
        try:
            for piece in self.vocab.pieces(text.encode(), special=True, limit=room):
                ids += piece
                self.steps += 1
                if self._cancelled is not None and self._cancelled.is_set():
                    raise _CancelledInEngine
        except TooManyTokens as exc:
            needed = exc.tokens + len(head) + len(tail)
            raise TooLarge(
                f"Requested tokens (at least {needed}) exceed context window of "
                f"{self.n_ctx}: shorten the prompt or raise model.n_ctx"
            ) from None
        return ids + tail


#: Where a plain Q/A transcript's answer ends: the model starting the next turn.
QA_STOPS = ["\nQ:"]


def qa_prompt(messages: list[dict[str, str]]) -> str:
    """Render chat messages as a plain ``Q: ... / A: ...`` transcript.

    For base (not instruction-tuned) models without a chat template, such as
    the default Gemma 3 270M: a question/answer frame is the prompt shape they
    continue most reliably.
    """
    lines = []
    for m in messages:
        if m["role"] == "system":
            lines.append(m["content"] + "\n")
        elif m["role"] == "user":
            lines.append(f"Q: {m['content']}")
        else:
            lines.append(f"A: {m['content']}")
    lines.append("A:")
    return "\n".join(lines)


@contextlib.contextmanager
def _model_params(use_extra_bufts: bool) -> Iterator[None]:
    """Load with ``use_extra_bufts`` set, which ``Llama()`` does not expose.

    Extra buffer types are llama.cpp's CPU weight repacking (AMX, AVX-512,
    ARM i8mm layouts): faster on some CPUs, but each process then holds a
    private copy of the weights instead of sharing the mmapped file, and on
    VMs that advertise AMX without enabling it the first matmul dies with
    SIGILL (seen on this project's CI machines).
    """
    original = llama_c.llama_model_default_params

    def patched() -> Any:
        params = original()
        params.use_extra_bufts = use_extra_bufts
        return params

    llama_c.llama_model_default_params = patched
    try:
        yield
    finally:
        llama_c.llama_model_default_params = original


class _TextTokenizer(LlamaTokenizer):
    """llama-cpp-python's tokenizer, minus special tokens' text on the way out,
    tokenizing in pieces on the way in.

    ``Llama.detokenize`` (which every completion and stream chunk goes through)
    delegates here. It still returns bytes, so llama-cpp-python's handling of a
    character split over byte tokens is unchanged. ``special`` is ignored: text
    for clients never carries special tokens.

    ``Llama.tokenize`` delegates here too, so the prompt a chat template renders
    (``llama_chat_format``'s handlers tokenize it) is tokenized in pieces.
    """

    def __init__(self, llm: Any, hidden: frozenset[int], vocab: Vocab) -> None:
        super().__init__(llm)
        self.hidden = hidden
        self.vocab = vocab

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True) -> list[int]:
        """The ids ``llama_tokenize`` gives ``text`` whole (``add_bos`` is its
        add_special), in pieces when the vocabulary allows and it is worth it."""
        if self.vocab.pair_max is None or len(text) <= PIECE_BYTES:
            return super().tokenize(text, add_bos, special)
        ids = self.vocab.tokenize(text, special)
        return [*self.vocab.bos, *ids, *self.vocab.eos] if add_bos else ids

    def detokenize(
        self, tokens: list[int], prev_tokens: list[int] | None = None, special: bool = False
    ) -> bytes:
        text_tokens = [t for t in tokens if t not in self.hidden]
        return bytes(super().detokenize(text_tokens, prev_tokens, special=False))


class _CancelledInEngine(Exception):
    """Raised inside llama-cpp-python's sampling loop to end generation at once."""


class _TokenCounter:
    """Counts tokens from llama-cpp-python's per-token hook, and stops on cancel.

    The logits processor runs once before every sampled token (completion and
    chat alike, where chat has no stopping criteria), its first call seeing
    exactly the prompt tokens. Raising from it unwinds the generator before the
    next decode step. An end on ``stop`` sampled one more token
    (end-of-generation) than it returned.
    """

    def __init__(self, cancelled: threading.Event) -> None:
        self.cancelled = cancelled
        self.prompt_tokens = 0
        self.samples = 0

    def count(self, input_ids: Any, scores: Any) -> Any:
        if self.cancelled.is_set():
            raise _CancelledInEngine
        if self.samples == 0:
            self.prompt_tokens = len(input_ids)
        self.samples += 1
        return scores

    def completion_tokens(self, finish_reason: str) -> int:
        return max(0, self.samples - 1) if finish_reason == "stop" else self.samples
