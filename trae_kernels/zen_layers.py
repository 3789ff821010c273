"""The flat forward's layer stack in one native call (``zen_layers.c``), where every kernel of
a layer has a C entry point: bf16 weights packed for zentorch (AMD, its C shims loaded), bf16
K/V pages, our AVX-512 rotation and SiLU, and a step whose attention the native paged kernel
runs for every row (decodes, and short prompt chunks beside them).

Why: the kernels of a SmolLM2 decode step are ~300 calls; from Python each costs 6-10 us of
wrapper besides the glue between them (docs/performance.md). The C loop calls the same kernels
with the same arguments, so its results are the Python loop's bits. Built on first use like
``cpu_native``; ``TRAE_NATIVE_LAYERS=0`` (or ``turned_off`` on a thread) keeps the Python loop.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

from trae_groups.kernels import cpu_native, zen_calls
from trae_groups.kernels.load_once import LoadOnce
from trae_groups.kernels.thread_switch import ThreadSwitch

SOURCE = Path(__file__).with_name("zen_layers.c")
ENV_SWITCH = "TRAE_NATIVE_LAYERS"  # "0": the flat forward's Python loop
_i64, _ptr, _f64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double

_switch = ThreadSwitch()
turned_off = _switch.turned_off  # this thread runs the Python loop meanwhile (tests)


class Step(ctypes.Structure):
    """``Step`` in zen_layers.c: one step's shapes and buffers."""

    _fields_ = [
        *((name, _i64) for name in (
            "rows", "attn_rows", "hidden", "heads", "kv_heads", "dim", "inter", "head_norms",
            "dtype", "threads",
        )),
        ("eps", _f64),
        ("scale", _f64),
        *((name, _ptr) for name in (
            "x0", "out", "residual", "qkv", "normed", "rotated", "attn", "gate_up", "act",
            "cos", "ssin",
        )),
        ("cs_rs", _i64),
        ("slots", _ptr),
        ("tables", _ptr),
        ("tab_s", _i64),
        ("row_seq", _ptr),
        ("row_pos", _ptr),
        *((name, _i64) for name in ("page_s", "tok_s", "head_s", "page_size")),
    ]  # fmt: skip


class Layer(ctypes.Structure):
    """``Layer`` in zen_layers.c: one layer's weights and caches (NULL: no bias)."""

    _fields_ = [
        *((name, _ptr) for name in (
            "in_norm", "post_norm", "qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w", "gate_up_b",
            "down_w", "down_b", "k_cache", "v_cache", "head_w", "head_ones",
        )),
        ("window", _i64),
    ]  # fmt: skip


def _address(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), _ptr).value


def _load() -> ctypes.CDLL:
    if os.environ.get(ENV_SWITCH) == "0":
        raise RuntimeError(f"{ENV_SWITCH}=0")
    zen, native = zen_calls.library(), cpu_native.library()
    if zen is None or native is None or not hasattr(native, "silu_mul_bf16"):
        raise RuntimeError("needs zentorch's C shims and the AVX-512 build of cpu_paged.c")
    lib = ctypes.CDLL(str(cpu_native.build(cpu_native.compiler(), SOURCE)))
    lib.layers_bind.argtypes = [_ptr] * 8
    lib.layers_bind.restype = None
    lib.layers_bind(
        _address(zen, "zen_linear"),
        _address(zen, "zen_add_rms_norm"),
        _address(zen, "zen_rms_norm"),
        _address(native, "rotate_bf16"),
        _address(native, "store_kv_bf16"),
        _address(native, "decode_attention_bf16"),
        _address(native, "silu_mul_bf16"),
        _address(native, "mul_rows_bf16"),
    )
    lib.decoder_layers_bf16.argtypes = [ctypes.POINTER(Step), ctypes.POINTER(Layer), _i64]
    lib.decoder_layers_bf16.restype = ctypes.c_int32
    return lib


_loaded = LoadOnce(
    _load,
    (OSError, AttributeError, RuntimeError, subprocess.SubprocessError),
    "the flat forward's layers loop in Python",
)


def library() -> ctypes.CDLL | None:
    """The loaded layer loop, or None where it cannot be had (the reason logged once) or
    this thread turned it off."""
    return None if _switch.off else _loaded.get()


def run(step: Step, layers: ctypes.Array, n_layers: int) -> None:
    """Every layer over the step (``library()`` must have returned the library)."""
    err = _loaded.get().decoder_layers_bf16(ctypes.byref(step), layers, n_layers)
    if err:
        raise RuntimeError(f"a native decoder layer failed (zentorch error {err})")
