"""The grouped low-rank update of batched LoRA: every row adds its own adapter's ``B @ A @ x``.

One step of the engine holds rows of many sequences, each with its adapter or none. The
adapters of one model sit in slots of two stacked tensors per targeted linear, ``a``
``[slots, rank, in]`` and ``b`` ``[slots, rank, out]`` (the scaling folded into ``b``,
ranks below the stack's zero-padded), and a step says which slot each row uses
(``LoraRows``). The update is added in place to what the base linear computed, so the
base stays whatever module it is (plain, oneDNN-packed, quantized) and no weight is ever
merged.

This torch function is the reference and the CPU path: one shrink and one expand matmul
per run of one adapter's rows (a segment matmul), at that adapter's own rank; or, for a
step of few rows in many runs, all slots at once with other slots' columns masked. The
Triton kernel (``triton_lora.py``) does the same per row, gathering each row's slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LoraRows:
    """Which adapter slot each row of a step uses.

    ``slots`` [T] (long, -1: the base alone) for kernels that gather per row; ``runs`` the
    same facts as contiguous ``(slot, start, stop)`` row ranges, base rows left out, for
    kernels that slice. The runner orders a step's sequences by adapter, so an adapter's
    rows form at most two runs (one among the decodes, one among the prefill chunks).
    """

    slots: torch.Tensor
    runs: tuple[tuple[int, int, int], ...]
    _masks: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_rows(self) -> int:
        return self.slots.shape[0]

    def mask(self, num_slots: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, num_slots * rank]: 1 where the column belongs to the row's slot (made once
        per step and shape, shared by every linear)."""
        key = (num_slots, rank, dtype)
        if key not in self._masks:
            mask = torch.zeros(
                self.num_rows, num_slots + 1, rank, dtype=dtype, device=self.slots.device
            )
            slot = torch.where(self.slots < 0, num_slots, self.slots)
            mask[torch.arange(self.num_rows, device=slot.device), slot] = 1
            self._masks[key] = mask[:, :num_slots].reshape(self.num_rows, num_slots * rank)
        return self._masks[key]


def runs_of(slots: list[int]) -> tuple[tuple[int, int, int], ...]:
    """Contiguous ranges of equal slot (>= 0) in a row's slot list."""
    runs: list[list[int]] = []
    for row, slot in enumerate(slots):
        if slot < 0:
            continue
        if runs and runs[-1][0] == slot and runs[-1][2] == row:
            runs[-1][2] = row + 1
        else:
            runs.append([slot, row, row + 1])
    return tuple(tuple(r) for r in runs)


def lora_update(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ranks: list[int],
    rows: LoraRows,
) -> torch.Tensor:
    """``y[t] += x[t] @ a[s, :r].T @ b[s, :r]`` for every row t of slot s (rank r), in place.

    x [T, in], y [T, out]; a [S, R, in]; b [S, R, out]; ``ranks[s]`` is slot s's rank in
    this linear (0: its adapter does not target it). Returns y. One shrink and one expand
    matmul per run, on slices: no gather, no scatter (CPU ``index_add_`` costs a per-row
    loop, several times the matmuls).
    """
    _check(y, x, a, b, rows)
    if len(rows.runs) > DENSE_MIN_RUNS and rows.num_rows <= DENSE_MAX_ROWS:
        return _dense(y, x, a, b, rows)
    for slot, start, stop in rows.runs:
        rank = ranks[slot]
        if rank == 0:
            continue
        y[start:stop].addmm_(x[start:stop] @ a[slot, :rank].T, b[slot, :rank])
    return y


# Many short runs (a decode step over many adapters): three matmul-sized ops per linear
# instead of two per run. Every row is multiplied by every slot's A (the columns of other
# slots then zeroed), which costs max_loras * rank * (in + out) per row: only for few rows.
DENSE_MIN_RUNS = 4
DENSE_MAX_ROWS = 128


def _dense(y, x, a, b, rows: LoraRows) -> torch.Tensor:
    num_slots, rank = a.shape[:2]
    v = x @ a.reshape(num_slots * rank, -1).T
    v.mul_(rows.mask(num_slots, rank, v.dtype))
    return y.addmm_(v, b.reshape(num_slots * rank, -1))


def select_lora_kernel(device: str | torch.device):
    """The grouped update for a model on ``device``: Triton's on CUDA when triton imports
    (compiled), this torch function everywhere else."""
    if torch.device(device).type == "cuda":
        from trae_groups.kernels import triton_lora

        if triton_lora.HAVE_TRITON and triton_lora.available(device):
            return triton_lora.lora_update
    return lora_update


def lora_update_reference(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """Row by row, from the slot index alone (padded ranks are zero): the test oracle."""
    out = y.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            out[t] += (a[slot] @ x[t]) @ b[slot]
    return out


def _check(y, x, a, b, rows: LoraRows) -> None:
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"lora_update: x {tuple(x.shape)} and y {tuple(y.shape)} must be [T, *]")
    if a.dim() != 3 or b.dim() != 3 or a.shape[:2] != b.shape[:2]:
        raise ValueError(f"lora_update: stacks a {tuple(a.shape)}, b {tuple(b.shape)} disagree")
    if a.shape[2] != x.shape[1] or b.shape[2] != y.shape[1]:
        raise ValueError(
            f"lora_update: a {tuple(a.shape)} / b {tuple(b.shape)} do not fit "
            f"x {tuple(x.shape)} -> y {tuple(y.shape)}"
        )
    if rows.num_rows != x.shape[0]:
        raise ValueError(f"lora_update: {rows.num_rows} row slots for {x.shape[0]} rows")
