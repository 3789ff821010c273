"""torch's C shim (the functions AOTInductor's generated code calls), as our C callers bind it:
the library, function addresses, and the codes it takes for dtypes and the CPU device."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

_i32, _ptr = ctypes.c_int32, ctypes.c_void_p
# torch's tensor-handle functions every caller binds, in this order
HANDLE_FUNCTIONS = (
    "aoti_torch_create_tensor_from_blob",
    "aoti_torch_delete_tensor_object",
    "aoti_torch_get_data_ptr",
)


def address(lib: ctypes.CDLL, name: str) -> int:
    """The address of ``name`` in ``lib``, to hand to a C caller's bind function."""
    return ctypes.cast(getattr(lib, name), _ptr).value


@functools.cache
def aten() -> ctypes.CDLL:
    """libtorch_cpu, where the shim lives (already loaded by ``import torch``)."""
    return ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))


def _code(name: str) -> int:
    fn = getattr(aten(), name)
    fn.restype = _i32
    return fn()


@functools.cache
def _dtype_codes() -> dict[torch.dtype, int]:
    return {
        torch.float32: _code("aoti_torch_dtype_float32"),
        torch.bfloat16: _code("aoti_torch_dtype_bfloat16"),
    }


DTYPES = (torch.float32, torch.bfloat16)  # the dtypes our callers pass


def dtype_code(dtype: torch.dtype) -> int:
    """The shim's code for ``dtype`` (one of ``DTYPES``)."""
    return _dtype_codes()[dtype]


def cpu_device() -> int:
    return _code("aoti_torch_device_type_cpu")


def handle_functions() -> list[int]:
    """The addresses of ``HANDLE_FUNCTIONS``."""
    return [address(aten(), name) for name in HANDLE_FUNCTIONS]
