"""Prompt attention through AMD's zentorch SDPA kernel, where the CPU and the dtype allow it.

Why: a prompt chunk's attention is a third of a prefill step with torch's CPU flash kernel
(SmolLM2, 32 prompts of 512 tokens, bf16, Zen 5: 4.1 of 11.1 s). torch's kernel splits the
keys in blocks of 512, so a causal chunk of 512 tokens computes every score of the square,
and a chunk beside its cached prefix needs a boolean mask that it reads score by score.
zentorch's kernel, the same call shape, runs the step's shapes 2.7-3.1x faster in bf16 and
1.6-2.1x in float32 (Zen 5: a causal 512-token chunk 1.6 against 4.6 ms, four 128-token
chunks over 512 keys with a mask 2.0 against 5.9 ms; docs/kernels.md). It takes
GQA as is (no repeated K/V), strided views, and an additive mask in the query's dtype.

Its causal flag aligns top-left (like torch's), so a chunk over a cached prefix gets an
explicit additive mask, aligned bottom-right. It returns no usable log-sum-exp, which the
paths here never need.

Used where zentorch's op library loads (the ``zen`` extra), the CPU is AMD's and has the
op's instruction set (AVX512-BF16 for bf16, AVX-512 for float32: an AVX2-only EPYC keeps
torch's kernel), and the K/V are in the query's dtype. ``TRAE_ZEN_ATTENTION=0`` turns it
off (torch's kernel then runs, the same numbers within rounding).
"""

from __future__ import annotations

import functools
import os

import torch

from trae_groups.kernels.thread_switch import ThreadSwitch

# zentorch 2.13's dispatcher ops leak every string argument they are called with (torch
# 2.13's stable ABI keeps a heap copy of each ``std::string`` it converts, pytorch#190493):
# 32 bytes a string, plus its characters past 15. The linear and norms go through zentorch's C
# shims instead (trae_kernels/zen_calls.py); what still takes the dispatcher (this SDPA, compiled
# graphs, the shims' fallbacks) passes a one-letter op name, which keeps the characters inline.
ZEN_OP_NAME = "z"

ENV_SWITCH = "TRAE_ZEN_ATTENTION"  # "0": never use zentorch's SDPA
_switch = ThreadSwitch()
turned_off = _switch.turned_off  # this thread runs torch's kernel meanwhile (tests)


@functools.cache
def _dtypes() -> frozenset[torch.dtype]:
    """The dtypes zentorch's SDPA runs here (empty where it cannot be had)."""
    if os.environ.get(ENV_SWITCH) == "0":
        return frozenset()
    # the engine's home for loading zentorch (its op library alone, not the 4.7 s import)
    from trae_groups.engine.fast_linear import zentorch_available
    from trae_groups.engine.hardware import cpu_vendor

    if cpu_vendor() != "AuthenticAMD" or not zentorch_available():
        return frozenset()
    if not hasattr(torch.ops.zentorch, "zentorch_sdpa"):
        return frozenset()
    found = set()
    if torch.cpu._is_avx512_supported():
        found.add(torch.float32)
    if torch.cpu._is_avx512_bf16_supported():
        found.add(torch.bfloat16)
    return frozenset(found)


def supports(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether a prompt chunk of ``query`` over ``key`` may run on zentorch's kernel."""
    return (
        query.device.type == "cpu"
        and key.dtype == query.dtype
        and query.dtype in _dtypes()
        and not _switch.off
    )


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool = False,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, heads, n_q, dim], k/v [B, kv_heads, n_k, dim] (views are fine); ``mask``
    additive [B or 1, 1, n_q, n_k] in q's dtype, ``causal`` top-left. [B, heads, n_q, dim]."""
    return torch.ops.zentorch.zentorch_sdpa(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale, zentorch_op_name=ZEN_OP_NAME
    )[0]


# Query rows per call where a causal chunk is split (``sdpa_causal``); blocks of 128 took 8.8
# ms and 256 9.3 where 64 took 8.0 (4 chunks of 512, SmolLM2's heads, bf16, Zen 4).
QUERY_BLOCK = 64
# Each block's keys are rounded up to a multiple of this: where a call's key count left a
# ragged tail, zentorch's kernel summed it apart from the whole square's (one bf16 unit in a
# few outputs); whole multiples of 16 and 32 gave its bits in 40 of 40 random shapes.
KEY_BLOCK = 32


def sdpa_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor,
    offset: int,
) -> torch.Tensor:  # fmt: skip
    """``sdpa`` with an additive ``mask`` (``[..., n_q, n_k]``) under which query row i sees no
    key past ``offset + i``: the rows in blocks of ``QUERY_BLOCK``, each over only the keys
    its rows may see. zentorch's kernel computes every score of the square it is given (its
    causal flag saves nothing: 11.1 against 11.4 ms for four causal 512-token chunks); in
    blocks the same chunks took 8.0 ms, and the bits are the same (the keys left out are
    masked ones, whose exp is 0, in whole ``KEY_BLOCK``s; tests/test_zen_attention.py)."""
    n_q, n_k = q.shape[2], k.shape[2]
    if n_q <= 2 * QUERY_BLOCK or offset + QUERY_BLOCK >= n_k:
        return sdpa(q, k, v, scale, mask=mask)
    out = q.new_empty(q.shape)
    for r0 in range(0, n_q, QUERY_BLOCK):
        r1 = min(n_q, r0 + QUERY_BLOCK)
        keys = min(n_k, -(-(offset + r1) // KEY_BLOCK) * KEY_BLOCK)
        out[:, :, r0:r1] = sdpa(q[:, :, r0:r1], k[:, :, :keys], v[:, :, :keys], scale,
                                mask=mask[..., r0:r1, :keys])  # fmt: skip
    return out
