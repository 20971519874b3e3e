"""The node's prompt-token counter: a model's vocabulary through llama.cpp, without weights.

Part of the llama.cpp engine adapter (``node.llama_engine``, ``node.llama_log``):
the modules that import ``llama_cpp``. The node process loads it once for the
broker's 413 check; workers never do.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import llama_cpp.llama_cpp as llama_c

from broker.admission import CHAT_TOKENS_PER_MESSAGE
from broker.protocol import ClientRequest
from node.llama_log import LLAMA_LOG, LOG_ERROR


def make_token_counter(model_path: str) -> Callable[[ClientRequest], int]:
    """A prompt-token counter for the broker's 413 check, from the model's vocabulary.

    Loads only the GGUF's vocabulary (``_Vocab``: a few MB, no weights), in the
    node process, once. ``chat`` prompts are counted as their contents plus
    ``CHAT_TOKENS_PER_MESSAGE`` per message.

    Raises:
        ValueError: llama.cpp could not read the vocabulary (its error is logged).
    """
    vocab = _Vocab(model_path)

    def count(req: ClientRequest) -> int:
        if req.prompt is not None:
            return vocab.count(req.prompt.encode())
        messages = req.messages or ()
        text = "\n".join(content for _, content in messages)
        return vocab.count(text.encode()) + CHAT_TOKENS_PER_MESSAGE * len(messages)

    return count


class _Vocab:
    """A model's tokenizer alone, through llama.cpp's C API (llama.h).

    ``llama_cpp.Llama(vocab_only=True)`` would also make a context, whose
    check of n_ctx against the training context (never read in a vocab-only
    load, so 0) logs "n_ctx_train (0) -- possible training context overflow",
    and it hides llama.cpp's errors during the load (``verbose=False``
    redirects fd 2). Loading the vocabulary directly needs no context; the
    load's warnings are about the file (the workers' loads see them too) and
    are dropped, its errors are shown.
    """

    def __init__(self, model_path: str) -> None:
        params = llama_c.llama_model_default_params()
        params.vocab_only = True
        with LLAMA_LOG.at_level(LOG_ERROR):
            model = llama_c.llama_model_load_from_file(model_path.encode(), params)
        if not model:
            raise ValueError(f"llama.cpp could not read the vocabulary of {model_path}")
        self._vocab = llama_c.llama_model_get_vocab(model)
        # The node keeps its counter for its lifetime; free the model with it.
        weakref.finalize(self, llama_c.llama_model_free, model)

    def count(self, text: bytes) -> int:
        """Tokens of ``text`` with BOS (as the worker's ``Llama.tokenize`` counts them).

        ``llama_tokenize`` with no room returns minus the number it needs.
        """
        n = int(llama_c.llama_tokenize(self._vocab, text, len(text), None, 0, True, False))
        return -n if n < 0 else n
