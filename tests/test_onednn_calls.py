"""oneDNN's linear called from C (trae_kernels/onednn_calls.c), as the native layer loop calls
it: through torch's op; for bf16 decode rows on AMX from the packed weight on tiles; for float32
rows from its panels. Both must give the op's bits (k in the same order, the same rounding, the
bias added before it)."""

from __future__ import annotations

import pytest
import torch

from trae_groups.engine.fast_linear import DEFAULT_BATCH_HINT as HINT
from trae_groups.engine.fast_linear import packable_dtypes
from trae_groups.kernels import onednn_calls

pytestmark = pytest.mark.skipif(onednn_calls.library() is None, reason="no oneDNN caller here")
# SmolLM2's four linears of a layer, and a test model's (tests/test_native_layers.py's WIDE)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (512, 128)]


def _tiles() -> bool:
    return onednn_calls.own_rows_limit(torch.bfloat16) > 0


def _runs_here(dtype: torch.dtype) -> bool:
    """Whether this file's own product should take the rows here: on Intel CPUs with AMX, and
    for float32 on CPUs with AVX2 but no AVX-512, the layouts and oneDNN's orders are ones it
    knows (elsewhere the op may keep them)."""
    avx2_only = dtype == torch.float32 and not torch.cpu._is_avx512_supported()
    return (_tiles() or avx2_only) and onednn_calls.own_rows_limit(dtype) > 0


def _check_rows(packed, n, k, dtype, rows_list, limit, g):
    """Each row count twice (the first call is the op's, checked against this file's; the
    second this file's where it gave the op's bits), with and without bias: the op's bits."""
    bias = (torch.randn(n, generator=g) * 0.1).to(dtype)
    handles = onednn_calls.WeightHandles()
    address = handles.of(packed)
    held = handles._weights[-1]
    if _runs_here(dtype):
        assert held.blocked == torch.ops.mkldnn.data_ptr(packed)
    for rows in rows_list:
        x = torch.randn(rows, k, generator=g).to(dtype)
        for b in (None, bias):
            want = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
            for call in ("checks", "runs"):
                got = onednn_calls.linear(x, address, n, b)
                assert torch.equal(got, want), (rows, call, b is None, (got - want).abs().max())
        if rows <= limit and _runs_here(dtype):  # this file's product gave the op's bits
            assert held.found[min(rows, onednn_calls.F32_SLOTS - 1)] > 0, rows
    return held


@pytest.mark.skipif(
    torch.bfloat16 not in packable_dtypes(), reason="oneDNN packs no bf16 weights on this CPU"
)
@pytest.mark.parametrize("n,k", SHAPES)
def test_decode_rows_give_the_ops_bits(n, k):
    g = torch.Generator().manual_seed(n + k)
    packed = torch.ops.mkldnn._reorder_linear_weight(
        (torch.randn(n, k, generator=g) * 0.05).bfloat16(), HINT
    )
    # one tile of rows, two, and past the tile path
    _check_rows(packed, n, k, torch.bfloat16, (1, 7, 16, 17, 32, 33), 32, g)


# SmolLM2's shapes again (k 1536: oneDNN sums k in blocks of 1024 from 2 rows, 512 at 1), and a
# k past 1,024 and no multiple of 32
F32_SHAPES = [*SHAPES, (128, 1104)]


@pytest.mark.parametrize("n,k", F32_SHAPES)
def test_float32_rows_give_the_ops_bits(n, k):
    g = torch.Generator().manual_seed(n * k)
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k, generator=g) * 0.05, HINT)
    # blocks of 6 rows, partial ones, and past 64: counts one slot each to 64, then prompt rows
    # (AVX2 builds) sharing one slot, proven at 65 and kept for 100, 301 and 700 (at k 1,104
    # and 1,536 more rows than one 2 MB chunk of the copy holds)
    limit = onednn_calls.own_rows_limit(torch.float32)
    rows = (1, 2, 5, 6, 7, 13, 32, 63, 64, 65, 100, 301, 700)
    held = _check_rows(packed, n, k, torch.float32, rows, limit, g)
    if _runs_here(torch.float32):
        assert set(held.found[1:]) <= {0, 512, 1024, 32767}


def test_a_product_in_another_order_is_not_kept():
    """What the first call's check guards against: the float32 panels summed in other k blocks
    than oneDNN's give other bits, and a row count where nothing of ours matched keeps the op."""
    n, k = 576, 1536
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k) * 0.05, HINT)
    handles = onednn_calls.WeightHandles()
    address = handles.of(packed)
    held = handles._weights[-1]
    if not held.blocked:
        pytest.skip("oneDNN does not pack float32 in panels here")
    x = torch.randn(8, k)
    want = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    held.found[8] = 256  # not oneDNN's blocks at this shape
    assert not torch.equal(onednn_calls.linear(x, address, n), want)
    held.found[8] = -1  # nothing matched: the op
    assert torch.equal(onednn_calls.linear(x, address, n), want)


def test_weights_the_c_paths_do_not_take_go_through_the_op():
    # 48 columns: not a whole block of 32 (bf16) or a panel of 64 (float32); 1,100 k: oneDNN
    # pads float32 k to 16 (the buffer is no n x k one)
    g = torch.Generator().manual_seed(0)
    handles = onednn_calls.WeightHandles()
    weights = (
        torch.randn(48, 64, generator=g).bfloat16(),
        torch.randn(48, 64, generator=g),
        torch.randn(64, 1100, generator=g),
    )
    for weight in (w for w in weights if w.dtype in packable_dtypes()):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, HINT)
        address = handles.of(packed)
        assert not handles._weights[-1].blocked
        x = torch.randn(3, weight.shape[1], generator=g).to(weight.dtype)
        want = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        assert torch.equal(onednn_calls.linear(x, address, weight.shape[0]), want)
