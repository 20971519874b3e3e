#!/usr/bin/env python3
"""Does a slot's output depend on its neighbours? Its logits, step by step (not a test).

A greedy generation of ``--tokens`` tokens from one prompt, with llama-cpp-python's
low-level API and the batched engine's context (one sequence per slot, a KV cache
split per sequence, flash attention as configured, weights not repacked unless
``--repack``, as the node loads them):

* on a one-slot context: the reference, every step one token;
* on a four-slot context beside k neighbours (k = 0..3): the prompt is evaluated
  in the step where the neighbours decode a token each, and every later step
  carries the slot's token and one token per neighbour (k + 1 rows), the slot's
  rows last or, with ``--slot-first``, first;
* beside three neighbours again, their tokens different: whether the neighbours'
  *content* reaches the slot (it must not) or only the step's shape does.

Printed per case: the largest difference of any logit from the reference over the
steps up to the first greedy token that differs (0 = bitwise equal), the step it
first appears at, and the step the tokens part, if they do, with how far apart the
reference's two best logits were there (a near tie). tests/system/test_slots.py
checks the text of 20 prompts beside neighbours; this shows where a difference comes
from. README "Workers and slots" has this machine's figures.

Not the engine's batches: the rows are placed by hand (the slot is sequence 0, its
neighbours 1-3), and the whole prompt is one step, where the engine cuts it into
chunks of at most ``node.engine.FLASH_PROMPT_ROWS`` under flash attention and orders
a step's rows with ``node.llama.slots.batch_order``; a prompt of 64 tokens or more
here takes flash attention's tiled kernel, which the engine never uses.

Usage: ``python scripts/batch_rounding.py [--threads 2] [--tokens 48] [--no-flash-attn]
[--repack] [--prompt TEXT] [--slot-first]``: ``--tokens`` 1..128 (each step's logits are
kept: ~1 MiB a token for the reference and as much for the run compared with it), a prompt
of at most 256 tokens.
"""

from __future__ import annotations

import argparse
import hashlib
from typing import Any

import llama_cpp
import llama_cpp.llama_cpp as llama_c
import numpy as np

from node.llama.engine import _context_params, _model_params
from node.model import resolve_model

NEIGHBOURS = ("Step 1: open the valve.", "The valve opened and", "Once upon a time")
N_CTX = 2048  # per slot, the default model.n_ctx
#: Rows of the script's one batch (and the context's n_batch): the prompt is one step.
BATCH = 512
#: Tokens of the prompt at most: with the neighbours' rows, one batch.
MAX_PROMPT = 256
#: Greedy tokens at most: each step's logits are kept (1 MiB each, 262,144 floats)
#: for the reference and the run compared with it.
MAX_TOKENS = 128

#: One row of a batch: (token, position, sequence, wants logits).
Row = tuple[int, int, int, bool]


def context(slots: int, threads: int, flash_attn: bool, repack: bool) -> Any:
    """A ``Llama`` with ``slots`` sequences of N_CTX cells each, as the engine makes it
    (weights repacked only with ``repack``, as ``model.repack`` does)."""
    with _context_params(n_seq_max=slots), _model_params(use_extra_bufts=repack):
        return llama_cpp.Llama(
            model_path=str(resolve_model("default")),
            n_ctx=N_CTX * slots,
            n_batch=BATCH,
            n_threads=threads,
            n_threads_batch=threads,
            flash_attn=flash_attn,
            verbose=False,
        )


