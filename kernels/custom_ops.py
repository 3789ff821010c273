"""Paged decode attention as one torch.library custom op, for compiled decode steps.

torch.compile traces transformers' decoder layers; our attention is a call it should neither
trace into (Python lists, data-dependent gathers, per-backend code) nor break its graph at.
Registered as ``torch.ops.trae.decode_attention`` it is one opaque node: the compiler sees a
fake implementation that returns the output's shape and knows the op writes the two caches.

The batch may be padded to a fixed size (the compiled shapes): rows whose slot is negative
are padding; they store nothing, attend to nothing and come back as zeros.
"""

from __future__ import annotations

import torch

from trae_groups.kernels.attention import PagedBatch, paged_attention, store_kv


@torch.library.custom_op("trae::decode_attention", mutates_args=("k_cache", "v_cache"))
def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int,
) -> torch.Tensor:
    """query [B, heads, dim], key/value [B, kv_heads, dim] for B one-token sequences (padded
    rows last, slot < 0); caches [pages, tokens_per_page, kv_heads, dim]; block_tables
    [B, width]; context_lens [B] after this token; sliding_window <= 0: none."""
    out = torch.zeros_like(query)
    n = int((slot_mapping >= 0).sum())
    if n == 0:
        return out
    store_kv(key[:n], value[:n], k_cache, v_cache, slot_mapping[:n])
    batch = PagedBatch(
        slot_mapping=slot_mapping[:n],
        query_starts=list(range(n + 1)),
        context_lens=context_lens[:n].tolist(),
        block_tables=block_tables[:n],
        num_decodes=n,
        tokens_per_page=k_cache.shape[1],
        context_lens_t=context_lens[:n],
    )
    window = sliding_window if sliding_window > 0 else None
    out[:n] = paged_attention(query[:n], key[:n], value[:n], k_cache, v_cache, batch, scale, window)
    return out


@decode_attention.register_fake
def _(query, key, value, k_cache, v_cache, slot_mapping, block_tables, context_lens, scale, sw):
    return torch.empty_like(query)
