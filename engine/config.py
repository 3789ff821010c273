"""Engine configuration: one frozen dataclass, checked once."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trae_groups.engine.deadlines import POLICIES
from trae_groups.engine.spec_config import SpeculativeConfig
from trae_groups.kernels.kv_formats import KV_FORMATS

if TYPE_CHECKING:  # torch is imported where a value needs it: validating a graph reads this
    import torch  # module and must not load torch

DEFAULT_LOAD_WAIT_S = 60.0
# A decode step of the demo's model is ~35-45 ms on 2 CPU cores: a step held near 100 ms lets
# a prompt beside running streams use about half of each step, and keeps a short chat behind a
# long prompt within about twice its time alone (bench/long_prefill.py)
DEFAULT_STEP_TIME_TARGET_MS = 100.0
# The share of a GPU's memory the process may fill (weights, pool, everything): vLLM's
# gpu_memory_utilization default. The rest is headroom for activations and other processes.
DEFAULT_GPU_MEMORY_RESERVATION = 0.9


class _TorchDtypes(Mapping[str, "torch.dtype"]):
    """dtype name -> torch dtype; torch is imported at the first lookup, not with the names."""

    def __init__(self, *names: str):
        self._names = names

    def __getitem__(self, name: str) -> torch.dtype:
        if name not in self._names:
            raise KeyError(name)
        import torch

        return getattr(torch, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


DTYPES = _TorchDtypes("float32", "bfloat16", "float16")
# "auto": each model whose graph does not set a dtype takes what the hardware runs fast,
# if the accuracy gate allows (engine/auto_weights.py); float32 is what it starts from
ENGINE_DTYPES = (*DTYPES, "auto")
QUANTIZATIONS = ("int8",)  # weight quantizations the weight store applies (engine/quant.py)
KV_CACHE_DTYPES = ("auto", *KV_FORMATS)
MODEL_FORWARDS = ("auto", "transformers")
# which kernel library multiplies a CPU model's linears (engine/fast_linear.py): "auto" is
# AMD's zentorch (ZenDNN) for float32 weights where it is installed (the ``zen`` extra) and
# the CPU is an AMD one, oneDNN's packed weights otherwise; the others force one
LINEAR_LIBRARIES = ("auto", "onednn", "zentorch")
COMPILE_MODES = (True, False, "auto")
# What compile="auto" compiles when TRAE_COMPILE=1 asks for it: the single-stream decode
# step, run beside serving (~50 s cold, ~7 s with inductor's cache warm). Without it "auto"
# stays eager: with the native attention kernels the eager step measured as fast or faster
# (docs/engine.md). Larger batches are matmul-bound and gain less per second of compile.
AUTO_COMPILE_SIZES = (1,)
# "1" makes compile="auto" compile AUTO_COMPILE_SIZES, "0" keeps it eager even then, for a
# process and the engine processes it starts; explicit True/False win
COMPILE_ENV = "TRAE_COMPILE"
# Compiled constraints (engine/constraints.py measures them): one request's may take this
# many bytes (a larger one is refused, a 422 naming the field that asked), and the compiled
# ones kept for reuse, per model's tokenizer, this many in all (least recently used dropped)
DEFAULT_MAX_CONSTRAINT_BYTES = 64 << 20
DEFAULT_CONSTRAINT_CACHE_BYTES = 256 << 20


@dataclass(frozen=True)
class EngineConfig:
    """The pool is sized when serving starts, after the weights are loaded
    (``pool_size``): ``pool_bytes`` if given; else, on a GPU, ``gpu_memory_reservation``
    of the device's memory minus what is in use then (weights, the CUDA context, other
    processes); else, on CPU, ``pool_fraction`` of the RAM still available then.
    page_bytes=None sizes pages to hold ``tokens_per_page`` tokens of the largest
    model registered at start-up; smaller models fit more tokens in a page."""

    device: str = "cpu"
    dtype: str = "float32"
    pool_bytes: int | None = None
    pool_fraction: float = 0.1  # CPU: of the RAM available once the weights are loaded
    gpu_memory_reservation: float | None = None  # GPU: None = DEFAULT_GPU_MEMORY_RESERVATION
    page_bytes: int | None = None
    tokens_per_page: int = 16
    max_num_seqs: int = 64
    # prompt tokens a step may carry: larger steps run the linears nearer their peak (what
    # 2,048 bought over 512: docs/engine.md, Scheduling); served steps beside decodes are
    # held to step_time_target_ms whatever this is
    max_num_batched_tokens: int = 2048
    # while other requests wait, one prompt chunk takes at most this many tokens of a
    # step, so a long prompt never keeps them out; None: max_num_batched_tokens // 4
    long_prefill_token_threshold: int | None = None
    # while sequences decode, a step carries only the prompt tokens that keep it near this
    # many milliseconds (the model's step cost is measured as it runs, engine/step_cost.py),
    # so a long prompt slows the streams beside it by a bounded factor; None: a prompt chunk
    # beside decodes may take the whole budget. Offline ``generate()`` (no loop thread, no
    # one streaming) never holds prompts back: there, throughput is all that counts
    step_time_target_ms: float | None = DEFAULT_STEP_TIME_TARGET_MS
    max_prompt_tokens: int | None = None  # longer prompts are refused; None: max_model_len - 1
    max_tokens_limit: int | None = None  # a request asking to generate more is refused
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_cache: bool = True
    fast_linear: bool = True  # oneDNN pre-packed linears on CPU, when available
    linear_library: str = "auto"  # one of LINEAR_LIBRARIES
    # which forward runs a causal LM on CPU: "auto" is our own for the families it knows
    # (engine/flat_forward.py: Llama, Mistral, Qwen2, Qwen3) and transformers' for the rest;
    # "transformers" is transformers' model classes with our attention for every model
    model_forward: str = "auto"
    # weights of the LLMs the engine loads itself: None (as the dtype says) or "int8"
    # (engine/quant.py); a graph sets it per model
    quantization: str | None = None
    # what KV pages hold: "auto" (the model's dtype), "int8" or "fp8" (one byte per value and
    # a float16 scale per token and KV head; fp8 on CUDA devices of capability 8.9 and up)
    kv_cache_dtype: str = "auto"
    attention_backend: str | None = None  # None: best available
    # waiting work's order (engine/deadlines.py): "deadline": earliest deadline, then deeper,
    # then older first; "graph": deeper, then older; "fifo": older first
    scheduling: str = "deadline"
    num_threads: int | None = None
    # LoRA adapters of one model resident at once (more are loaded on demand, least recently
    # used evicted) and the highest adapter rank a model takes (its slots are this wide)
    max_loras: int = 4
    max_lora_rank: int = 16
    # decode-only steps at fixed batch sizes (the batch padded up to one of these), prepared
    # once the pool has its size (at start): torch.compile on CPU (seconds to minutes each),
    # CUDA graphs on a GPU with the triton backend (engine/decode_graphs.py); others eager.
    # True: every size of compile_batch_sizes; "auto": none, or AUTO_COMPILE_SIZES where it
    # works with TRAE_COMPILE=1 (``auto_compile_reason``); False: none
    compile: bool | str = "auto"
    compile_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    # bytes of weights held at once: on-demand models are evicted (least recently used,
    # idle) to stay within it; None: no limit (engine/residency.py)
    weight_budget: int | None = None
    # seconds a request waits for its on-demand model to become resident, then 503;
    # None: DEFAULT_LOAD_WAIT_S
    load_wait_s: float | None = None
    max_constraint_bytes: int = DEFAULT_MAX_CONSTRAINT_BYTES
    constraint_cache_bytes: int = DEFAULT_CONSTRAINT_CACHE_BYTES
    # speculative decoding of every causal LM (a graph sets it per model): None is off;
    # engine/speculative.py has the methods, ranges and defaults
    speculative: SpeculativeConfig | None = None

    def __post_init__(self):
        if self.dtype not in ENGINE_DTYPES:
            raise ValueError(f"dtype: must be one of {list(ENGINE_DTYPES)}, got {self.dtype!r}")
        if self.pool_bytes is not None and self.pool_bytes <= 0:
            raise ValueError("pool_bytes: must be > 0")
        if not 0.0 < self.pool_fraction <= 0.95:
            raise ValueError("pool_fraction: must be in (0, 0.95]")
        if self.gpu_memory_reservation is not None and not 0.0 < self.gpu_memory_reservation <= 1:
            raise ValueError("gpu_memory_reservation: must be in (0, 1]")
        for name in ("tokens_per_page", "max_num_seqs", "max_num_batched_tokens", "max_loras"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        for name in ("long_prefill_token_threshold", "max_prompt_tokens", "max_tokens_limit"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1 (or None)")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(
                f"quantization: must be one of {list(QUANTIZATIONS)} or None, "
                f"got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype: must be one of {list(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.model_forward not in MODEL_FORWARDS:
            raise ValueError(
                f"model_forward: must be one of {list(MODEL_FORWARDS)}, got {self.model_forward!r}"
            )
        if self.linear_library not in LINEAR_LIBRARIES:
            raise ValueError(
                f"linear_library: must be one of {list(LINEAR_LIBRARIES)}, "
                f"got {self.linear_library!r}"
            )
        if self.scheduling not in POLICIES:
            raise ValueError(f"scheduling: must be one of {POLICIES}, got {self.scheduling!r}")
        if self.step_time_target_ms is not None and not self.step_time_target_ms > 0:
            raise ValueError("step_time_target_ms: must be > 0 (or None)")
        if self.max_lora_rank < 1:
            raise ValueError("max_lora_rank: must be >= 1")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile: must be one of {list(COMPILE_MODES)}, got {self.compile!r}")
        if not self.compile_batch_sizes or min(self.compile_batch_sizes) < 1:
            raise ValueError("compile_batch_sizes: must be a non-empty list of sizes >= 1")
        if self.weight_budget is not None and self.weight_budget <= 0:
            raise ValueError("weight_budget: must be > 0 (or None)")
        for name in ("max_constraint_bytes", "constraint_cache_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if self.load_wait_s is not None and self.load_wait_s <= 0:
            raise ValueError("load_wait_s: must be > 0")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError("speculative: must be a SpeculativeConfig (or None)")
        if self.page_bytes is not None and (self.page_bytes < 64 or self.page_bytes % 64):
            raise ValueError("page_bytes: must be a positive multiple of 64")

    @property
    def long_prefill_tokens(self) -> int:
        """The chunk cap the scheduler applies while others wait."""
        if self.long_prefill_token_threshold is not None:
            return self.long_prefill_token_threshold
        return max(1, self.max_num_batched_tokens // 4)

    @property
    def step_target_s(self) -> float | None:
        return None if self.step_time_target_ms is None else self.step_time_target_ms / 1000

    @property
    def load_wait(self) -> float:
        return DEFAULT_LOAD_WAIT_S if self.load_wait_s is None else self.load_wait_s

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype models load in; for "auto", float32, the reference the choice starts from."""
        return DTYPES[self.dtype if self.dtype in DTYPES else "float32"]

    @property
    def memory_reservation(self) -> float:
        if self.gpu_memory_reservation is None:
            return DEFAULT_GPU_MEMORY_RESERVATION
        return self.gpu_memory_reservation

    @property
    def kv_storage(self) -> torch.dtype | None:
        """The one-byte dtype KV pages hold, or None: the model's own dtype."""
        from trae_groups.kernels.kv_quant import KV_STORAGE

        return KV_STORAGE[self.kv_cache_dtype][0] if self.kv_cache_dtype in KV_STORAGE else None

    def pool_size(self) -> tuple[int, str]:
        """Bytes for the pool now, and where the figure comes from (for the log)."""
        if self.pool_bytes is not None:
            return self.pool_bytes, "pool_bytes"
        import torch

        if torch.device(self.device).type == "cuda":
            free, total = torch.cuda.mem_get_info(torch.device(self.device))
            size = reserved_pool_bytes(total, free, self.memory_reservation)
            share, in_use = self.memory_reservation * 100, (total - free) / 2**30
            return size, f"{share:g}% of {self.device} less {in_use:.1f} GiB in use"
        return int(available_memory(self.device) * self.pool_fraction), (
            f"{self.pool_fraction * 100:g}% of available RAM"
        )


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes from 8388608, "512MiB", "1.5G", "64kb" (powers of 1024); ValueError else."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"not a size: {text!r} (try 512MiB or 2G)")
    unit = match.group(2).lower()
    scale = 1024 ** ("kmgt".index(unit) + 1) if unit else 1
    return int(float(match.group(1)) * scale)


def reserved_pool_bytes(total: int, free: int, reservation: float) -> int:
    """The pool's share of a device: ``reservation`` of its memory minus what is already
    in use by anyone (``total - free``); 0 when nothing is left."""
    return max(0, int(total * reservation) - (total - free))


def available_memory(device: str) -> int:
    import torch

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
