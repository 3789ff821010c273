"""Runs a causal LM's steps over our paged KV memory.

On CPU a model of a family ``engine/flat_forward.py`` implements (Llama, Mistral, Qwen2,
Qwen3) runs on that forward (``prepare_forward`` fuses and packs it at load). Any other
model runs transformers' own class, loaded with ``attn_implementation="trae_paged"``, an
attention function registered with transformers' ``AttentionInterface``. Either way each
step is one forward over the flattened batch (decodes first, then prefill chunks); the
step's attention inputs reach every layer explicitly (never a global), and logits are
computed only at the rows that sample.

Optionally (``EngineConfig(compile=True)``, CPU) steps that are decodes only run through
``CompiledDecode``: the same forward under torch.compile, the batch padded up to one of a
few fixed sizes compiled at start-up, attention as one custom op
(``torch.ops.trae.compiled_decode_attention``), the packed linears as direct oneDNN calls.
Every other step (prefill chunks, mixed steps, batches above the largest size) runs eagerly.
"""

from __future__ import annotations

import logging
import time
import types
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from trae_groups.engine.decode_graphs import DecodeGraphs, GraphStep, cuda_capture, decode_rows
from trae_groups.engine.fast_linear import (
    fast_linear_available,
    linear_library,
    lower_packed_linear,
    pack_linears,
)
from trae_groups.engine.flat_forward import (
    Attend,
    FlatForward,
    flat_forward_of,
    paged_attend,
    unsupported_reason,
)
from trae_groups.engine.lora import LoraSlots, lora_rows
from trae_groups.engine.memory_pool import KVLayout, KVView
from trae_groups.engine.prompt_logprobs import PromptSpan, positions_to_score
from trae_groups.engine.scheduler import SchedulerOutput
from trae_groups.kernels import AttentionBackend, PagedBatch
from trae_groups.kernels.compiled_decode_attention import decode_mask
from trae_groups.kernels.lora import LoraRows

ATTN_NAME = "trae_paged"
log = logging.getLogger("trae_groups.engine")


@dataclass
class StepContext:
    """What one forward's attention layers need; an explicit argument, never global."""

    batch: PagedBatch
    kv: KVView
    backend: AttentionBackend


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [1, heads, T, dim], key/value
    [1, kv_heads, T, dim] with RoPE applied; returns [1, T, heads, dim]."""
    ctx: StepContext | DecodeInputs | GraphStep | None = kwargs.get("trae_step")
    if isinstance(ctx, DecodeInputs):
        return _compiled_decode_attention(module, query, key, value, scaling, kwargs, ctx)
    if isinstance(ctx, GraphStep):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = ctx.attention(
            module.layer_idx,
            query[0].transpose(0, 1),
            key[0].transpose(0, 1),
            value[0].transpose(0, 1),
            scale,
            kwargs.get("sliding_window"),
        )
        return out.unsqueeze(0), None
    if ctx is None:
        raise RuntimeError(
            "this model runs on trae-groups' paged attention; call it through LLMRunner"
        )
    layer = module.layer_idx
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    k_cache, v_cache = ctx.kv.k[layer], ctx.kv.v[layer]
    ctx.backend.store_kv(k, v, k_cache, v_cache, ctx.batch.slot_mapping)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = ctx.backend.paged_attention(
        q, k, v, k_cache, v_cache, ctx.batch, scale, kwargs.get("sliding_window")
    )
    return out.unsqueeze(0), None


class DecodeInputs(NamedTuple):
    """A compiled decode step's attention inputs: tensors only, so the compiler can guard
    on them. Rows past the real batch are padding (slot -1, context length 0)."""

    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, width >= 2]
    context_lens: torch.Tensor  # [B]
    num_real: torch.Tensor  # [1]: rows before the padding


def _compiled_decode_attention(module, query, key, value, scaling, kwargs, d: DecodeInputs):
    """transformers' attention signature over a compiled decode step's inputs."""
    q = query[0].transpose(0, 1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = _compiled_attend(d)(
        module.layer_idx,
        q,
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        kwargs.get("sliding_window"),
        scale,
    )
    return out.unsqueeze(0), None


def _compiled_attend(d: DecodeInputs) -> Attend:
    """A compiled decode step's attention (our flat forward calls it directly): index math
    and mask in the graph (inductor fuses them); the op only stores, gathers and attends."""

    def attend(layer: int, q, k, v, window: int | None, scale: float) -> torch.Tensor:
        k_cache, v_cache = d.k_caches[layer], d.v_caches[layer]
        page = k_cache.shape[1]
        mask = decode_mask(d.context_lens, d.block_tables.shape[1] * page, window)
        return torch.ops.trae.compiled_decode_attention(
            q, k, v, k_cache, v_cache, d.slot_mapping // page, d.slot_mapping % page,
            d.block_tables, mask, d.context_lens, window or 0, d.num_real, scale,
        )  # fmt: skip

    return attend


AttentionInterface.register(ATTN_NAME, paged_attention_forward)


def kv_layout(config, dtype: torch.dtype, storage: torch.dtype | None = None) -> KVLayout:
    """The KV shape a decoder config implies (text config for multimodal wrappers);
    ``storage``: a quantized dtype the pages hold instead of ``dtype``."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return KVLayout(config.num_hidden_layers, kv_heads, head_dim, dtype, storage)


