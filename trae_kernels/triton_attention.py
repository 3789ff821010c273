"""Paged attention in Triton: the GPU backend, and (through Triton's interpreter) its own test bed.

Same contract as the torch reference in ``attention.py``: ``store_kv`` scatters new K/V
into pages; ``paged_attention`` runs a flattened batch of decodes (one row each, first)
and prefill chunks over block tables. Three kernels:

- decode: one program per (sequence, kv head, split). The query heads sharing a kv head
  are the rows of one tile, so each K/V page is read once per kv head (GQA/MQA for
  free). Long contexts with few sequences are split along the keys ("flash decoding")
  and a small reduce kernel merges the splits' partial softmaxes.
- prefill: one program per (tile of a chunk's query rows, query head), online softmax
  over key blocks, causal with the chunk's offset (bottom-right aligned), optional
  sliding window.
- store: one program per block of new tokens.

Keys are addressed token by token through the block table (page = pos // page size), so
a key block may span pages and any page size works; all cache strides are the tensor's
own (pool pages are byte-sized and shared between models, so the page stride is not
tokens_per_page * kv_heads * head_dim in general). Softmax and accumulation run in fp32.

Compiled or interpreted is a process-wide choice Triton makes when ``triton.language`` is
first imported (its own helpers such as ``tl.sum`` are jitted then): with
``TRITON_INTERPRET=1`` (or ``TRAE_TRITON_INTERPRET=1`` seen before triton's first import)
the same kernel bodies run on CPU tensors through Triton's numpy interpreter. That is a
correctness harness, not a CPU backend: it is orders of magnitude slower than the torch
reference. Importing this module never fails: without triton, ``HAVE_TRITON`` is False
and the registry leaves the backend out.
"""

from __future__ import annotations

import functools
import os

import torch

from trae_groups.kernels.attention import PagedBatch
from trae_groups.kernels.kv_quant import KV_STORAGE, MIN_SCALE, QuantKV

_TRUE = ("1", "true", "yes", "on")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KV_DTYPES = ("int8",)  # quantized KV caches these kernels read and write (kv_quant.py)
_LOG2E = 1.4426950408889634

if os.environ.get("TRAE_TRITON_INTERPRET", "").strip().lower() in _TRUE:
    # must precede triton's first import: triton.language builds its own helpers
    # (tl.sum, tl.zeros, ...) compiled or interpreted once, at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    HAVE_TRITON = True
    # the process-wide mode triton.language was imported in
    INTERPRETED = isinstance(tl.sum, InterpretedFunction)
except Exception:  # absent or broken: the registry imports this module everywhere
    HAVE_TRITON = INTERPRETED = False

    def _no_jit(fn=None, **_):
        return fn if fn is not None else _no_jit

    class _NoTriton:  # the kernel definitions below still evaluate without triton
        constexpr = None
        jit = staticmethod(_no_jit)

    triton = tl = _NoTriton()


def available(device: str | torch.device) -> bool:
    """CUDA with triton installed; or any device when triton runs interpreted."""
    if not HAVE_TRITON:
        return False
    if INTERPRETED:
        return True
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------


