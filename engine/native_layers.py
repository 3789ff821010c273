"""The flat forward's layer loop as one native call, where every kernel of it has a C entry.

A bf16 SmolLM2 decode step is ~300 kernel calls; from Python each costs 6-10 us of wrapper,
ctypes and allocation besides the glue between them. Run from C
(``trae_kernels/zen_layers.c``) the same kernels with the same arguments give the same bits
and the step's forward took 31.9 against 42.2 ms at batch 32 and 11.5 against 17.1 ms at
batch 1 (SmolLM2-135M, bf16, Zen 4; docs/performance.md).

It takes a step when: the linears are bf16 or float32, all packed by zentorch, all by oneDNN
or all bf16 on our AVX2 panels (``caller_of``), with zentorch's norms or ours beside them, no
LoRA row is in the step and no linear is wrapped, no linear would take its float32 path for
many rows (``fast_linear.UPCAST_ROWS``), the K/V pages have the linears' dtype, head size and
MLP width fit the rotation and SiLU kernels, and the step's attention is the native paged
kernel's for every row (``attention.native_rows``: decodes and short prompt chunks).
Any other step runs the Python loop in ``FlatForward.forward``.
"""

from __future__ import annotations

import logging

import torch

from trae_groups.engine.fast_linear import UPCAST_ROWS, PackedLinear
from trae_groups.kernels import cpu_native, onednn_calls, torch_shim, zen_layers

log = logging.getLogger("trae_groups.engine")


class NativeLayersFailed(RuntimeError):
    """A kernel of the native loop failed mid-step: the step's K/V rows and residual are
    partly written, so the flat forward runs the whole step again in Python (its stores
    rewrite the same slots) and this model keeps the Python loop from then on."""


class NativeLayers:
    """One flat forward's native loop: the per-layer table of weights and pages, built once
    for the modules and pages it was built from and rebuilt when they change."""

    def __init__(self) -> None:
        self._cached: tuple | None = None  # (key, table or None)
        self.failed = False  # a kernel failed once: the Python loop from then on

    def run(self, flat, attend, x, residual, cos, sin) -> torch.Tensor | None:
        """Every layer of ``flat`` (a ``FlatForward``) over the step: the last MLP's output,
        with ``residual`` updated in place as the Python loop leaves it; None where the
        step or a layer is not what the native loop takes. ``attend`` is the eager step's
        ``PagedAttend``; ``cos`` and ``sin`` the step's rotary tables [T, 1, dim]."""
        if self.failed or not flat.zen_norms or torch.compiler.is_compiling():
            return None  # (dynamo cannot trace the kernel library's load lock)
        kind = zen_layers.step_kind(x.dtype)
        if kind is None:
            return None
        if not hasattr(attend, "native_rows"):
            return None
        whole = attend.native_rows()
        if whole is None or zen_layers.library() is None or not _rotates(cos, sin, x.dtype):
            return None
        table = self._table(flat, attend.kv)
        if table is None:
            return None
        if not (x.is_contiguous() and residual.is_contiguous()):
            return None
        row_seq, row_pos = whole
        t = x.shape[0]
        attn_rows = 1 if flat.padded else t  # a padded step's copy row does not attend
        batch = attend.batch
        if row_seq.shape[0] != attn_rows or batch.slot_mapping.shape[0] != attn_rows:
            return None
        layers, page = table
        if page["upcasts"] and x.shape[0] >= UPCAST_ROWS:
            return None
        first, d = flat._layers[0], flat.head_dim
        qk_heads = flat.heads + flat.kv_heads
        out = torch.empty_like(x)
        qkv = torch.empty((t, first.q_size + 2 * first.kv_size), dtype=x.dtype)
        rotated = torch.empty((t, qk_heads, d), dtype=x.dtype)
        normed = torch.empty_like(rotated) if flat.kind == "qwen3" else rotated
        attn = torch.empty((t, first.q_size), dtype=x.dtype)
        gate_up = torch.empty((t, 2 * first.intermediate), dtype=x.dtype)
        act = torch.empty((t, first.intermediate), dtype=x.dtype)
        slots = batch.slot_mapping.contiguous()
        tables = batch.block_tables.contiguous()
        step = zen_layers.Step(
            rows=t, attn_rows=attn_rows, hidden=x.shape[1], heads=flat.heads,
            kv_heads=flat.kv_heads, dim=d, inter=first.intermediate,
            head_norms=flat.kind == "qwen3", dtype=torch_shim.dtype_code(x.dtype),
            threads=torch.get_num_threads(), kind=kind[0], elem=kind[1],
            library=page["library"], eps=page["eps"], scale=flat.scale,
            x0=x.data_ptr(), out=out.data_ptr(), residual=residual.data_ptr(),
            qkv=qkv.data_ptr(), normed=normed.data_ptr(), rotated=rotated.data_ptr(),
            attn=attn.data_ptr(), gate_up=gate_up.data_ptr(), act=act.data_ptr(),
            cos=cos.data_ptr(), ssin=sin.data_ptr(), cs_rs=cos.stride(0),
            slots=slots.data_ptr(), tables=tables.data_ptr(), tab_s=tables.stride(0),
            row_seq=row_seq.data_ptr(), row_pos=row_pos.data_ptr(),
            page_s=page["strides"][0], tok_s=page["strides"][1], head_s=page["strides"][2],
            page_size=page["size"],
        )  # fmt: skip
        try:
            zen_layers.run(step, layers, len(flat._layers))
        except RuntimeError as exc:
            self.failed = True
            log.exception("the native layer loop failed; this model's layers run in Python now")
            raise NativeLayersFailed(str(exc)) from exc
        return out

    def _table(self, flat, kv) -> tuple | None:
        """The table for the modules the flat forward reads now (LoRA may have wrapped
        o_proj or down_proj since) and these pages."""
        modules = modules_of(flat)
        first = kv.k[0]
        key = (id(kv), first.data_ptr() if isinstance(first, torch.Tensor) else None, modules)
        if self._cached is None or self._cached[0] != key:
            self._cached = (key, _build(flat, kv, modules))
        return self._cached[1]


