"""oneDNN's linear called from C (trae_kernels/onednn_calls.c), as the native layer loop calls
it: through torch's op; for bf16 decode rows on AMX from the packed weight on tiles; for float32
rows from its panels. Both must give the op's bits (k in the same order, the same rounding, the
bias added before it)."""

from __future__ import annotations

import pytest
import torch

from trae_groups.engine.fast_linear import DEFAULT_BATCH_HINT as HINT
from trae_groups.kernels import onednn_calls

pytestmark = pytest.mark.skipif(onednn_calls.library() is None, reason="no oneDNN caller here")
# SmolLM2's four linears of a layer, and a test model's (tests/test_native_layers.py's WIDE)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (512, 128)]


def _tiles() -> bool:
    return bool(onednn_calls.library().onednn_tiles())


@pytest.mark.parametrize("n,k", SHAPES)
def test_decode_rows_give_the_ops_bits(n, k):
    g = torch.Generator().manual_seed(n + k)
    weight = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, HINT)
    bias = (torch.randn(n, generator=g) * 0.1).bfloat16()
    handles = onednn_calls.WeightHandles()
    address = handles.of(packed, HINT)
    if _tiles():  # the tile path takes this weight: oneDNN packed it in pairs
        assert onednn_calls.packs_as_read(n, k, HINT, torch.bfloat16)
        assert handles._weights[-1].blocked == torch.ops.mkldnn.data_ptr(packed)
    for rows in (1, 7, 16, 17, 32, 33):  # one tile of rows, two, and past the tile path
        x = torch.randn(rows, k, generator=g).bfloat16()
        for b in (None, bias):
            want = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
            got = onednn_calls.linear(x, address, n, b)
            assert torch.equal(got, want), (rows, b is None, (got - want).abs().max())


# SmolLM2's shapes again (k 1536: oneDNN sums k in blocks of 1024 from 2 rows, 512 at 1), and a
# k that is no multiple of 32
F32_SHAPES = [*SHAPES, (128, 1104)]


@pytest.mark.parametrize("n,k", F32_SHAPES)
def test_float32_rows_give_the_ops_bits(n, k):
    g = torch.Generator().manual_seed(n * k)
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k, generator=g) * 0.05, HINT)
    bias = torch.randn(n, generator=g) * 0.1
    handles = onednn_calls.WeightHandles()
    address = handles.of(packed, HINT)
    held = handles._weights[-1]
    panels = bool(held.blocked)
    if onednn_calls.library().onednn_panels():
        assert panels == onednn_calls.packs_as_read(n, k, HINT, torch.float32)
    for rows in (1, 2, 5, 6, 7, 13, 32, 63, 64, 65):  # blocks of 6 rows, partial ones, past 64
        x = torch.randn(rows, k, generator=g)
        for b in (None, bias):
            want = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
            for call in ("learns", "runs"):  # the first call at a row count learns k's blocks
                got = onednn_calls.linear(x, address, n, b)
                assert torch.equal(got, want), (rows, call, b is None, (got - want).abs().max())
        if panels and rows <= onednn_calls.F32_ROWS and _tiles():
            # on Intel CPUs with AMX oneDNN's order is one the panel path knows: it runs here
            assert held.k_block[rows] in (512, 1024), rows


def test_float32_panels_in_another_k_order_give_other_bits():
    """What the learning guards against: the wrong k blocks change the result."""
    n, k = 576, 1536
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k) * 0.05, HINT)
    handles = onednn_calls.WeightHandles()
    address = handles.of(packed, HINT)
    held = handles._weights[-1]
    if not held.blocked:
        pytest.skip("oneDNN does not pack float32 in panels here")
    x = torch.randn(8, k)
    want = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    held.k_block[8] = 256  # not oneDNN's blocks at this shape
    assert not torch.equal(onednn_calls.linear(x, address, n), want)


def test_weights_the_c_paths_do_not_take_go_through_the_op():
    # 48 columns: not a whole block of 32 (bf16) or a panel of 64 (float32)
    g = torch.Generator().manual_seed(0)
    handles = onednn_calls.WeightHandles()
    for weight in ((torch.randn(48, 64, generator=g)).bfloat16(), torch.randn(48, 64, generator=g)):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, HINT)
        address = handles.of(packed, HINT)
        assert not handles._weights[-1].blocked
        x = torch.randn(3, 64, generator=g).to(weight.dtype)
        want = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        assert torch.equal(onednn_calls.linear(x, address, weight.shape[0]), want)
    assert not onednn_calls.packs_as_read(48, 64, HINT, torch.bfloat16)
    assert not onednn_calls.packs_as_read(48, 64, HINT, torch.float32)
