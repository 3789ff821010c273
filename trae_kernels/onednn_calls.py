"""torch's oneDNN linear on a prepacked weight, callable from C (``onednn_calls.c``): the
native layer loop's linear where oneDNN packs the weights (Intel CPUs: AMX or AVX512-BF16).

The C function takes the packed weight as a tensor handle: ``WeightHandles`` makes them, one
per weight, and releases them with itself. Built on first use like ``cpu_native``'s kernels;
where it cannot be had (no C compiler, torch without oneDNN) the layer loop stays in Python.
AVX2 builds also multiply bf16 weights of their own layout (``bf16_panels``): a bf16 model's
linears on a CPU without bf16 matmuls.
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
    lib.onednn_own_rows.argtypes = [_i32]
    lib.onednn_own_rows.restype = _i64
    lib.onednn_found_slots.restype = _i64
    if hasattr(lib, "onednn_bf16_panels"):  # AVX2 builds
        lib.onednn_bf16_panels.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr]
        lib.onednn_bf16_panels.restype = _i32
    if lib.onednn_found_slots() != F32_SLOTS:
        raise RuntimeError("onednn_calls.c and onednn_calls.py disagree on F32_SLOTS")
    return lib


_loaded = LoadOnce(_load, cpu_native.LOAD_ERRORS, "oneDNN's linears are called from Python only")


def library() -> ctypes.CDLL | None:
    """The loaded caller, or None where it cannot be had (the reason logged once)."""
    return _loaded.get()


# ``Weight.found``'s length: a slot a float32 row count to 64, one for every count past it
# (onednn_calls.c's F32_SLOTS)
F32_SLOTS = 66


def own_rows_limit(dtype: torch.dtype) -> int:
    """The most rows onednn_calls.c multiplies itself in ``dtype`` here (bf16: 32, on AMX
    tiles; float32: 64 in an AVX-512 build, any count in an AVX2 one, prompt rows included),
    0 where it only calls the op or cannot be had."""
    lib = library()
    return lib.onednn_own_rows(torch_shim.dtype_code(dtype)) if lib is not None else 0


class Weight(ctypes.Structure):
    """A packed weight for the C caller (``Weight`` in onednn_calls.c)."""

    _fields_ = [("handle", _ptr), ("blocked", _ptr), ("found", ctypes.c_int16 * F32_SLOTS)]


# The columns of a block of the layouts onednn_calls.c reads, by dtype: bf16 [n / 32][k / 2][32][2]
# (pairs of k for 32 columns, what oneDNN's AMX kernels read), float32 [n / 64][k][64] (panels)
_BLOCK_COLUMNS = {torch.bfloat16: 32, torch.float32: 64}


def _blocked(weight: torch.Tensor) -> int | None:
    """The packed buffer's address where onednn_calls.c may read it itself: bf16 on a CPU with
    AMX, float32 in an AVX-512 or AVX2 build, whole blocks of its columns (and of 32 k for the
    tiles), and a buffer of exactly n x k elements (no padding), so that any reading stays
    inside it. Whether the layout and order are the ones it reads, the first call at each row
    count checks against the op (onednn_calls.c's ``own_rows``). Else None: the op."""
    if weight.dtype not in _BLOCK_COLUMNS or not own_rows_limit(weight.dtype):
        return None
    n, k = weight.shape
    if n % _BLOCK_COLUMNS[weight.dtype] or (weight.dtype == torch.bfloat16 and k % 32):
        return None
    if torch.ops.mkldnn._nbytes(weight) != n * k * weight.element_size():
        return None
    return torch.ops.mkldnn.data_ptr(weight)


class WeightHandles:
    """Packed weights for the C caller: torch's tensor handles (heap ``at::Tensor``s, each
    holding a reference), all released when this is dropped, and where onednn_calls.c reads a
    weight's buffer itself (``_blocked``) its address."""

    def __init__(self) -> None:
        self._capsules: list = []  # torch hands a handle out and takes it back as a capsule
        self._weights: list[Weight] = []
        self._steal = torch._C._aoti.alloc_tensor_by_stealing_from_void_ptr  # kept for __del__

    def of(self, weight: torch.Tensor) -> int:
        """The address of a ``Weight`` for ``weight`` (packed by ``_reorder_linear_weight``)."""
        capsule = torch._C._aoti.unsafe_alloc_void_ptr_from_tensor(weight)
        self._capsules.append(capsule)
        held = Weight(_capsule_pointer(capsule, None), _blocked(weight))
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


class OwnRows:
    """One packed weight as ``PackedLinear`` hands rows to onednn_calls.c, where it multiplies
    them itself from the packed buffer (bf16 on AMX tiles, float32 panels): the op's bits
    without the op's ~20 us a call (a decode step's lm_head, the Python loop's decode rows),
    and on AVX2 CPUs faster than the op at prompt rows too."""

    def __init__(self, weight: torch.Tensor) -> None:
        self._handles = WeightHandles()
        self.address = self._handles.of(weight)
        self.out_features = weight.shape[0]
        own = self._handles._weights[-1].blocked
        self.max_rows = own_rows_limit(weight.dtype) if own else 0

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, self.address, self.out_features, bias)


def own_rows(weight: torch.Tensor) -> OwnRows | None:
    """An ``OwnRows`` for a packed weight, or None where onednn_calls.c would only call the op
    (another layout, dtype or CPU; no caller here)."""
    if library() is None:
        return None
    caller = OwnRows(weight)
    return caller if caller.max_rows else None


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


# Columns of a panel of ``bf16_panels`` (onednn_calls.c's PANEL)
PANEL = 64


def bf16_panels_built() -> bool:
    """Whether ``bf16_panels`` runs here: an AVX2 build (a CPU with AVX2 and no AVX-512, and a
    C compiler to build it)."""
    return hasattr(library(), "onednn_bf16_panels")


def bf16_panels_take(out_features: int) -> bool:
    """Whether ``bf16_panels`` multiplies a bf16 weight of this many outputs here: whole
    panels of 64 columns, where they are built."""
    return bf16_panels_built() and out_features % PANEL == 0


def bf16_panels_of(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [n, k] laid out as the panels ``bf16_panels`` reads: [n / 64][k][64]."""
    n, k = weight.shape
    return weight.detach().reshape(n // PANEL, PANEL, k).transpose(1, 2).contiguous()


def bf16_panels(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [rows, k] (bf16) @ W.T + bias`` from ``bf16_panels_of(W)``, summed in float32 and
    rounded to bf16 once: the bits of the float32 panels over x and W widened, rounded as
    torch rounds, at half their weight bytes. ``bias`` is float32 or None."""
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError("the bf16 panels take a bf16 matrix")
    if x.stride(1) != 1:
        x = x.contiguous()
    n = panels.shape[0] * PANEL
    out = torch.empty((x.shape[0], n), dtype=torch.bfloat16)
    if x.shape[0] == 0:
        return out
    err = _loaded.get().onednn_bf16_panels(
        x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), panels.data_ptr(), n,
        None if bias is None else bias.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    if err:
        raise MemoryError("the bf16 panels found no memory for their copy of the rows")
    return out