def _rotates(cos: torch.Tensor, signed_sin: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the native rotation takes these tables (``cpu_native.rotate``'s conditions)."""
    return (
        cos.dtype == signed_sin.dtype == dtype
        and cos.shape == signed_sin.shape
        and cos.stride() == signed_sin.stride()
        and cos.stride(2) == 1
        and cos.shape[1] == 1
    )


def modules_of(flat) -> tuple:
    """Each layer's (qkv, o, gate_up, down) as the flat forward reads them now (read from the
    modules' own ``_modules`` dicts: ``nn.Module.__getattr__`` made this ~0.2 ms a step)."""
    qkv, gate_up = flat.qkv._modules, flat.gate_up._modules
    return tuple(
        (
            qkv[str(i)],
            layer.block._modules["self_attn"]._modules["o_proj"],
            gate_up[str(i)],
            layer.block._modules["mlp"]._modules["down_proj"],
        )
        for i, layer in enumerate(flat._layers)
    )


def caller_of(linear: PackedLinear) -> str:
    """Which of ``zen_layers.LIBRARIES`` multiplies this linear: its library, or our bf16
    panels where it holds them."""
    return "bf16_panels" if linear.bf16_panels else linear.library


def takes_model(flat) -> bool:
    """Whether the native loop takes this model's layers (its steps still need pages of the
    model's dtype and native attention): for ``trae model info``."""
    if zen_layers.library() is None:
        return False
    first = flat._layers[0]
    if flat.head_dim % 32 or first.intermediate % 16 or flat.heads % flat.kv_heads:
        return False
    group_limit, dim_limit = cpu_native.limits()
    if flat.heads // flat.kv_heads > group_limit or flat.head_dim > dim_limit:
        return False
    linears = [m for layer in modules_of(flat) for m in layer]
    if not all(type(m) is PackedLinear for m in linears):
        return False
    dtype, library = linears[0].dtype, caller_of(linears[0])
    return (
        zen_layers.step_kind(dtype) is not None
        and zen_layers.linear_library(library) is not None
        and all(
            caller_of(m) == library and m.dtype == dtype
            and (m.weight_dtype == dtype or m.bf16_panels)
            for m in linears
        )
    )  # fmt: skip


def _build(flat, kv, modules) -> tuple | None:
    """(ctypes array of ``zen_layers.Layer``, the pages' strides, size and norm epsilon),
    or None where a layer is not what the native loop takes."""
    if not takes_model(flat):
        return None
    rows = (zen_layers.Layer * len(flat._layers))()
    dtype, library = modules[0][0].dtype, caller_of(modules[0][0])
    # oneDNN's caller takes each packed weight as a tensor handle, zentorch's its address
    handles = onednn_calls.WeightHandles() if library == "onednn" else None

    def weight_of(m) -> int:
        if handles is None:
            return m.packed_weight.data_ptr()
        return handles.of(m.packed_weight)

    eps, pages, held = set(), set(), [handles]
    for i, (layer, linears) in enumerate(zip(flat._layers, modules, strict=True)):
        k_cache, v_cache = kv.k[i], kv.v[i]
        plain = isinstance(k_cache, torch.Tensor) and k_cache.dtype == dtype
        if not plain or not cpu_native.stores(k_cache, k_cache, v_cache):
            return None
        block = layer.block
        norms = (block.input_layernorm, block.post_attention_layernorm)
        pages.add((cpu_native.cache_strides(k_cache), k_cache.shape[1]))
        eps.update(n.variance_epsilon for n in norms)
        tensors = [n.weight for n in norms]
        for m in linears:
            tensors += [m.packed_weight] if handles is None else []
            bias = m.bias  # float32 beside bf16 panels, else the linears' dtype
            if bias is not None and not (bias.dtype == m.weight_dtype and bias.is_contiguous()):
                return None
            held.append(bias)
        row = rows[i]
        row.in_norm, row.post_norm = (n.weight.data_ptr() for n in norms)
        for name, m in zip(("qkv", "o", "gate_up", "down"), linears, strict=True):
            setattr(row, f"{name}_w", weight_of(m))
            setattr(row, f"{name}_b", None if m.bias is None else m.bias.data_ptr())
        row.k_cache, row.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        row.window = layer.window or 0
        if flat.kind == "qwen3":
            attn = block.self_attn
            weight = flat._head_norm_weights(layer, attn)
            eps.update((attn.q_norm.variance_epsilon, attn.k_norm.variance_epsilon))
            row.head_w = weight.data_ptr()
            tensors.append(weight)
        if not all(w.dtype == dtype and w.is_contiguous() for w in tensors):
            return None
        held.append(tensors)
    if len(eps) != 1 or len(pages) != 1:
        return None
    strides, size = pages.pop()
    upcasts = any(m.plain_weight is not None for linears in modules for m in linears)
    return rows, {
        "eps": eps.pop(), "strides": strides, "size": size, "held": held,
        "library": zen_layers.linear_library(library), "upcasts": upcasts,
    }  # fmt: skip
