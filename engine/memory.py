"""What a model's memory is: every tensor a module holds, counted in bytes.

``nn.Module`` only knows its parameters and buffers. Inference paths keep weights
elsewhere too: a oneDNN pre-packed linear holds an opaque mkldnn tensor in a plain
attribute, torch's dynamic int8 linear holds fbgemm's packed weight in a script
object, an adapter may hold its matrices in a dict. None of that shows in
``parameters()``, yet it is most of the model's memory once packed. So the one walk
every report uses (``module_tensors``) asks each module for its held tensors too:

* a module class we own defines ``held_tensors(self) -> Iterable[tuple[str, Tensor]]``
  (the hook, ``HELD_TENSORS``): the tensors it keeps outside ``_parameters`` and
  ``_buffers``, each once;
* a class we do not own gets a function registered for it with ``register_held``;
* torch's quantized Linear kinds are recognised by their packed parameters.

Opaque tensors (mkldnn) have no data pointer; ``tensor_key`` identifies them by the
object instead, and ``tensor_bytes`` counts them by element count and size (the
blocked layout pads nothing on the shapes models use; measured against RSS in
tests/test_memory_accounting.py).

``release_file_pages`` gives back the resident pages of memory-mapped weights that no
model uses any more (packing or quantizing replaced them): the mapping stays (other
tensors of the file live in it), its pages no longer count in the process's memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from functools import cache

import torch
from torch import nn

log = logging.getLogger("trae_groups.engine")

HELD_TENSORS = "held_tensors"
_REGISTERED: dict[type, Callable[[nn.Module], Iterable[tuple[str, torch.Tensor]]]] = {}
_MADV_DONTNEED = 4


def register_held(cls: type, fn: Callable[[nn.Module], Iterable[tuple[str, torch.Tensor]]]) -> None:
    """Count the tensors ``fn(module)`` yields for every module of exactly ``cls``."""
    _REGISTERED[cls] = fn


def held_tensors(module: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """The tensors ``module`` itself keeps outside its parameters and buffers."""
    hook = getattr(type(module), HELD_TENSORS, None)
    if hook is not None:
        return hook(module)
    fn = _REGISTERED.get(type(module))
    if fn is not None:
        return fn(module)
    packed = getattr(module, "_packed_params", None)  # torch's quantized Linear kinds
    if isinstance(packed, nn.Module) and hasattr(packed, "_weight_bias"):
        return _torch_quantized(module)
    return ()


def module_tensors(model: nn.Module) -> Iterator[tuple[nn.Module, str, str, torch.Tensor]]:
    """Every (module, kind, name, tensor) holding model memory; kind is "param",
    "buffer" or "held" (the hook's). A tensor reachable twice is yielded twice:
    callers dedupe with ``tensor_key``."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                yield module, "param", name, p
        for name, b in module._buffers.items():
            if b is not None:
                yield module, "buffer", name, b
        for name, t in held_tensors(module):
            if t is not None:
                yield module, "held", name, t


def is_opaque(t: torch.Tensor) -> bool:
    """A tensor without strided storage (mkldnn's blocked weights)."""
    return t.layout != torch.strided and not t.is_quantized


def tensor_key(t: torch.Tensor) -> tuple:
    """Identity of the memory a tensor holds: two views of the same bytes are equal."""
    if is_opaque(t):
        return ("opaque", id(t))
    return (str(t.device), t.data_ptr(), t.dtype, tuple(t.shape))


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def distinct(model: nn.Module) -> dict[tuple, torch.Tensor]:
    """The model's tensors, each distinct one once (tied weights count once)."""
    seen: dict[tuple, torch.Tensor] = {}
    for _, _, _, t in module_tensors(model):
        seen.setdefault(tensor_key(t), t)
    return seen


# -- quantized modules torch owns ------------------------------------------------------------
def _torch_quantized(module: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """torch's quantized Linear kinds (dynamic int8, static): fbgemm keeps the int8
    weight packed in a script object; unpacking gives tensors of the same size (the int8
    weight, a float bias)."""
    weight, bias = module._packed_params._weight_bias()
    return [("weight", weight), ("bias", bias)]


# -- giving back memory-mapped pages ------------------------------------------------------
@cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def file_mappings() -> list[tuple[int, int]]:
    """(start, end) of every file-backed mapping of this process (Linux; else none)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return []
    spans = []
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[4] != "0" and parts[5].startswith("/"):
            start, end = (int(x, 16) for x in parts[0].split("-"))
            spans.append((start, end))
    return spans


def release_file_pages(dead: Iterable[torch.Tensor], live: Iterable[torch.Tensor]) -> int:
    """Drop the resident pages of the CPU tensors in ``dead`` that lie in a file mapping
    and overlap no tensor of ``live``; returns the bytes given back.

    Only file-backed pages qualify: dropping an unmodified private page of a file only
    makes a later read fetch it from the file again, so a tensor someone still holds
    elsewhere reads the same bytes. Anonymous memory is left to its owners.
    """
    libc = _libc()
    page = os.sysconf("SC_PAGE_SIZE")
    files = file_mappings()
    if libc is None or not files:
        return 0
    kept = sorted(_span(t) for t in live if _in_ram(t))
    released = 0
    for t in dead:
        if not _in_ram(t):
            continue
        start, end = _span(t)
        if not any(a <= start and end <= b for a, b in files):
            continue
        for lo, hi in _minus(start, end, kept):
            lo, hi = -(-lo // page) * page, hi // page * page
            if hi > lo and libc.madvise(lo, hi - lo, _MADV_DONTNEED) == 0:
                released += hi - lo
    return released


def _in_ram(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and not is_opaque(t) and not t.is_quantized and t.numel() > 0


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + tensor_bytes(t)


def _minus(start: int, end: int, kept: list[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """The parts of [start, end) that no span in ``kept`` (sorted) covers."""
    at = start
    for lo, hi in kept:
        if hi <= at or lo >= end:
            continue
        if lo > at:
            yield at, lo
        at = max(at, hi)
    if at < end:
        yield at, end


# -- the process as the kernel sees it ----------------------------------------------------
def process_memory(pss: bool = True) -> dict[str, int]:
    """Resident memory of this process in bytes: ``rss``, ``pss`` (shared pages split
    among their users), ``anon`` (heap, private copies) and ``file`` (mapped files).
    Linux reads ``/proc/self/smaps_rollup``; elsewhere only ``rss`` (peak, from
    ``resource``) is known. ``pss=False`` leaves pss out and reads the kernel's counters
    (``/proc/self/status``) instead: the rollup walks every mapping's page tables, ~15 ms
    in a serving process (a /metrics scrape took 25 ms, 17 of them here), the counters
    are read in microseconds."""
    path, fields = "/proc/self/smaps_rollup", {"Rss": "rss", "Pss": "pss", "Anonymous": "anon"}
    if not pss:
        path, fields = "/proc/self/status", {"VmRSS": "rss", "RssAnon": "anon"}
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0].rstrip(":") in fields:
                    out[fields[parts[0].rstrip(":")]] = int(parts[1]) * 1024
    except OSError:
        import resource

        return {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    out["file"] = max(0, out.get("rss", 0) - out.get("anon", 0))
    return out


def trim_heap() -> None:
    """Hand the C heap's free memory back to the system (glibc keeps it otherwise), so
    that a reading after freeing tensors shows what is really held."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


#: Kernel caches that grow with every new matmul shape: oneDNN's primitive cache
#: (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and ideep's, torch's layer over it
#: (``LRU_CACHE_CAPACITY``), both 1,024 entries by default. A bf16 matmul of a new row
#: count (LoRA's per-adapter segments, a prefill chunk's length) adds one to each: 1,200
#: such matmuls held 641 MB after a heap trim at the default, 83 MB with both at 128
#: (tests/test_kernel_caches.py). The engine sets both to this (a user's own setting
#: wins); a step reuses a few dozen shapes, so its working set stays cached.
KERNEL_CACHE_ENTRIES = 128
_KERNEL_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_kernel_caches(entries: int = KERNEL_CACHE_ENTRIES) -> dict[str, str]:
    """Cap oneDNN's and ideep's shape caches (unless the environment already does).

    Both libraries read their variable when they first build a primitive, so this takes
    effect only if it runs before this process's first oneDNN matmul: the engine calls it
    as it starts, before any model loads. Returns the settings in force."""
    for name in _KERNEL_CACHE_VARS:
        os.environ.setdefault(name, str(entries))
    return {name: os.environ[name] for name in _KERNEL_CACHE_VARS}


#: A request piece (an HTTP body, a prompt's text) at least this large is "large": parsed off
#: the event loop, counted against the server's limit on large bodies, and followed by a heap
#: trim (glibc keeps the megabytes that parsing and tokenizing it took: 60 bodies of 1 MB
#: left the engine process 1.2 GB larger until trimmed)
LARGE_PIECE_BYTES = 256 << 10


#: The engine loop trims the heap once it has been idle this long after work (engine/loop.py):
#: measured on SmolLM2 after 32 x 100 offline runs, 1,470 -> 1,316 MB; a trim takes
#: milliseconds and never runs between two steps of a burst
IDLE_TRIM_S = 1.0


class TrimSoon:
    """``trim_heap()`` once, ``delay_s`` after the last ``request()``: large pieces of work
    ask for it as they end, a burst of them costs one trim, on a thread of its own."""

    def __init__(self, delay_s: float = 1.0):
        self.delay_s = delay_s
        self.trims = 0
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def request(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(self.delay_s, self._run)
            self._timer.daemon = True
            self._timer.start()

    def _run(self) -> None:
        trim_heap()
        with self._lock:
            self.trims += 1
            if self._timer is threading.current_thread():
                self._timer = None
