"""int8 linears: per-channel int8 weights, int8 activations quantized per call (dynamic).

Why this op and not another (measured with bench/memory.py and a per-shape sweep on this
AVX-512 VNNI CPU, SmolLM2-135M shapes, 2 threads): torch's own ``quantized::linear_dynamic``
(fbgemm, VNNI dot products) ran the 576x49152 lm_head in 0.8 ms at batch 1 where oneDNN's
packed float32 took 4.9 ms and packed bf16 2.2 ms, and stayed level with packed bf16 on the
small per-layer shapes at batch 1 and 32. Weight-only int8 (``aten._weight_int8pack_mm``, what
torchao's int8 weight-only config calls on CPU) was as fast at batch 1 but 8x slower than bf16
at batch 32; torchao 0.18's tensor-subclass configs added ~0.3-0.5 ms of dispatch per call and
took 20-40 ms for the lm_head. oneDNN's ``qlinear_pointwise`` with activations quantized in
Python was 1.5-2x slower than fbgemm. So: no new dependency, torch's op.

The module is a drop-in for ``nn.Linear``/``PackedLinear`` (any leading shape, float32 in and
out; a LoRA wrapper calls ``base(x)``). Its int8 weight and bias are found by the weight
store's per-module tensor walk (``_packed_params._weight_bias()``, the same attribute torch.ao's
dynamic linears expose), so their bytes are counted like any other.

torch marks quantized tensors as deprecated (a warning at creation) but the ops are still the
fastest int8 path in torch 2.13; if they go, this module is the one place to change.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

__all__ = [
    "LLM_KEEP_FLOAT", "Int8Linear", "int8_available", "needs_reduced_range", "quantize_linears"
]  # fmt: skip


def int8_available() -> bool:
    """Whether torch's int8 dynamic linear kernels (fbgemm/x86) are built in."""
    return any(e in torch.backends.quantized.supported_engines for e in ("x86", "fbgemm"))


def needs_reduced_range() -> bool:
    """Whether activations must be 7-bit here: without VNNI (AVX2 only, as on an EPYC of the
    Zen 3 generation) the kernel's u8 x s8 pairs sum in saturating 16-bit lanes, and full
    8-bit activations put a 64-wide linear's output 12-36% off where 7 bits keep it at 1-2%."""
    from trae_groups.engine.hardware import detect

    return not detect("cpu").int8_dot


class _Packed:
    """What the weight store reads: ``_weight_bias()`` gives the int8 weight and the bias."""

    def __init__(self, packed: torch.ScriptObject) -> None:
        self.packed = packed

    def _weight_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.ops.quantized.linear_unpack(self.packed)


def quantize_weight(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric per-output-channel int8: scale = max |w| of the row / 127."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    zero = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation notice for quantized tensors
        return torch.quantize_per_channel(w, scale.double(), zero, 0, torch.qint8)


class Int8Linear(nn.Module):
    """``y = x @ W.T + b`` with W in int8 (per-channel scales) and x quantized per call.

    ``reduce_range`` uses 7-bit activations, which CPUs without VNNI need to avoid overflow
    in their 16-bit intermediate sums; with VNNI full 8 bits are exact and more accurate.
    ``None`` (the default) chooses by the CPU (``needs_reduced_range``).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        reduce_range: bool | None = None,
    ) -> None:
        super().__init__()
        if weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError("Int8Linear needs a 2-D CPU weight")
        self.out_features, self.in_features = weight.shape
        self.reduce_range = needs_reduced_range() if reduce_range is None else reduce_range
        b = None if bias is None else bias.detach().float().contiguous()
        self._packed_params = _Packed(
            torch.ops.quantized.linear_prepack(quantize_weight(weight), b)
        )

    @classmethod
    def from_linear(cls, linear: nn.Module, reduce_range: bool | None = None) -> Int8Linear:
        """From an ``nn.Linear`` (its weight is read, not modified)."""
        return cls(linear.weight, linear.bias, reduce_range)

    def held_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The int8 weight and the bias, for the byte count (the ``held_tensors`` hook of
        engine/memory.py): fbgemm keeps them packed, outside parameters and buffers."""
        weight, bias = self._packed_params._weight_bias()
        return [("weight", weight)] + ([("bias", bias)] if bias is not None else [])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"Int8Linear takes float32 activations, got {x.dtype}")
        if x.dim() == 1:  # nn.Linear takes a single vector; the kernel wants rows
            return self.forward(x[None])[0]
        return torch.ops.quantized.linear_dynamic(x, self._packed_params.packed, self.reduce_range)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"reduce_range={self.reduce_range}"
        )


# Decoder MLPs stay float (Llama/Qwen/Mistral, GPT-2, OPT/Phi, GPT-NeoX, Mixtral experts).
# The input of their output projection carries the few huge "outlier" features LLM.int8()
# describes, which one activation scale per call flattens, and the error grows with the tokens
# that share a call: on SmolLM2-135M, a 131-token text in one forward went from perplexity
# 19.3 to 32 with every linear int8, to 22.2 (+15%) with only down_proj float and to 19.0
# (-1.5%) with the whole MLP float. The int8 layers left (attention projections and the
# lm_head, the largest single matmul) are where most of the batch-1 time went.
LLM_KEEP_FLOAT = (
    "gate_proj", "up_proj", "down_proj",  # Llama family
    "c_fc", "c_proj",  # GPT-2 (its attention output projection is also c_proj: kept too)
    "fc1", "fc2", "dense_h_to_4h", "dense_4h_to_h", "w1", "w2", "w3",
)  # fmt: skip


def quantize_linears(
    model: nn.Module, keep_float: tuple[str, ...] = (), reduce_range: bool | None = None
) -> int:
    """Replace every plain ``nn.Linear`` of ``model`` with an ``Int8Linear``, except those
    registered under a name in ``keep_float``; return how many were replaced.

    Exact type only (a LoRA or other subclass keeps its own forward). A tied lm_head gets its
    own int8 copy while the input embedding keeps the float tensor; a Linear registered under
    two parents is converted once.
    """
    if reduce_range is None:  # once for the model, not per linear
        reduce_range = needs_reduced_range()
    done: dict[int, Int8Linear] = {}
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent._modules.items()  # _modules: a second registration too
        if type(child) is nn.Linear and child.weight.device.type == "cpu"
        and name not in keep_float
    ]  # fmt: skip
    for parent, name, child in targets:
        if id(child) not in done:
            done[id(child)] = Int8Linear.from_linear(child, reduce_range)
        setattr(parent, name, done[id(child)])
    return len(done)