def generate(
    llm: Any, prompt: str, tokens: int, neighbours: int, base: int, first: bool = False
) -> tuple[list[int], list[Any]]:
    """Greedy tokens of sequence 0 and its logits per step (numpy arrays), with
    ``neighbours`` other sequences decoding token ``base + position`` beside it;
    sequence 0's rows after theirs, as the engine fills a batch (generating slots
    first, in slot order), or before them with ``first``."""
    ctx, n_vocab = llm.ctx, llama_c.llama_vocab_n_tokens(llama_c.llama_model_get_vocab(llm.model))
    memory = llama_c.llama_get_memory(ctx)
    batch = llama_c.llama_batch_init(BATCH, 0, 1)

    def decode(rows: list[Row]) -> None:
        batch.n_tokens = len(rows)
        for i, (token, pos, seq, logits) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        if llama_c.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    try:
        for seq in range(1 + neighbours):
            llama_c.llama_memory_seq_rm(memory, seq, -1, -1)
        at: dict[int, int] = {}
        for seq in range(1, 1 + neighbours):
            own = llm.tokenize(NEIGHBOURS[seq - 1].encode())
            decode([(t, i, seq, False) for i, t in enumerate(own)])
            at[seq] = len(own)

        def beside() -> list[Row]:
            rows = [(base + at[s], at[s], s, False) for s in at]
            for s in at:
                at[s] += 1
            return rows

        ids = llm.tokenize(prompt.encode())
        own = [(t, i, 0, i == len(ids) - 1) for i, t in enumerate(ids)]
        decode(own + beside() if first else beside() + own)
        out, logits, pos = [], [], len(ids)
        row = len(ids) - 1 if first else len(at) + len(ids) - 1
        for _ in range(tokens):
            step = np.ctypeslib.as_array(llama_c.llama_get_logits_ith(ctx, row), shape=(n_vocab,))
            logits.append(step.copy())
            out.append(int(step.argmax()))
            mine = (out[-1], pos, 0, True)
            decode([mine, *beside()] if first else [*beside(), mine])
            row, pos = 0 if first else len(at), pos + 1
        return out, logits
    finally:
        llama_c.llama_batch_free(batch)


def _within(low: int, high: int) -> Any:
    """An argparse type: an int in [low, high]."""

    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in {low}..{high}")
        return value

    parse.__name__ = "integer"  # argparse names it in "invalid integer value: 'abc'"
    return parse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=_within(1, 256), default=2)
    parser.add_argument(
        "--tokens", type=_within(1, MAX_TOKENS), default=48, help=f"1..{MAX_TOKENS}"
    )
    parser.add_argument("--prompt", default="In 1969, the first humans")
    parser.add_argument("--no-flash-attn", action="store_true")
    parser.add_argument(
        "--repack", action="store_true", help="repacked weights, as model.repack = true"
    )
    parser.add_argument(
        "--slot-first", action="store_true", help="the slot's rows before its neighbours'"
    )
    args = parser.parse_args()
    flash = not args.no_flash_attn
    one = context(1, args.threads, flash, args.repack)
    if (n := len(one.tokenize(args.prompt.encode()))) > MAX_PROMPT:
        parser.error(f"--prompt: {n} tokens; at most {MAX_PROMPT} (one batch with its neighbours)")
    ref_tokens, ref_logits = generate(one, args.prompt, args.tokens, 0, 1000)
    one.close()
    four = context(4, args.threads, flash, args.repack)
    cases = [(f"4 slots, {k} neighbours ({k + 1} rows a step)", k, 1000) for k in range(4)]
    cases.append(("4 slots, 3 neighbours writing other tokens", 3, 5000))
    print(
        f"prompt {args.prompt!r}, {args.tokens} greedy tokens, {args.threads} threads, "
        f"flash attention {'on' if flash else 'off'}, weights "
        f"{'repacked' if args.repack else 'not repacked'}, the slot's rows "
        f"{'first' if args.slot_first else 'last'}; reference: a one-slot context"
    )
    digests: dict[int, list[bytes]] = {}  # per neighbour count, the first run's logits
    for name, k, base in cases:
        tokens, logits = generate(four, args.prompt, args.tokens, k, base, args.slot_first)
        # Up to the first token that differs: after it the texts, not the rounding, differ.
        apart = next(
            (i for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)) if a != b), None
        )
        steps = zip(logits[: None if apart is None else apart + 1], ref_logits, strict=False)
        diffs = [float(np.abs(a - b).max()) for a, b in steps]
        first = next((i for i, d in enumerate(diffs) if d > 0), None)
        where = "bitwise equal" if first is None else f"first at step {first}"
        line = f"  {name}: max |logit diff| {max(diffs):.3g} ({where})"
        if apart is not None:
            margin = np.sort(ref_logits[apart])[-2:]
            tie = margin[1] - margin[0]
            line += f"; tokens differ from step {apart} (best two alone {tie:.3g} apart)"
        mine = [hashlib.sha256(step.tobytes()).digest() for step in logits]
        if k in digests:  # the same shape, other neighbours' tokens: the content's share
            same = mine == digests[k]
            line += f"; against the first {k} neighbours' run: {'0' if same else 'differs'}"
        digests.setdefault(k, mine)
        print(line)
    four.close()


if __name__ == "__main__":
    main()
