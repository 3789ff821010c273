"""The CPU's paged-KV kernels (``cpu_paged.c``): built on first use, loaded through ctypes.

Why native code: a decode step's attention through torch gathers each sequence's pages into
a fresh tensor per layer and runs SDPA on it, ~0.2 ms a layer at batch 1 and ~0.5 ms at
batch 32 on SmolLM2's shapes, most of it per-call overhead around very few FLOPs; storing
the new K/V is two advanced-indexing writes more. The C loops read the pages where they lie.
The flat forward's bf16 SiLU-and-product and rotation are two such loops too (AVX-512 builds):
torch ran them as two and three kernels with tensors between; these round where torch does.

Why built here: no wheel carries kernels for this torch on these CPUs (the Intel extension
stopped at torch 2.8; zentorch is for AMD EPYC). The source is one C file with no torch
headers: ``cc -O3 -march=native -fopenmp -ffp-contract=off`` builds it in about a second
into a cache keyed by the source, the compiler and the CPU's flags (``TRAE_KERNEL_CACHE``, else
``~/.cache/trae-groups/kernels``). Without a C compiler, or with ``TRAE_NATIVE_KERNELS=0``,
nothing is built and the torch reference runs (the same numbers within float rounding).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from trae_groups.kernels import torch_shim
from trae_groups.kernels.thread_switch import ThreadSwitch

log = logging.getLogger("trae_groups.kernels")

SOURCE = Path(__file__).with_name("cpu_paged.c")
ENV_SWITCH = "TRAE_NATIVE_KERNELS"  # "0": never build or use them
CACHE_ENV = "TRAE_KERNEL_CACHE"
FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-math-errno",
    "-ffp-contract=off",
    "-shared",
    "-fPIC",
)
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_limits = (0, 0)
_switch = ThreadSwitch()
turned_off = _switch.turned_off  # this thread runs the torch reference meanwhile (tests)


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _text(source: Path) -> bytes:
    """The source with the local headers it includes (``#include "x.h"``): what the build
    depends on."""
    text = source.read_bytes()
    headers = re.findall(rb'^#include "([\w.]+)"', text, flags=re.MULTILINE)
    return text + b"".join(_text(source.with_name(h.decode())) for h in headers)


def build(cc: str, source: Path = SOURCE) -> Path:
    """The shared object for ``source``, compiler and CPU, built once into the cache."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        _text(source) + version.encode() + " ".join(FLAGS).encode() + _cpu_flags().encode()
    ).hexdigest()[:20]
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "trae-groups" / "kernels")
    target = cache / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run(
            [cc, *FLAGS, "-o", str(built), str(source)], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-400:]}")
        os.replace(built, target)  # atomic: another process may be building it too
    return target


# what loading a built kernel library may raise (LoadOnce logs it and runs without)
LOAD_ERRORS = (OSError, AttributeError, RuntimeError, subprocess.SubprocessError)


def built(source: Path, switch: str | None = None) -> ctypes.CDLL:
    """``source`` built (once, cached) and loaded; RuntimeError where the environment switch
    ``switch`` says "0" or there is no C compiler."""
    if switch and os.environ.get(switch) == "0":
        raise RuntimeError(f"{switch}=0")
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang)")
    return ctypes.CDLL(str(build(cc, source)))


