"""Paged attention, torch reference: runs anywhere and is the oracle for other backends.

A step's batch is flattened into one row dimension: first ``num_decodes`` sequences of
one new token each, then prefill chunks (possibly continuing over cached context).
K/V of every sequence live in pages; ``block_tables[s]`` lists sequence s's pages in
order, so token position p sits in page ``block_tables[s, p // page]`` at ``p % page``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from trae_groups.kernels import cpu_amx, cpu_native, cpu_prompt, zen_attention
from trae_groups.kernels.kv_quant import QuantKV

# At most this many K/V rows (sequences x padded context) gathered for one padded
# prefill call; 32k rows of 8 KV heads x 128 dims in fp32 is 128 MiB each for K and V.
MAX_PADDED_KEYS = 32768
# Prompt chunks of at most this many tokens, in a step that also decodes, run through the
# native decode kernel as one row per token instead of a gather of their cached prefix and
# two flash calls (1 decode + a 4-token chunk 2,000 tokens deep: 2.3 against 8.8 ms for 30
# layers, SmolLM2's heads, bf16, Zen 4; level with flash from ~32 rows): the held steps
# beside a long prompt carry such chunks.
NATIVE_CHUNK_ROWS = 32


@dataclass
class PagedBatch:
    """Everything a kernel needs about one step's batch (built once per step).

    slot_mapping: [T] flat slot (page * tokens_per_page + offset) of each new token.
    query_starts: S+1 offsets of each sequence's rows in the flattened batch.
    context_lens: S total KV lengths (cached + new) after this step.
    block_tables: [S, max_pages] page ids, padded with 0.
    """

    slot_mapping: torch.Tensor
    query_starts: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor
    num_decodes: int
    tokens_per_page: int
    context_lens_t: torch.Tensor | None = None
    _masks: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[num_decodes, 1, 1, L] True where a decode token may attend (cached per step)."""
        key = ("decode", window)
        if key not in self._masks:
            nd = self.num_decodes
            lens = self.context_lens_t[:nd]
            width = self.block_tables.shape[1] * self.tokens_per_page
            pos = torch.arange(width, device=lens.device)
            mask = pos[None, :] < lens[:, None]
            if window is not None:
                mask &= pos[None, :] >= (lens[:, None] - window)
            self._masks[key] = mask[:, None, None, :]
        return self._masks[key]

    def decode_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each decode row's sequence and the last position it attends (int64, cached per
        step): what the native kernel reads instead of a mask."""
        key = ("decode_rows",)
        if key not in self._masks:
            nd = self.num_decodes
            lens = self.context_lens_t[:nd].to(torch.int64)
            self._masks[key] = (torch.arange(nd, dtype=torch.int64), lens - 1)
        return self._masks[key]

    def rows_at(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``all_rows`` for the given rows of the step only (flat row indices)."""
        starts = torch.tensor(self.query_starts, dtype=torch.int64)
        rows = rows.to(torch.int64)
        seqs = torch.searchsorted(starts, rows, right=True) - 1
        ends = torch.tensor(self.context_lens, dtype=torch.int64)[seqs]
        return seqs, ends - (starts[seqs + 1] - rows)

    def all_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``decode_rows`` for every row of the step, prompt chunks' included: a chunk's
        token at position p attends positions up to p (its K/V are stored before attention
        runs), so a short chunk is as many decode rows (cached per step)."""
        key = ("all_rows",)
        if key not in self._masks:
            self._masks[key] = self.rows_at(torch.arange(self.query_starts[-1]))
        return self._masks[key]

    def chunk_rows(self) -> tuple[torch.Tensor, ...]:
        """Each prompt chunk's row of ``block_tables``, first row in the step, rows and
        context (int64 each, cached per step): what the native prompt kernel reads."""
        key = ("chunk_rows",)
        if key not in self._masks:
            nd, starts = self.num_decodes, self.query_starts
            chunks = range(nd, self.num_seqs)
            self._masks[key] = tuple(
                torch.tensor(values, dtype=torch.int64)
                for values in (
                    list(chunks),
                    [starts[s] for s in chunks],
                    [starts[s + 1] - starts[s] for s in chunks],
                    [self.context_lens[s] for s in chunks],
                )
            )
        return self._masks[key]

    def longest_chunk(self) -> int:
        """The most tokens any prompt chunk of the step has (1 without one; cached per step:
        every layer asks)."""
        key = ("longest_chunk",)
        if key not in self._masks:
            starts = self.query_starts
            chunks = range(self.num_decodes, self.num_seqs)
            self._masks[key] = max((starts[s + 1] - starts[s] for s in chunks), default=1)
        return self._masks[key]

    def decode_bias(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """``decode_mask`` as an additive mask (0 or -inf) in the query's dtype: SDPA's CPU
        kernel reads it ~25% faster than a boolean one at decode shapes (cached per step)."""
        return self.additive_mask(("decode", window), self.decode_mask(window), dtype)

    def prefill_plan(self, window: int | None) -> tuple[torch.Tensor, ...] | None:
        """Index tensors and mask to run every prefill chunk in one padded SDPA call
        (cached per step: every layer uses them), or None when padding would cost more
        than twice the exact work (chunks of very different sizes), when the gathered
        keys would pass ``MAX_PADDED_KEYS`` (long contexts: one by one holds one
        sequence's K/V at a time), or there is only one chunk: those run one by one."""
        key = ("prefill", window)
        if key in self._masks:
            return self._masks[key]
        nd, page, starts = self.num_decodes, self.tokens_per_page, self.query_starts
        first = starts[nd]
        n_q = [starts[s + 1] - starts[s] for s in range(nd, self.num_seqs)]
        n_k = self.context_lens[nd:]
        longest, n_pages = max(n_q), -(-max(n_k) // page)
        exact = sum(q * k for q, k in zip(n_q, n_k, strict=True))
        keys = len(n_q) * n_pages * page  # K/V rows gathered at once: bounds the memory
        if len(n_q) == 1 or keys > MAX_PADDED_KEYS or keys * longest > 2 * exact:
            self._masks[key] = None
            return None
        device = self.block_tables.device
        q_len = torch.tensor(n_q, device=device)[:, None]
        k_len = torch.tensor(n_k, device=device)[:, None]
        col = torch.arange(longest, device=device)[None, :]
        real = col < q_len  # [seqs, longest]: rows that are not padding
        start = torch.tensor(starts[nd:-1], device=device)[:, None]
        rows = torch.where(real, start + col, first)  # padding reads some real row
        # a query's position in its sequence; padding rows sit at 0 and see key 0 only
        q_pos = torch.where(real, k_len - q_len + col, 0)
        k_pos = torch.arange(n_pages * page, device=device)
        mask = k_pos[None, None, :] <= q_pos[:, :, None]
        if window is not None:
            mask &= k_pos[None, None, :] > q_pos[:, :, None] - window
        keep = real.flatten().nonzero().squeeze(1)
        tables = self.block_tables[nd:, :n_pages]
        self._masks[key] = (tables, rows, keep, mask[:, None])
        return self._masks[key]

    def additive_mask(self, key: tuple, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A boolean mask of this step (True: attend), named by ``key``, as an additive one
        (0 or -inf) in ``dtype``: made once per step, every layer uses it."""
        key = ("additive", *key, dtype)
        if key not in self._masks:
            bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            self._masks[key] = bias.masked_fill_(~mask, float("-inf"))
        return self._masks[key]


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [T, kv_heads, dim] into caches [pages, tokens_per_page, kv_heads, dim]
    (``QuantKV`` caches quantize them on the way in)."""
    if cpu_native.stores(key, k_cache, v_cache):
        cpu_native.store_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    page_size = k_cache.shape[1]
    pages = torch.div(slot_mapping, page_size, rounding_mode="floor")
    offsets = slot_mapping - pages * page_size
    if isinstance(k_cache, QuantKV):
        k_cache.store(pages, offsets, key)
        v_cache.store(pages, offsets, value)
        return
    k_cache[pages, offsets] = key
    v_cache[pages, offsets] = value


def gather_kv(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """[n_pages] page ids → [n_pages * tokens_per_page, kv_heads, dim], whole pages at once
    (dequantized from a ``QuantKV``)."""
    return cache.index_select(0, pages).flatten(0, 1)


def gather_pages(
    k_cache, v_cache, tables: torch.Tensor, lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's pages ``tables`` [S, W] of both caches gathered whole (``gather_kv``), K and
    V [S, W * tokens_per_page, kv_heads, dim], with every slot at or past the row's length
    ``lens`` [S] zeroed. Those slots (a last page's tail, the table's padding, which points at
    page 0) hold whatever their page held before, NaN in another model's layout, and a masked
    NaN still poisons SDPA's weighted sum: cleared here, the pool hands out pages uncleared."""
    rows, width = tables.shape
    keys = width * k_cache.shape[1]
    stale = torch.arange(keys, device=lens.device)[None, :] >= lens[:, None]
    stale = stale[:, :, None, None].to(k_cache.device)
    pages = tables.reshape(-1)
    return tuple(
        gather_kv(cache, pages).view(rows, keys, *cache.shape[2:]).masked_fill_(stale, 0)
        for cache in (k_cache, v_cache)
    )


def _prefill_mask(
    n_q: int, n_k: int, window: int | None, device, explicit: bool = False
) -> torch.Tensor | None:
    """Causal mask aligned bottom-right (queries are the last n_q of n_k positions); None
    where a kernel's causal flag says the same (a fresh prompt, no window), unless
    ``explicit``."""
    if n_q == n_k and window is None and not explicit:
        return None
    q_pos = torch.arange(n_k - n_q, n_k, device=device)[:, None]
    k_pos = torch.arange(n_k, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def native_rows(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's sequence and last position where ``paged_attention`` runs the whole step
    through the native kernel (decodes, and prompt chunks short enough to run as decode
    rows), or None where prompt chunks take SDPA. The flat forward's native layer loop
    (trae_kernels/zen_layers.py) asks the same, so both attend alike."""
    if batch.num_decodes == batch.num_seqs:
        return batch.decode_rows()
    if batch.longest_chunk() <= NATIVE_CHUNK_ROWS:
        return batch.all_rows()
    return None


def attend_rows(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    rows: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor | None:
    """``paged_attention``'s output for ``rows`` of the step only (query [T, heads, dim], the
    step's K/V already stored): each row a decode row at its position, through the native
    kernel; None where that kernel does not take these pages."""
    if not cpu_native.supports(query, k_cache, v_cache):
        return None
    row_seq, row_pos = batch.rows_at(rows)
    return cpu_native.decode_attention(
        query.index_select(0, rows), k_cache, v_cache, batch.block_tables, row_seq, row_pos,
        scale, sliding_window,
    )  # fmt: skip


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """query [T, heads, dim]; key/value [T, kv_heads, dim] (new tokens, already stored).

    Returns [T, heads, dim]. GQA/MQA: decodes fold a KV head's query heads into its rows,
    prefills use SDPA's ``enable_gqa``.
    """
    nd = batch.num_decodes
    gqa = query.shape[1] != k_cache.shape[2]
    native = cpu_native.supports(query, k_cache, v_cache)
    if native and nd < batch.num_seqs and (whole := native_rows(batch)) is not None:
        row_seq, row_pos = whole  # short chunks beside decodes: one call for all
        return cpu_native.decode_attention(
            query, k_cache, v_cache, batch.block_tables, row_seq, row_pos, scale, sliding_window
        )
    # a decode-only step (most steps) returns SDPA's output as it is: no copy into ``out``
    out = None if nd == batch.num_seqs else torch.empty_like(query)
    if nd and native:  # pages read where they lie
        row_seq, row_pos = batch.decode_rows()
        o = cpu_native.decode_attention(
            query[:nd], k_cache, v_cache, batch.block_tables, row_seq, row_pos, scale,
            sliding_window,
        )  # fmt: skip
        if out is None:
            return o
        out[:nd] = o
    elif nd:
        tables, lens = batch.block_tables[:nd], batch.context_lens_t[:nd]
        k, v = gather_pages(k_cache, v_cache, tables, lens)
        bias = batch.decode_bias(sliding_window, query.dtype)
        o = decode_attention(query[:nd], k, v, bias, scale)
        if out is None:
            return o
        out[:nd] = o
    if nd < batch.num_seqs:
        if cpu_amx.supports_prefill(query, k_cache, v_cache):  # the pages where they lie
            cpu_amx.prefill(query, k_cache, v_cache, batch, scale, sliding_window, out)
            return out
        # float32 on AVX-512 or AVX2, bf16 on AVX-512, before zentorch's SDPA: on a Zen 5 EPYC
        # a 32 x 512 prefill took 9.7-10.4 s with it against 10.0-11.5 s with zentorch's in
        # float32, a 32 x 512 run (64 new) 6.9-7.2 s against 7.2-7.8 s in bf16
        if cpu_prompt.supports(query, k_cache, v_cache):
            cpu_prompt.prefill(query, k_cache, v_cache, batch, scale, sliding_window, out)
            return out
        plan = batch.prefill_plan(sliding_window)
        if plan is None:
            _prefill_one_by_one(query, key, value, k_cache, v_cache, batch, scale,
                                sliding_window, gqa, out)  # fmt: skip
        else:
            _prefill_padded(query, k_cache, v_cache, batch, plan, scale, sliding_window, gqa,
                            out)  # fmt: skip
    return out


def decode_attention(
    query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """One new token per sequence: query [n, heads, dim]; k/v [n, L, kv_heads, dim] gathered
    from the pages; bias [n, 1, 1, L] additive (``PagedBatch.decode_bias``). [n, heads, dim].

    The query heads that share a KV head become that KV head's query rows, [n, kv_heads,
    group, dim] (head h reads KV head h // group): one SDPA call then multiplies a few rows
    per KV head, where its GQA path runs each query head as a row of its own (~30% slower at
    SmolLM2's shapes, batch 32)."""
    n, heads, dim = query.shape
    kv_heads = k.shape[2]
    q = query.reshape(n, kv_heads, heads // kv_heads, dim)
    o = F.scaled_dot_product_attention(
        q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias, scale=scale
    )
    return o.reshape(n, heads, dim)


# Decode attention is SDPA in every dtype. An earlier torch took a slow path for bf16/fp16
# one-token queries with a mask (~12 ms a layer at batch 32), so bf16/fp16 decodes ran as two
# matmuls with a float32 softmax (``_decode_matmul``, still what CUDA-graph references use).
# On torch 2.13 SDPA is the faster one in both dtypes (SmolLM2's shapes, 176 keys, bf16: 35 vs
# 126 us at batch 1, 0.65 vs 1.2 ms at batch 32; fp32 37 vs 47 us and 1.0 vs 2.1 ms).


def _decode_matmul(q, k, v, mask, scale) -> torch.Tensor:
    """Decode attention as matmuls: q [nd, heads, dim]; k/v [nd, L, kv_heads, dim]; mask
    [nd, 1, 1, L]. Scores and softmax in float32, products in the input dtype."""
    nd, heads, dim = q.shape
    kv_heads = k.shape[2]
    qg = q.view(nd, kv_heads, heads // kv_heads, dim)  # head h reads KV head h // group
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).float() * scale  # [nd, kv, group, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(-1).to(q.dtype)
    return torch.matmul(probs, v.transpose(1, 2)).view(nd, heads, dim)


def _prefill_padded(query, k_cache, v_cache, batch, plan, scale, window, gqa, out) -> None:
    """Every prefill chunk of the step in one SDPA call, padded to the longest chunk
    and context: one call per layer instead of one per sequence."""
    tables, rows, keep, mask = plan
    lens = batch.context_lens_t[batch.num_decodes :]
    k, v = gather_pages(k_cache, v_cache, tables, lens)
    q = query.index_select(0, rows.reshape(-1)).view(*rows.shape, *query.shape[1:])
    if zen_attention.supports(q, k):
        bias = batch.additive_mask(("prefill", window), mask, q.dtype)
        starts, nd = batch.query_starts, batch.num_decodes
        # a padded row r sees no key past (its context - its chunk) + r: the most of those
        offset = max(batch.context_lens[s] - (starts[s + 1] - starts[s])
                     for s in range(nd, batch.num_seqs))  # fmt: skip
        o = zen_attention.sdpa_causal(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                      scale, bias, offset)  # fmt: skip
    else:
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            scale=scale,
            enable_gqa=gqa,
        )  # [n_seqs, heads, longest chunk, dim]
    first = batch.query_starts[batch.num_decodes]
    out[first:] = o.transpose(1, 2).flatten(0, 1).index_select(0, keep)


def _flash_lse(q, k, v, causal: bool, scale: float):
    """CPU flash attention with its log-sum-exp: q [heads, n, dim], k/v [heads, m, dim]."""
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q[None], k[None], v[None], 0.0, causal, scale=scale
    )
    return o[0], lse[0]


def _prefix_then_chunk(q, k_prefix, v_prefix, k_new, v_new, scale: float):
    """A prompt chunk over its cached prefix without a mask: every query sees the whole
    prefix (one unmasked flash call, the query heads of a KV head stacked along the query
    axis, so GQA needs no copy of the prefix) and its own chunk causally (a second call);
    the two are merged by their log-sum-exps. An explicit [n_q, n_k] mask would send SDPA
    down a slower path that grows with the context. q [n_q, heads, dim]; k/v [n, kv, dim]."""
    n_q, heads, dim = q.shape
    kv_heads = k_prefix.shape[1]
    group = heads // kv_heads
    qg = q.view(n_q, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * n_q, dim)
    o1, lse1 = _flash_lse(qg, k_prefix.transpose(0, 1), v_prefix.transpose(0, 1), False, scale)
    o1 = o1.view(kv_heads, group, n_q, dim).reshape(heads, n_q, dim)
    lse1 = lse1.view(kv_heads, group, n_q).reshape(heads, n_q)
    k2, v2 = k_new.transpose(0, 1), v_new.transpose(0, 1)
    if group > 1:
        k2, v2 = k2.repeat_interleave(group, 0), v2.repeat_interleave(group, 0)
    o2, lse2 = _flash_lse(q.transpose(0, 1), k2, v2, True, scale)
    top = torch.maximum(lse1, lse2)
    w1, w2 = (lse1 - top).exp_(), (lse2 - top).exp_()
    total = w1 + w2
    merged = o1.float() * (w1 / total)[..., None] + o2.float() * (w2 / total)[..., None]
    return merged.to(q.dtype).transpose(0, 1)  # [n_q, heads, dim]


def _prefill_one_by_one(query, key, value, k_cache, v_cache, batch, scale, window, gqa, out):
    starts = batch.query_starts
    if zen_attention.supports(query, key):
        for s in range(batch.num_decodes, batch.num_seqs):
            out[starts[s] : starts[s + 1]] = _zen_chunk(
                query, key, value, k_cache, v_cache, batch, s, scale, window
            )
        return
    for s in range(batch.num_decodes, batch.num_seqs):
        lo, hi = starts[s], starts[s + 1]
        n_q, n_k = hi - lo, batch.context_lens[s]
        if n_q == n_k:  # fresh prefill: the new K/V are the whole context
            k, v = key[lo:hi], value[lo:hi]
        elif window is None and query.device.type == "cpu" and not isinstance(k_cache, QuantKV):
            n_prefix = n_k - n_q  # cached before this step; the chunk's own K/V are key/value
            n_pages = -(-n_prefix // batch.tokens_per_page)
            pages = batch.block_tables[s, :n_pages]
            k_prefix = gather_kv(k_cache, pages)[:n_prefix]
            v_prefix = gather_kv(v_cache, pages)[:n_prefix]
            out[lo:hi] = _prefix_then_chunk(
                query[lo:hi], k_prefix, v_prefix, key[lo:hi], value[lo:hi], scale
            )
            continue
        else:
            n_pages = -(-n_k // batch.tokens_per_page)
            pages = batch.block_tables[s, :n_pages]
            k = gather_kv(k_cache, pages)[:n_k]
            v = gather_kv(v_cache, pages)[:n_k]
        mask = _prefill_mask(n_q, n_k, window, query.device)
        o = F.scaled_dot_product_attention(
            query[lo:hi].transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=gqa,
        )
        out[lo:hi] = o.transpose(0, 1)


def _zen_chunk(query, key, value, k_cache, v_cache, batch, s, scale, window) -> torch.Tensor:
    """Sequence ``s``'s prompt chunk on zentorch's kernel: a fresh prompt causal over its own
    K/V, a chunk over a cached prefix (or in a window) over its pages with a bottom-right
    mask. [n_q, heads, dim]."""
    lo, hi = batch.query_starts[s], batch.query_starts[s + 1]
    n_q, n_k = hi - lo, batch.context_lens[s]
    q = query[lo:hi].transpose(0, 1)[None]
    if n_q == n_k:
        k, v = key[lo:hi], value[lo:hi]
    else:
        pages = batch.block_tables[s, : -(-n_k // batch.tokens_per_page)]
        k, v = gather_kv(k_cache, pages)[:n_k], gather_kv(v_cache, pages)[:n_k]
    k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    blocked = n_q > 2 * zen_attention.QUERY_BLOCK
    bool_mask = _prefill_mask(n_q, n_k, window, query.device, explicit=blocked)
    if bool_mask is None:  # a short fresh prompt: the kernel's own (top-left) causal flag
        o = zen_attention.sdpa(q, k, v, scale, causal=True)
    else:
        bias = batch.additive_mask(("chunk", s, window), bool_mask, q.dtype)
        o = zen_attention.sdpa_causal(q, k, v, scale, bias, n_k - n_q)
    return o[0].transpose(0, 1)


def naive_attention(
    query: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    query_starts: list[int],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Dense per-sequence attention from whole K/V tensors: the oracle for tests."""
    out = torch.empty_like(query)
    for s, (k, v) in enumerate(zip(keys, values, strict=True)):
        lo, hi = query_starts[s], query_starts[s + 1]
        n_q, n_k = hi - lo, k.shape[0]
        group = query.shape[1] // k.shape[1]
        kk = k.repeat_interleave(group, dim=1).transpose(0, 1).float()
        vv = v.repeat_interleave(group, dim=1).transpose(0, 1).float()
        scores = query[lo:hi].transpose(0, 1).float() @ kk.transpose(1, 2) * scale
        mask = _prefill_mask(n_q, n_k, sliding_window, query.device)
        if mask is None:
            mask = torch.ones(n_q, n_k, dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        out[lo:hi] = (scores.softmax(-1) @ vv).transpose(0, 1).to(query.dtype)
    return out


def graph_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Store and attend for B one-token rows without reading any tensor's data on the host,
    so that a CUDA graph can capture it (engine/decode_graphs.py): the reference the Triton
    backend's ``graph_decode`` is checked against, and the backend of CPU tests of graphs.

    query [B, heads, dim], key/value [B, kv_heads, dim]; block_tables [B, width] (any width
    that holds every row's pages); context_lens [B]. Rows whose slot is negative are
    padding: they store nothing and come back as zeros. Plain (not quantized) caches only.
    """
    if isinstance(k_cache, QuantKV):
        raise ValueError("graph_decode (torch): plain caches only; the triton backend takes int8")
    rows = slot_mapping.shape[0]
    real = slot_mapping >= 0
    # No branch on data: a padding row rewrites what a real row writes (the first one), or,
    # when every row is padding, slot 0 with the value it already holds. Duplicate slots
    # then always carry equal values, whichever write lands last.
    first_real = real.to(torch.int8).argmax()
    src = torch.where(real, torch.arange(rows, device=real.device), first_real)
    slots = slot_mapping[src].clamp(min=0)
    page_size = k_cache.shape[1]
    pages, offsets = slots // page_size, slots % page_size
    keep = real[src][:, None, None]
    k_cache[pages, offsets] = torch.where(keep, key[src], k_cache[pages, offsets])
    v_cache[pages, offsets] = torch.where(keep, value[src], v_cache[pages, offsets])

    width = block_tables.shape[1] * page_size
    k, v = gather_pages(k_cache, v_cache, block_tables, context_lens)
    pos = torch.arange(width, device=query.device)
    mask = pos[None, :] < context_lens[:, None]
    if sliding_window is not None:
        mask &= pos[None, :] >= context_lens[:, None] - sliding_window
    out = _decode_matmul(query, k, v, mask[:, None, None, :], scale)
    return torch.where(real[:, None, None], out, 0.0).to(query.dtype)
