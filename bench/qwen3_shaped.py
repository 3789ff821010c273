"""A Qwen3-shaped model folder for the engine benchmarks: SmolLM2-135M's sizes (30 layers,
576 wide, 9 query and 3 KV heads of 64, 1,536 MLP, tied 49,152-token embedding) with Qwen3's
per-head q/k norms, seeded random bf16 weights, and SmolLM2's tokenizer (copied from the
demo's converted folder, ``bench/smollm2.py``). No weights are downloaded.

    .venv/bin/python bench/qwen3_shaped.py                       # /tmp/trae-bench/qwen3-smollm2
    .venv/bin/python bench/vs_vllm.py --model-dir /tmp/trae-bench/qwen3-smollm2 --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from smollm2 import model_folder  # noqa: E402

SIZES = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
    tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0,
    bos_token_id=1, eos_token_id=2, pad_token_id=2,
)  # fmt: skip
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build(target: Path, smollm2: Path, seed: int = 0) -> Path:
    """The folder at ``target`` (left as it is when its weights exist)."""
    if (target / "model.safetensors").exists():
        return target
    source = model_folder(smollm2)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**SIZES), dtype=torch.bfloat16)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, target / name)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/trae-bench/qwen3-smollm2"))
    parser.add_argument("--smollm2-dir", type=Path, default=Path("/tmp/trae-bench/smollm2-135m"))
    args = parser.parse_args()
    print(build(args.model_dir, args.smollm2_dir))


if __name__ == "__main__":
    main()
