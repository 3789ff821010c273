"""Runs transformers' own causal-LM classes over our paged KV memory.

No model code of ours: the model is loaded with ``attn_implementation="trae_paged"``,
an attention function registered with transformers' ``AttentionInterface``. Each step
is one forward over the flattened batch (decodes first, then prefill chunks); the
step's ``StepContext`` reaches every attention layer as a keyword argument, and
logits are computed only at the rows that sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from trae_groups.engine.memory_pool import KVLayout, KVView
from trae_groups.engine.scheduler import SchedulerOutput
from trae_groups.kernels import AttentionBackend, PagedBatch

ATTN_NAME = "trae_paged"


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
    ctx: StepContext | None = kwargs.get("trae_step")
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


AttentionInterface.register(ATTN_NAME, paged_attention_forward)


def kv_layout(config, dtype: torch.dtype) -> KVLayout:
    """The KV shape a decoder config implies (text config for multimodal wrappers)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return KVLayout(config.num_hidden_layers, kv_heads, head_dim, dtype)


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    sample_rows: torch.Tensor  # rows of T whose logits are needed
    batch: PagedBatch


class LLMRunner:
    def __init__(self, model: torch.nn.Module, kv: KVView, backend: AttentionBackend):
        self.model = model
        self.kv = kv
        self.backend = backend
        self.device = next(model.parameters()).device

    def prepare(self, sched: SchedulerOutput) -> ModelInputs:
        page = self.kv.tokens_per_page
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        context_lens: list[int] = []
        sample_rows: list[int] = []
        tables: list[list[int]] = []
        for item in sched.scheduled:
            seq, lo = item.seq, item.seq.num_computed
            hi = lo + item.num_new
            tokens = seq.token_ids
            ids.extend(tokens[lo:hi])
            positions.extend(range(lo, hi))
            pages = seq.pages
            slots.extend(pages[p // page] * page + p % page for p in range(lo, hi))
            starts.append(starts[-1] + item.num_new)
            context_lens.append(hi)
            if item.samples:
                sample_rows.append(starts[-1] - 1)
            tables.append(pages[: -(-hi // page)])
        width = max(len(t) for t in tables)
        padded = [page_id for t in tables for page_id in t + [0] * (width - len(t))]
        ids_t, positions_t, slots_t, lens_t, rows_t, tables_t = self._to_device(
            ids, positions, slots, context_lens, sample_rows, padded
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
        """Logits [num_sampling_rows, vocab] (float32)."""
        # a chunk that ends before its prompt does keeps no rows: only the cache fills
        out = self.model(
            input_ids=inputs.input_ids,
            position_ids=inputs.position_ids,
            use_cache=False,
            logits_to_keep=inputs.sample_rows,
            trae_step=StepContext(inputs.batch, self.kv, self.backend),
        )
        return out.logits[0].float()
