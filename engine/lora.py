"""Many LoRA adapters on one base model, batched: slots, the wrapped linears, LRU.

A model's adapters are *registered* by name (their folder is read and checked once, then
dropped) and *resident* in one of ``max_loras`` slots when a step needs them. Each targeted
linear of the base is wrapped in a ``LoraLinear``: it calls its base module as is (plain,
oneDNN-packed or quantized: whatever it was) and adds, for the step's rows, their adapter's
low-rank update, grouped by slot (``trae_kernels/lora.py``). Rows of the base and of different
adapters run in one forward; no weight is merged, no forward runs per adapter.

The runner tells the wrapped linears which slot each row uses by setting the step's
``LoraRows`` on this model's ``LoraSlots`` for the duration of one forward (an object per
model, never a global). Slots are filled on the engine thread between steps: an adapter a
waiting request needs is read from its folder into a free slot, or into the slot of the
least recently used adapter that no running request uses; when every slot is busy the
request waits (the scheduler admits it once a slot frees), it never fails.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from trae_groups.engine.adapters import read_adapter
from trae_groups.engine.errors import ModelLoadError
from trae_groups.kernels.lora import LoraRows, lora_update, runs_of

_uids = itertools.count(1)


@dataclass(frozen=True)
class Adapter:
    """A registered adapter: where it lives, what it targets, what it costs."""

    name: str
    path: str
    uid: int  # a fresh one per registration: keys the prefix cache (a reloaded name is new)
    rank: int
    modules: tuple[str, ...]
    parameters: int
    nbytes: int  # its own tensors at its own rank


@dataclass(frozen=True)
class AdapterReport:
    """One adapter as reports show it (``trae model info``, stats)."""

    name: str
    path: str
    rank: int
    parameters: int
    bytes: int  # its own tensors, at its own rank
    resident: bool  # holds a slot now
    dtype: str
    device: str


class LoraLinear(nn.Module):
    """``base_layer(x)`` plus each row's adapter update; any base module with in/out features."""

    def __init__(self, base_layer: nn.Module, slots: LoraSlots):
        super().__init__()
        self.base_layer = base_layer
        self.in_features = base_layer.in_features
        self.out_features = base_layer.out_features
        self._slots = slots  # a plain attribute: not a submodule, not in state_dict
        self.a: torch.Tensor | None = None  # [max_loras, max_rank, in]
        self.b: torch.Tensor | None = None  # [max_loras, max_rank, out], scaling folded in
        self.ranks: list[int] = [0] * slots.max_loras  # 0: that slot's adapter skips this linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        rows = self._slots.rows
        if rows is None or self.a is None:
            return y
        flat = y.reshape(-1, self.out_features)
        self._slots.kernel(flat, x.reshape(-1, self.in_features), self.a, self.b, self.ranks, rows)
        return flat.view(y.shape)

    def add_update(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add this step's adapter update to ``y`` in place, the base output computed
        elsewhere (a slice of a fused projection, ``engine/flat_forward.py``)."""
        rows = self._slots.rows
        if rows is not None and self.a is not None:
            self._slots.kernel(y, x, self.a, self.b, self.ranks, rows)

    def allocate(self, max_loras: int, max_rank: int, dtype, device) -> None:
        self.a = torch.zeros(max_loras, max_rank, self.in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, max_rank, self.out_features, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, self.b) if t is not None)


Kernel = Callable[..., torch.Tensor]


class LoraSlots:
    """One model's adapters: registered ones, the ``max_loras`` resident slots, LRU order.

    ``register``/``unregister`` may be called from any thread; ``make_room``, ``rows_for``
    and the forward run on the engine thread only.
    """

    def __init__(
        self,
        model: nn.Module,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        kernel: Kernel = lora_update,
    ):
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.kernel = kernel
        self.rows: LoraRows | None = None  # set for one forward by the runner
        self._lock = threading.Lock()
        self._registered: dict[str, Adapter] = {}
        self._resident: OrderedDict[str, tuple[int, int]] = OrderedDict()  # name -> (slot, uid)
        self._linears: dict[str, LoraLinear] = {}
        self.num_loads = 0
        self.num_evictions = 0

    # -- registering (any thread) -------------------------------------------------------
    def register(self, name: str, folder: str | Path) -> Adapter:
        """Read and check the folder now (ModelLoadError if it does not fit); the weights
        are read again when a request first needs a slot for it."""
        weights = read_adapter(folder, self.model, self.max_rank, self.dtype)
        adapter = Adapter(
            name,
            weights.path,
            next(_uids),
            weights.rank,
            tuple(weights.modules),
            weights.parameters,
            weights.nbytes,
        )
        with self._lock:
            if name in self._registered:
                raise ValueError(f"an adapter named {name!r} is already on this model")
            self._registered[name] = adapter
        return adapter

    def unregister(self, name: str) -> None:
        """Forget the adapter; its slot is cleared before the next step that needs one."""
        with self._lock:
            self._registered.pop(name, None)

    def get(self, name: str) -> Adapter | None:
        with self._lock:
            return self._registered.get(name)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._registered)

    # -- slots (engine thread) ------------------------------------------------------------
    def is_resident(self, name: str | None) -> bool:
        return name is None or name in self._resident

    def slot_of(self, name: str | None) -> int:
        return -1 if name is None else self._resident[name][0]

    def make_room(self, wanted: Iterable[str], in_use: set[str]) -> list[tuple[str, Exception]]:
        """Bring the adapters ``wanted`` (most urgent first) into slots while there is room,
        evicting the least recently used adapter that ``in_use`` does not name. Returns the
        adapters that failed to load (their folder changed or vanished), with why."""
        self._drop_unregistered()
        failed: list[tuple[str, Exception]] = []
        pinned = set(in_use)
        for name in dict.fromkeys(wanted):
            if name in self._resident:
                pinned.add(name)
                continue
            slot = self._free_slot(pinned)
            if slot is None:
                break  # every slot serves a running request: the rest wait
            try:
                self._load(name, slot)
            except (ModelLoadError, KeyError) as exc:
                failed.append((name, exc))
                continue
            pinned.add(name)
        return failed

    def touch(self, names: Iterable[str]) -> None:
        """These adapters ran this step: most recently used."""
        for name in names:
            if name in self._resident:
                self._resident.move_to_end(name)

    def _free_slot(self, pinned: set[str]) -> int | None:
        used = {slot for slot, _ in self._resident.values()}
        free = next((s for s in range(self.max_loras) if s not in used), None)
        if free is not None:
            return free
        victim = next((n for n in self._resident if n not in pinned), None)
        if victim is None:
            return None
        slot, _ = self._resident.pop(victim)
        self._clear(slot)
        self.num_evictions += 1
        return slot

    def _drop_unregistered(self) -> None:
        with self._lock:
            stale = [
                n
                for n, (_, uid) in self._resident.items()
                if n not in self._registered or self._registered[n].uid != uid
            ]
        for name in stale:
            slot, _ = self._resident.pop(name)
            self._clear(slot)

    def _load(self, name: str, slot: int) -> None:
        with self._lock:
            adapter = self._registered[name]
        weights = read_adapter(adapter.path, self.model, self.max_rank, self.dtype)
        self._clear(slot)
        for module_name, (a, b) in weights.modules.items():
            linear = self._wrap(module_name)
            rank = a.shape[0]
            linear.a[slot, :rank].copy_(a)
            linear.b[slot, :rank].copy_(b)
            linear.ranks[slot] = rank
        self._resident[name] = (slot, adapter.uid)
        self.num_loads += 1

    def _clear(self, slot: int) -> None:
        for linear in self._linears.values():
            if linear.ranks[slot]:
                linear.a[slot].zero_()
                linear.b[slot].zero_()
                linear.ranks[slot] = 0

    def _wrap(self, module_name: str) -> LoraLinear:
        """The LoraLinear at ``module_name``, wrapping the base module there the first time."""
        linear = self._linears.get(module_name)
        if linear is None:
            parent_name, _, child = module_name.rpartition(".")
            parent = self.model.get_submodule(parent_name) if parent_name else self.model
            linear = LoraLinear(getattr(parent, child), self)
            linear.allocate(self.max_loras, self.max_rank, self.dtype, self.device)
            setattr(parent, child, linear)
            self._linears[module_name] = linear
        return linear

    # -- a step ----------------------------------------------------------------------------
    def resident_names(self) -> list[str]:
        return list(self._resident)

    def uid(self, name: str) -> int:
        with self._lock:
            return self._registered[name].uid

    # -- accounting ------------------------------------------------------------------------
    def adapter_bytes(self) -> dict[str, int]:
        """Bytes of each registered adapter's own tensors (at its own rank)."""
        with self._lock:
            return {name: a.nbytes for name, a in self._registered.items()}

    def report(self) -> list[AdapterReport]:
        """Every registered adapter: its own bytes, rank, and whether it holds a slot now."""
        with self._lock:
            adapters = list(self._registered.values())
        resident = dict(self._resident)
        return [
            AdapterReport(
                a.name,
                a.path,
                a.rank,
                a.parameters,
                a.nbytes,
                resident.get(a.name, (None, 0))[1] == a.uid,
                str(self.dtype).removeprefix("torch."),
                str(self.device),
            )
            for a in sorted(adapters, key=lambda a: a.name)
        ]

    def slot_bytes(self) -> int:
        """Bytes the resident slots take on the device (zero-padded to the maximum rank)."""
        return sum(linear.nbytes for linear in list(self._linears.values()))


def lora_rows(slots_t: torch.Tensor, slots: list[int]) -> LoraRows | None:
    """A step's ``LoraRows`` (``slots_t``: ``slots`` on the device); None when no row uses
    an adapter (the wrapped linears then add nothing)."""
    runs = runs_of(slots)
    return LoraRows(slots_t, runs) if runs else None
