"""Batched LoRA benchmark: 32 concurrent requests over 8 rank-16 adapters on the engine bench model.

    .venv/bin/python bench/lora.py --quick      # smoke run: 8 new tokens, 1 repeat
    .venv/bin/python bench/lora.py              # 64 new tokens, median of 3

Three rates, same process, same prompts, greedy, eos disabled (output tokens/s):
  base   our engine, the 32 requests on the base model alone;
  lora   our engine, the same requests spread over 8 adapters (4 each), one mixed batch
         (base and lora runs alternate, so each pair sees the same machine load);
  peft   peft's PeftModel with the 8 adapters: ``generate`` per adapter, its 4 requests as one
         left-padded batch (``set_adapter`` between them).
Targets (issue 15): lora >= 0.75x base, lora >= 3x peft. Memory: the 8 adapters' own bytes and
the engine's resident slots, against the base's bytes (target <= 5%). The lora rows' tokens are
checked against peft's. Prints, never asserts: absolute rates drift on shared machines.
On an oversubscribed CPU run it with ``OMP_WAIT_POLICY=PASSIVE``: without it every small
matmul's OpenMP region spin-waits for cores other processes hold, which costs the LoRA
update's many small matmuls most (see docs/lora.md).
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

from trae_groups.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

NUM_ADAPTERS = 8
RANK = 16


def build_adapters(base: Path, root: Path, targets: list[str]) -> dict[str, Path]:
    """Eight random-init rank-16 adapters saved by peft (B random too: they change outputs)."""
    import peft
    from transformers import AutoModelForCausalLM

    folders = {f"a{i}": root / f"a{i}" for i in range(NUM_ADAPTERS)}
    if all((f / "adapter_model.safetensors").exists() for f in folders.values()):
        return folders
    model = AutoModelForCausalLM.from_pretrained(base)
    for i, folder in enumerate(folders.values()):
        torch.manual_seed(100 + i)
        config = peft.LoraConfig(
            r=RANK, lora_alpha=2 * RANK, target_modules=targets, init_lora_weights=False
        )
        wrapped = peft.get_peft_model(model, config)
        wrapped.save_pretrained(folder)
        model = wrapped.unload()  # the base again, for the next adapter
    return folders


def engine_rates(engine, prompts, adapters, max_new: int, repeats: int):
    """Base-only and mixed-adapter runs alternating, so both see the same machine load;
    returns each side's samples, the per-repeat ratios and the mixed run's tokens."""
    params = SamplingParams(max_tokens=max_new, ignore_eos=True)
    base, lora, ratios, outputs = [], [], [], None
    for _ in range(repeats):
        rates = []
        for names in (None, adapters):
            engine.pool.clear_cache()
            start = time.perf_counter()
            outputs = engine.generate(prompts, params, adapters=names)
            rates.append(sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start))
        base.append(rates[0])
        lora.append(rates[1])
        ratios.append(rates[1] / rates[0])
    return base, lora, ratios, [o.token_ids for o in outputs]


@torch.inference_mode()
def peft_rate(base: Path, folders: dict[str, Path], prompts, adapters, max_new: int, repeats: int):
    import peft

    model = peft.PeftModel.from_pretrained(peers.load_model(base), folders["a0"], adapter_name="a0")
    for name, folder in folders.items():
        if name != "a0":
            model.load_adapter(folder, adapter_name=name)
    model.eval()
    cfg = peers.greedy_config(max_new)
    by_adapter: dict[str, list[int]] = {}
    for i, name in enumerate(adapters):
        by_adapter.setdefault(name, []).append(i)

    def run() -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for name, rows in by_adapter.items():
            model.set_adapter(name)
            ids, mask = peers.left_pad([prompts[i] for i in rows])
            got = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
            for row, seq in zip(rows, got[:, ids.shape[1] :].tolist(), strict=True):
                out[row] = seq
        return out

    model.set_adapter("a0")  # warm-up
    model.generate(input_ids=torch.tensor([prompts[0]]), generation_config=peers.greedy_config(2))
    samples, outputs = [], {}
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = run()
        samples.append(len(prompts) * max_new / (time.perf_counter() - start))
    return statistics.median(samples), samples, [outputs[i] for i in range(len(prompts))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 new tokens, 1 repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--targets", default="q_proj,v_proj", help="adapters' target modules")
    parser.add_argument("--no-peft", action="store_true", help="skip the peft peer")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    peers.quiet_known_warnings()
    max_new = args.max_new_tokens or (8 if args.quick else peers.MAX_NEW_TOKENS)
    repeats = 1 if args.quick else args.repeats
    targets = args.targets.split(",")

    base = peers.build_model()
    folders = build_adapters(base, base.parent / ("loras-" + "-".join(targets)), targets)
    prompts = peers.make_prompts()
    adapters = [f"a{i % NUM_ADAPTERS}" for i in range(len(prompts))]
    print(f"machine: {peers.machine_load()}")
    print(f"{len(prompts)} requests, {NUM_ADAPTERS} adapters rank {RANK} on {targets}, "
          f"{max_new} new tokens, median of {repeats}")  # fmt: skip

    config = EngineConfig(
        pool_bytes=512 << 20, max_num_seqs=64, max_num_batched_tokens=1024,
        max_loras=NUM_ADAPTERS, max_lora_rank=RANK,
    )  # fmt: skip
    engine = LLMEngine({"bench": base}, config)  # generate() steps in this thread
    for name, folder in folders.items():
        engine.add_adapter("bench", name, folder)
    warm = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.generate([[5, 6, 7]] * (NUM_ADAPTERS + 1), warm, adapters=[None, *folders])
    base_samples, lora_samples, ratios, lora_out = engine_rates(
        engine, prompts, adapters, max_new, repeats
    )
    base_rate, lora_rate = statistics.median(base_samples), statistics.median(lora_samples)
    print(f"base  engine, base model only   {base_rate:8.1f} tok/s  {_fmt(base_samples)}")
    print(f"lora  engine, 8 adapters mixed  {lora_rate:8.1f} tok/s  {_fmt(lora_samples)}")
    print(f"      lora / base = {statistics.median(ratios):.2f}x, median of the alternating "
          f"pairs {_fmt(ratios, 2)} (target >= 0.75x)")  # fmt: skip
    if not args.no_peft:
        peft_r, peft_samples, peft_out = peft_rate(
            base, folders, prompts, adapters, max_new, repeats
        )
        print(f"peft  generate per adapter      {peft_r:8.1f} tok/s  {_fmt(peft_samples)}")
        print(f"      lora / peft = {lora_rate / peft_r:.2f}x (target >= 3x)")
        same = sum(a == b for a, b in zip(lora_out, peft_out, strict=True))
        print(f"      greedy tokens equal to peft's: {same}/{len(prompts)} requests")

    worker = engine.llms["bench"]
    base_bytes = (base / "model.safetensors").stat().st_size  # float32 weights (packed ones hide)
    own = sum(worker.adapters.adapter_bytes().values())
    slots = worker.adapters.slot_bytes()
    print(f"memory: base {base_bytes / 2**20:.1f} MiB; 8 adapters' own tensors "
          f"{own / 2**20:.2f} MiB = {own / base_bytes:.1%} of the base (target <= 5%); "
          f"resident slots (8 x rank {RANK}) {slots / 2**20:.2f} MiB = {slots / base_bytes:.1%}")  # fmt: skip


def _fmt(samples: list[float], digits: int = 1) -> str:
    return "[" + ", ".join(f"{s:.{digits}f}" for s in samples) + "]"


if __name__ == "__main__":
    main()
