"""Attention backends, chosen once at start-up (not a global: the engine holds one)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trae_groups.kernels import attention as reference

log = logging.getLogger("trae_groups.kernels")


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    store_kv: Callable
    paged_attention: Callable
    # Whether a page must be cleared when it is handed out: a kernel that reads whole pages
    # and masks the unused tail multiplies stale bytes (NaN in another model's layout) by a
    # zero weight, and 0 x NaN is NaN. flash-attn's paged kernels do; the Triton kernels and
    # the CPU native ones never load a slot past a sequence's length, and the torch
    # reference zeroes those slots in its gathered copy (attention.gather_pages); each is
    # tested over pages full of NaN.
    needs_zeroed_pages: bool = True
    # kv_cache_dtype values (besides "auto") its kernels read and write
    kv_dtypes: tuple[str, ...] = ("int8", "fp8")
    # decode attention that reads no tensor data on the host (capturable in a CUDA graph,
    # engine/decode_graphs.py); None: this backend's decode steps are never captured
    graph_decode: Callable | None = None

    def check_kv(self, kv_cache_dtype: str, device: str | torch.device) -> None:
        """Refuse a KV cache dtype this backend or device cannot hold (a clear error at
        start-up, not a wrong answer later)."""
        if kv_cache_dtype == "auto":
            return
        if kv_cache_dtype not in self.kv_dtypes:
            raise ValueError(
                f"kv_cache_dtype {kv_cache_dtype!r}: the {self.name} attention backend "
                f"supports {['auto', *self.kv_dtypes]}"
            )
        if kv_cache_dtype == "fp8" and not has_fp8(torch.device(device)):
            raise ValueError(
                "kv_cache_dtype 'fp8' needs a CUDA device of compute capability 8.9 or newer; "
                f"{device} has none (use 'int8')"
            )


def has_fp8(device: torch.device) -> bool:
    """float8 e4m3 storage and conversions in hardware: Ada/Hopper and newer GPUs."""
    return (
        device.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability(device) >= (8, 9)
    )


def _torch_backend() -> AttentionBackend:
    return AttentionBackend(
        "torch",
        reference.store_kv,
        reference.paged_attention,
        needs_zeroed_pages=False,
        graph_decode=reference.graph_decode,
    )


# name -> (is_available(device), factory); GPU backends register themselves on import.
_BACKENDS: dict[str, tuple[Callable[[torch.device], bool], Callable[[], AttentionBackend]]] = {
    "torch": (lambda device: True, _torch_backend),
}
# flash-attn's paged kernels need 256-token pages (the engine's default is 16), so it
# is opt-in: EngineConfig(attention_backend="flash_attn", tokens_per_page=256).
_PREFERENCE = ["triton", "torch"]


def register_backend(
    name: str,
    available: Callable[[torch.device], bool],
    factory: Callable[[], AttentionBackend],
) -> None:
    _BACKENDS[name] = (available, factory)


def available_backends(device: torch.device) -> list[str]:
    return [name for name, (ok, _) in _BACKENDS.items() if ok(device)]


def select_backend(device: str | torch.device, prefer: str | None = None) -> AttentionBackend:
    """The named backend, or the best one available on the device."""
    device = torch.device(device)
    if prefer is not None:
        if prefer not in _BACKENDS:
            raise ValueError(f"unknown attention backend {prefer!r}; known: {sorted(_BACKENDS)}")
        ok, factory = _BACKENDS[prefer]
        if not ok(device):
            raise ValueError(f"attention backend {prefer!r} is not available on {device}")
        return factory()
    for name in _PREFERENCE:
        if name in _BACKENDS and _BACKENDS[name][0](device):
            backend = _BACKENDS[name][1]()
            log.info("attention backend: %s on %s", backend.name, device)
            return backend
    return _torch_backend()


def _register_gpu_backends() -> None:
    """Triton and flash-attn, each only if its module imports; a missing or broken package
    leaves the torch reference (the modules guard their own imports too)."""
    try:
        from trae_groups.kernels import triton_attention as tri

        register_backend(
            "triton",
            tri.available,
            lambda: AttentionBackend(
                "triton",
                tri.store_kv,
                tri.paged_attention,
                needs_zeroed_pages=False,
                kv_dtypes=tri.KV_DTYPES,
                graph_decode=tri.graph_decode,
            ),
        )
    except Exception as exc:  # pragma: no cover - defensive
        log.debug("triton backend not registered: %s", exc)
    try:
        from trae_groups.kernels import flash_attn_backend as fa

        register_backend(
            "flash_attn",
            fa.available,
            lambda: AttentionBackend("flash_attn", fa.store_kv, fa.paged_attention, kv_dtypes=()),
        )
    except Exception as exc:  # pragma: no cover - defensive
        log.debug("flash_attn backend not registered: %s", exc)


_register_gpu_backends()
