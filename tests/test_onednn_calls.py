"""oneDNN's linear called from C (trae_kernels/onednn_calls.c), as the native layer loop calls
it: through torch's op, and for decode rows on AMX from the packed weight on tiles, which must
give the op's bits (k in the same order, the same rounding, the bias added before it)."""

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
        assert onednn_calls.packs_in_pairs(n, k, HINT)
        assert handles._weights[-1].pairs == torch.ops.mkldnn.data_ptr(packed)
    for rows in (1, 7, 16, 17, 32, 33):  # one tile of rows, two, and past the tile path
        x = torch.randn(rows, k, generator=g).bfloat16()
        for b in (None, bias):
            want = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
            got = onednn_calls.linear(x, address, n, b)
            assert torch.equal(got, want), (rows, b is None, (got - want).abs().max())


def test_weights_the_tile_path_does_not_take_go_through_the_op():
    # 48 columns: not a whole block of 32; float32: not bf16
    g = torch.Generator().manual_seed(0)
    handles = onednn_calls.WeightHandles()
    for weight in ((torch.randn(48, 64, generator=g)).bfloat16(), torch.randn(64, 64, generator=g)):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, HINT)
        address = handles.of(packed, HINT)
        assert not handles._weights[-1].pairs
        x = torch.randn(3, 64, generator=g).to(weight.dtype)
        want = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        assert torch.equal(onednn_calls.linear(x, address, weight.shape[0]), want)
    assert not onednn_calls.packs_in_pairs(48, 64, HINT)
