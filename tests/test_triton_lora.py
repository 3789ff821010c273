"""The Triton LoRA kernel against the torch path, through Triton's interpreter on CPU.

As in test_triton_kernels.py: Triton picks compiled or interpreted once per process, so the
kernel runs in one spawned worker started with ``TRITON_INTERPRET=1``; the parent builds the
expected values with the torch path and compares. With CUDA, the same cases also run on the
GPU, compiled (marked gpu).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from trae_groups.kernels import triton_lora
from trae_groups.kernels.lora import LoraRows, lora_update, runs_of

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}
# (rows' slots, slots, max rank, in, out, each slot's rank; 0: the slot skips this linear)
CASES = {
    "mixed decode": ([1, -1, 0, 1, 2, -1, 0, 0, 1, 3], 4, 16, 72, 40, [16, 5, 0, 9]),
    "one adapter, all rows": ([0] * 7, 2, 8, 64, 130, [8, 3]),
    "base rows only": ([-1, -1, -1], 2, 8, 32, 32, [8, 8]),
    "rank above 16": ([1, 0, 1], 2, 48, 40, 24, [48, 33]),
}


def build(case: str, dtype: str, seed: int = 0):
    per_row, slots, max_rank, d_in, d_out, ranks = CASES[case]
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(slots, max_rank, d_in, generator=g) / d_in**0.5
    b = torch.randn(slots, max_rank, d_out, generator=g)
    for slot, rank in enumerate(ranks):  # what LoraSlots keeps: zero past each slot's rank
        a[slot, rank:] = 0
        b[slot, rank:] = 0
    x = torch.randn(len(per_row), d_in, generator=g)
    y = torch.randn(len(per_row), d_out, generator=g)
    t = DTYPES[dtype]
    slots_t = torch.tensor(per_row, dtype=torch.long)
    return x.to(t), y.to(t), a.to(t), b.to(t), ranks, LoraRows(slots_t, runs_of(per_row))


def run_triton(case: str, dtype: str, device: str) -> torch.Tensor:
    x, y, a, b, ranks, rows = build(case, dtype)
    dev = torch.device(device)
    rows = LoraRows(rows.slots.to(dev), ())
    out = triton_lora.lora_update(y.to(dev), x.to(dev), a.to(dev), b.to(dev), ranks, rows)
    return out.cpu()


def expected(case: str, dtype: str) -> torch.Tensor:
    x, y, a, b, ranks, rows = build(case, dtype)
    return lora_update(y.float(), x.float(), a.float(), b.float(), ranks, rows).to(x.dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_lora_matches_the_torch_path_interpreted(interpreter, case, dtype):
    got = interpreter.submit(run_triton, case, dtype, "cpu").result(timeout=300)
    want = expected(case, dtype)
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
    if case == "base rows only":  # nothing to add: the base's output comes back untouched
        assert torch.equal(got, build(case, dtype)[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_lora_matches_the_torch_path_on_gpu(case, dtype):
    got = run_triton(case, dtype, "cuda")
    torch.testing.assert_close(got, expected(case, dtype), atol=TOL[dtype], rtol=TOL[dtype])
