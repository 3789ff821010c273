"""Attention and KV-cache ops over paged memory; backends chosen at run time.

Names load on first use (PEP 562): the engine's configuration reads ``kv_formats`` when a
graph is only validated, and that must not pull in torch and every backend.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOMES = {
    "KV_STORAGE": "kv_quant",
    "AttentionBackend": "backend",
    "PagedBatch": "attention",
    "QuantKV": "kv_quant",
    "available_backends": "backend",
    "naive_attention": "attention",
    "paged_attention": "attention",
    "register_backend": "backend",
    "select_backend": "backend",
    "store_kv": "attention",
}

if TYPE_CHECKING:
    from trae_groups.kernels.attention import (
        PagedBatch,
        naive_attention,
        paged_attention,
        store_kv,
    )
    from trae_groups.kernels.backend import (
        AttentionBackend,
        available_backends,
        register_backend,
        select_backend,
    )
    from trae_groups.kernels.kv_quant import KV_STORAGE, QuantKV


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


__all__ = [
    "KV_STORAGE",
    "AttentionBackend",
    "PagedBatch",
    "QuantKV",
    "available_backends",
    "naive_attention",
    "paged_attention",
    "register_backend",
    "select_backend",
    "store_kv",
]
