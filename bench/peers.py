"""The engine benchmark's workload, and what transformers itself achieves on it.

Everything a user could run without us: ``generate`` one request at a time, ``generate`` on the
whole batch with left padding, and transformers' continuous batching (long-lived manager and
``generate_batch``), plus this machine's roofline, so bench/engine.py can place our engine
between "what people get today" and "what the hardware allows". Timings are medians of repeats
within one process; absolute numbers drift on shared machines, ratios are what matter.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

# The benchmark model: Qwen3 architecture, ~58M params, float32, random weights.
MODEL_CONFIG = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
MODEL_SEED = 1234
PROMPT_SEED = 0
NUM_PROMPTS = 32
PROMPT_LEN = (48, 80)  # inclusive range of prompt lengths
MAX_NEW_TOKENS = 64
PAD_ID = 0

# transformers' continuous batching sized explicitly: unsized, it reserves 60% of RAM.
CB_PAGE_SIZE, CB_NUM_BLOCKS, CB_MAX_BATCH_TOKENS = 64, 128, 1024


class _DropKnown(logging.Filter):
    """Drops the log lines this workload triggers on purpose (eos disabled, no psutil)."""

    KNOWN = ("`eos_token_id` should consist of positive integers", "psutil")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(k in record.getMessage() for k in self.KNOWN)


def quiet_known_warnings() -> None:
    """Silence per-call warnings about the deliberate eos=-1 and CB's missing psutil."""
    for name in ("transformers.generation.utils", "ContinuousBatchingLogger"):
        logging.getLogger(name).addFilter(_DropKnown())


@dataclass
class PeerResult:
    """Median output tokens/s of one way of serving the workload, with its greedy outputs."""

    name: str
    tokens_per_s: float
    samples: list[float] = field(default_factory=list)
    outputs: list[list[int]] | None = None  # new tokens per prompt, in prompt order
    note: str = ""


def machine_load() -> str:
    """Load average and CPU pressure: how contended this run's cores were (others share them)."""
    parts = []
    try:
        parts.append("loadavg " + " ".join(Path("/proc/loadavg").read_text().split()[:3]))
        some = Path("/proc/pressure/cpu").read_text().splitlines()[0].split()
        parts.append("cpu pressure " + " ".join(some[1:3]))
    except (OSError, IndexError):
        pass
    # Under contention, OpenMP's default spin-waiting makes small oneDNN matmuls 3-30x slower.
    parts.append(f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}")
    return ", ".join(parts)


def default_model_dir() -> Path:
    return Path(os.environ.get("TRAE_BENCH_MODEL_DIR", "/tmp/trae-bench/qwen3-58m"))


def build_model(model_dir: str | os.PathLike[str] | None = None) -> Path:
    """Save the random-weight benchmark model once; later calls reuse it if the config matches."""
    path = Path(model_dir) if model_dir is not None else default_model_dir()
    stamp = path / "trae_bench.json"
    want = {"config": MODEL_CONFIG, "seed": MODEL_SEED}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return path
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(MODEL_SEED)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**MODEL_CONFIG), dtype=torch.float32)
    model.generation_config.eos_token_id = -1
    model.save_pretrained(path)
    stamp.write_text(json.dumps(want))
    return path


