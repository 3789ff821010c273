"""Decode steps replayed from CUDA graphs captured at start-up.

At small batches a GPU decode step costs kernel launches, not arithmetic: transformers'
modules issue hundreds of small kernels per step (per layer: norms, RoPE, projections,
attention, residuals, activation), each a few microseconds of CPU for microseconds of GPU.
A CUDA graph records one step's kernels once and replays them with one launch; vLLM and
SGLang capture their decode batches for this reason.

How: for each size in ``sizes`` (largest first, all in one graph memory pool) one decode step
of that many rows is captured over static buffers: token ids, positions, KV slots, block
tables as wide as the longest sequence the model admits, and context lengths. A step of n
one-token rows copies its inputs into the first n rows, marks the rest of its size as padding
(slot -1, length 0: they store nothing and attend to nothing), replays the smallest graph that
holds it and reads n rows of that graph's logits. A graph freezes every launch argument, so
attention goes through the backend's ``graph_decode``, which takes its lengths from the
device (no per-step launch sizes, no host reads).

Prefill chunks, mixed steps, steps with adapter rows and batches above the largest size run
eagerly. Capture is an argument: ``cuda_capture`` on a GPU; tests on CPU pass
``replay_eagerly``, which runs the same step over the same static buffers at each replay, so
everything but the capture itself is exercised without a GPU.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from trae_groups.engine.memory_pool import KVView
from trae_groups.kernels import AttentionBackend
from trae_groups.kernels.kv_quant import QuantKV

if TYPE_CHECKING:
    from trae_groups.engine.llm_runner import ModelInputs

log = logging.getLogger("trae_groups.engine")

Captured = tuple[Callable[[], object], torch.Tensor]  # (replay, the logits it writes)
Capture = Callable[[Callable[[], torch.Tensor], object], Captured]


def cuda_capture(step: Callable[[], torch.Tensor], pool: object) -> Captured:
    """One warm-up run on a side stream (Triton compiles, cuBLAS picks kernels and
    workspaces outside the capture), then the capture into the shared pool."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        logits = step()
    return graph.replay, logits


def replay_eagerly(step: Callable[[], torch.Tensor], pool: object) -> Captured:
    """The CPU stand-in for tests: a replay reruns the step over the same static buffers and
    writes the same static logits a graph's replay would."""
    logits = step()
    return (lambda: logits.copy_(step())), logits


def decode_rows(inputs: ModelInputs) -> int | None:
    """Rows of a step that is decodes only, each sampling (what fixed-size decode paths
    run); None for any other step."""
    batch = inputs.batch
    n = batch.num_seqs
    if batch.num_decodes != n or inputs.input_ids.shape[1] != n:
        return None
    if inputs.sample_rows.numel() != n:
        return None
    return n


@dataclass
class GraphStep:
    """What a captured step's attention layers read: one size's rows of the static buffers."""

    kv: KVView
    attend: Callable  # the backend's graph_decode
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor

    def attention(self, layer: int, query, key, value, scale: float, window: int | None):
        """query [B, heads, dim], key/value [B, kv_heads, dim] -> [B, heads, dim]."""
        return self.attend(
            query, key, value, self.kv.k[layer], self.kv.v[layer], self.slot_mapping,
            self.block_tables, self.context_lens, scale, window,
        )  # fmt: skip


def _kv_address(kv: KVView) -> int:
    first = kv.k[0]
    return (first.values if isinstance(first, QuantKV) else first).data_ptr()


class DecodeGraphs:
    """Captured decode steps of one model, one per padded batch size."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVView,
        backend: AttentionBackend,
        sizes: tuple[int, ...],
        max_model_len: int,
        capture: Capture = cuda_capture,
    ):
        if backend.graph_decode is None:
            raise ValueError(f"the {backend.name} attention backend has no graph_decode")
        self.model = model
        self.kv = kv
        self.attend = backend.graph_decode
        self.sizes = sorted(set(sizes))
        self.capture = capture
        self.device = next(model.parameters()).device
        rows = self.sizes[-1]
        width = -(-max_model_len // kv.tokens_per_page)  # the pages of the longest sequence
        index = dict(dtype=torch.long, device=self.device)
        self.input_ids = torch.zeros(1, rows, **index)
        self.positions = torch.zeros(1, rows, **index)
        self.slots = torch.full((rows,), -1, **index)
        self.tables = torch.zeros(rows, width, **index)
        self.lens = torch.zeros(rows, **index)
        self._graphs: dict[int, Captured] = {}
        self._kv_address = _kv_address(kv)
        self.capture_s = 0.0  # start-up seconds
        self.memory_bytes = 0  # device memory the graphs hold (their pool), CUDA only
        self.steps = 0  # decode steps replayed

    @torch.inference_mode()
    def capture_all(self) -> float:
        """Capture every size now, largest first (smaller ones reuse its pool); seconds."""
        start = time.perf_counter()
        cuda = self.device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if cuda else None
        before = torch.cuda.memory_reserved(self.device) if cuda else 0
        for size in reversed(self.sizes):
            self._graphs[size] = self.capture(functools.partial(self._forward, size), pool)
        if cuda:
            torch.cuda.synchronize(self.device)
            self.memory_bytes = torch.cuda.memory_reserved(self.device) - before
        self.capture_s = time.perf_counter() - start
        return self.capture_s

    def _forward(self, size: int) -> torch.Tensor:
        step = GraphStep(self.kv, self.attend, self.slots[:size], self.tables[:size],
                         self.lens[:size])  # fmt: skip
        out = self.model(
            input_ids=self.input_ids[:, :size],
            position_ids=self.positions[:, :size],
            use_cache=False,
            logits_to_keep=0,
            trae_step=step,
        )
        return out.logits[0]

    def size_for(self, inputs: ModelInputs) -> int | None:
        """The captured size that runs this step, or None: run it eagerly."""
        n = decode_rows(inputs)
        if n is None or inputs.batch.block_tables.shape[1] > self.tables.shape[1]:
            return None
        return next((size for size in self.sizes if size >= n), None)

    def run(self, inputs: ModelInputs, size: int) -> torch.Tensor:
        """Logits [n, vocab] (float32, a copy) of a decode-only step replayed at ``size``."""
        if _kv_address(self.kv) != self._kv_address:
            raise RuntimeError("the KV pool moved after its decode graphs were captured")
        batch = inputs.batch
        n, width = batch.num_seqs, batch.block_tables.shape[1]
        self.input_ids[:, :n].copy_(inputs.input_ids)
        self.positions[:, :n].copy_(inputs.position_ids)
        self.slots[:n].copy_(batch.slot_mapping)
        self.slots[n:size].fill_(-1)
        self.lens[:n].copy_(batch.context_lens_t)
        self.lens[n:size].zero_()
        self.tables[:n, :width].copy_(batch.block_tables)  # columns past a row's pages: unread
        replay, logits = self._graphs[size]
        replay()
        self.steps += 1
        return logits[:n].to(torch.float32, copy=True)