# ints that change from step to step are not specialised on (no recompiles mid-serving)
@triton.jit(do_not_specialize=["num_tokens"])
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_tokens,
    s_slot,
    sk_t,
    sk_h,
    sk_d,
    sv_t,
    sv_h,
    sv_d,
    skc_p,
    skc_t,
    skc_h,
    skc_d,
    svc_p,
    svc_t,
    svc_h,
    svc_d,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_ELEMS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HD: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tok < num_tokens
    slot = tl.load(slot_ptr + tok.to(tl.int64) * s_slot, mask=t_ok, other=-1).to(tl.int64)
    t_ok = t_ok & (slot >= 0)  # a negative slot is padding: nothing to store
    page = slot // PAGE
    off = slot % PAGE
    j = tl.arange(0, BLOCK_HD)  # (kv head, dim) flattened
    head = j // HEAD_DIM
    dim = j % HEAD_DIM
    ok = t_ok[:, None] & (j < HEAD_ELEMS)[None, :]
    row = tok.to(tl.int64)[:, None]
    k = tl.load(key_ptr + row * sk_t + (head * sk_h + dim * sk_d)[None, :], mask=ok)
    v = tl.load(value_ptr + row * sv_t + (head * sv_h + dim * sv_d)[None, :], mask=ok)
    k_dst = (
        k_cache_ptr + (page * skc_p + off * skc_t)[:, None] + (head * skc_h + dim * skc_d)[None, :]
    )
    v_dst = (
        v_cache_ptr + (page * svc_p + off * svc_t)[:, None] + (head * svc_h + dim * svc_d)[None, :]
    )
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["num_tokens"])
def _store_kv_int8_kernel(
    x_ptr,
    cache_ptr,
    scale_ptr,
    slot_ptr,
    num_tokens,
    s_slot,
    sx_t,
    sx_h,
    sx_d,
    sc_p,
    sc_t,
    sc_h,
    sc_d,
    ss_p,
    ss_t,
    ss_h,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QMAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One (block of tokens, kv head): int8 values and a float16 scale, as kv_quant.quantize."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    t_ok = tok < num_tokens
    slot = tl.load(slot_ptr + tok.to(tl.int64) * s_slot, mask=t_ok, other=-1).to(tl.int64)
    t_ok = t_ok & (slot >= 0)
    page = slot // PAGE
    off = slot % PAGE
    d = tl.arange(0, BLOCK_D)
    ok = t_ok[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(
        x_ptr + (tok.to(tl.int64) * sx_t + head * sx_h)[:, None] + (d * sx_d)[None, :],
        mask=ok,
        other=0.0,
    ).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 1) / QMAX, MIN_SCALE)
    scale = scale.to(tl.float16).to(tl.float32)  # divide by the scale that is stored
    q = x / scale[:, None]
    q = tl.minimum(tl.maximum(tl.where(q >= 0, q + 0.5, q - 0.5), -QMAX), QMAX)  # round
    tl.store(
        cache_ptr + (page * sc_p + off * sc_t + head * sc_h)[:, None] + (d * sc_d)[None, :],
        q.to(tl.int8),
        mask=ok,
    )
    tl.store(scale_ptr + page * ss_p + off * ss_t + head * ss_h, scale.to(tl.float16), mask=t_ok)


