"""Our own forward for the decoder families we serve, over the flat paged batch.

transformers' model classes run one module call per projection, norm and activation, and
rebuild rotary tables, masks and views per layer: at batch 1 on a CPU most of a decode step
is that glue, not the matmuls. For the families below (Llama, SmolLM2 included, Mistral,
Qwen2, Qwen3) the engine runs this forward instead, over the same weights:

* q/k/v and gate/up are one matmul each (the weights concatenated once at load, then packed
  for oneDNN where it pays); the separate weights are dropped, so memory stays what the
  model needs;
* RMSNorm is torch's fused op, the residual add done in place before it (zentorch's fused
  add-and-norm beside packed linears where zentorch loads);
* rotary cos/sin are computed once per step (the model's own rotary module, so every
  scaling type it knows stays exact) and applied to q and k at once;
* SiLU-and-multiply reads the fused gate/up output once;
* in bf16 on AVX-512 the rotation and SiLU-and-multiply are native passes
  (``trae_kernels/cpu_paged.c``) that round where torch's ops round: the same bits;
* logits only for the rows that sample.

The batch is the scheduler's flattened one (decodes first, then prefill chunks); attention
is the engine's backend (``store_kv`` and ``paged_attention``), so int8 KV pages, sliding
windows and every backend work as before. The transformers model object stays: its config,
tokenizer and generation config, its embedding and norms (shared tensors), and placeholders
(``FusedSlice``) where q/k/v/gate/up were, so LoRA adapters still target those names: a
wrapped slice adds its update to its columns of the fused output. Any other architecture
runs through transformers' forward with our attention (``llm_runner``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trae_groups.engine import native_layers
from trae_groups.engine.native_layers import NativeLayers, NativeLayersFailed
from trae_groups.kernels import AttentionBackend, PagedBatch, attention, cpu_native, zen_calls

# the model_type values whose layers this forward implements
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


class FusedSlice(nn.Module):
    """Where a projection fused into a wider one was: its shape and columns, no weight.

    LoRA (``engine/lora.py``) wraps it by name like any linear; the flat forward then adds the
    adapter's update to these columns of the fused output. It is never called itself.
    """

    def __init__(self, in_features: int, start: int, stop: int):
        super().__init__()
        self.in_features = in_features
        self.out_features = stop - start
        self.start, self.stop = start, stop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a fused projection's slice runs inside the flat forward")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, columns={self.start}:{self.stop}"


def _linear_parts(parts: list[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` whose output is the parts' outputs side by side."""
    weight = torch.cat([p.weight.detach() for p in parts])
    biases = [p.bias for p in parts]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat(
            [b.detach() if b is not None else weight.new_zeros(p.out_features)
             for b, p in zip(biases, parts, strict=True)]
        )  # fmt: skip
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    return fused


