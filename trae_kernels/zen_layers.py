"""The flat forward's layer stack in one native call (``zen_layers.c``), where every kernel of
a layer has a C entry point: bf16 or float32 weights packed for zentorch (AMD) or oneDNN
(Intel, and AMD without AVX-512), or bf16 weights on our AVX2 panels (a CPU without bf16
matmuls: onednn_calls.bf16_panels), zentorch's norms (its C shims loaded) or, in AVX2 builds,
ours (zentorch not needed there), K/V pages of the same dtype, our rotation and SiLU (bf16 and
float32), and a step whose attention the native paged kernel runs for every row (decodes, and
short prompt chunks beside them).

Why: the kernels of a SmolLM2 decode step are ~300 calls; from Python each costs 6-10 us of
wrapper besides the glue between them (docs/performance.md). The C loop calls the same kernels
with the same arguments, so its results are the Python loop's bits. Built on first use like
``cpu_native``; ``TRAE_NATIVE_LAYERS=0`` (or ``turned_off`` on a thread) keeps the Python loop.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from trae_groups.kernels import cpu_native, onednn_calls, zen_calls
from trae_groups.kernels.load_once import LoadOnce
from trae_groups.kernels.thread_switch import ThreadSwitch
from trae_groups.kernels.torch_shim import address

SOURCE = Path(__file__).with_name("zen_layers.c")
ENV_SWITCH = "TRAE_NATIVE_LAYERS"  # "0": the flat forward's Python loop
KINDS = (torch.bfloat16, torch.float32)  # Step.kind indexes this (``KINDS`` in zen_layers.c)
# Step.library indexes this (``LIBRARIES`` in zen_layers.c): PackedLinear.library's names, and
# "bf16_panels" for a PackedLinear whose bf16 weights are our panels (``bf16_panels``)
LIBRARIES = ("zentorch", "onednn", "bf16_panels")
_i64, _ptr, _f64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double

_bound: set[torch.dtype] = set()  # the KINDS whose kernels this build has (bound at load)
_switch = ThreadSwitch()
turned_off = _switch.turned_off  # this thread runs the Python loop meanwhile (tests)


class Step(ctypes.Structure):
    """``Step`` in zen_layers.c: one step's shapes and buffers."""

    _fields_ = [
        *((name, _i64) for name in (
            "rows", "attn_rows", "hidden", "heads", "kv_heads", "dim", "inter", "head_norms",
            "dtype", "threads", "kind", "elem", "library",
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
            "down_w", "down_b", "k_cache", "v_cache", "head_w",
        )),
        ("window", _i64),
    ]  # fmt: skip


def _load() -> ctypes.CDLL:
    if os.environ.get(ENV_SWITCH) == "0":
        raise RuntimeError(f"{ENV_SWITCH}=0")
    native = cpu_native.library()
    if native is None or not hasattr(native, "silu_mul_f32"):
        raise RuntimeError("needs an AVX-512 or AVX2 build of cpu_paged.c")
    # our add-and-norm in AVX2 builds (zentorch's took 5.6x its time at 2,048 rows
    # there), zentorch's elsewhere: the flat forward's Python loop picks the same (_norms_for).
    # So an AVX2 build runs the loop without zentorch (its linears oneDNN's there).
    own_norm = hasattr(native, "add_rms_norm_call")
    zen = zen_calls.library()
    if zen is None and not own_norm:
        raise RuntimeError("needs zentorch's C shims (its add-and-norm) in an AVX-512 build")
    lib = cpu_native.built(SOURCE)
    lib.layers_bind.argtypes = [_ptr]
    lib.layers_bind.restype = None
    lib.layers_bind(
        address(native, "add_rms_norm_call") if own_norm else address(zen, "zen_add_rms_norm")
    )
    lib.layers_bind_linear.argtypes = [_i64, _ptr]
    lib.layers_bind_linear.restype = ctypes.c_int32
    onednn = onednn_calls.library()
    callers = {
        "zentorch": (zen, "zen_linear"),
        "onednn": (onednn, "onednn_linear"),
        "bf16_panels": (onednn, "onednn_bf16_panels_linear"),  # AVX2 builds
    }
    for index, name in enumerate(LIBRARIES):
        caller, function = callers[name]
        if caller is None or not hasattr(caller, function):
            continue
        if lib.layers_bind_linear(index, address(caller, function)):
            raise RuntimeError("zen_layers.c has fewer linear libraries than zen_layers.LIBRARIES")
    lib.layers_bind_kind.argtypes = [_i64] + [_ptr] * 5
    lib.layers_bind_kind.restype = ctypes.c_int32
    for kind, dtype in enumerate(KINDS):
        suffix = cpu_native.suffix(dtype)
        if not hasattr(native, f"silu_mul_{suffix}"):
            continue
        _bound.add(dtype)
        rotate, store, silu, head_norms = (
            address(native, f"{n}_{suffix}")
            for n in ("rotate", "store_kv", "silu_mul", "head_norms")
        )
        attend = ctypes.cast(cpu_native.decode_kernel(dtype), _ptr).value  # AMX's where it loads
        if lib.layers_bind_kind(kind, rotate, store, attend, silu, head_norms):
            raise RuntimeError("zen_layers.c has fewer element types than zen_layers.KINDS")
    lib.decoder_layers.argtypes = [ctypes.POINTER(Step), ctypes.POINTER(Layer), _i64]
    lib.decoder_layers.restype = ctypes.c_int32
    return lib


_loaded = LoadOnce(
    _load,
    cpu_native.LOAD_ERRORS,
    "the flat forward's layers loop in Python",
)


def library() -> ctypes.CDLL | None:
    """The loaded layer loop, or None where it cannot be had (the reason logged once) or
    this thread turned it off."""
    return None if _switch.off else _loaded.get()


def step_kind(dtype: torch.dtype) -> tuple[int, int] | None:
    """(Step.kind, Step.elem) for activations of ``dtype``; None where the loop has no kernels
    for it."""
    if dtype not in KINDS or _loaded.get() is None or dtype not in _bound:
        return None
    return KINDS.index(dtype), torch.empty((), dtype=dtype).element_size()


def linear_library(name: str) -> int | None:
    """Step.library for linears packed by ``name`` (one of ``LIBRARIES``); None where the loop
    has no caller of it loaded."""
    if name not in LIBRARIES:
        return None
    onednn = onednn_calls.library()
    if name == "onednn" and onednn is None:
        return None
    if name == "bf16_panels" and not hasattr(onednn, "onednn_bf16_panels_linear"):
        return None
    return LIBRARIES.index(name)


def run(step: Step, layers: ctypes.Array, n_layers: int) -> None:
    """Every layer over the step (``library()`` must have returned the library)."""
    err = _loaded.get().decoder_layers(ctypes.byref(step), layers, n_layers)
    if err:
        raise RuntimeError(f"a native decoder layer failed (kernel error {err})")
