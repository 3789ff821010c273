"""Prompt attention over paged K/V on AVX-512 or AVX2 (``cpu_prompt.c``): a step's prompt chunks
attend over their pages where they lie, computing only the scores the causal edge (and a
window) leaves. bf16 chunks take the AMX kernel where the CPU has it (cpu_amx.py); ``call``
runs either with a step's chunks.

Where it runs: float32 queries and pages in an AVX-512 build of the kernel (or an AVX2 and FMA
one: 16 queries an item where AVX-512's takes 32), bf16 ones in an AVX-512 build (widened
exactly, summed in float32, rounded once), head size 64 or 128. Elsewhere zentorch's SDPA or
torch's flash kernel runs (attention._prefill_padded and friends). ``TRAE_NATIVE_PROMPTS=0``
turns it off. Built on first use like ``cpu_native``'s kernels.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from trae_groups.kernels import cpu_native
from trae_groups.kernels.load_once import LoadOnce
from trae_groups.kernels.thread_switch import ThreadSwitch

SOURCE = Path(__file__).with_name("cpu_prompt.c")
# the kernel of each dtype (bf16 in AVX-512 builds only)
_KERNELS = {torch.float32: "prefill_attention_f32", torch.bfloat16: "prefill_attention_bf16"}
ENV_SWITCH = "TRAE_NATIVE_PROMPTS"  # "0": zentorch's or torch's prompt attention instead
HEAD_SIZES = (64, 128)
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
# a prompt kernel's arguments (cpu_prompt.c's and cpu_amx.c's are the same)
ARGTYPES = (
    [_ptr, _i64, _ptr, _ptr, *[_i64] * 4, _ptr, _i64, _ptr, _ptr, _ptr, _ptr]
    + [_i64] * 4
    + [ctypes.c_float, _i64, _ptr, _i64, ctypes.c_int]
)

_switch = ThreadSwitch()
turned_off = _switch.turned_off  # this thread runs torch's kernel meanwhile (tests)


def _load() -> ctypes.CDLL:
    lib = cpu_native.built(SOURCE, ENV_SWITCH)
    if not hasattr(lib, "prefill_attention_f32"):
        raise RuntimeError("no AVX-512 or AVX2 on this CPU (or in this compiler)")
    for name in _KERNELS.values():
        if hasattr(lib, name):
            getattr(lib, name).argtypes = ARGTYPES
            getattr(lib, name).restype = ctypes.c_int
    return lib


_loaded = LoadOnce(_load, cpu_native.LOAD_ERRORS, "float32 prompt attention on torch's kernel")


def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None where it cannot be had (the reason logged once) or this
    thread turned it off."""
    return None if _switch.off else _loaded.get()


def takes(query: torch.Tensor, k_cache, v_cache, dtype: torch.dtype, head_sizes) -> bool:
    """Whether a prompt kernel for ``dtype`` and ``head_sizes`` takes this layer's chunks:
    plain pages of the query's dtype, heads packed in each row."""
    if query.dtype != dtype or not cpu_native.stores(query, k_cache, v_cache):
        return False
    heads, dim = query.shape[1:]
    return (
        dim in head_sizes
        and heads % k_cache.shape[2] == 0
        and query.stride(2) == 1
        and query.stride(1) == dim
    )


def supports(query: torch.Tensor, k_cache, v_cache) -> bool:
    """Whether ``prefill`` takes this layer's prompt chunks."""
    name = _KERNELS.get(query.dtype)
    if name is None or not takes(query, k_cache, v_cache, query.dtype, HEAD_SIZES):
        return False
    return hasattr(library(), name)


def call(kernel, query, k_cache, v_cache, batch, scale: float, window: int | None, out) -> None:
    """Run a prompt kernel over every prompt chunk of the step: their rows of ``out`` [T,
    heads, dim] (the decode rows are left as they are)."""
    table_row, first_row, rows, ctx = batch.chunk_rows()
    tables = batch.block_tables
    if not tables.is_contiguous():
        tables = tables.contiguous()
    page_s, tok_s, head_s = cpu_native.cache_strides(k_cache)
    err = kernel(
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), page_s,
        tok_s, head_s, k_cache.shape[1], tables.data_ptr(), tables.stride(0),
        table_row.data_ptr(), first_row.data_ptr(), rows.data_ptr(), ctx.data_ptr(),
        table_row.shape[0], query.shape[1], k_cache.shape[2], query.shape[2], scale,
        window or 0, out.data_ptr(), out.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    if err:
        raise RuntimeError(f"native prompt attention failed (error {err})")


def prefill(query, k_cache, v_cache, batch, scale: float, window: int | None, out) -> None:
    """``call`` with the kernel of the query's dtype (``supports`` said yes)."""
    kernel = getattr(library(), _KERNELS[query.dtype])
    call(kernel, query, k_cache, v_cache, batch, scale, window, out)
