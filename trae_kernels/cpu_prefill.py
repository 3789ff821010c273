"""Prompt attention over paged K/V on AMX tiles (``cpu_prefill.c``): a step's prompt chunks
attend over their pages where they lie, bf16 in, float32 softmax and sums.

Where it runs: an x86 CPU with AMX (``amx_bf16``; Intel Xeon from Sapphire Rapids on), the
kernel built with AMX (``-march=native`` there) and the tile state granted by the OS, bf16
queries and pages, head size 64, pages of a multiple of 16 tokens. Elsewhere the torch path
(``attention._prefill_padded`` and friends, or zentorch's kernel) runs.
``TRAE_AMX_PREFILL=0`` turns it off. Built on first use like ``cpu_native``'s kernels.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import torch

from trae_groups.kernels import cpu_native
from trae_groups.kernels.load_once import LoadOnce
from trae_groups.kernels.thread_switch import ThreadSwitch

SOURCE = Path(__file__).with_name("cpu_prefill.c")
ENV_SWITCH = "TRAE_AMX_PREFILL"  # "0": torch's (or zentorch's) prompt attention instead
HEAD_SIZE = 64  # DIM in cpu_prefill.c
TILE_ROWS = 16  # TILE in cpu_prefill.c: a page must hold a multiple of it
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p

_switch = ThreadSwitch()
turned_off = _switch.turned_off  # this thread runs the torch path meanwhile (tests)


def _load() -> ctypes.CDLL:
    if os.environ.get(ENV_SWITCH) == "0":
        raise RuntimeError(f"{ENV_SWITCH}=0")
    cc = cpu_native.compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang)")
    lib = ctypes.CDLL(str(cpu_native.build(cc, SOURCE)))
    if not hasattr(lib, "prefill_attention_amx"):
        raise RuntimeError("no AMX on this CPU (or in this compiler)")
    if not lib.prefill_amx_init():
        raise RuntimeError("the OS did not grant the AMX tile state")
    lib.prefill_attention_amx.argtypes = (
        [_ptr, _i64, _ptr, _ptr, *[_i64] * 4, _ptr, _i64, _ptr, _ptr, _ptr, _ptr]
        + [_i64] * 4
        + [ctypes.c_float, _i64, _ptr, _i64, ctypes.c_int]
    )
    lib.prefill_attention_amx.restype = ctypes.c_int
    return lib


_loaded = LoadOnce(
    _load,
    (OSError, AttributeError, RuntimeError, subprocess.SubprocessError),
    "prompt attention on torch's kernels",
)


def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None where it cannot be had (the reason logged once) or this
    thread turned it off."""
    return None if _switch.off else _loaded.get()


def supports(query: torch.Tensor, k_cache, v_cache) -> bool:
    """Whether ``attend`` takes this layer's prompt chunks."""
    if not cpu_native.stores(query, k_cache, v_cache) or query.dtype != torch.bfloat16:
        return False
    heads, dim = query.shape[1:]
    kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    if dim != HEAD_SIZE or heads % kv_heads or page % TILE_ROWS:
        return False
    if query.stride(2) != 1 or query.stride(1) != dim or query.stride(0) % 2:
        return False
    return library() is not None


def attend(query, k_cache, v_cache, batch, scale: float, window: int | None, out) -> None:
    """Every prompt chunk's rows of ``out`` [T, heads, dim] (the step's decode rows are left
    as they are); ``supports`` must have said yes."""
    table_row, first_row, rows, ctx = batch.chunk_rows()
    tables = batch.block_tables
    if not tables.is_contiguous():
        tables = tables.contiguous()
    page_s, tok_s, head_s = cpu_native.cache_strides(k_cache)
    err = library().prefill_attention_amx(
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), page_s,
        tok_s, head_s, k_cache.shape[1], tables.data_ptr(), tables.stride(0),
        table_row.data_ptr(), first_row.data_ptr(), rows.data_ptr(), ctx.data_ptr(),
        table_row.shape[0], query.shape[1], k_cache.shape[2], query.shape[2], scale,
        window or 0, out.data_ptr(), out.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    if err:
        raise RuntimeError(f"AMX prompt attention failed (error {err})")
