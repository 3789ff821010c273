"""Attention over paged K/V on AMX tiles (``cpu_amx.c``), bf16 in, float32 softmax and sums:
prompt chunks attend over their pages where they lie (``prefill``), and decode rows score a
page of keys per tile product (``decode``, cpu_native's decode kernel's arguments).

Where it runs: an x86 CPU with AMX (``amx_bf16``; Intel Xeon from Sapphire Rapids on), the
kernels built with AMX (``-march=native`` there) and the tile state granted by the OS, bf16
queries and pages, pages of a multiple of 16 tokens, head size 64 or 128 (decodes of other
shapes go to cpu_native's AVX-512 kernel). Elsewhere the other kernels run.
``TRAE_AMX_ATTENTION=0`` turns both off. Built on first use like ``cpu_native``'s kernels.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from trae_groups.kernels import cpu_native, cpu_prompt
from trae_groups.kernels.load_once import LoadOnce
from trae_groups.kernels.thread_switch import ThreadSwitch
from trae_groups.kernels.torch_shim import address

SOURCE = Path(__file__).with_name("cpu_amx.c")
ENV_SWITCH = "TRAE_AMX_ATTENTION"  # "0": the AVX-512 and torch kernels instead
HEAD_SIZES = (64, 128)  # what both kernels take (cpu_amx.c)
TILE_ROWS = 16  # TILE in cpu_amx.c: a page must hold a multiple of it
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p

_switch = ThreadSwitch()
turned_off = _switch.turned_off  # this thread runs the other kernels meanwhile (tests)


def _load() -> ctypes.CDLL:
    native = cpu_native.library()
    if native is None:
        raise RuntimeError("cpu_native's kernels are off")
    lib = cpu_native.built(SOURCE, ENV_SWITCH)
    if not hasattr(lib, "prefill_attention_amx"):
        raise RuntimeError("no AMX on this CPU (or in this compiler)")
    lib.amx_init.argtypes = [_ptr]
    if not lib.amx_init(address(native, "decode_attention_bf16")):
        raise RuntimeError("the OS did not grant the AMX tile state")
    lib.prefill_attention_amx.argtypes = cpu_prompt.ARGTYPES
    lib.prefill_attention_amx.restype = ctypes.c_int
    lib.decode_attention_amx.argtypes = native.decode_attention_bf16.argtypes
    lib.decode_attention_amx.restype = None
    return lib


_loaded = LoadOnce(_load, cpu_native.LOAD_ERRORS, "attention on our other kernels and torch's")


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot be had (the reason logged once) or this
    thread turned them off."""
    return None if _switch.off else _loaded.get()


def decodes(dtype: torch.dtype) -> bool:
    """Whether bf16 decode rows go to the AMX kernel (``decode_attention_amx``; it hands
    shapes it does not take to cpu_native's)."""
    return dtype == torch.bfloat16 and library() is not None


def supports_prefill(query: torch.Tensor, k_cache, v_cache) -> bool:
    """Whether ``prefill`` takes this layer's prompt chunks."""
    if not cpu_prompt.takes(query, k_cache, v_cache, torch.bfloat16, HEAD_SIZES):
        return False
    return k_cache.shape[1] % TILE_ROWS == 0 and query.stride(0) % 2 == 0 and library() is not None


def prefill(query, k_cache, v_cache, batch, scale: float, window: int | None, out) -> None:
    """``cpu_prompt.call`` with the AMX kernel (``supports_prefill`` said yes)."""
    cpu_prompt.call(
        library().prefill_attention_amx, query, k_cache, v_cache, batch, scale, window, out
    )