def activation_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype a model's hidden states (and so its K/V) have: its input embedding's.
    Linears may hold something else (int8) and still take and return this."""
    return model.get_input_embeddings().weight.dtype


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    sample_rows: torch.Tensor  # rows of T whose logits are needed
    batch: PagedBatch
    lora: LoraRows | None = None  # each row's adapter slot; None: every row is the base's
    scored: list[PromptSpan] = field(default_factory=list)  # prompt positions scored
    picks: torch.Tensor | None = None  # the sampling rows' logits (None: every row samples)

    def sampling_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits of the rows that sample, out of every row that kept logits."""
        return logits if self.picks is None else logits[self.picks.to(logits.device)]


# Inductor options of the compiled decode. The generated wrapper would check every extern
# result's size and stride in Python (two checks per linear, ~450 a SmolLM2 step) where our ops'
# fake kernels already fix both. Emulating eager's rounding of bf16 intermediates keeps compiled
# bf16 logits next to eager's (max difference 0.63 -> 0.19 on SmolLM2, batch 16), same speed.
_INDUCTOR = {"size_asserts": False, "alignment_asserts": False, "emulate_precision_casts": True}


class CompiledDecode:
    """Decode-only steps through torch.compile, one graph per padded batch size.

    The batch (n one-token sequences) is padded to the smallest of ``sizes`` that holds it;
    the block table's width is the one dynamic dimension (at least 2 columns: dynamo
    specialises a size of 1). Compiled at start-up by ``warm_up`` with padding-only batches,
    which touch no page. Inductor's FX graph and AOT caches (on by default, under
    ``TORCHINDUCTOR_CACHE_DIR``) make a restart with the same model and torch cheaper;
    dynamo still traces each size again.
    """

    def __init__(self, model: torch.nn.Module, kv: KVView, sizes: tuple[int, ...]):
        self.model = model
        self.flat = flat_forward_of(model)  # our forward, or transformers' (None)
        self.kv = kv
        self.sizes = sorted(set(sizes))
        self.compile_s = 0.0
        self.steps = 0  # decode steps that ran compiled
        # dynamo keeps its compiled graphs on the code object: give each instance its own,
        # so models (and engines) do not share one list of entries and one recompile limit
        forward = types.FunctionType(
            CompiledDecode._forward.__code__.replace(), CompiledDecode._forward.__globals__
        )
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, 2 * len(self.sizes))
        lower_packed_linear()
        self._fn = torch.compile(
            types.MethodType(forward, self), dynamic=False, fullgraph=True, options=_INDUCTOR
        )

    def _forward(self, input_ids, position_ids, decode: DecodeInputs) -> torch.Tensor:
        if self.flat is not None:
            return self.flat(input_ids[0], position_ids[0], None, _compiled_attend(decode))
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=0,
            trae_step=decode,
        )
        return out.logits[0]

    def size_for(self, inputs: ModelInputs) -> int | None:
        """The padded size for a decode-only step, or None: run it eagerly."""
        n = decode_rows(inputs)
        return None if n is None else next((size for size in self.sizes if size >= n), None)

    def run(self, inputs: ModelInputs, size: int) -> torch.Tensor:
        """Logits [n, vocab] (float32) of a decode-only step padded to ``size``."""
        batch = inputs.batch
        pad = size - batch.num_seqs
        tables = batch.block_tables
        tables = F.pad(tables, (0, max(0, 2 - tables.shape[1]), 0, pad))
        logits = self._call(
            F.pad(inputs.input_ids, (0, pad)),
            F.pad(inputs.position_ids, (0, pad)),
            F.pad(batch.slot_mapping, (0, pad), value=-1),
            tables,
            F.pad(batch.context_lens_t, (0, pad)),
            torch.tensor([batch.num_seqs]),
        )
        self.steps += 1
        return logits[: batch.num_seqs].float()

    def _call(self, ids, positions, slots, tables, lens, real) -> torch.Tensor:
        # Dynamo's guard check costs ~0.2-1 ms a SmolLM2 step (~500 tensor guards). Skipping
        # it (set_stance(skip_guard_eval_unsafe=True)) would flip a process-wide stance: a
        # model compiling on another thread meanwhile would fail, and so would the recompile
        # after LoRA wraps this model's linears. Not done.
        torch._dynamo.mark_dynamic(tables, 1)
        decode = DecodeInputs(self.kv.k, self.kv.v, slots, tables, lens, real)
        return self._fn(ids, positions, decode)

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Compile every size now (padding only: no page is read or written); seconds."""
        start = time.perf_counter()
        for size in self.sizes:
            # ids and positions must be distinct tensors, as in run(): dynamo guards on
            # aliasing, and one shared tensor here compiled a graph no real step matched
            # (every size was compiled again at its first real step)
            self._call(
                torch.zeros(1, size, dtype=torch.long),
                torch.zeros(1, size, dtype=torch.long),
                torch.full((size,), -1, dtype=torch.long),
                torch.zeros(size, 2, dtype=torch.long),
                torch.zeros(size, dtype=torch.long),
                torch.zeros(1, dtype=torch.long),
            )
        self.compile_s = time.perf_counter() - start
        return self.compile_s


def prepare_forward(model: torch.nn.Module, config) -> bool:
    """Make a loaded causal LM ready for the engine's steps, in place: our flat forward
    (fused projections) where its family allows and ``config.model_forward`` is "auto", and
    oneDNN-packed linears on CPU (``config.fast_linear``). Returns whether weights were
    replaced (the weight store then settles its accounting). A model already prepared (one
    instance behind several workers) is left as it is."""
    if torch.device(config.device).type != "cpu":
        return False  # GPUs keep transformers' forward (and CUDA graphs of it)
    changed = False
    if (
        config.model_forward == "auto"
        and flat_forward_of(model) is None
        and unsupported_reason(model) is None
    ):
        model.trae_flat = FlatForward(model)
        changed = True
    if config.fast_linear and fast_linear_available():
        library = linear_library(config.linear_library, next(model.parameters()).dtype)
        changed = bool(pack_linears(model, library=library)) or changed
    return changed


class LLMRunner:
    def __init__(self, model: torch.nn.Module, kv: KVView, backend: AttentionBackend):
        self.model = model
        self.kv = kv
        self.backend = backend
        self.device = next(model.parameters()).device
        self.flat = flat_forward_of(model)
        self.compiled: CompiledDecode | DecodeGraphs | None = None  # fixed-size decode steps
        self.lora: LoraSlots | None = None  # the model's adapters, once it has any

    def enable_compile(self, sizes: tuple[int, ...], max_model_len: int) -> float:
        """Fixed-size decode steps for these padded batch sizes: torch.compile on CPU (torch
        attention backend), captured CUDA graphs on a GPU (triton backend); returns the
        start-up seconds it took. Other steps, and other devices or backends, stay eager."""
        if self.device.type == "cuda":
            if self.backend.name != "triton":
                log.warning("CUDA graphs: with the triton attention backend only; %s stays "
                            "eager", self.backend.name)  # fmt: skip
                return 0.0
            return self.enable_graphs(sizes, max_model_len)
        if self.kv.layout.storage is not None:
            log.warning("compile: not with a quantized KV cache yet; decode stays eager")
            return 0.0
        if self.device.type != "cpu" or self.backend.name != "torch":
            log.warning(
                "compile: on CPU with the torch attention backend, or CUDA with triton; "
                "%s with %s stays eager",
                self.device,
                self.backend.name,
            )
            return 0.0
        compiled = CompiledDecode(self.model, self.kv, sizes)
        seconds = compiled.warm_up()
        self.compiled = compiled  # steps take it once every size is compiled (maybe meanwhile)
        return seconds

    def enable_graphs(self, sizes: tuple[int, ...], max_model_len: int, capture=cuda_capture):
        """Capture decode steps as graphs (``capture``: ``replay_eagerly`` in CPU tests).
        A failed capture is logged and leaves the model eager; returns seconds."""
        if self.flat is not None:  # graphs capture transformers' forward (what GPUs run)
            log.warning("CUDA graphs: not of the flat forward; decode stays eager")
            return 0.0
        try:
            graphs = DecodeGraphs(self.model, self.kv, self.backend, sizes, max_model_len, capture)
            seconds = graphs.capture_all()
        except Exception:
            log.exception("CUDA graph capture failed; decode steps stay eager")
            return 0.0
        log.info(
            "decode graphs: sizes %s captured in %.1f s, %.0f MiB",
            graphs.sizes,
            seconds,
            graphs.memory_bytes / 2**20,
        )
        self.compiled = graphs
        return seconds

    def prepare(self, sched: SchedulerOutput) -> ModelInputs:
        page = self.kv.tokens_per_page
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        context_lens: list[int] = []
        sample_rows: list[int] = []
        tables: list[list[int]] = []
        row_slots: list[int] = []
        scored: list[PromptSpan] = []
        picks: list[int] = []  # the sampling rows among the rows that keep logits
        for item in sched.scheduled:
            seq, lo = item.seq, item.seq.num_computed
            hi = lo + item.num_new
            tokens = seq.token_ids + item.draft  # proposals: KV and logits, not yet kept
            ids.extend(tokens[lo:hi])
            positions.extend(range(lo, hi))
            pages = seq.pages
            slots.extend(pages[p // page] * page + p % page for p in range(lo, hi))
            starts.append(starts[-1] + item.num_new)
            context_lens.append(hi)
            first, count = positions_to_score(seq, lo, hi)
            if count:  # the prompt is scored: its rows keep logits too
                scored.append(PromptSpan(seq, first, len(sample_rows), count))
                row = starts[-2] + first - lo
                sample_rows.extend(range(row, row + count))
            if item.samples:  # a verified proposal samples at each of its rows
                for row in range(starts[-1] - 1 - len(item.draft), starts[-1]):
                    picks.append(len(sample_rows))
                    sample_rows.append(row)
            tables.append(pages[: -(-hi // page)])
            if self.lora is not None:
                row_slots.extend([self.lora.slot_of(seq.adapter)] * item.num_new)
        width = max(len(t) for t in tables)
        padded = [page_id for t in tables for page_id in t + [0] * (width - len(t))]
        if row_slots and max(row_slots) < 0:
            row_slots = []  # base rows only: nothing to add
        ids_t, positions_t, slots_t, lens_t, rows_t, tables_t, lora_t = self._to_device(
            ids, positions, slots, context_lens, sample_rows, padded, row_slots
        )
        batch = PagedBatch(
            slot_mapping=slots_t,
            query_starts=starts,
            context_lens=context_lens,
            block_tables=tables_t.view(len(tables), width),
            num_decodes=len(sched.decodes),
            tokens_per_page=page,
            context_lens_t=lens_t,
        )
        return ModelInputs(
            input_ids=ids_t.view(1, -1),
            position_ids=positions_t.view(1, -1),
            sample_rows=rows_t,
            batch=batch,
            lora=lora_rows(lora_t, row_slots) if row_slots else None,
            scored=scored,
            picks=torch.tensor(picks, dtype=torch.long) if scored else None,
        )

    def _to_device(self, *parts: list[int]) -> tuple[torch.Tensor, ...]:
        """A step's index lists in one host-to-device copy, split into views there.
        On CUDA the host buffer is pinned and the copy asynchronous: one transfer per
        step instead of six blocking ones from pageable memory."""
        flat = [x for part in parts for x in part]
        on_gpu = self.device.type == "cuda"
        host = torch.tensor(flat, dtype=torch.long, pin_memory=on_gpu)
        device = host.to(self.device, non_blocking=True) if on_gpu else host.to(self.device)
        return device.split([len(part) for part in parts])

    @torch.inference_mode()
    def run(self, inputs: ModelInputs) -> torch.Tensor:
        """Logits [num_sampling_rows, vocab] in the model's dtype (float32 from a fixed-size
        replay, whose static buffer is copied out anyway): a plain greedy row takes
        its argmax from them as they are (a bf16 batch-32 step's float32 copy was 6 MB and
        ~0.3 ms), and what computes with them converts (Sampler.adjust, score_tokens)."""
        if self.compiled is not None and inputs.lora is None:  # adapter rows run eagerly
            size = self.compiled.size_for(inputs)
            if size is not None:
                try:
                    return self.compiled.run(inputs, size)
                except Exception:  # e.g. a recompile the limit refuses: eager from now on
                    # (a compile failure happens before any K/V is written; a rerun rewrites
                    # the same slots with the same values)
                    log.exception("fixed-size decode failed; this model runs eagerly from now on")
                    self.compiled = None
        if self.lora is not None:
            self.lora.rows = inputs.lora  # what the wrapped linears read during this forward
        try:
            if self.flat is not None:
                return self.flat(
                    inputs.input_ids[0],
                    inputs.position_ids[0],
                    inputs.sample_rows,
                    paged_attend(inputs.batch, self.kv, self.backend),
                    inputs.lora is not None,
                )
            # a chunk that ends before its prompt does keeps no rows: only the cache fills
            out = self.model(
                input_ids=inputs.input_ids,
                position_ids=inputs.position_ids,
                use_cache=False,
                logits_to_keep=inputs.sample_rows,
                trae_step=StepContext(inputs.batch, self.kv, self.backend),
            )
        finally:
            if self.lora is not None:
                self.lora.rows = None
        return out.logits[0]
