"""zentorch through its C shims (trae_kernels/zen_calls.py): the same bits as its dispatcher ops,
and no memory left behind per call (the dispatcher ops leak each string argument)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from trae_groups.engine.fast_linear import zentorch_dtypes
from trae_groups.kernels import zen_calls

pytestmark = pytest.mark.skipif(
    zen_calls.library() is None, reason="no zentorch or no C compiler here"
)
zen = torch.ops.zentorch if zen_calls.library() is not None else None
# zentorch's bf16 matmuls need AVX512-BF16 (its norms take bf16 anywhere)
DTYPES = [torch.float32, torch.bfloat16]
LINEAR_DTYPES = [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        torch.bfloat16 not in zentorch_dtypes(), reason="zentorch has no bf16 matmul here"
    )),
]  # fmt: skip


def _rss_mb() -> float:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.parametrize("dtype", LINEAR_DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_a_linear_gives_the_dispatcher_ops_bits(dtype, rows, bias):
    torch.manual_seed(rows)
    weight = zen.zentorch_weight_prepack_for_linear(torch.randn(96, 80, dtype=dtype))
    b = torch.randn(96, dtype=dtype) if bias else None
    wide = torch.randn(rows, 100, dtype=dtype)
    for x in (wide[:, :80].contiguous(), wide[:, :80]):  # packed rows, and strided ones
        want = zen.zentorch_linear_unary(x.contiguous(), weight, b, is_weight_prepacked=True)
        got = zen_calls.linear(x, weight, b)
        assert got is not None and torch.equal(got, want)


def test_a_batch_of_sequences_is_taken_as_its_rows():
    weight = zen.zentorch_weight_prepack_for_linear(torch.randn(8, 4))
    x = torch.randn(1, 5, 4)  # transformers' forward: [batch, tokens, in]
    want = zen.zentorch_linear_unary(x, weight, None, is_weight_prepacked=True)
    got = zen_calls.linear(x, weight, None)
    assert got is not None and got.shape == (1, 5, 8) and torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_norms_give_the_dispatcher_ops_bits(dtype):
    torch.manual_seed(0)
    x, residual, weight = (torch.randn(s, dtype=dtype) for s in ((9, 64), (9, 64), (64,)))
    assert torch.equal(zen_calls.rms_norm(x, weight, 1e-5), zen.zentorch_rms_norm(x, weight, 1e-5))
    hidden, res = x.clone(), residual.clone()
    zen.zentorch_add_rms_norm_(hidden, weight, res, 1e-5)
    got_hidden, got_res = x.clone(), residual.clone()
    assert zen_calls.add_rms_norm(got_hidden, got_res, weight, 1e-5)
    assert torch.equal(got_hidden, hidden) and torch.equal(got_res, res)


def test_what_the_shims_do_not_take_is_left_to_the_dispatcher():
    weight = zen.zentorch_weight_prepack_for_linear(torch.randn(8, 4))
    assert zen_calls.linear(torch.randn(3, 2, 4).transpose(0, 1), weight, None) is None  # strided
    assert zen_calls.linear(torch.randn(4, 2).t(), weight, None) is None  # columns strided
    assert zen_calls.rms_norm(torch.randn(0, 4), torch.ones(4), 1e-5) is None  # no rows
    assert not zen_calls.add_rms_norm(torch.randn(3, 4), torch.randn(2, 4), torch.ones(4), 1e-5)


def test_calls_leave_no_memory_behind():
    weight = zen.zentorch_weight_prepack_for_linear(torch.randn(64, 32))
    norm = torch.ones(32)
    x, hidden, residual = torch.randn(1, 32), torch.randn(1, 32), torch.randn(1, 32)
    for _ in range(1000):  # warm: allocator pools, zentorch's own caches
        zen_calls.linear(x, weight, None)
        zen_calls.add_rms_norm(hidden, residual, norm, 1e-5)
    before = _rss_mb()
    for _ in range(50_000):  # the dispatcher ops leaked ~100-150 bytes a call: 10+ MB here
        zen_calls.linear(x, weight, None)
        zen_calls.rms_norm(x, norm, 1e-5)
        zen_calls.add_rms_norm(hidden, residual, norm, 1e-5)
    assert _rss_mb() - before < 3.0


def test_the_switch_turns_the_shims_off():
    import os
    import subprocess
    import sys

    code = "from trae_groups.kernels import zen_calls; print(zen_calls.library() is None)"
    env = {**os.environ, zen_calls.ENV_SWITCH: "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "True", out.stderr