class _Concat(nn.Module):
    """Parts that cannot be concatenated (quantized linears): called one by one."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def fuse(parent: nn.Module, names: tuple[str, ...]) -> nn.Module:
    """Replace ``parent``'s linears ``names`` by slices of one fused projection; return it."""
    parts = [getattr(parent, n) for n in names]
    same = all(type(p) is nn.Linear for p in parts) and len({p.weight.dtype for p in parts}) == 1
    fused = _linear_parts(parts) if same else _Concat(parts)
    start = 0
    for name, part in zip(names, parts, strict=True):
        setattr(parent, name, FusedSlice(part.in_features, start, start + part.out_features))
        start += part.out_features
    return fused


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``model`` cannot take the flat forward (None: it can)."""
    config = model.config.get_text_config()
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        return f"architecture {kind!r} runs through transformers (flat forward: {FAMILIES})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (the flat forward fuses silu)"
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None or not hasattr(model, "lm_head") or not hasattr(base, "rotary_emb"):
        return "not the usual decoder layout (model.layers, rotary_emb, lm_head)"
    return None


# attend(layer index, q [T, heads, dim], k and v [T, kv_heads, dim], window, scale) -> [T, heads, dim]
Attend = Callable[
    [int, torch.Tensor, torch.Tensor, torch.Tensor, "int | None", float], torch.Tensor
]


@dataclass
class PagedAttend:
    """The eager step's attention: the backend stores each layer's new K/V into its pages
    and attends over the batch's block tables (int8 pages, windows, any backend). The
    native layer loop reads the batch and pages from it."""

    batch: PagedBatch
    kv: object  # the runner's KV pages: .k and .v, one tensor (or QuantKV) per layer
    backend: AttentionBackend

    def __call__(self, layer: int, q, k, v, window: int | None, scale: float, rows=None):
        """Attention [T, heads, dim]; with ``rows`` (flat row indices) that of those rows only,
        every row's K/V stored all the same."""
        k_cache, v_cache = self.kv.k[layer], self.kv.v[layer]
        self.backend.store_kv(k, v, k_cache, v_cache, self.batch.slot_mapping)
        if rows is not None and self.backend.paged_attention is attention.paged_attention:
            out = attention.attend_rows(q, k_cache, v_cache, self.batch, rows, scale, window)
            if out is not None:
                return out
        out = self.backend.paged_attention(q, k, v, k_cache, v_cache, self.batch, scale, window)
        return out if rows is None else out.index_select(0, rows)

    def native_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What the native decode kernel reads for every row of this step, where the
        backend would run the whole step through it (else None)."""
        if self.backend.paged_attention is not attention.paged_attention:
            return None
        return attention.native_rows(self.batch)


paged_attend = PagedAttend  # (batch, kv, backend): the eager step's Attend


@dataclass
class _Layer:
    """One decoder layer's pieces, read from transformers' modules at every step where
    LoRA may wrap them (o_proj, down_proj) and fixed otherwise."""

    block: nn.Module  # the transformers decoder layer (not owned)
    q_size: int
    kv_size: int
    intermediate: int
    window: int | None
    #: Qwen3's q and k norm weights side by side, with the key of the tensors they came from
    head_norm: tuple | None = None


class FlatForward(nn.Module):
    """The forward of a Llama-family decoder over a flat paged batch (module docstring)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        config = model.config.get_text_config()
        self.kind = config.model_type
        base = model.model
        self.heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.eps = config.rms_norm_eps
        self._refs = (model, base)  # a tuple: not registered as submodules (no cycle)
        self.qkv = nn.ModuleList()
        self.gate_up = nn.ModuleList()
        self._layers: list[_Layer] = []
        for block in base.layers:
            attn, mlp = block.self_attn, block.mlp
            qkv = fuse(attn, ("q_proj", "k_proj", "v_proj"))
            gate_up = fuse(mlp, ("gate_proj", "up_proj"))
            self.qkv.append(qkv)
            self.gate_up.append(gate_up)
            window = getattr(attn, "sliding_window", None)
            if self.kind == "mistral":
                window = getattr(config, "sliding_window", None)
            self._layers.append(
                _Layer(
                    block,
                    q_size=self.heads * self.head_dim,
                    kv_size=self.kv_heads * self.head_dim,
                    intermediate=mlp.up_proj.out_features,
                    window=window,
                )
            )  # fmt: skip
        self.scale = self.head_dim**-0.5
        self.zen_norms = False  # set per step: zentorch's norms beside packed linears
        self.native = NativeLayers()  # the layer loop in one native call, where it applies

    @property
    def model(self) -> nn.Module:
        return self._refs[0]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        sample_rows: torch.Tensor | None,
        attend: Attend,
        lora_active: bool = False,
    ) -> torch.Tensor:
        """input_ids, positions [T]; logits [len(sample_rows), vocab] (every row when
        ``sample_rows`` is None), in the model's dtype. ``attend(layer, q, k, v, window,
        scale)`` stores the new K/V and returns attention [T, heads, dim]: the eager
        backend's (``paged_attend``) or a compiled step's."""
        try:
            return self._forward(input_ids, positions, sample_rows, attend, lora_active)
        except NativeLayersFailed:  # logged, and off for this model: the step again in Python
            return self._forward(input_ids, positions, sample_rows, attend, lora_active)

    def _forward(self, input_ids, positions, sample_rows, attend: Attend, lora_active: bool):
        model, base = self._refs
        # A step of one row (a batch-1 decode) runs as two copies of it: zentorch's kernels
        # take a matrix-vector path for one row whose sums round apart from their matrix path
        # (1 of 3,072 gate/up outputs, 7 of 49,152 logits on SmolLM2, bf16 and float32, Zen 4),
        # and from two rows on each row gets the same bits at any count. So a sequence decoded
        # alone, in a batch or verifying proposals picks the same greedy tokens; two rows cost
        # what one does there (memory-bound; tests/test_batch_invariance.py). LoRA rows stay
        # as they are: their adapters are indexed by row.
        padded = input_ids.shape[0] == 1 and not lora_active
        if padded:
            input_ids, positions = input_ids.expand(2), positions.expand(2)
            sample_rows = None if sample_rows is None or sample_rows.numel() else sample_rows
        self.padded = padded
        hidden = base.embed_tokens(input_ids)
        cos, sin = base.rotary_emb(hidden, positions[None])
        cos, sin = cos[0, :, None, :], _signed_sin(sin[0, :, None, :])
        residual = hidden
        rms_norm, add_rms_norm = _norms_for(self.qkv[0])
        self.zen_norms = rms_norm in (_zen_rms_norm, _native_rms_norm)  # the native loop's
        x = rms_norm(hidden, base.layers[0].input_layernorm)
        native = None if lora_active else self.native.run(self, attend, x, residual, cos, sin)
        if native is not None:
            hidden = native
        keep = self._keeps_sampling_rows(attend, sample_rows, input_ids.shape[0], lora_active)
        last = len(self._layers) - 1 if keep else -1
        # the fused projections are read from the module lists: packing replaces them there
        for i, layer in enumerate(self._layers if native is None else ()):
            block, qkv, gate_up = layer.block, self.qkv[i], self.gate_up[i]
            if i:
                x = add_rms_norm(hidden, residual, block.input_layernorm)
            rows = sample_rows if i == last else None
            if rows is not None:
                residual = residual.index_select(0, rows)
                sample_rows = None  # the rows left are those that sample
            hidden = self._attention(i, layer, qkv(x), cos, sin, attend, lora_active, x, rows)
            x = add_rms_norm(hidden, residual, block.post_attention_layernorm)
            hidden = self._mlp(layer, gate_up(x), lora_active, x)
        if sample_rows is None:
            rows = residual.add_(hidden)
        else:
            rows = residual.index_select(0, sample_rows).add_(hidden.index_select(0, sample_rows))
        logits = model.lm_head(rms_norm(rows, base.norm))
        return logits[:1] if padded else logits

    def _keeps_sampling_rows(self, attend: Attend, sample_rows, rows: int, lora_active) -> bool:
        """Whether the step's last layer runs only the rows that sample, past its K/V: they
        are all that reaches the logits (one row of a 512-token chunk that ends its prompt,
        none of one that does not). Kept rows attend as decode rows, so a step with more of
        them than sequences (a prompt's logprobs: each of its rows) keeps the prompt kernel
        for the whole layer; LoRA steps keep every row (adapters are indexed by row), and so
        do a step whose every row samples and the padded batch-1 step."""
        if sample_rows is None or lora_active or self.padded:
            return False
        n = sample_rows.numel()
        return isinstance(attend, PagedAttend) and n < rows and n <= attend.batch.num_seqs

    def _attention(
        self, i, layer: _Layer, qkv, cos, sin, attend: Attend, lora_active, x, rows=None
    ):
        """The attention block's output: every row's, or only ``rows``' (every row's K/V
        stored either way)."""
        attn = layer.block.self_attn
        if lora_active:
            _slice_updates(attn, ("q_proj", "k_proj", "v_proj"), x, qkv)
        q, k, v = self._qkv_heads(layer, qkv, cos, sin)
        if self.padded:  # the copy row is no token: it neither stores K/V nor attends
            out = attend(i, q[:1], k[:1], v[:1], layer.window, self.scale)
            return attn.o_proj(out.reshape(1, layer.q_size).expand(2, -1).contiguous())
        if rows is not None:
            out = attend(i, q, k, v, layer.window, self.scale, rows)
            return attn.o_proj(out.reshape(rows.numel(), layer.q_size))
        out = attend(i, q, k, v, layer.window, self.scale)
        return attn.o_proj(out.reshape(q.shape[0], layer.q_size))

    def _qkv_heads(self, layer: _Layer, qkv, cos, sin):
        """q, k, v [T, heads or kv_heads, dim] of the fused projection's output, q and k
        normed (Qwen3) and rotated."""
        t, d, qk_size = qkv.shape[0], self.head_dim, layer.q_size + layer.kv_size
        v = qkv[:, qk_size:].view(t, self.kv_heads, d)
        qk = qkv[:, :qk_size].view(t, self.heads + self.kv_heads, d)
        if self.kind == "qwen3":  # RMSNorm over each head, before rotary: q's and k's at once
            qk = self._head_norms(layer, layer.block.self_attn, qk)
        qk = _rotate(qk, cos, sin)  # q and k side by side in the fused output: one rotation
        return qk[:, : self.heads], qk[:, self.heads :], v

    def _head_norms(self, layer: _Layer, attn: nn.Module, qk: torch.Tensor) -> torch.Tensor:
        """Qwen3's q_norm over the query heads and k_norm over the key heads of ``qk``
        [T, heads + kv_heads, dim], as one norm without weight and one product with both
        weights side by side (transformers' order: normalized, rounded to the dtype, then
        weighted): in one native pass over the fused output where it is built (a copy, a
        norm and a product took 0.35 s of a 32 x 512-token Qwen3-shaped prefill, Intel Xeon),
        torch's ops otherwise."""
        q_w, k_w = attn.q_norm.weight, attn.k_norm.weight
        eps = attn.q_norm.variance_epsilon
        d = qk.shape[2]
        if torch.compiler.is_compiling():  # traced into the graph, no cache
            weight = _side_by_side(q_w, k_w, self.heads, self.kv_heads)
            return torch.rms_norm(qk, (d,), None, eps) * weight
        weight = self._head_norm_weights(layer, attn)
        normed = cpu_native.head_norms(qk, weight, eps)
        if normed is not None:
            return normed
        return torch.rms_norm(qk, (d,), None, eps).mul_(weight)

    def _head_norm_weights(self, layer: _Layer, attn: nn.Module) -> torch.Tensor:
        """Qwen3's q and k norm weights side by side [heads + kv_heads, dim], built once per
        weights."""
        q_w, k_w = attn.q_norm.weight, attn.k_norm.weight
        key = (q_w.data_ptr(), k_w.data_ptr(), q_w.dtype)
        if layer.head_norm is None or layer.head_norm[0] != key:
            weight = _side_by_side(q_w, k_w, self.heads, self.kv_heads)
            layer.head_norm = (key, weight)
        return layer.head_norm[1]

    def _mlp(self, layer: _Layer, gate_up, lora_active, x):
        mlp = layer.block.mlp
        if lora_active:
            _slice_updates(mlp, ("gate_proj", "up_proj"), x, gate_up)
        n = layer.intermediate
        both = cpu_native.silu_mul(gate_up, n)
        if both is None:
            both = F.silu(gate_up[:, :n]).mul_(gate_up[:, n:])
        return mlp.down_proj(both)


