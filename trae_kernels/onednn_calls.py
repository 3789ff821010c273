"""torch's oneDNN linear on a prepacked weight, callable from C (``onednn_calls.c``): the
native layer loop's linear where oneDNN packs the weights (Intel CPUs: AMX or AVX512-BF16).

The C function takes the packed weight as a tensor handle: ``WeightHandles`` makes them, one
per weight, and releases them with itself. Built on first use like ``cpu_native``'s kernels;
where it cannot be had (no C compiler, torch without oneDNN) the layer loop stays in Python.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from trae_groups.kernels import cpu_native, torch_shim
from trae_groups.kernels.load_once import LoadOnce

SOURCE = Path(__file__).with_name("onednn_calls.c")
_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p


def _load() -> ctypes.CDLL:
    if not torch.backends.mkldnn.is_available():
        raise RuntimeError("torch was built without oneDNN")
    lib = cpu_native.built(SOURCE)
    lib.onednn_bind.argtypes = [_ptr] * 4 + [_i32] * 3
    lib.onednn_bind.restype = None
    lib.onednn_bind(
        *torch_shim.handle_functions(),
        torch_shim.address(torch_shim.aten(), "aoti_torch_cpu__linear_pointwise"),
        torch_shim.cpu_device(),
        torch_shim.dtype_code(torch.float32),
        torch_shim.dtype_code(torch.bfloat16),
    )
    lib.onednn_linear.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _i64, _i32, _ptr, _ptr]
    lib.onednn_linear.restype = _i32
    lib.onednn_tiles.argtypes = []
    lib.onednn_tiles.restype = _i32
    return lib


_loaded = LoadOnce(_load, cpu_native.LOAD_ERRORS, "oneDNN's linears are called from Python only")


def library() -> ctypes.CDLL | None:
    """The loaded caller, or None where it cannot be had (the reason logged once)."""
    return _loaded.get()


class Weight(ctypes.Structure):
    """A packed weight for the C caller (``Weight`` in onednn_calls.c)."""

    _fields_ = [("handle", _ptr), ("pairs", _ptr)]


@functools.cache
def packs_in_pairs(n: int, k: int, batch_hint: int | None) -> bool:
    """Whether oneDNN packs a bf16 [n, k] weight (with this batch hint) as [n / 32][k / 2][32]
    [2], the layout onednn_calls.c's tile path reads: checked on a packed probe, since the
    layout is oneDNN's choice (by CPU, shape and hint), not a promise."""
    if n % 32 or k % 32:
        return False
    probe = torch.randn(n, k, generator=torch.Generator().manual_seed(0)).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(probe, batch_hint)
    if torch.ops.mkldnn._nbytes(packed) != n * k * 2:
        return False
    raw = (ctypes.c_uint16 * (n * k)).from_address(torch.ops.mkldnn.data_ptr(packed))
    got = torch.frombuffer(raw, dtype=torch.int16).view(torch.bfloat16)
    want = probe.view(n // 32, 32, k // 2, 2).permute(0, 2, 1, 3).reshape(-1)
    return torch.equal(got, want)


class WeightHandles:
    """Packed weights for the C caller: torch's tensor handles (heap ``at::Tensor``s, each
    holding a reference), all released when this is dropped, and where the tile path takes
    a weight (bf16, AMX, ``packs_in_pairs``) the address of its buffer."""

    def __init__(self) -> None:
        self._capsules: list = []  # torch hands a handle out and takes it back as a capsule
        self._weights: list[Weight] = []
        self._steal = torch._C._aoti.alloc_tensor_by_stealing_from_void_ptr  # kept for __del__

    def of(self, weight: torch.Tensor, batch_hint: int | None) -> int:
        """The address of a ``Weight`` for ``weight``, packed with ``batch_hint`` (the tile
        path checks the layout oneDNN gives that hint)."""
        capsule = torch._C._aoti.unsafe_alloc_void_ptr_from_tensor(weight)
        self._capsules.append(capsule)
        n, k = weight.shape
        lib = library()
        tiles = weight.dtype == torch.bfloat16 and lib is not None and lib.onednn_tiles()
        pairs = (
            torch.ops.mkldnn.data_ptr(weight)
            if tiles and packs_in_pairs(n, k, batch_hint)
            else None
        )
        held = Weight(_capsule_pointer(capsule, None), pairs)
        self._weights.append(held)
        return ctypes.addressof(held)

    def release(self) -> None:
        capsules, self._capsules = self._capsules, []
        self._weights = []
        for capsule in capsules:  # the tensor takes the handle over and frees it when dropped
            self._steal(capsule)

    def __del__(self) -> None:
        self.release()


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_pointer.restype = ctypes.c_void_p


def linear(
    x: torch.Tensor, handle: int, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [rows, in] @ W.T + bias`` through the C caller (``handle`` from ``WeightHandles``;
    ``library()`` must have loaded): what the layer loop calls, for tests of the caller."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError("the C caller takes a packed matrix")
    out = torch.empty((x.shape[0], out_features), dtype=x.dtype)
    err = _loaded.get().onednn_linear(
        x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), out_features,
        torch_shim.dtype_code(x.dtype), handle, None if bias is None else bias.data_ptr(),
    )  # fmt: skip
    if err:
        raise RuntimeError(f"oneDNN's linear failed (error {err})")
    return out
