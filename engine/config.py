"""Engine configuration: one frozen dataclass, checked once."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    """pool_bytes wins over pool_fraction (of the device's available memory).
    page_bytes=None sizes pages to hold ``tokens_per_page`` tokens of the largest
    model registered at start-up; smaller models fit more tokens in a page."""

    device: str = "cpu"
    dtype: str = "float32"
    pool_bytes: int | None = None
    pool_fraction: float = 0.1
    page_bytes: int | None = None
    tokens_per_page: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # while other requests wait, one prompt chunk takes at most this many tokens of a
    # step, so a long prompt never keeps them out; None: max_num_batched_tokens // 4
    long_prefill_token_threshold: int | None = None
    max_prompt_tokens: int | None = None  # longer prompts are refused; None: max_model_len - 1
    max_tokens_limit: int | None = None  # a request asking to generate more is refused
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_cache: bool = True
    fast_linear: bool = True  # oneDNN pre-packed linears on CPU, when available
    attention_backend: str | None = None  # None: best available
    scheduling: str = "graph"  # "graph": deeper, then older work first; "fifo": older first
    num_threads: int | None = None
    # LoRA adapters of one model resident at once (more are loaded on demand, least recently
    # used evicted) and the highest adapter rank a model takes (its slots are this wide)
    max_loras: int = 4
    max_lora_rank: int = 16
    # torch.compile decode-only steps (CPU), the batch padded up to one of these sizes; each is
    # compiled when the model is added (seconds each); other steps run eagerly
    compile: bool = False
    compile_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.pool_bytes is not None and self.pool_bytes <= 0:
            raise ValueError("pool_bytes: must be > 0")
        if not 0.0 < self.pool_fraction <= 0.95:
            raise ValueError("pool_fraction: must be in (0, 0.95]")
        for name in ("tokens_per_page", "max_num_seqs", "max_num_batched_tokens", "max_loras"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        for name in ("long_prefill_token_threshold", "max_prompt_tokens", "max_tokens_limit"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1 (or None)")
        if self.max_lora_rank < 1:
            raise ValueError("max_lora_rank: must be >= 1")
        if self.scheduling not in ("graph", "fifo"):
            raise ValueError(f"scheduling: must be 'graph' or 'fifo', got {self.scheduling!r}")
        if not self.compile_batch_sizes or min(self.compile_batch_sizes) < 1:
            raise ValueError("compile_batch_sizes: must be a non-empty list of sizes >= 1")
        if self.page_bytes is not None and (self.page_bytes < 64 or self.page_bytes % 64):
            raise ValueError("page_bytes: must be a positive multiple of 64")

    @property
    def long_prefill_tokens(self) -> int:
        """The chunk cap the scheduler applies while others wait."""
        if self.long_prefill_token_threshold is not None:
            return self.long_prefill_token_threshold
        return max(1, self.max_num_batched_tokens // 4)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def pool_size(self) -> int:
        if self.pool_bytes is not None:
            return self.pool_bytes
        return int(available_memory(self.device) * self.pool_fraction)


def available_memory(device: str) -> int:
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
