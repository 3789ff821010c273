"""flash-attn's paged kernels behind our attention contract, where their layout rules allow.

One ``flash_attn_varlen_func(..., block_table=...)`` call covers the whole flattened batch
(decodes and prefill chunks alike): flash-attn aligns its causal mask bottom-right, which is
exactly a chunk continuing over cached context. K/V are stored by our own ``store_kv``
(flash-attn has no paged scatter of its own outside ``flash_attn_with_kvcache``).

When it applies (checked by ``supports``; flash-attn 2.6+ reading ``flash_attn_2_cuda``):
- CUDA tensors, float16 or bfloat16 (no float32 kernels);
- tokens per page a multiple of 256 (``mha_varlen_fwd`` rejects smaller paged blocks;
  the engine's default is 16, so set ``EngineConfig(tokens_per_page=256)``);
- head_dim a multiple of 8 and at most 256 (other sizes make flash-attn pad, i.e. copy,
  the whole cache on every call);
- last dim contiguous, and the other cache strides multiples of 16 bytes. The page stride
  itself may be anything: the paged path reads the page stride from ``k.stride(0)``
  (``params.k_batch_stride``), so the pool's byte-sized pages shared between models are
  usable without a contiguous ``[num_blocks, page_size, kv_heads, head_dim]`` copy.
  This reading of flash-attn's source is unverified on a GPU here (see docs/kernels.md).

Otherwise each call falls back to the Triton kernels when they run on the device, else to
the torch reference, and says so once in the log.
"""

from __future__ import annotations

import logging

import torch

from trae_groups.kernels import attention as reference
from trae_groups.kernels import triton_attention
from trae_groups.kernels.attention import PagedBatch

log = logging.getLogger("trae_groups.kernels")

try:
    from flash_attn import flash_attn_varlen_func

    HAVE_FLASH_ATTN = True
except Exception:  # absent, or built for another torch/CUDA: never break the registry
    flash_attn_varlen_func = None
    HAVE_FLASH_ATTN = False

PAGE_MULTIPLE = 256
_DTYPES = (torch.float16, torch.bfloat16)
_warned: set[str] = set()


def available(device: str | torch.device) -> bool:
    """flash-attn imports and the device is a CUDA GPU."""
    return HAVE_FLASH_ATTN and torch.device(device).type == "cuda" and torch.cuda.is_available()


def layout_problem(k_cache: torch.Tensor) -> str | None:
    """Why flash-attn's paged kernel cannot read this view's layout (device aside)."""
    if k_cache.dim() != 4:
        return f"cache must be [pages, tokens_per_page, kv_heads, head_dim], got {k_cache.dim()}-D"
    if k_cache.dtype not in _DTYPES:
        return f"cache dtype {k_cache.dtype}: flash-attn runs float16/bfloat16 only"
    _, page, _, dim = k_cache.shape
    if page % PAGE_MULTIPLE:
        return (
            f"{page} tokens per page: flash-attn's paged kernels need a multiple of {PAGE_MULTIPLE}"
        )
    if dim % 8 or dim > 256:
        return f"head_dim {dim}: flash-attn needs a multiple of 8, at most 256"
    if k_cache.stride(-1) != 1:
        return "cache's last dimension is not contiguous"
    align = 16 // k_cache.element_size()
    if any(s % align for s in k_cache.stride()[:-1]) or k_cache.data_ptr() % 16:
        return "cache strides or base address not 16-byte aligned"
    return None


def unsupported_reason(k_cache: torch.Tensor) -> str | None:
    """Why flash-attn cannot serve this cache here, or None if it can."""
    if not HAVE_FLASH_ATTN:
        return "flash_attn is not installed"
    if k_cache.device.type != "cuda":
        return f"cache on {k_cache.device}, flash-attn needs CUDA"
    return layout_problem(k_cache)


def supports(k_cache: torch.Tensor) -> bool:
    return unsupported_reason(k_cache) is None


def _fallback(device: torch.device) -> tuple:
    """(store_kv, paged_attention) used when flash-attn cannot take the layout."""
    if triton_attention.available(device):
        return triton_attention.store_kv, triton_attention.paged_attention
    return reference.store_kv, reference.paged_attention


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        log.warning("flash_attn backend falls back (%s)", reason)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V into pages: Triton's kernel on GPU when present, else torch's."""
    _fallback(k_cache.device)[0](key, value, k_cache, v_cache, slot_mapping)


def _varlen_meta(batch: PagedBatch, device: torch.device) -> dict:
    """int32 block table and cumulative lengths flash-attn wants, built once per step."""
    key = ("flash_attn", device)
    if key not in batch._masks:
        as_i32 = {"dtype": torch.int32, "device": device}
        q_lens = [b - a for a, b in zip(batch.query_starts, batch.query_starts[1:], strict=False)]
        cu_k = [0]
        for n in batch.context_lens:
            cu_k.append(cu_k[-1] + n)
        batch._masks[key] = {
            "block_table": batch.block_tables.to(**as_i32).contiguous(),
            "cu_q": torch.tensor(batch.query_starts, **as_i32),
            "cu_k": torch.tensor(cu_k, **as_i32),
            "max_q": max(q_lens, default=0),
            "max_k": max(batch.context_lens, default=0),
        }
    return batch._masks[key]


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The reference contract; flash-attn when ``supports(k_cache)``, else the fallback."""
    reason = unsupported_reason(k_cache) or unsupported_reason(v_cache)
    if reason is None and query.dtype != k_cache.dtype:
        reason = f"query is {query.dtype}, caches {k_cache.dtype}"
    if reason is not None:
        _warn_once(reason)
        return _fallback(k_cache.device)[1](
            query, key, value, k_cache, v_cache, batch, scale, sliding_window
        )
    if query.shape[0] == 0:
        return torch.empty_like(query)
    meta = _varlen_meta(batch, k_cache.device)
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
    return flash_attn_varlen_func(
        query,
        k_cache,
        v_cache,
        meta["cu_q"],
        meta["cu_k"],
        meta["max_q"],
        meta["max_k"],
        softmax_scale=scale,
        causal=True,
        window_size=window,
        block_table=meta["block_table"],
    )
