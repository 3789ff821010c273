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
    # The torch kernel reads whole pages and masks the unused tail, so stale bytes (NaN
    # in another model's layout) must be cleared when a page is handed out; the Triton
    # kernels never load a slot past a sequence's length (tested with NaN there).
    needs_zeroed_pages: bool = True


def _torch_backend() -> AttentionBackend:
    return AttentionBackend("torch", reference.store_kv, reference.paged_attention)


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
                "triton", tri.store_kv, tri.paged_attention, needs_zeroed_pages=False
            ),
        )
    except Exception as exc:  # pragma: no cover - defensive
        log.debug("triton backend not registered: %s", exc)
    try:
        from trae_groups.kernels import flash_attn_backend as fa

        register_backend(
            "flash_attn",
            fa.available,
            lambda: AttentionBackend("flash_attn", fa.store_kv, fa.paged_attention),
        )
    except Exception as exc:  # pragma: no cover - defensive
        log.debug("flash_attn backend not registered: %s", exc)


_register_gpu_backends()
