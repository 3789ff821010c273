"""Several sequences of one prompt (``SamplingParams.n`` / ``best_of``) from one prefill.

The request's first sequence runs alone until its prompt is computed; then the others
are forked from it: each takes a reference to its full prompt pages (shared, read only:
nothing writes below the last prompt token again) and computes only what is left, the
prompt's last partial page, before it samples on its own. With the prefix cache off too,
the prompt's KV is computed once, plus at most a page per fork.

All sequences carry the request's id and their own ``index``; the request ends when all
have finished. The first one is the one the worker's bookkeeping holds (``_live``).
"""

from __future__ import annotations

import dataclasses

import torch

from trae_groups.engine.memory_pool import MemoryPool
from trae_groups.engine.sequence import Sequence, Status


def make_children(first: Sequence, matcher) -> None:
    """The prompt's other sequences, held by ``first`` until it is forked. Seeded
    requests give each its own seed (``seed + index``), so they differ yet reproduce.
    ``matcher``: a fresh constraint matcher for each (None: unconstrained)."""
    params = first.params
    for index in range(1, params.num_sequences):
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed((params.seed + index) % 2**63)
        child = dataclasses.replace(
            first,
            prompt_token_ids=list(first.prompt_token_ids),
            index=index,
            generator=generator,
            matcher=matcher() if first.matcher is not None else None,
            output_token_ids=[],
            pages=[],
            block_hashes=[],
            logprobs=[],
            top_logprobs=[],
            prompt_logprobs=[],
            unforked=[],
            forks=[],
        )
        first.unforked.append(child)
    first.forks = list(first.unforked)


def fork(first: Sequence, pool: MemoryPool, tokens_per_page: int) -> list[Sequence]:
    """Start ``first``'s held sequences now that its prompt is computed: they share its
    full prompt pages (those before the last prompt token's); returns them."""
    shared = (len(first.prompt_token_ids) - 1) // tokens_per_page
    started = first.unforked
    for child in started:
        for page in first.pages[:shared]:
            pool.share(page)
        child.pages = first.pages[:shared]
        child.num_computed = child.num_published = shared * tokens_per_page
        child.num_cached_tokens = child.num_computed
        child.prompt_logprobs = list(first.prompt_logprobs)  # the same prompt, scored once
    first.unforked = []
    return started


def end_unforked(first: Sequence) -> list[Sequence]:
    """``first`` ended before its prompt was computed: its held sequences end with it
    (same reason); returns them."""
    ended, first.unforked = first.unforked, []
    for child in ended:
        child.status = Status.FINISHED
        child.stop_reason = first.stop_reason
    return ended


def family(first: Sequence) -> list[Sequence]:
    return [first, *first.forks]
