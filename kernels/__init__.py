"""Attention and KV-cache ops over paged memory; backends chosen at run time."""

from trae_groups.kernels.attention import PagedBatch, naive_attention, paged_attention, store_kv
from trae_groups.kernels.backend import (
    AttentionBackend,
    available_backends,
    register_backend,
    select_backend,
)
from trae_groups.kernels.kv_quant import KV_STORAGE, QuantKV

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
