"""Decode attention for compiled CPU decode steps: the lean form of the torch reference.

The op it replaced rebuilt a ``PagedBatch``, a mask and the padding count in every layer:
~190 us per call at batch 1 (fp32, SmolLM2's shapes), ~30% of what the compiled graph left
besides the linears. Here the mask comes in as an argument (the
graph computes it from the context lengths, fused by inductor) and the padding count as a
one-element tensor, so a call is the store, one gather per cache and the attention proper:
~45-55 us at batch 1 (bench: docs/performance.md). The numbers are the reference kernel's: the
same SDPA call in every dtype, on the same gathered pages.
"""

from __future__ import annotations

import torch

from trae_groups.kernels import cpu_native
from trae_groups.kernels.attention import decode_attention, gather_pages


def decode_mask(context_lens: torch.Tensor, width: int, sliding_window: int | None) -> torch.Tensor:
    """[B, 1, 1, width] True where a one-token query at each row's last position may attend;
    all False for padding rows (context length 0). Traceable: the compiled graph builds it."""
    pos = torch.arange(width, device=context_lens.device)
    lens = context_lens[:, None]
    mask = pos[None, :] < lens
    if sliding_window:
        mask &= pos[None, :] >= lens - sliding_window
    return mask[:, None, None, :]


@torch.library.custom_op("trae::compiled_decode_attention", mutates_args=("k_cache", "v_cache"))
def compiled_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_pages: torch.Tensor,
    slot_offsets: torch.Tensor,
    block_tables: torch.Tensor,
    mask: torch.Tensor,
    context_lens: torch.Tensor,
    window: int,
    num_real: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """query [B, heads, dim], key/value [B, kv_heads, dim] for B one-token sequences, the
    first ``num_real`` ([1]) real and the rest padding; caches [pages, tokens_per_page,
    kv_heads, dim] (plain tensors, not quantized; a layer's view of the pool, so not
    contiguous); each new token's page and offset [B]; block_tables [B, width]; mask from
    ``decode_mask`` (the torch path's), context lengths [B] and the window (0: none, the
    native kernel's). Stores the real rows' K/V, returns [B, heads, dim] (padding rows 0)."""
    n = int(num_real)
    out = torch.zeros_like(query)
    if n == 0:
        return out
    if cpu_native.supports(query, k_cache, v_cache):  # as the eager step: pages where they lie
        slots = slot_pages[:n] * k_cache.shape[1] + slot_offsets[:n]
        cpu_native.store_kv(key[:n], value[:n], k_cache, v_cache, slots)
        last = context_lens[:n].to(torch.int64) - 1
        out[:n] = cpu_native.decode_attention(
            query[:n], k_cache, v_cache, block_tables[:n], torch.arange(n), last, scale,
            window or None,
        )  # fmt: skip
        return out
    pages, offsets = slot_pages[:n], slot_offsets[:n]
    k_cache.index_put_((pages, offsets), key[:n])
    v_cache.index_put_((pages, offsets), value[:n])
    k, v = gather_pages(k_cache, v_cache, block_tables[:n], context_lens[:n])
    # the reference kernel's own decode attention (trae_kernels/attention.py), the same bias
    bias = torch.zeros(mask[:n].shape, dtype=query.dtype).masked_fill_(~mask[:n], float("-inf"))
    out[:n] = decode_attention(query[:n], k, v, bias, scale)
    return out


@compiled_decode_attention.register_fake
def _(query, key, value, k_cache, v_cache, pages, offsets, tables, mask, lens, window, real, scale):
    return torch.empty_like(query)
