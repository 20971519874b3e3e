"""The llama.cpp engine (llama-cpp-python): the only module that imports ``llama_cpp``.

One ``Llama`` context, one sequence at a time (the object is not thread-safe;
llama-cpp-python#1529). Cancellation works at two depths:

* during decoding, generation is a Python generator: the stopping criterion
  checks the cancel flag after every sampled token and ends the loop;
* during prompt evaluation there is no Python hook, so llama.cpp's abort
  callback (``llama_set_abort_callback``, checked by ggml-cpu after each graph
  node) makes ``llama_decode`` return 2, which the wrapper raises as a
  ``RuntimeError``; the context is then reset and stays usable.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import llama_cpp.llama_cpp as llama_c
from llama_cpp.llama_grammar import LlamaGrammar

from broker.admission import CHAT_TOKENS_PER_MESSAGE
from broker.errors import Cancelled, InternalError, ProtocolError, TooLarge
from broker.protocol import ClientRequest
from node.engine import Emit, EngineSpec


class LlamaEngine:
    """Runs ``generate`` and ``chat`` requests on a GGUF model.

    Args:
        spec: model path, ``n_ctx`` (tokens), ``n_batch`` (tokens) and ``threads``
            (the cores this worker may really use: llama-cpp-python's default of
            ``cpu_count()//2`` ignores affinity and CPU quotas).

    Raises:
        ValueError: llama.cpp could not load the model.
    """

    kind = "llama"

    def __init__(self, spec: EngineSpec) -> None:
        self.model = Path(spec.model_path).name
        with _model_params(use_extra_bufts=spec.repack):
            # Typed as Any: the wrapper's return types are unions of str and dicts.
            self.llm: Any = llama_cpp.Llama(
                model_path=spec.model_path,
                n_ctx=spec.n_ctx,
                n_batch=spec.n_batch,
                n_threads=spec.threads,
                n_threads_batch=spec.threads,
                chat_format=spec.chat_format or None,
                verbose=False,
            )
        self.n_ctx = self.llm.n_ctx()
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
            "logits_processor": llama_cpp.LogitsProcessorList([counter.count]),
        }
        for name in ("temperature", "top_p", "seed", "stop"):
            if name in job:
                kwargs[name] = job[name]
        if "json_schema" in job and (job["op"] == "generate" or self.plain_chat):
            kwargs["grammar"] = _schema_grammar(job["json_schema"])
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
        if cancelled.is_set():
            raise Cancelled("cancelled", partial_text="".join(pieces))
        usage = {
            "prompt_tokens": counter.prompt_tokens,
            "completion_tokens": counter.completion_tokens(finish),
        }
        return {"text": "".join(pieces), "finish_reason": finish, "usage": usage}

    def _stream(self, job: dict[str, Any], kwargs: dict[str, Any]) -> Iterator[tuple[str, str]]:
        """(text, finish_reason) per chunk of the llama-cpp-python stream."""
        if job["op"] == "chat" and self.plain_chat:
            kwargs["stop"] = [*job.get("stop", []), *QA_STOPS]
            first = True
            for chunk in self.llm.create_completion(qa_prompt(job["messages"]), **kwargs):
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
            for chunk in self.llm.create_completion(job["prompt"], **kwargs):
                choice = chunk["choices"][0]
                yield choice.get("text") or "", choice.get("finish_reason") or ""


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


def _schema_grammar(schema: dict[str, Any]) -> Any:
    """A llama.cpp GBNF grammar that only admits JSON valid for ``schema``.

    Raises:
        ProtocolError: the schema cannot be turned into a grammar.
    """
    try:
        return LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
    except Exception as exc:  # the converter raises assorted types on bad schemas
        raise ProtocolError(f"json_schema is not usable: {exc}") from exc


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


def make_token_counter(model_path: str) -> Callable[[ClientRequest], int]:
    """A prompt-token counter for the broker's 413 check, from the model's vocabulary.

    Loads the GGUF with ``vocab_only`` (the tokenizer, no weights: a few MB),
    in the node process, once. ``chat`` prompts are counted as their contents
    plus ``CHAT_TOKENS_PER_MESSAGE`` per message.
    """
    vocab = llama_cpp.Llama(model_path=model_path, vocab_only=True, verbose=False)

    def count(req: ClientRequest) -> int:
        if req.prompt is not None:
            return len(vocab.tokenize(req.prompt.encode(), add_bos=True))
        messages = req.messages or ()
        text = "\n".join(content for _, content in messages)
        return len(vocab.tokenize(text.encode(), add_bos=True)) + CHAT_TOKENS_PER_MESSAGE * len(
            messages
        )

    return count


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
