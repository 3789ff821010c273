"""The grouped LoRA update in Triton: the GPU path behind ``kernels.lora.lora_update``'s contract.

Each row gathers its own slot (``rows.slots``; -1 rows do nothing), so one launch serves a
step whatever mix of adapters it holds, with no sorting and no per-adapter launch. Two
kernels, as in punica's BGMV: *shrink* ``v[t] = a[slot] @ x[t]`` (one program per row, the
rank as one tile, the input dimension in blocks) and *expand* ``y[t] += v[t] @ b[slot]``
(one program per row and block of outputs), accumulating in fp32. Ranks below the stack's
are zero-padded, so the kernels run at the stack's rank. A row-per-program gather is the
simple design that fits decode steps; long prefills would want segment tiles (rows of one
adapter sharing each weight tile), which this does not do yet.

Compiled or interpreted follows ``triton_attention``: under ``TRITON_INTERPRET=1`` the same
bodies run on CPU tensors (the tests' way to check them against the torch path).
"""

from __future__ import annotations

import torch

from trae_groups.kernels.lora import LoraRows, _check
from trae_groups.kernels.triton_attention import HAVE_TRITON, available, tl, triton

__all__ = ["HAVE_TRITON", "available", "lora_update"]


@triton.jit(do_not_specialize=["num_in"])
def _shrink_kernel(
    x_ptr,
    a_ptr,
    slot_ptr,
    v_ptr,
    num_in,
    rank,
    sx_t,
    sa_s,
    sa_r,
    sv_t,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        r = tl.arange(0, BLOCK_R)
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, num_in, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + t * sx_t + k, mask=k < num_in, other=0.0).to(tl.float32)
            ak = tl.load(
                a_ptr + slot * sa_s + r[:, None] * sa_r + k[None, :],
                mask=(r[:, None] < rank) & (k[None, :] < num_in),
                other=0.0,
            ).to(tl.float32)
            acc += tl.sum(ak * xk[None, :], axis=1)
        tl.store(v_ptr + t * sv_t + r, acc, mask=r < rank)


@triton.jit(do_not_specialize=["num_out"])
def _expand_kernel(
    v_ptr,
    b_ptr,
    slot_ptr,
    y_ptr,
    num_out,
    rank,
    sv_t,
    sb_s,
    sb_r,
    sy_t,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.arange(0, BLOCK_R)
        vr = tl.load(v_ptr + t * sv_t + r, mask=r < rank, other=0.0)
        bn = tl.load(
            b_ptr + slot * sb_s + r[:, None] * sb_r + n[None, :],
            mask=(r[:, None] < rank) & (n[None, :] < num_out),
            other=0.0,
        ).to(tl.float32)
        delta = tl.sum(bn * vr[:, None], axis=0)
        y = tl.load(y_ptr + t * sy_t + n, mask=n < num_out, other=0.0)
        tl.store(y_ptr + t * sy_t + n, (y.to(tl.float32) + delta).to(y.dtype), mask=n < num_out)


def lora_update(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ranks: list[int],
    rows: LoraRows,
) -> torch.Tensor:
    """Same contract as ``kernels.lora.lora_update`` (``ranks`` and the runs are not
    needed: each row reads its slot, padded ranks are zero). In place; returns y."""
    _check(y, x, a, b, rows)
    for name, t in (("x", x), ("y", y), ("a", a), ("b", b)):
        if t.stride(-1) != 1:
            raise ValueError(f"triton lora_update: {name} must be contiguous in its last dim")
    num_rows, rank = x.shape[0], a.shape[1]
    if num_rows == 0:
        return y
    v = torch.empty(num_rows, rank, dtype=torch.float32, device=x.device)
    block_r = max(16, triton.next_power_of_2(rank))
    slots = rows.slots
    _shrink_kernel[(num_rows,)](
        x, a, slots, v, x.shape[1], rank, x.stride(0), a.stride(0), a.stride(1), v.stride(0),
        BLOCK_R=block_r, BLOCK_K=64,
    )  # fmt: skip
    block_n = 64
    _expand_kernel[(num_rows, triton.cdiv(y.shape[1], block_n))](
        v, b, slots, y, y.shape[1], rank, v.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_R=block_r, BLOCK_N=block_n,
    )  # fmt: skip
    return y