def _side_by_side(q_w: torch.Tensor, k_w: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """[heads + kv_heads, dim]: q's norm weight for each query head, then k's for each key head."""
    return torch.cat((q_w.expand(heads, -1), k_w.expand(kv_heads, -1)))


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    return torch.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


def _add_rms_norm(hidden: torch.Tensor, residual: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """``residual += hidden`` in place, then the norm of it (the next sublayer's input)."""
    residual.add_(hidden)
    return _rms_norm(residual, norm)


def _zen_rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    if x.numel() == 0:  # a step whose prompt chunk samples nothing; the kernel logs an error
        return torch.empty_like(x)
    return zen_calls.rms_norm_op(x, norm.weight, norm.variance_epsilon)


def _zen_add_rms_norm(hidden: torch.Tensor, residual: torch.Tensor, norm: nn.Module):
    """``_add_rms_norm`` in one zentorch kernel: the sum goes to ``residual``, the norm of it
    to ``hidden``'s storage (the sublayer's output, not read again)."""
    zen_calls.add_rms_norm_op(hidden, residual, norm.weight, norm.variance_epsilon)
    return hidden


def _native_rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    out = cpu_native.rms_norm(x, norm.weight, norm.variance_epsilon)
    return _rms_norm(x, norm) if out is None else out


def _native_add_rms_norm(hidden: torch.Tensor, residual: torch.Tensor, norm: nn.Module):
    """``_add_rms_norm`` in one pass of ours (AVX2 builds, float32), leaving the sum and the
    norm where zentorch's fused op leaves them (the native loop binds the same kernel)."""
    out = cpu_native.add_rms_norm(hidden, residual, norm.weight, norm.variance_epsilon)
    return _add_rms_norm(hidden, residual, norm) if out is None else out


def _norms_for(projection: nn.Module) -> tuple[Callable, Callable]:
    """The RMSNorm pair beside these linears: ours in float32 where the linears are packed and
    the kernels are an AVX2 build's (cpu_native.norms: zentorch's took 5.6x their time at 2,048
    rows on a Zen 3 EPYC), else zentorch's where the linears are packed (by zentorch or oneDNN)
    and zentorch loads, torch's otherwise and while compiling (the eager kernels are what was
    measured). zentorch's took 61 norms of a SmolLM2 step in 0.49 against
    1.53 ms at 1 row, 3.7 against 14.6 at 512 (bf16, Zen 4), and 0.32 against 0.84 ms at 2
    rows, 10 against 62 at 2,048 on an Intel Xeon with AMX (bench/zentorch_linear.py)."""
    from trae_groups.engine.fast_linear import PackedLinear, zentorch_available, zentorch_dtypes

    packed = isinstance(projection, PackedLinear) and not torch.compiler.is_compiling()
    if packed and cpu_native.norms(projection.dtype):  # ours, in AVX2 builds: see cpu_paged.c
        return _native_rms_norm, _native_add_rms_norm
    if packed and zentorch_available() and projection.dtype in zentorch_dtypes():
        return _zen_rms_norm, _zen_add_rms_norm
    return _rms_norm, _add_rms_norm


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated, once per step: rotate-half's sign moves from every
    layer's rotation (a pass over q and k) into this [T, 1, dim] table."""
    half = sin.shape[-1] // 2
    return torch.cat((sin[..., :half].neg(), sin[..., half:]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half form (transformers' ``apply_rotary_pos_emb``), exactly:
    rotate_half(x) * sin == cat(x2, x1) * ``_signed_sin(sin)``. x [T, heads, dim]; cos and
    signed_sin [T, 1, dim]. In bf16 or float32 on AVX-512 one native pass gives the same bits."""
    rotated = cpu_native.rotate(x, cos, signed_sin)
    if rotated is not None:
        return rotated
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin)


def _slice_updates(parent: nn.Module, names: tuple[str, ...], x, fused_out) -> None:
    """Add each LoRA-wrapped slice's update to its columns of the fused output, in place."""
    for name in names:
        part = getattr(parent, name)
        base = getattr(part, "base_layer", None)
        if isinstance(base, FusedSlice):
            part.add_update(x, fused_out[:, base.start : base.stop])


def flat_forward_of(model: nn.Module) -> FlatForward | None:
    """The model's flat forward, if it runs on one."""
    flat = getattr(model, "trae_flat", None)
    return flat if isinstance(flat, FlatForward) else None


def forward_path(model: nn.Module) -> str:
    """Which forward runs a causal LM, and why, and which library packs its linears, for
    ``trae model info`` and logs."""
    from trae_groups.engine.fast_linear import PackedLinear

    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    libraries = sorted({m.library for m in linears})
    packed = f"; linears: {'+'.join(libraries)}" if libraries else ""
    widened = sorted({m.widening() for m in linears if m.widened})
    packed += f" ({'; '.join(widened)})" if widened else ""
    flat = flat_forward_of(model)
    if flat is not None:
        native = "; layer loop: native" if native_layers.takes_model(flat) else ""
        return "trae (fused projections)" + packed + native
    reason = unsupported_reason(model)
    return "transformers" + (f": {reason}" if reason else "") + packed