def make_prompts(
    n: int = NUM_PROMPTS,
    lengths: tuple[int, int] = PROMPT_LEN,
    vocab: int = MODEL_CONFIG["vocab_size"],
    seed: int = PROMPT_SEED,
) -> list[list[int]]:
    """Seeded random token-id prompts (ids from 3 up: never pad/bos/eos)."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(lengths[0], lengths[1] + 1, (n,), generator=gen)
    return [torch.randint(3, vocab, (int(L),), generator=gen).tolist() for L in lens]


def greedy_config(max_new_tokens: int) -> GenerationConfig:
    """Greedy, eos disabled: every request produces exactly max_new_tokens."""
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=-1,
        pad_token_id=PAD_ID,
    )


def load_model(model_dir: str | os.PathLike[str], attn_implementation: str = "sdpa") -> nn.Module:
    """A fresh float32 instance in eval mode (never share one between plain generate and CB)."""
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attn_implementation
    )
    return model.eval()


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


@torch.inference_mode()
def _generate_one(model: nn.Module, prompt: Sequence[int], cfg: GenerationConfig) -> list[int]:
    ids = torch.tensor([list(prompt)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    return out[0, ids.shape[1] :].tolist()


def generate_sequential(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    repeats: int,
    subset: int | None = 4,
) -> PeerResult:
    """(a) ``generate`` one request at a time.

    Each repeat times the first `subset` requests back to back and divides their output tokens
    by the wall time; this per-token rate stands for all prompts (the requests are independent,
    so the rate of a subset is the rate of the whole, up to prompt-length mix).
    """
    cfg = greedy_config(max_new_tokens)
    chosen = list(prompts if subset is None else prompts[:subset])
    _generate_one(model, chosen[0], cfg)  # warm-up
    samples = []
    for _ in range(repeats):
        elapsed, _ = _timed(lambda: [_generate_one(model, p, cfg) for p in chosen])
        samples.append(len(chosen) * max_new_tokens / elapsed)
    note = f"timed {len(chosen)} of {len(prompts)} requests per repeat; rate extrapolated"
    if len(chosen) == len(prompts):
        note = f"all {len(prompts)} requests timed"
    return PeerResult("generate, one at a time", statistics.median(samples), samples, None, note)


def reference_outputs(
    model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> tuple[list[list[int]], float]:
    """Greedy tokens of unpadded batch-1 ``generate`` for every prompt (the parity reference),
    and the output tokens/s of that pass (a full, unextrapolated sample of (a))."""
    cfg = greedy_config(max_new_tokens)
    _generate_one(model, prompts[0], greedy_config(2))  # warm-up
    elapsed, outs = _timed(lambda: [_generate_one(model, p, cfg) for p in prompts])
    return outs, len(prompts) * max_new_tokens / elapsed


def left_pad(prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(list(p))
        mask[row, width - len(p) :] = 1
    return ids, mask


def generate_padded(
    model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, repeats: int
) -> PeerResult:
    """(b) one ``generate`` call on all prompts, left-padded to the longest."""
    cfg = greedy_config(max_new_tokens)
    ids, mask = left_pad(prompts)

    @torch.inference_mode()
    def run() -> torch.Tensor:
        return model.generate(ids, attention_mask=mask, generation_config=cfg)

    run()  # warm-up (the first call also builds the cache classes)
    samples, out = [], None
    for _ in range(repeats):
        elapsed, out = _timed(run)
        samples.append(len(prompts) * max_new_tokens / elapsed)
    outputs = out[:, ids.shape[1] :].tolist()
    return PeerResult(
        "generate, all at once (left pad)", statistics.median(samples), samples, outputs
    )


def cb_config() -> transformers.ContinuousBatchingConfig:
    return transformers.ContinuousBatchingConfig(
        page_size=CB_PAGE_SIZE, num_blocks=CB_NUM_BLOCKS, max_batch_tokens=CB_MAX_BATCH_TOKENS
    )


def collect_results(mgr, request_ids: list[str], timeout_s: float) -> dict[str, list[int]]:
    """Wait for every request of one round; fail loudly rather than hang or drop one."""
    want, got = set(request_ids), {}
    deadline = time.monotonic() + timeout_s
    while want - got.keys():
        if time.monotonic() > deadline:
            raise TimeoutError(f"continuous batching: {len(want - got.keys())} requests unfinished")
        result = mgr.get_result(timeout=1.0)
        if result is None:
            if not mgr.is_running():
                raise RuntimeError("continuous batching thread died")
            continue
        if result.error:
            raise RuntimeError(f"continuous batching request failed: {result.error}")
        if result.is_finished() and result.request_id in want:
            got[result.request_id] = list(result.generated_tokens)
    return got


def cb_manager(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    repeats: int,
    timeout_s: float = 600.0,
) -> PeerResult:
    """(c) transformers' continuous batching, one long-lived manager (setup not timed).

    Each repeat submits all prompts at once and waits for all of them. Use a dedicated model
    instance: after a paged run it gives wrong tokens from plain ``generate``.
    """
    inputs = [list(p) for p in prompts]
    mgr = model.init_continuous_batching(
        generation_config=greedy_config(max_new_tokens), continuous_batching_config=cb_config()
    )
    mgr.start()
    try:
        warm = mgr.add_requests(inputs=inputs[:2], max_new_tokens=2)
        collect_results(mgr, warm, timeout_s)
        samples, outputs = [], None
        for _ in range(repeats):
            start = time.perf_counter()
            ids = mgr.add_requests(inputs=inputs, max_new_tokens=max_new_tokens)
            got = collect_results(mgr, ids, timeout_s)
            samples.append(len(inputs) * max_new_tokens / (time.perf_counter() - start))
            outputs = [got[i] for i in ids]
    finally:
        mgr.stop(block=True)
        mgr.destroy()
    return PeerResult(
        "transformers CB, long-lived manager", statistics.median(samples), samples, outputs
    )


def cb_generate_batch(
    model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, repeats: int
) -> PeerResult:
    """(c') ``model.generate_batch``: what a user calls once; manager setup and warm-up timed."""
    inputs = [list(p) for p in prompts]
    cfg = greedy_config(max_new_tokens)
    samples, outputs = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        res = model.generate_batch(
            inputs=inputs, generation_config=cfg, continuous_batching_config=cb_config()
        )
        samples.append(len(inputs) * max_new_tokens / (time.perf_counter() - start))
        outputs = [list(r.generated_tokens) for r in res.values()]
    return PeerResult(
        "transformers CB, generate_batch (setup incl.)",
        statistics.median(samples),
        samples,
        outputs,
    )


@torch.inference_mode()
def batch1_latency(
    model: nn.Module, prompt: Sequence[int], max_new_tokens: int, repeats: int
) -> tuple[float, float]:
    """Batch-1 (prefill ms, decode ms/token), from generate with 1 vs max_new_tokens tokens."""
    ids = torch.tensor([list(prompt)])
    mask = torch.ones_like(ids)

    def gen(n: int) -> float:
        return _timed(
            lambda: model.generate(ids, attention_mask=mask, generation_config=greedy_config(n))
        )[0]

    gen(2)
    short = statistics.median(gen(1) for _ in range(repeats))
    full = statistics.median(gen(max_new_tokens) for _ in range(repeats))
    return short * 1e3, (full - short) / (max_new_tokens - 1) * 1e3


def count_equal(got: Sequence[Sequence[int]] | None, want: Sequence[Sequence[int]]) -> int:
    """How many prompts' generated tokens are identical."""
    if got is None:
        return 0
    return sum(list(g) == list(w) for g, w in zip(got, want, strict=False))


# ------------------------------------------------------------------------------ roofline


@dataclass
class Roofline:
    """This machine's measured limits, and what they imply for the benchmark model."""

    read_gb_s: float
    copy_gb_s: float
    gemm_gflops: dict[str, float]
    weight_bytes_per_step: int
    flops_per_token: int

    @property
    def batch1_floor_ms(self) -> float:
        """Every decode step reads every weight once: the batch-1 lower bound."""
        return self.weight_bytes_per_step / (self.read_gb_s * 1e9) * 1e3

    def batch_ceiling_tokens_s(self, key: str) -> float:
        """Large-batch upper bound: compute-bound at the given GEMM rate."""
        return self.gemm_gflops[key] * 1e9 / self.flops_per_token


def _median_rate(fn: Callable[[], object], work: float, repeats: int, inner: int = 1) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append(work * inner / (time.perf_counter() - start))
    return statistics.median(samples)


def measure_bandwidth(repeats: int, mbytes: int = 512) -> tuple[float, float]:
    """(read GB/s via a sum, copy GB/s counting read + write) on a buffer far beyond cache."""
    n = mbytes * 2**20 // 4
    src, dst = torch.ones(n), torch.empty(n)
    read = _median_rate(lambda: src.sum(), src.nbytes / 1e9, repeats)
    copy = _median_rate(lambda: dst.copy_(src), 2 * src.nbytes / 1e9, repeats)
    return read, copy


@torch.inference_mode()
def measure_gemm(repeats: int) -> dict[str, float]:
    """GFLOP/s of a square 2048³ GEMM and the decode-shaped 32×512→1536, plain and packed."""
    from trae_groups.engine.fast_linear import PackedLinear, fast_linear_available

    torch.manual_seed(0)
    rates: dict[str, float] = {}
    cases = {"2048³": (2048, 2048, 2048, 1), "32×512×1536": (32, 512, 1536, 50)}
    for label, (m, k, n, inner) in cases.items():
        x, lin = torch.randn(m, k), nn.Linear(k, n, bias=False)
        work = 2 * m * k * n / 1e9
        rates[f"{label} nn.Linear"] = _median_rate(lambda x=x, f=lin: f(x), work, repeats, inner)
        if fast_linear_available():
            pk = PackedLinear.from_linear(lin)
            rates[f"{label} packed"] = _median_rate(lambda x=x, f=pk: f(x), work, repeats, inner)
    return rates


def model_costs(model: nn.Module) -> tuple[int, int]:
    """(weight bytes one decode step reads, matmul FLOPs per token) of a causal LM.

    The input embedding contributes one row per token, so it is left out of both; attention
    over the cache adds ~4·layers·heads·head_dim·context FLOPs (≈2% at context 100), also left out.
    """
    emb = model.get_input_embeddings().weight
    bytes_read = sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb)
    linear_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    return bytes_read, 2 * linear_params


def measure_roofline(model: nn.Module, repeats: int) -> Roofline:
    read, copy = measure_bandwidth(repeats)
    bytes_read, flops = model_costs(model)
    return Roofline(read, copy, measure_gemm(repeats), bytes_read, flops)
