"""torch's oneDNN linear on a prepacked weight, callable from C (``onednn_calls.c``): the
native layer loop's linear where oneDNN packs the weights (Intel CPUs: AMX or AVX512-BF16).

The C function takes the packed weight as a tensor handle: ``WeightHandles`` makes them, one
per weight, and releases them with itself. Built on first use like ``cpu_native``'s kernels;
where it cannot be had (no C compiler, torch without oneDNN) the layer loop stays in Python.
"""

from __future__ import annotations

import ctypes
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
    return lib


_loaded = LoadOnce(_load, cpu_native.LOAD_ERRORS, "oneDNN's linears are called from Python only")


def library() -> ctypes.CDLL | None:
    """The loaded caller, or None where it cannot be had (the reason logged once)."""
    return _loaded.get()


class WeightHandles:
    """Tensor handles (heap ``at::Tensor``s, each holding a reference) of packed weights for
    the C caller; all released when this is dropped."""

    def __init__(self) -> None:
        self._capsules: list = []  # torch hands a handle out and takes it back as a capsule
        self._steal = torch._C._aoti.alloc_tensor_by_stealing_from_void_ptr  # kept for __del__

    def of(self, weight: torch.Tensor) -> int:
        """A handle of ``weight``, as an address for the C caller."""
        capsule = torch._C._aoti.unsafe_alloc_void_ptr_from_tensor(weight)
        self._capsules.append(capsule)
        return _capsule_pointer(capsule, None)

    def release(self) -> None:
        capsules, self._capsules = self._capsules, []
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
