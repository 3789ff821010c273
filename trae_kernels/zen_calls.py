"""zentorch's linear, norm and fused add-and-norm through its C shims (``zen_calls.c``), not
torch's dispatcher: zentorch 2.13's dispatcher ops leak each string argument (~140 bytes a
linear call, the C file says why). Built on first use like ``cpu_native``'s kernels; where it
cannot be had (no C compiler, no zentorch, ``TRAE_ZEN_SHIMS=0``) callers use the dispatcher
ops, which compute the same bits."""

from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path

import torch

from trae_groups.kernels import cpu_native, torch_shim
from trae_groups.kernels.load_once import LoadOnce
from trae_groups.kernels.zen_attention import ZEN_OP_NAME

SOURCE = Path(__file__).with_name("zen_calls.c")
ENV_SWITCH = "TRAE_ZEN_SHIMS"  # "0": zentorch's dispatcher ops (they leak) instead
_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p


def _load() -> ctypes.CDLL:
    if os.environ.get(ENV_SWITCH) == "0":
        raise RuntimeError(f"{ENV_SWITCH}=0")
    # the shims' library by its path, not ``import zentorch``: that import took ~1.9 s alone
    # and ~50 MB in an engine process (its compile passes, which the engine does not use);
    # engine/fast_linear.py loaded zentorch's op library, which this one serves
    spec = importlib.util.find_spec("zentorch")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("zentorch is not installed")
    zen = ctypes.CDLL(str(Path(spec.submodule_search_locations[0]) / "libzentorch.so"))
    lib = cpu_native.built(SOURCE)
    lib.zen_bind.argtypes = [_ptr] * 6 + [_i32]
    lib.zen_bind.restype = None
    lib.zen_bind(
        *torch_shim.handle_functions(),
        torch_shim.address(zen, "aoti_torch_cpu_zentorch_linear_unary_out"),
        torch_shim.address(zen, "aoti_torch_cpu_zentorch_add_rms_norm_"),
        torch_shim.address(zen, "aoti_torch_cpu_zentorch_rms_norm"),
        torch_shim.cpu_device(),
    )
    lib.zen_linear.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _i64, _i32, _ptr, _ptr]
    lib.zen_linear.restype = _i32
    lib.zen_add_rms_norm.argtypes = [_ptr, _ptr, _i64, _i64, _i32, _ptr, ctypes.c_double]
    lib.zen_add_rms_norm.restype = _i32
    lib.zen_rms_norm.argtypes = [_ptr, _ptr, _i64, _i64, _i32, _i64, _ptr, ctypes.c_double]
    lib.zen_rms_norm.restype = _i32
    return lib


_loaded = LoadOnce(
    _load,
    (ImportError, ValueError, *cpu_native.LOAD_ERRORS),
    "zentorch called through torch's dispatcher (it leaks per call)",
)


def library() -> ctypes.CDLL | None:
    """The loaded shims' caller, or None where it cannot be had (the reason logged once)."""
    return _loaded.get()


def _matrix(t: torch.Tensor) -> bool:
    return (
        t.dim() == 2
        and t.stride(1) == 1
        and t.dtype in torch_shim.DTYPES
        and t.device.type == "cpu"
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x [..., in] @ weight.T + bias`` with zentorch's prepacked ``weight`` [out, in], or
    None where the shims do not take these (the caller uses the dispatcher op). Rows may be
    strided in a matrix; more dimensions must be packed (transformers' [1, T, in])."""
    lib = library()
    if lib is None or not weight.is_contiguous() or (bias is not None and not bias.is_contiguous()):
        return None
    lead = x.shape[:-1]
    if x.dim() != 2:
        if not x.is_contiguous():
            return None
        x = x.view(-1, x.shape[-1])
    if not _matrix(x) or x.shape[0] == 0:
        return None
    rows, n = x.shape[0], weight.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype)
    err = lib.zen_linear(
        x.data_ptr(), rows, x.shape[1], x.stride(0), out.data_ptr(), n, torch_shim.dtype_code(x.dtype),
        weight.data_ptr(), None if bias is None else bias.data_ptr(),
    )  # fmt: skip
    if err:
        return None
    return out if len(lead) == 1 else out.view(*lead, n)


def add_rms_norm(
    hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> bool:
    """``residual += hidden``, then ``hidden = rms_norm(residual) * weight`` in place; False
    where the shims do not take these (nothing written: the caller uses the dispatcher op).
    A failure inside zentorch raises: the sum may be half written by then."""
    lib = library()
    if lib is None or not (_matrix(hidden) and hidden.is_contiguous() and residual.is_contiguous()):
        return False
    if residual.shape != hidden.shape or not weight.is_contiguous() or hidden.shape[0] == 0:
        return False
    rows, dim = hidden.shape
    code = torch_shim.dtype_code(hidden.dtype)
    err = lib.zen_add_rms_norm(
        hidden.data_ptr(), residual.data_ptr(), rows, dim, code, weight.data_ptr(), eps
    )
    if err:
        raise RuntimeError(f"zentorch_add_rms_norm_ failed on [{rows}, {dim}] {hidden.dtype}")
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``rms_norm(x) * weight`` for a packed ``x`` [rows, dim], or None where the shims do
    not take it (the caller uses the dispatcher op)."""
    lib = library()
    if lib is None or not (_matrix(x) and x.is_contiguous() and weight.is_contiguous()):
        return None
    if x.shape[0] == 0:
        return None
    out = torch.empty_like(x)
    rows, dim = x.shape
    err = lib.zen_rms_norm(
        x.data_ptr(), out.data_ptr(), rows, dim, torch_shim.dtype_code(x.dtype), x.element_size(),
        weight.data_ptr(), eps,
    )  # fmt: skip
    return out if err == 0 else None


# -- the shim where it takes the call, else zentorch's dispatcher op (the same bits) -------
def linear_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, shim: bool = True
) -> torch.Tensor:
    """zentorch's linear with a prepacked ``weight``; ``shim=False`` (while compiling: a
    graph traces the dispatcher op) skips the shim."""
    out = linear(x, weight, bias) if shim else None
    if out is None:
        out = torch.ops.zentorch.zentorch_linear_unary(
            x, weight, bias, is_weight_prepacked=True, zentorch_op_name=ZEN_OP_NAME
        )
    return out


def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = rms_norm(x, weight, eps)
    if out is None:
        out = torch.ops.zentorch.zentorch_rms_norm(x, weight, eps, zentorch_op_name=ZEN_OP_NAME)
    return out


def add_rms_norm_op(
    hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """``residual += hidden``, then ``hidden = rms_norm(residual) * weight``, in place."""
    if not add_rms_norm(hidden, residual, weight, eps):
        torch.ops.zentorch.zentorch_add_rms_norm_(
            hidden, weight, residual, eps, zentorch_op_name=ZEN_OP_NAME
        )
