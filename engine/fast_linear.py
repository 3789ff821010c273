"""oneDNN pre-packed linears: the fastest matmul path this CPU offers.

torch's ``nn.Linear`` goes through MKL, which on these AMD cores reaches well under half of what
oneDNN gets from a weight reordered once into its blocked layout (the path torch.compile's
freezing uses). Measured with bench/linear.py on the benchmark model's 57 matmuls per decode
step: ~1.6-1.8x faster at batch 1, ~2x at batch 32 (lm_head 2.2-2.7x), logits within float
rounding of the plain path. Packing is for inference only: the packed weight is an
opaque mkldnn tensor (no ``state_dict``, no ``.to()``, no autograd), so pack after loading and keep
an unpacked instance where a reference path is needed.

Contention caveat: oneDNN opens an OpenMP region per matmul. With OpenMP's default spin-waiting,
a batch-1 step of ~56 small matmuls on 2 shared, oversubscribed cores measured 3-30x slower than
uncontended (MKL suffered far less); ``OMP_WAIT_POLICY=PASSIVE`` in the environment before torch
loads kept it at MKL's level or better. Uncontended, packed wins on whole decode steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trae_groups.engine.config import LINEAR_LIBRARIES
from trae_groups.engine.hardware import cpu_vendor, detect
from trae_groups.kernels import onednn_calls, zen_calls

__all__ = [
    "DEFAULT_BATCH_HINT",
    "LINEAR_LIBRARIES",
    "PackedLinear",
    "fast_linear_available",
    "linear_library",
    "lower_packed_linear",
    "pack_linears",
    "packable_dtypes",
    "widened_dtypes",
    "zentorch_available",
]

# The reorder takes an optional batch-size hint that picks the blocked layout. The packed weight
# works for any number of rows; the hint only changes speed. Measured on decode shapes
# (bench/linear.py --hints): hint 1 (a GEMV layout) is 1.2-2x slower for every T > 1, no hint is
# fine for T <= 64 but ~1.8x slower on the 512x32000 lm_head at T = 512, and hints 8..512 are
# within noise of each other everywhere from T = 1 to 512. 32 (a full decode batch) sits there.
DEFAULT_BATCH_HINT = 32

# From this many rows on, a bf16/fp16 linear runs in float32 on an upcast copy of its plain
# weight: on CPUs without AMX, oneDNN's bf16 matmul reaches ~170-185 GFLOP/s where its float32
# one reaches ~320-340 (Xeon with AVX512-BF16, SmolLM2's shapes, bench/linear.py --upcast),
# and the upcast (weight and rows) costs less than the difference from ~64-96 rows on: at 128
# rows 111 against 160 ms for the model's 120 linears, at 256 rows 190 against 284. Fewer rows
# (decode steps) stay on the packed bf16 weight, which is twice as fast as anything else there.
# Accumulation is float32 either way; the output is rounded to the model's dtype as before.
# The cost: the plain weight is held beside the packed one (twice the weight memory, counted
# in the weight store), so it is done only where it pays (upcast_pays): not on CPUs with AMX,
# and not on AMD's AVX512-BF16 (Zen 4), where the upcast took 4.8x bf16's time at 128 rows.
UPCAST_ROWS = 96

# zentorch against oneDNN (bench/zentorch_linear.py, an AVX2-only EPYC of the Zen 3
# generation, SmolLM2's 121 float32 linears of one step, 2 threads): 0.72-0.78x oneDNN's time
# at 1 row, 0.75x at 8, 0.87-0.91x at 32, but 1.06-1.08x at 128 and 1.27x at 512 (prefill
# chunks). Each weight is held once, prepacked by one library: keeping both layouts to pick
# per row count would double the weights' memory (and zentorch on a plain weight caches a
# reordered copy of it by itself, the same doubling, unseen by our accounting). Decode is
# most of what a server does, so "auto" takes one library for every row count, per dtype
# (_zentorch_by_default).


def fast_linear_available() -> bool:
    """Whether torch was built with oneDNN and can run it here (a CPU build is enough)."""
    return bool(torch.backends.mkldnn.is_available())


def widened_dtypes() -> frozenset[torch.dtype]:
    """Half-precision weight dtypes oneDNN cannot pack here, whose linears multiply in float32
    instead (``PackedLinear``'s ``weight_dtype``): a bf16 model on a CPU without AVX512-BF16
    or AMX. Its bf16 matmul there is oneDNN's reference one (~0.01-0.02 TFLOP/s on a Zen 3
    EPYC, a 32 x 100 SmolLM2 run 27.5 tok/s, level with vLLM's bf16); the float32 product of
    the widened rows and weights, rounded to bf16 once, is what a bf16 matmul computes, in
    another order. bf16 weights stay bf16 where our AVX2 panels read them
    (``onednn_calls.bf16_panels``); others are held as float32 copies, twice their size."""
    packable = packable_dtypes()
    if torch.float32 not in packable:
        return frozenset()
    return frozenset({torch.bfloat16, torch.float16}) - packable


def packable_dtypes() -> frozenset[torch.dtype]:
    """Weight dtypes oneDNN can pack on this CPU; others stay plain ``nn.Linear``.

    float32 always; bfloat16 needs avx512_bf16/AMX, float16 needs avx512_fp16 or avx_ne_convert.
    """
    if not fast_linear_available():
        return frozenset()
    dtypes = {torch.float32}
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        dtypes.add(torch.bfloat16)
    if torch.ops.mkldnn._is_mkldnn_fp16_supported():
        dtypes.add(torch.float16)
    return frozenset(dtypes)


_zentorch: bool | None = None


def zentorch_available() -> bool:
    """Whether AMD's zentorch kernels load here (they register ``torch.ops.zentorch``).

    Only the package's op library is loaded (12 ms): ``import zentorch`` takes ~4.7 s, most of
    it torch's inductor, for compile passes the engine does not use.
    """
    global _zentorch
    if _zentorch is None:
        _zentorch = _load_zentorch_ops()
    return _zentorch


def zentorch_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes zentorch packs here: float32, and bf16 where the CPU has AVX512-BF16
    (Zen 4: 0.77x oneDNN's bf16 time at 1 row, 0.89x at 32, 0.95x at 128, level at 512,
    bench/zentorch_linear.py). Others stay on oneDNN."""
    if detect("cpu").bf16_math:
        return (torch.float32, torch.bfloat16)
    return (torch.float32,)


def _load_zentorch_ops() -> bool:
    import importlib.util
    from pathlib import Path

    try:
        spec = importlib.util.find_spec("zentorch")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return False
    try:
        for library in sorted(Path(spec.submodule_search_locations[0]).glob("_C.*.so")):
            torch.ops.load_library(str(library))
        if not hasattr(torch.ops.zentorch, "zentorch_linear_unary"):
            import zentorch  # noqa: F401  (a layout without the bare library: the full import)
        return hasattr(torch.ops.zentorch, "zentorch_linear_unary")
    except Exception:  # a wheel built for another torch, or a CPU it does not support
        return False


def linear_library(choice: str = "auto", dtype: torch.dtype = torch.float32) -> str:
    """ "onednn" or "zentorch": what ``choice`` (one of LINEAR_LIBRARIES) means on this host
    for a model whose weights are ``dtype``."""
    if choice not in LINEAR_LIBRARIES:
        raise ValueError(f"linear_library: must be one of {list(LINEAR_LIBRARIES)}, got {choice!r}")
    if choice == "zentorch" and not zentorch_available():
        raise ValueError(
            "linear_library: 'zentorch' is not installed (pip install 'trae-groups[zen]')"
        )
    if choice == "auto":
        amd = cpu_vendor() == "AuthenticAMD"
        takes = dtype in _zentorch_by_default() and dtype in zentorch_dtypes()
        return "zentorch" if amd and takes and zentorch_available() else "onednn"
    return choice


def _zentorch_by_default() -> frozenset[torch.dtype]:
    """The weight dtypes ``auto`` gives zentorch on an AMD CPU where it loads, as measured
    (bench/zentorch_linear.py, a SmolLM2 step's linears, 2 threads):

    - with AVX-512, bf16 only: zentorch's bf16 took 0.77x oneDNN's time at 1 row, 0.89x at 32
      (Zen 4) and 0.85x, 0.92x (Zen 5); its float32 1.32x oneDNN's at 32 rows, level at 1 and
      2,048 (Zen 5: a 32 x 100 float32 run 3.6 s against 4.1-4.3 s on zentorch);
    - with AVX2 and FMA only, none where our panels over oneDNN's layout run (``_avx2_panels``),
      else float32 (zentorch 0.72-0.78x oneDNN's time at 1 row on Zen 3)."""
    if _avx2_panels():
        return frozenset()
    if detect("cpu").avx512:
        return frozenset({torch.bfloat16})
    return frozenset({torch.float32})


def _avx2_panels() -> bool:
    """Whether float32 rows run on our own AVX2 panels over oneDNN's layout here (a CPU with
    AVX2 and no AVX-512: onednn_calls.c), decode and prompt rows alike. On an EPYC of the Zen 3
    generation a SmolLM2 step's 121 float32 linears took 21.3 against zentorch's ~26 ms at 1
    row and 80 against 82 at 32, oneDNN's prefill rows were ~8% faster than zentorch's (2,048
    rows) and the panels' 0.92x oneDNN's time there, so oneDNN packs."""
    return not detect("cpu").avx512 and onednn_calls.own_rows_limit(torch.float32) > 0


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` on a weight reordered once for oneDNN (or for zentorch: ``library``).

    Accepts any leading shape (``[T, in]``, ``[1, T, in]``, ``[B, T, in]``) and any row count:
    the engine flattens a varying batch of sequences into one row dimension.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        batch_hint: int | None = DEFAULT_BATCH_HINT,
        upcast_large: bool = True,
        library: str = "onednn",
    ) -> None:
        super().__init__()
        if weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError("PackedLinear needs a 2-D CPU weight")
        widened = weight.dtype in widened_dtypes()
        if weight.dtype not in packable_dtypes() and not widened:
            raise TypeError(f"oneDNN cannot pack {weight.dtype} weights on this CPU")
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype  # what goes in and comes out
        # what is packed and multiplied: float32 for a widened half-precision weight
        self.weight_dtype = torch.float32 if widened else weight.dtype
        self.batch_hint = batch_hint
        # a widened bf16 weight stays bf16 where our AVX2 panels read it: half the bytes of a
        # float32 copy, the same product (onednn_calls.bf16_panels)
        self.bf16_panels = (
            widened and weight.dtype == torch.bfloat16
            and onednn_calls.bf16_panels_take(self.out_features)
        )  # fmt: skip
        self.library = (
            "zentorch"
            if library == "zentorch" and self.weight_dtype in zentorch_dtypes()
            and zentorch_available() and not self.bf16_panels
            else "onednn"
        )  # fmt: skip
        # A plain attribute, not a buffer: an mkldnn tensor breaks state_dict, .to() and hooks
        # that iterate buffers. The original weight is not kept, so packing costs no extra memory
        # unless someone else (a tied embedding) still holds it. zentorch's prepacked weight is
        # a dense tensor in its own blocked order, held the same way.
        if self.bf16_panels:
            self.packed_weight = onednn_calls.bf16_panels_of(weight)
        else:
            source = weight.detach().to(self.weight_dtype).contiguous()
            if self.library == "zentorch":
                prepack = torch.ops.zentorch.zentorch_weight_prepack_for_linear
                self.packed_weight = prepack(source)
            else:
                self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(source, batch_hint)
        # Half-precision weights keep their plain tensor too (a view of the mapped file where
        # the dtype on disk is the served one): large row counts multiply in float32 from it.
        self.plain_weight = (
            weight.detach()
            if self.weight_dtype in (torch.bfloat16, torch.float16) and upcast_large
            else None
        )  # fmt: skip
        self._own_rows: onednn_calls.OwnRows | bool | None = False  # False: not looked up yet
        # The bias stays a dense tensor (the op takes it as is); a buffer so .to()/state_dict see it.
        self.register_buffer(
            "bias", None if bias is None else bias.detach().to(self.weight_dtype).contiguous()
        )

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, batch_hint: int | None = DEFAULT_BATCH_HINT
    ) -> PackedLinear:
        """Pack an existing ``nn.Linear`` (its weight is read, not modified)."""
        return cls(linear.weight, linear.bias, batch_hint)

    @property
    def widened(self) -> bool:
        """Whether a half-precision weight is held and multiplied as float32 (widened_dtypes)."""
        return self.weight_dtype != self.dtype

    def widening(self) -> str:
        """How a widened weight is held, for ``trae model info``."""
        name = str(self.dtype).removeprefix("torch.")
        if self.bf16_panels:
            return f"{name} weights on our AVX2 panels, summed in float32"
        return f"{name} weights held as float32"

    def held_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The packed weight, for memory accounting (engine/memory.py): it is no buffer."""
        held = [("packed_weight", self.packed_weight)]
        if self.plain_weight is not None:
            held.append(("plain_weight", self.plain_weight))
        return held

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compiling = torch.compiler.is_compiling()
        if not compiling and x.dtype != self.dtype:
            raise TypeError(f"PackedLinear holds {self.dtype} weights but got {x.dtype} input")
        if self.bf16_panels:  # bf16 rows in and out, float32 sums (onednn_calls.bf16_panels)
            rows = x.reshape(-1, self.in_features)
            multiply = torch.ops.trae.bf16_panels if compiling else onednn_calls.bf16_panels
            out = multiply(rows, self.packed_weight, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        if self.widened:  # float32 rows, the product rounded back once
            return self._multiply(x.to(self.weight_dtype), compiling).to(self.dtype)
        return self._multiply(x, compiling)

    def _multiply(self, x: torch.Tensor, compiling: bool) -> torch.Tensor:
        """``x @ W.T + b`` with x already in ``weight_dtype``."""
        if self.library == "zentorch":
            if x.numel() == 0:  # the kernel logs an error on an empty input
                return x.new_empty((*x.shape[:-1], self.out_features))
            # its C shim (the dispatcher op leaks, trae_kernels/zen_calls.py); the dispatcher
            # op is traced as is when compiling: lower_packed_linear loads its meta functions
            return zen_calls.linear_op(x, self.packed_weight, self.bias, shim=not compiling)
        if compiling:  # see lower_packed_linear
            return torch.ops.trae.packed_linear(x, self.packed_weight, self.bias, self.out_features)
        rows = x.numel() // self.in_features
        if self.plain_weight is not None and rows >= UPCAST_ROWS:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.plain_weight.float(), bias).to(self.dtype)
        own = self._own_rows
        if own is False:
            own = self._own_rows = onednn_calls.own_rows(self.packed_weight)
        if own is not None and 0 < rows <= own.max_rows and x.is_contiguous():
            out = own(x.view(rows, self.in_features), self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, dtype={self.dtype}, "
            f"weight_dtype={self.weight_dtype}, batch_hint={self.batch_hint}, "
            f"library={self.library}"
        )


# For torch.compile: inductor's own lowering of ``mkldnn._linear_pointwise`` asserts that the
# weight is a constant it packed itself (freezing), so a graph traces the packed matmul as this
# op instead. Left as a custom op, every call would cross into Python (~11 us more than the
# mkldnn op, 211 calls per SmolLM2 step); ``lower_packed_linear`` makes inductor emit the mkldnn
# op itself as an extern call in the generated code. Eager calls the mkldnn op directly.
@torch.library.custom_op("trae::packed_linear", mutates_args=())
def _packed_linear_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@_packed_linear_op.register_fake
def _(x, weight, bias, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.custom_op("trae::bf16_panels", mutates_args=())
def _bf16_panels_op(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The bf16 panels as an op a compiled graph calls (eager calls them directly)."""
    return onednn_calls.bf16_panels(x, panels, bias)


@_bf16_panels_op.register_fake
def _(x, panels, bias):
    return x.new_empty((x.shape[0], panels.shape[0] * onednn_calls.PANEL))


_lowered = False


def lower_packed_linear() -> None:
    """Teach inductor to compile ``trae::packed_linear`` into a direct call of
    ``mkldnn._linear_pointwise`` (no Python per call). Once per process; only our op's lowering
    is added, inductor's own ones are untouched. Imports inductor, so call it only when compiling.
    """
    global _lowered
    if _zentorch:  # its ops' meta functions, for tracing, come with the full package (once)
        import zentorch  # noqa: F401
    if _lowered:
        return
    from torch._inductor.lowering import fallback_handler, register_lowering

    mkldnn_call = fallback_handler(
        torch.ops.mkldnn._linear_pointwise.default, add_to_fallback_set=False
    )

    @register_lowering(torch.ops.trae.packed_linear.default, type_promotion_kind=None)
    def _lower(x, weight, bias, out_features):
        return mkldnn_call(x, weight, bias, "none", [], "")

    _lowered = True


def _packable(module: nn.Module, dtypes: frozenset[torch.dtype]) -> bool:
    # Exact type only: subclasses (LoRA, quantised, parallel linears) override forward and must
    # keep it. Meta or non-CPU weights (not loaded, or on an accelerator) are left alone.
    return (
        type(module) is nn.Linear
        and module.weight.device.type == "cpu"
        and module.weight.dtype in dtypes
    )


def upcast_pays() -> bool:
    """Whether large half-precision row counts should multiply in float32 (UPCAST_ROWS):
    where bf16 matmuls run at about half the float32 rate (Intel without AMX). With AMX, or
    AVX512-BF16 on AMD, bf16 is the fast path and no plain copy of the weight is kept."""
    return not detect("cpu").bf16_matmul_outruns_float32


def pack_linears(
    model: nn.Module,
    batch_hint: int | None = DEFAULT_BATCH_HINT,
    upcast_large: bool | None = None,
    library: str = "onednn",
) -> int:
    """Replace every plain ``nn.Linear`` in ``model`` with a ``PackedLinear``; return how many.

    Covers the lm_head. A tied lm_head gets its own packed copy while the input embedding keeps
    the original tensor, so embedding lookups are unaffected (the tie is broken: packing is the
    last step before inference). A Linear shared by several parents is packed once.
    ``upcast_large`` (default: ``upcast_pays()``) keeps half-precision weights' plain tensors
    for the float32 path of large row counts: twice the weight memory for them. Call
    ``torch.set_num_threads`` before this (oneDNN and MKL share one pool). Returns 0 where oneDNN
    is unavailable, leaving the model as it was. ``library`` "zentorch" (as resolved by
    ``linear_library``) prepacks float32 weights for zentorch instead of oneDNN.
    """
    dtypes = packable_dtypes() | widened_dtypes()
    if not dtypes:
        return 0
    upcast = upcast_pays() if upcast_large is None else upcast_large
    packed: dict[int, PackedLinear] = {}
    targets = [
        (parent, name, child)
        for parent in model.modules()
        # _modules, not named_children(): the latter hides a module's second registration.
        for name, child in parent._modules.items()
        if child is not None and _packable(child, dtypes)
    ]
    for parent, name, child in targets:
        if id(child) not in packed:
            packed[id(child)] = PackedLinear(child.weight, child.bias, batch_hint, upcast, library)
        setattr(parent, name, packed[id(child)])
    return len(packed)