def _declare(lib: ctypes.CDLL) -> None:
    for suffix in _SUFFIX.values():
        store = getattr(lib, f"store_kv_{suffix}")
        store.argtypes = [_ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, *[_i64] * 6, _ptr, ctypes.c_int]
        store.restype = None
        decode = getattr(lib, f"decode_attention_{suffix}")
        decode.argtypes = (
            [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr]
            + [_i64] * 4
            + [ctypes.c_float, _i64, _ptr, _i64, ctypes.c_int]
        )
        decode.restype = None
    for suffix in _SUFFIX.values():  # AVX-512 and AVX2 builds
        if not hasattr(lib, f"silu_mul_{suffix}"):
            continue
        silu = getattr(lib, f"silu_mul_{suffix}")
        silu.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _i64, ctypes.c_int]
        silu.restype = None
        rotate = getattr(lib, f"rotate_{suffix}")
        rotate.argtypes = [_ptr, *[_i64] * 4, _ptr, _ptr, _i64, _ptr, ctypes.c_int]
        rotate.restype = None
        norms = getattr(lib, f"head_norms_{suffix}")
        norms.argtypes = [_ptr, *[_i64] * 4, _ptr, ctypes.c_double, _ptr, ctypes.c_int]
        norms.restype = None
        pick = getattr(lib, f"argmax_rows_{suffix}")
        pick.argtypes = [_ptr, _i64, _i64, _i64, _ptr, ctypes.c_int]
        pick.restype = None
    if hasattr(lib, "add_rms_norm_f32"):  # AVX2 builds (AVX-512 ones keep zentorch's norms)
        norms = (lib.add_rms_norm_f32, lib.rms_norm_f32, lib.add_rms_norm_bf16, lib.rms_norm_bf16)
        for norm in norms:
            norm.argtypes = [_ptr, _ptr, _i64, _i64, _ptr, ctypes.c_double, ctypes.c_int]
            norm.restype = None
        lib.norms_bind.argtypes = [ctypes.c_int32, ctypes.c_int32]
        lib.norms_bind.restype = None
        # the dtype codes the native loop passes add_rms_norm_call
        lib.norms_bind(*(torch_shim.dtype_code(d) for d in (torch.float32, torch.bfloat16)))


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot be had (the reason logged once)."""
    global _lib, _tried, _limits
    if _switch.off:
        return None
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            lib = built(SOURCE, ENV_SWITCH)
            _declare(lib)
            group, dim = _i64(), _i64()
            lib.limits(ctypes.byref(group), ctypes.byref(dim))
            _limits = (group.value, dim.value)
            _lib = lib
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            log.info("native CPU attention kernels not used (torch reference instead): %s", exc)
        _tried = True
    return _lib


def limits() -> tuple[int, int]:
    """The decode kernel's most query heads per KV head and largest head size (0, 0 before
    the library loads)."""
    return _limits


def cache_strides(cache: torch.Tensor) -> tuple[int, int, int] | None:
    """(page, token, head) element strides of a [pages, page, heads, dim] cache whose rows
    of ``dim`` are contiguous, else None."""
    if cache.dim() != 4 or cache.stride(3) != 1:
        return None
    return cache.stride(0), cache.stride(1), cache.stride(2)


def stores(rows: torch.Tensor, k_cache, v_cache) -> bool:
    """Whether ``store_kv`` takes these: CPU rows in float32/bf16, plain caches (a
    ``QuantKV`` is no tensor) of the same dtype with matching strides."""
    if not isinstance(k_cache, torch.Tensor) or not isinstance(v_cache, torch.Tensor):
        return False
    if rows.device.type != "cpu" or rows.dtype not in _SUFFIX or library() is None:
        return False
    if k_cache.dtype != rows.dtype or v_cache.dtype != rows.dtype:
        return False
    strides = cache_strides(k_cache)
    return strides is not None and strides == cache_strides(v_cache)


def supports(query: torch.Tensor, k_cache, v_cache) -> bool:
    """Whether ``decode_attention`` takes this layer: what ``stores`` asks, and a head
    shape within the kernel's bounds."""
    if not stores(query, k_cache, v_cache):
        return False
    heads, dim, kv_heads = query.shape[1], query.shape[2], k_cache.shape[2]
    max_group, max_dim = _limits
    return heads % kv_heads == 0 and heads // kv_heads <= max_group and dim <= max_dim


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A [rows, heads, dim] tensor whose heads and dims are packed (rows may be strided)."""
    if t.stride(2) == 1 and t.stride(1) == t.shape[2]:
        return t
    return t.contiguous()


def store_kv(key, value, k_cache, v_cache, slot_mapping: torch.Tensor) -> None:
    """key/value [T, kv_heads, dim] into their slots (slot -1: padding, skipped)."""
    lib = library()
    key, value = _rows(key), _rows(value)
    slots = slot_mapping.contiguous()
    page_s, tok_s, head_s = cache_strides(k_cache)
    getattr(lib, f"store_kv_{_SUFFIX[key.dtype]}")(
        key.data_ptr(), value.data_ptr(), key.shape[0], key.stride(0), value.stride(0),
        k_cache.data_ptr(), v_cache.data_ptr(), page_s, tok_s, head_s, k_cache.shape[1],
        key.shape[1], key.shape[2], slots.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    row_seq: torch.Tensor,
    row_pos: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """query [n, heads, dim], one token per row; row r attends positions up to
    ``row_pos[r]`` (and, with a window, the last ``window`` of them) of sequence
    ``row_seq[r]``'s pages. Returns [n, heads, dim] in the query's dtype."""
    query = _rows(query)
    out = torch.empty(query.shape, dtype=query.dtype)
    tables = block_tables if block_tables.is_contiguous() else block_tables.contiguous()
    page_s, tok_s, head_s = cache_strides(k_cache)
    decode_kernel(query.dtype)(
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        page_s, tok_s, head_s, k_cache.shape[1], tables.data_ptr(), tables.stride(0),
        row_seq.data_ptr(), row_pos.data_ptr(), query.shape[0], query.shape[1],
        k_cache.shape[2], query.shape[2], scale, window or 0, out.data_ptr(), out.stride(0),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def decode_kernel(dtype: torch.dtype):
    """The decode kernel for ``dtype``'s pages (``library()`` loaded): AMX's for bf16 where it
    loads (cpu_amx.py: a page of keys scored per tile product), else this library's."""
    from trae_groups.kernels import cpu_amx  # built on this module: imported when first asked

    if cpu_amx.decodes(dtype):
        return cpu_amx.library().decode_attention_amx
    return getattr(library(), f"decode_attention_{_SUFFIX[dtype]}")


