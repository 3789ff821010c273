"""Compressed KV cache: one byte per value, one float16 scale per (token, kv head).

A quantized cache is a ``QuantKV``: the values ``[pages, tokens_per_page, kv_heads, dim]`` in
int8 (or float8 e4m3 on GPUs that have it) and their scales ``[pages, tokens_per_page, kv_heads]``,
both views of the same pool pages. Scales are symmetric, ``max |x| / qmax`` over the head's
``dim`` values, so each token is quantized once, when it is stored, and never again: pages
shared through the prefix cache stay exact copies.

``QuantKV.index_select`` returns whole pages dequantized to the compute dtype, so the torch
reference gathers a quantized cache with the same code as a plain one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trae_groups.kernels.kv_formats import KV_FORMATS

# kv_cache_dtype name -> (storage dtype, largest magnitude it holds)
KV_STORAGE: dict[str, tuple[torch.dtype, float]] = {
    name: (getattr(torch, dtype), qmax) for name, (dtype, qmax) in KV_FORMATS.items()
}
SCALE_DTYPE = torch.float16
MIN_SCALE = 2.0**-24  # float16's smallest (subnormal) value: an all-zero head divides safely


def quantize(x: torch.Tensor, storage: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., dim] -> (values [..., dim] in ``storage``, scales [...] in float16)."""
    qmax = _qmax(storage)
    amax = x.detach().abs().amax(dim=-1).float()
    scale = (amax / qmax).clamp(min=MIN_SCALE).to(SCALE_DTYPE)
    scaled = x.float() / scale.float().unsqueeze(-1)
    if storage == torch.int8:
        return scaled.round_().clamp_(-qmax, qmax).to(torch.int8), scale
    return scaled.clamp_(-qmax, qmax).to(storage), scale


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``quantize``, in ``dtype``."""
    out = values.to(dtype)  # one new tensor, scaled in place (dequantizing is per step)
    return out.mul_(scale.to(dtype).unsqueeze(-1))


def _qmax(storage: torch.dtype) -> float:
    for dtype, qmax in KV_STORAGE.values():
        if dtype == storage:
            return qmax
    raise ValueError(f"no quantized KV storage of dtype {storage}")


@dataclass(frozen=True)
class QuantKV:
    """One layer's K (or V) cache in pages: quantized values, their scales, and the dtype
    attention computes in (the model's)."""

    values: torch.Tensor  # [pages, tokens_per_page, kv_heads, dim]
    scale: torch.Tensor  # [pages, tokens_per_page, kv_heads], float16
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device

    def index_select(self, dim: int, pages: torch.Tensor) -> torch.Tensor:
        """Whole pages, dequantized: [n, tokens_per_page, kv_heads, dim] in ``dtype``."""
        if dim != 0:
            raise ValueError("a quantized cache is selected by page (dim 0) only")
        return dequantize(
            self.values.index_select(0, pages), self.scale.index_select(0, pages), self.dtype
        )

    def store(self, pages: torch.Tensor, offsets: torch.Tensor, x: torch.Tensor) -> None:
        """x [T, kv_heads, dim] into (page, offset) slots, quantized."""
        values, scale = quantize(x, self.values.dtype)
        self.values[pages, offsets] = values
        self.scale[pages, offsets] = scale