@triton.jit(do_not_specialize=["window", "chunk"])
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    table_ptr,
    ctx_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    qk_scale,
    window,
    chunk,
    sq_t,
    sq_h,
    sq_d,
    sk_p,
    sk_t,
    sk_h,
    sk_d,
    sv_p,
    sv_t,
    sv_h,
    sv_d,
    sks_p,
    sks_t,
    sks_h,
    svs_p,
    svs_t,
    svs_h,
    sb_s,
    sb_p,
    so_t,
    so_h,
    so_d,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    ROW_CHUNK: tl.constexpr,
    KV_QUANT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    n_k = tl.load(ctx_ptr + seq).to(tl.int32)
    if ROW_CHUNK:  # a launch graphs replay: each row splits its own keys (whole blocks each)
        first = 0
        if HAS_WINDOW:
            first = tl.maximum(n_k - window, 0) // BLOCK_N * BLOCK_N
        chunk = tl.cdiv(tl.cdiv(n_k - first, num_splits), BLOCK_N) * BLOCK_N
        lo = first + split * chunk
    else:
        lo = split * chunk
    hi = tl.minimum(lo + chunk, n_k)
    if HAS_WINDOW:
        lo = tl.maximum(lo, n_k - window)

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + h
    q = tl.load(
        q_ptr + seq.to(tl.int64) * sq_t + (heads * sq_h)[:, None] + (d * sq_d)[None, :],
        mask=h_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST or KV_QUANT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table = table_ptr + seq.to(tl.int64) * sb_s
    for start in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = (pos >= lo) & (pos < hi)
        page = tl.load(table + (pos // PAGE) * sb_p, mask=valid, other=0).to(tl.int64)
        off = pos % PAGE
        kv_ok = valid[:, None] & d_ok[None, :]
        k = tl.load(
            k_cache_ptr
            + (page * sk_p + off * sk_t + kv_head * sk_h)[:, None]
            + (d * sk_d)[None, :],
            mask=kv_ok,
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr
            + (page * sv_p + off * sv_t + kv_head * sv_h)[:, None]
            + (d * sv_d)[None, :],
            mask=kv_ok,
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if KV_QUANT:
            at = page * sks_p + off * sks_t + kv_head * sks_h
            k = (
                k.to(tl.float32)
                * tl.load(k_scale_ptr + at, mask=valid, other=0.0).to(tl.float32)[:, None]
            )
            at = page * svs_p + off * svs_t + kv_head * svs_h
            v = (
                v.to(tl.float32)
                * tl.load(v_scale_ptr + at, mask=valid, other=0.0).to(tl.float32)[:, None]
            )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # every block holds a valid key: finite
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if SPLIT:
        # unnormalised partials: [decodes, heads, splits] and [..., head_dim]
        part = (seq * (tl.num_programs(1) * GROUP) + heads).to(tl.int64) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=h_ok)
        tl.store(part_l_ptr + part, l_i, mask=h_ok)
        tl.store(
            part_acc_ptr + (part * HEAD_DIM)[:, None] + d[None, :],
            acc,
            mask=h_ok[:, None] & d_ok[None, :],
        )
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + seq.to(tl.int64) * so_t + (heads * so_h)[:, None] + (d * so_d)[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=h_ok[:, None] & d_ok[None, :],
        )


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    out_ptr,
    num_splits,
    so_t,
    so_h,
    so_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    sp_ok = sp < num_splits
    d_ok = d < HEAD_DIM
    base = (seq * tl.num_programs(1) + head).to(tl.int64) * num_splits
    m = tl.load(part_m_ptr + base + sp, mask=sp_ok, other=float("-inf"))
    denom = tl.load(part_l_ptr + base + sp, mask=sp_ok, other=0.0)
    acc = tl.load(
        part_acc_ptr + ((base + sp) * HEAD_DIM)[:, None] + d[None, :],
        mask=sp_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_max = tl.max(m, 0)  # finite unless the row has no keys (a padding row: zeros)
    w = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)
    total = tl.sum(w * denom, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)  # no keys: padding
    tl.store(
        out_ptr + seq.to(tl.int64) * so_t + head * so_h + d * so_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


@triton.jit(do_not_specialize=["window"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    table_ptr,
    ctx_ptr,
    starts_ptr,
    tile_seq_ptr,
    tile_row_ptr,
    out_ptr,
    qk_scale,
    window,
    sq_t,
    sq_h,
    sq_d,
    sk_p,
    sk_t,
    sk_h,
    sk_d,
    sv_p,
    sv_t,
    sv_h,
    sv_d,
    sks_p,
    sks_t,
    sks_h,
    svs_p,
    svs_t,
    svs_h,
    sb_s,
    sb_p,
    so_t,
    so_h,
    so_d,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    KV_QUANT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq = tl.load(tile_seq_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    q_lo = tl.load(starts_ptr + seq).to(tl.int32)
    n_q = tl.load(starts_ptr + seq + 1).to(tl.int32) - q_lo
    n_k = tl.load(ctx_ptr + seq).to(tl.int32)
    first = n_k - n_q  # position of the chunk's first query (bottom-right alignment)

    rows = row0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    r_ok = rows < n_q
    d_ok = d < HEAD_DIM
    q_pos = first + rows
    q = tl.load(
        q_ptr + ((q_lo + rows).to(tl.int64) * sq_t)[:, None] + head * sq_h + (d * sq_d)[None, :],
        mask=r_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST or KV_QUANT:
        q = q.to(tl.float32)

    hi = tl.minimum(n_k, first + row0 + BLOCK_M)  # past the tile's last query: masked
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first + row0 - window + 1, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = table_ptr + seq.to(tl.int64) * sb_s
    for start in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        k_in = pos < hi
        page = tl.load(table + (pos // PAGE) * sb_p, mask=k_in, other=0).to(tl.int64)
        off = pos % PAGE
        kv_ok = k_in[:, None] & d_ok[None, :]
        k = tl.load(
            k_cache_ptr
            + (page * sk_p + off * sk_t + kv_head * sk_h)[:, None]
            + (d * sk_d)[None, :],
            mask=kv_ok,
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr
            + (page * sv_p + off * sv_t + kv_head * sv_h)[:, None]
            + (d * sv_d)[None, :],
            mask=kv_ok,
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if KV_QUANT:
            at = page * sks_p + off * sks_t + kv_head * sks_h
            k = (
                k.to(tl.float32)
                * tl.load(k_scale_ptr + at, mask=k_in, other=0.0).to(tl.float32)[:, None]
            )
            at = page * svs_p + off * svs_t + kv_head * svs_h
            v = (
                v.to(tl.float32)
                * tl.load(v_scale_ptr + at, mask=k_in, other=0.0).to(tl.float32)[:, None]
            )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        see = (pos[None, :] <= q_pos[:, None]) & k_in[None, :]
        if HAS_WINDOW:
            see = see & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(see, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row may see nothing in this block yet (window start): keep exp2 finite
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + ((q_lo + rows).to(tl.int64) * so_t)[:, None] + head * so_h + (d * so_d)[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=r_ok[:, None] & d_ok[None, :],
    )


# --------------------------------------------------------------------------------------
# Host side: checks, per-batch metadata, launch parameters.
# --------------------------------------------------------------------------------------


def _check_runnable(device: torch.device) -> None:
    if not HAVE_TRITON:
        raise RuntimeError("the triton backend needs the triton package")
    if device.type != "cuda" and not INTERPRETED:
        raise ValueError(
            f"tensors on {device}: compiled Triton kernels need CUDA tensors; to run on CPU "
            "through Triton's interpreter, set TRITON_INTERPRET=1 (or TRAE_TRITON_INTERPRET=1) "
            "before triton is first imported"
        )


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


def _unwrap(k_cache, v_cache) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
    """Plain caches, or a quantized pair's values and (k scales, v scales); checked."""
    if isinstance(k_cache, QuantKV) != isinstance(v_cache, QuantKV):
        raise ValueError("k_cache and v_cache must both be quantized (QuantKV) or both plain")
    if not isinstance(k_cache, QuantKV):
        _check_caches(k_cache, v_cache)
        return k_cache, v_cache, None
    kc, vc = k_cache.values, v_cache.values
    if kc.dtype != torch.int8 or vc.dtype != torch.int8:
        raise ValueError(f"quantized caches: int8 values only here, got {kc.dtype}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.scale.shape != cache.values.shape[:3] or cache.scale.dtype != torch.float16:
            raise ValueError(f"{name}.scale: expected float16 {tuple(cache.values.shape[:3])}")
    _check_caches(kc, vc, quantized=True)
    return kc, vc, (k_cache.scale, v_cache.scale)


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, quantized: bool = False) -> None:
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache/v_cache: expected equal shapes [num_pages, tokens_per_page, kv_heads, "
            f"head_dim], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if (not quantized and k_cache.dtype not in _DTYPES) or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"k_cache/v_cache: dtype must be one of float32/float16/bfloat16 and equal, "
            f"got {k_cache.dtype} and {v_cache.dtype}"
        )
    if v_cache.device != k_cache.device:
        raise ValueError(f"k_cache on {k_cache.device} but v_cache on {v_cache.device}")
    if min(k_cache.stride()) < 0 or min(v_cache.stride()) < 0:
        raise ValueError("k_cache/v_cache: negative strides are not supported")


def _check_tokens(
    name: str, t: torch.Tensor, num_tokens: int, heads: int | None, dim: int, device
) -> None:
    if (
        t.dim() != 3
        or t.shape[0] != num_tokens
        or t.shape[2] != dim
        or (heads and t.shape[1] != heads)
    ):
        want = f"[{num_tokens}, {heads or 'heads'}, {dim}]"
        raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the caches on {device}")
    if t.dtype not in _DTYPES:
        raise ValueError(f"{name}: dtype must be float32/float16/bfloat16, got {t.dtype}")


def _check_index(name: str, t: torch.Tensor, dims: int, device) -> None:
    if t.dim() != dims or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{name}: expected a {dims}-D int32/int64 tensor, got {t.dim()}-D {t.dtype}"
        )
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the caches on {device}")


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [T, kv_heads, dim] into caches [pages, tokens_per_page, kv_heads, dim].

    A negative slot is skipped (padding), unlike the reference, which has none. ``QuantKV``
    caches get int8 values and a float16 scale per token and head."""
    k_cache, v_cache, scales = _unwrap(k_cache, v_cache)
    _, page, kv_heads, dim = k_cache.shape
    num_tokens = key.shape[0] if key.dim() else -1
    _check_tokens("key", key, num_tokens, kv_heads, dim, k_cache.device)
    _check_tokens("value", value, num_tokens, kv_heads, dim, k_cache.device)
    _check_index("slot_mapping", slot_mapping, 1, k_cache.device)
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {num_tokens} tokens")
    _check_runnable(k_cache.device)
    if num_tokens == 0:
        return
    if scales is not None:
        _store_quantized(key, value, k_cache, v_cache, scales, slot_mapping, num_tokens)
        return
    block_hd = _pow2(kv_heads * dim)
    block_t = max(1, min(64, 4096 // block_hd))
    grid = (triton.cdiv(num_tokens, block_t),)
    _store_kv_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_tokens,
        slot_mapping.stride(0),
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        PAGE=page,
        HEAD_DIM=dim,
        HEAD_ELEMS=kv_heads * dim,
        BLOCK_T=block_t,
        BLOCK_HD=block_hd,
    )


def _store_quantized(key, value, k_cache, v_cache, scales, slot_mapping, num_tokens) -> None:
    _, page, kv_heads, dim = k_cache.shape
    block_d = _pow2(dim, 16)
    block_t = max(1, min(64, 4096 // block_d))
    grid = (triton.cdiv(num_tokens, block_t), kv_heads)
    for x, cache, scale in ((key, k_cache, scales[0]), (value, v_cache, scales[1])):
        _store_kv_int8_kernel[grid](
            x,
            cache,
            scale,
            slot_mapping,
            num_tokens,
            slot_mapping.stride(0),
            *x.stride(),
            *cache.stride(),
            *scale.stride(),
            PAGE=page,
            HEAD_DIM=dim,
            QMAX=KV_STORAGE["int8"][1],
            MIN_SCALE=MIN_SCALE,
            BLOCK_T=block_t,
            BLOCK_D=block_d,
        )


def _batch_meta(batch: PagedBatch, num_tokens: int, device: torch.device) -> dict:
    """Checks and device tensors derived from the batch, built once per step (the batch
    is shared by every layer) and kept in the batch's own per-step cache."""
    cache = batch._masks
    key = ("triton", device)
    if key in cache:
        return cache[key]
    starts = batch.query_starts
    nd, ns = batch.num_decodes, batch.num_seqs
    if len(starts) != ns + 1 or starts[0] != 0 or starts[-1] != num_tokens:
        raise ValueError(
            f"query_starts must be {ns + 1} offsets from 0 to {num_tokens}, got {len(starts)} "
            f"ending at {starts[-1] if starts else None}"
        )
    if not 0 <= nd <= ns or starts[nd] != nd:
        raise ValueError(f"num_decodes={nd}: the first {nd} sequences must have one query row each")
    for s in range(ns):
        n_q = starts[s + 1] - starts[s]
        if n_q < 0 or n_q > batch.context_lens[s]:
            raise ValueError(f"sequence {s}: {n_q} query rows over {batch.context_lens[s]} keys")
    _check_index("block_tables", batch.block_tables, 2, device)
    if batch.block_tables.shape[0] != ns:
        raise ValueError(f"block_tables has {batch.block_tables.shape[0]} rows for {ns} sequences")
    needed = -(-max(batch.context_lens, default=0) // batch.tokens_per_page)
    if batch.block_tables.shape[1] < needed:
        raise ValueError(f"block_tables has {batch.block_tables.shape[1]} columns, {needed} needed")
    ctx = batch.context_lens_t
    if ctx is None:
        ctx = torch.tensor(batch.context_lens, dtype=torch.int32, device=device)
    else:
        _check_index("context_lens_t", ctx, 1, device)
    meta = {"context_lens": ctx, "tiles": {}}
    cache[key] = meta
    return meta


def _prefill_tiles(batch: PagedBatch, meta: dict, block_m: int, device) -> tuple:
    """(tile_seq, tile_row, query_starts) device tensors for the prefill grid."""
    if block_m not in meta["tiles"]:
        starts = batch.query_starts
        seqs, rows = [], []
        for s in range(batch.num_decodes, batch.num_seqs):
            for r in range(0, starts[s + 1] - starts[s], block_m):
                seqs.append(s)
                rows.append(r)
        as_t = functools.partial(torch.tensor, dtype=torch.int32, device=device)
        meta["tiles"][block_m] = (as_t(seqs), as_t(rows), as_t(starts))
    return meta["tiles"][block_m]


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def _decode_splits(batch: PagedBatch, kv_heads: int, device: torch.device) -> int:
    """Split the keys only when decodes × kv heads cannot fill the GPU."""
    if INTERPRETED:
        return 1
    nd = batch.num_decodes
    longest = max(batch.context_lens[:nd])
    programs = nd * kv_heads
    target = 2 * _num_sms(device)
    if programs >= target:
        return 1
    return max(1, min(-(-target // programs), -(-longest // 256), 32))


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    scale: float,
    sliding_window: int | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """query [T, heads, dim]; key/value [T, kv_heads, dim] (new tokens, already stored).

    Returns [T, heads, dim] (contiguous). K/V are all read from the pages, so ``key`` and
    ``value`` are only checked. ``num_splits`` overrides the decode key split (tests).
    ``QuantKV`` caches are dequantized as they are read."""
    compute = k_cache.dtype  # a QuantKV's is the model's dtype
    k_cache, v_cache, scales = _unwrap(k_cache, v_cache)
    device = k_cache.device
    _, page, kv_heads, dim = k_cache.shape
    num_tokens = query.shape[0] if query.dim() else -1
    _check_tokens("query", query, num_tokens, None, dim, device)
    _check_tokens("key", key, num_tokens, kv_heads, dim, device)
    _check_tokens("value", value, num_tokens, kv_heads, dim, device)
    heads = query.shape[1]
    if heads % kv_heads:
        raise ValueError(f"query has {heads} heads, not a multiple of the {kv_heads} kv heads")
    if query.dtype != compute:
        raise ValueError(f"query is {query.dtype} but the caches are {compute}")
    if batch.tokens_per_page != page:
        raise ValueError(f"batch.tokens_per_page={batch.tokens_per_page}, caches hold {page}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    meta = _batch_meta(batch, num_tokens, device)
    _check_runnable(device)
    out = torch.empty(query.shape, dtype=query.dtype, device=device)
    if num_tokens == 0:
        return out

    group = heads // kv_heads
    consts = launch_constants(
        query.dtype, group, dim, page, sliding_window is not None, scales is not None
    )
    qk_scale = float(scale) * _LOG2E
    window = int(sliding_window or 0)
    ks, vs = scales if scales is not None else (k_cache, v_cache)  # unread when not quantized
    scale_strides = (*ks.stride()[:3], *vs.stride()[:3])
    strides = (*query.stride(), *k_cache.stride(), *v_cache.stride(), *scale_strides,
               *batch.block_tables.stride())  # fmt: skip

    nd = batch.num_decodes
    if nd:
        dec = consts["decode"]
        splits = num_splits or _decode_splits(batch, kv_heads, device)
        longest = max(batch.context_lens[:nd])
        per_split = -(-longest // splits)
        chunk = -(-per_split // dec["BLOCK_N"]) * dec["BLOCK_N"]  # whole key blocks per split
        _launch_decode(query, k_cache, v_cache, scales, batch.block_tables, meta["context_lens"],
                       out, nd, splits, chunk, qk_scale, window, consts)  # fmt: skip

    if nd < batch.num_seqs:
        pre = consts["prefill"]
        tile_seq, tile_row, starts = _prefill_tiles(batch, meta, pre["BLOCK_M"], device)
        if tile_seq.numel():
            _prefill_kernel[(tile_seq.numel(), heads)](
                query,
                k_cache,
                v_cache,
                ks,
                vs,
                batch.block_tables,
                meta["context_lens"],
                starts,
                tile_seq,
                tile_row,
                out,
                qk_scale,
                window,
                *strides,
                *out.stride(),
                **pre,
            )
    return out


def graph_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Store and attend for B one-token rows with launches that read nothing on the host, so
    that a CUDA graph can capture them (engine/decode_graphs.py). Same contract as the torch
    reference ``attention.graph_decode``: padding rows (slot < 0, context 0) store nothing and
    come back as zeros; ``QuantKV`` caches too. Programs are (row, kv head, split): the
    number of key splits is fixed by the batch size (to fill the GPU when rows x kv heads
    cannot), and each row divides its own keys among them on the device. ``num_splits``
    overrides it (tests)."""
    store_kv(key, value, k_cache, v_cache, slot_mapping)  # skips negative slots
    compute = k_cache.dtype
    k_cache, v_cache, scales = _unwrap(k_cache, v_cache)
    device = k_cache.device
    _, page, kv_heads, dim = k_cache.shape
    rows, heads = query.shape[0], query.shape[1]
    _check_tokens("query", query, rows, None, dim, device)
    if heads % kv_heads or query.dtype != compute:
        raise ValueError(
            f"query: {heads} heads of {query.dtype} over {kv_heads} kv heads of {compute}"
        )
    _check_index("block_tables", block_tables, 2, device)
    _check_index("context_lens", context_lens, 1, device)
    if block_tables.shape[0] != rows or context_lens.shape[0] != rows:
        raise ValueError(f"block_tables and context_lens need {rows} rows")
    out = torch.empty(query.shape, dtype=query.dtype, device=device)
    consts = launch_constants(
        query.dtype, heads // kv_heads, dim, page, sliding_window is not None, scales is not None
    )
    splits = num_splits or _graph_splits(rows, kv_heads, device)
    # chunk 0 is unread: with row_chunk each row computes its split size on the device
    _launch_decode(query, k_cache, v_cache, scales, block_tables, context_lens, out, rows,
                   splits, 0, float(scale) * _LOG2E, int(sliding_window or 0), consts,
                   row_chunk=True)  # fmt: skip
    return out


def _launch_decode(
    query, k_cache, v_cache, scales, block_tables, context_lens, out, rows: int, splits: int,
    chunk: int, qk_scale: float, window: int, consts: dict, row_chunk: bool = False,
) -> None:  # fmt: skip
    """The decode kernel over the first ``rows`` rows, and the reduce kernel when the keys are
    split; plain caches (``_unwrap``ped) with their scales, if quantized."""
    heads, dim = query.shape[1], query.shape[2]
    ks, vs = scales if scales is not None else (k_cache, v_cache)  # unread when not quantized
    if splits > 1:
        part_m = torch.empty(rows, heads, splits, dtype=torch.float32, device=out.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(rows, heads, splits, dim, dtype=torch.float32, device=out.device)
    else:
        part_m = part_l = part_acc = out  # unused
    _decode_kernel[(rows, k_cache.shape[2], splits)](
        query,
        k_cache,
        v_cache,
        ks,
        vs,
        block_tables,
        context_lens,
        out,
        part_m,
        part_l,
        part_acc,
        qk_scale,
        window,
        chunk,
        *query.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *ks.stride()[:3],
        *vs.stride()[:3],
        *block_tables.stride(),
        *out.stride(),
        **{**consts["decode"], "SPLIT": splits > 1, "ROW_CHUNK": row_chunk},
    )
    if splits > 1:
        _reduce_splits_kernel[(rows, heads)](
            part_m, part_l, part_acc, out, splits, *out.stride(),
            BLOCK_S=_pow2(splits), **consts["reduce"],
        )  # fmt: skip


def _graph_splits(rows: int, kv_heads: int, device: torch.device) -> int:
    """Key splits for a captured size: enough programs for two per SM when rows x kv heads
    fall short (batch 1 over 3 kv heads on 132 SMs: 32 splits, of which a row of 100 keys
    uses 2); one in the interpreter."""
    if INTERPRETED:
        return 1
    programs = rows * kv_heads
    return max(1, min(32, -(-2 * _num_sms(device) // programs)))


def launch_constants(
    dtype: torch.dtype, group: int, dim: int, page: int, has_window: bool, kv_quant: bool = False
) -> dict[str, dict]:
    """Compile-time constants and launch options per kernel (also used by the compile test).

    Tiles: 64x64 for 16-bit heads up to 128 wide; halved for fp32 or wider heads so the
    K/V tiles and accumulator fit shared memory on GPUs smaller than Hopper. Untuned."""
    wide = dim > 128 or dtype == torch.float32
    common = dict(
        GROUP=group,
        HEAD_DIM=dim,
        PAGE=page,
        HAS_WINDOW=has_window,
        KV_QUANT=kv_quant,  # int8 pages, dequantized to float32 as they are read
        # the interpreter's dot treats bfloat16 as raw uint16: give it fp32 operands
        UPCAST=INTERPRETED and dtype == torch.bfloat16,
        # fp32 caches get exact fp32 dots (not tf32): parity with the reference matters
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        BLOCK_D=_pow2(dim, 16),
    )
    return {
        "decode": dict(
            common,
            BLOCK_H=_pow2(group, 16),
            BLOCK_N=32 if wide else 64,
            ROW_CHUNK=False,  # True in graph_decode: split sizes from each row's length
            num_warps=4,
        ),
        "prefill": dict(
            common,
            BLOCK_M=32 if wide else 64,
            BLOCK_N=32 if wide else 64,
            num_warps=4 if dim <= 64 else 8,
            num_stages=2,
        ),
        "reduce": dict(HEAD_DIM=dim, BLOCK_D=common["BLOCK_D"]),
    }