def suffix(dtype: torch.dtype) -> str:
    """The C name suffix of ``dtype``'s kernels ("f32", "bf16")."""
    return _SUFFIX[dtype]


def pointwise(x: torch.Tensor) -> bool:
    """Whether ``silu_mul``, ``rotate``, ``head_norms`` and ``argmax`` take this CPU tensor:
    bf16 or float32 in AVX-512 and AVX2 builds."""
    if x.dtype not in _SUFFIX or x.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    lib = library()
    return lib is not None and hasattr(lib, f"silu_mul_{_SUFFIX[x.dtype]}")


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` for a float32 or bf16 matrix: the same indices (first maximum; first
    NaN where a row has one), from a vector kernel where it is built (torch's took 1.6 ms for
    32 rows of 49,152 logits, this ~0.1 ms)."""
    if not pointwise(x) or x.dim() != 2 or x.stride(1) != 1:
        return x.argmax(-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0] and x.shape[1]:
        getattr(library(), f"argmax_rows_{_SUFFIX[x.dtype]}")(
            x.data_ptr(), x.shape[0], x.stride(0), x.shape[1], out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out
    return x.argmax(-1)


def head_norms(qk: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """Qwen3's RMSNorm over each head of ``qk`` [T, heads, dim] (heads packed, rows strided:
    the fused q/k/v output in place), weighted by ``weight`` [heads, dim], rounded as
    transformers' Qwen3RMSNorm rounds (normalized, then weighted); packed [T, heads, dim], or
    None where the kernel does not take these."""
    if not pointwise(qk) or qk.dim() != 3 or qk.stride(2) != 1:
        return None
    t, heads, dim = qk.shape
    if qk.stride(1) != dim or dim % 16 or weight.dtype != qk.dtype:
        return None
    if weight.shape != (heads, dim) or not weight.is_contiguous():
        return None
    out = torch.empty((t, heads, dim), dtype=qk.dtype)
    if t:
        getattr(library(), f"head_norms_{_SUFFIX[qk.dtype]}")(
            qk.data_ptr(), t, qk.stride(0), heads, dim, weight.data_ptr(), eps, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
    return out


def norms(dtype: torch.dtype) -> bool:
    """Whether ``add_rms_norm`` and ``rms_norm`` take rows of ``dtype`` here (float32 and bf16
    in AVX2 builds: the flat forward's norms there, and float32's the native loop's)."""
    lib = library()
    suffix = _SUFFIX.get(dtype)
    return suffix is not None and lib is not None and hasattr(lib, f"add_rms_norm_{suffix}")


def _norm_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.dim() == 2 and x.is_contiguous() and weight.is_contiguous()
        and weight.dtype == x.dtype and weight.shape == (x.shape[1],)
    )  # fmt: skip


def add_rms_norm(
    hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor | None:
    """``residual += hidden`` in place, then RMSNorm of it into ``hidden``'s storage (returned),
    as zentorch's fused add-and-norm leaves them; None where the kernel does not take these."""
    if not norms(hidden.dtype) or not _norm_rows(hidden, weight):
        return None
    if not residual.is_contiguous() or residual.shape != hidden.shape:
        return None
    if hidden.numel():
        getattr(library(), f"add_rms_norm_{_SUFFIX[hidden.dtype]}")(
            hidden.data_ptr(), residual.data_ptr(), hidden.shape[0], hidden.shape[1],
            weight.data_ptr(), eps, torch.get_num_threads(),
        )  # fmt: skip
    return hidden


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of x's rows times ``weight`` (a new tensor); None where the kernel does not take
    these."""
    if not norms(x.dtype) or not _norm_rows(x, weight):
        return None
    out = torch.empty_like(x)
    if x.numel():
        getattr(library(), f"rms_norm_{_SUFFIX[x.dtype]}")(
            x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps,
            torch.get_num_threads(),
        )  # fmt: skip
    return out


def silu_mul(gate_up: torch.Tensor, n: int) -> torch.Tensor | None:
    """``silu(gate_up[:, :n]) * gate_up[:, n:]`` for a matrix whose rows are packed (bf16:
    rounded as torch rounds it; float32: within a few ulp of torch, cpu_paged.c), or None where
    the kernel does not take it."""
    if not pointwise(gate_up) or gate_up.dim() != 2 or gate_up.stride(1) != 1 or n % 16:
        return None
    if gate_up.shape[1] != 2 * n:
        return None
    rows = gate_up.shape[0]
    out = torch.empty((rows, n), dtype=gate_up.dtype)
    if rows:
        getattr(library(), f"silu_mul_{_SUFFIX[gate_up.dtype]}")(
            gate_up.data_ptr(), rows, gate_up.stride(0), n, out.data_ptr(), n,
            torch.get_num_threads(),
        )  # fmt: skip
    return out


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor | None:
    """Rotate-half rotary of x [T, heads, dim] (heads packed, rows strided) by cos and
    signed_sin [T, 1, dim], rounded as ``flat_forward._rotate``; None where the kernel does
    not take these."""
    if not pointwise(x):
        return None
    t, heads, dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != dim or dim % 32 or cos.dtype != x.dtype:
        return None
    if cos.shape != (t, 1, dim) or cos.stride() != signed_sin.stride() or cos.stride(2) != 1:
        return None
    if signed_sin.shape != cos.shape or signed_sin.dtype != x.dtype:
        return None
    out = torch.empty((t, heads, dim), dtype=x.dtype)
    if t:
        getattr(library(), f"rotate_{_SUFFIX[x.dtype]}")(
            x.data_ptr(), t, x.stride(0), heads, dim, cos.data_ptr(), signed_sin.data_ptr(),
            cos.stride(0), out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
    return out
