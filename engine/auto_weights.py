"""``dtype: auto`` / ``quantization: auto``: pick a model's weights from the hardware, then
check accuracy before serving.

``candidates`` is a pure function of a ``Hardware`` (inject one in tests): the most compact
choice the hardware runs fast first, float32 (the reference) last. ``load_auto`` loads the
float32 reference and each candidate in turn through the weight store, runs the accuracy
gate (``engine/accuracy_gate.py``), keeps the first that passes and releases the rest; a
refusal is logged with its figures and the next candidate is tried. The choice and its
reason travel on the ``LoadedModel`` (``choice``), which ``trae model info`` shows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from trae_groups.engine import accuracy_gate
from trae_groups.engine.hardware import Hardware
from trae_groups.engine.tasks import generates
from trae_groups.engine.weights import LoadedModel, WeightStore
from trae_groups.kernels import onednn_calls

log = logging.getLogger("trae_groups.engine")


@dataclass(frozen=True)
class WeightChoice:
    dtype: torch.dtype
    quantize: str | None
    reason: str

    @property
    def label(self) -> str:
        return self.quantize or str(self.dtype).removeprefix("torch.")


def candidates(
    hw: Hardware,
    task: str,
    *,
    dtype_auto: bool,
    quant_auto: bool,
    base: torch.dtype = torch.float32,
) -> list[WeightChoice]:
    """What to try, in order; the last entry needs no gate (it is ``base``, or float32)."""
    tried: list[WeightChoice] = []
    if quant_auto and hw.device == "cpu" and hw.int8_dot:
        tried.append(WeightChoice(torch.float32, "int8", f"{hw.describe()}: int8 dot products"))
        # GPU int8/fp8 weights are not implemented: a quantization: auto there stays float
    if dtype_auto and hw.bf16_math:
        tried.append(WeightChoice(torch.bfloat16, None, f"{hw.describe()}: bf16 matmuls"))
    elif dtype_auto and hw.bf16_panels and onednn_calls.bf16_panels_built():
        # (without a C compiler the panels are not built, and bf16 weights would be float32
        # copies at float32's speed: no reason to try bf16)
        why = f"{hw.describe()}: bf16 weights on our AVX2 panels, half float32's bytes"
        tried.append(WeightChoice(torch.bfloat16, None, why))
    elif dtype_auto and hw.device == "cuda":
        tried.append(WeightChoice(torch.float16, None, f"{hw.describe()}: no bf16, fp16"))
    final = torch.float32 if dtype_auto else base
    tried.append(WeightChoice(final, None, "float reference"))
    return tried


@dataclass(frozen=True)
class AutoDecision:
    chosen: WeightChoice
    why: str  # the choice, the gate's figures, refusals before it


def load_auto(
    store: WeightStore,
    path: str | Path,
    task: str,
    hw: Hardware,
    *,
    dtype_auto: bool,
    quant_auto: bool,
    base: torch.dtype = torch.float32,
    bound: float = accuracy_gate.DEFAULT_MAX_DROP,
    eval_set: list[tuple[str, str]] | None = None,
    **load_kwargs: Any,
) -> tuple[LoadedModel, AutoDecision]:
    """Load ``path`` for ``task`` with the best candidate that passes the gate (on
    ``eval_set``, (text, label) pairs, for a classifier that has one)."""
    options = candidates(hw, task, dtype_auto=dtype_auto, quant_auto=quant_auto, base=base)
    reference: LoadedModel | None = None
    refused: list[str] = []
    for choice in options[:-1]:
        loaded = store.load(path, task, dtype=choice.dtype, quantize=choice.quantize,
                            **load_kwargs)  # fmt: skip
        if loaded.loads > 1:
            # the store already holds this instance for another graph, node or version: it
            # serves in these weights (gated then, or asked for by name), and its forward may
            # be ours by now, which the gate's transformers forward cannot run
            if reference is not None:
                store.unload_model(reference)
            why = loaded.choice or f"{choice.label} (already loaded so by another graph)"
            return loaded, AutoDecision(replace(choice), why)
        reference = reference or store.load(path, task, dtype=torch.float32, **load_kwargs)
        result = _gate(reference, loaded, task, bound, eval_set)
        if result.passed:
            why = f"{choice.label} ({choice.reason}); gate passed: {result.detail}"
            store.unload_model(reference)
            return _decided(loaded, choice, why, refused)
        log.warning(
            "%s: %s refused by the accuracy gate (drop %.2f%% > %.2f%%): %s",
            path, choice.label, 100 * result.drop, 100 * bound, result.detail,
        )  # fmt: skip
        refused.append(f"{choice.label} refused ({result.detail})")
        store.unload_model(loaded)
    last = options[-1]
    if reference is not None and last.dtype == torch.float32 and last.quantize is None:
        loaded = reference
    else:
        if reference is not None:
            store.unload_model(reference)
        loaded = store.load(path, task, dtype=last.dtype, **load_kwargs)
    return _decided(loaded, last, f"{last.label} ({last.reason})", refused)


def _decided(loaded: LoadedModel, choice: WeightChoice, why: str, refused: list[str]):
    why = "; ".join([*refused, why]) if refused else why
    loaded.choice = why
    log.info("%s: weights %s", loaded.name, why)
    return loaded, AutoDecision(replace(choice), why)


def _gate(reference: LoadedModel, candidate: LoadedModel, task: str, bound: float, eval_set):
    ref, cand, tok = reference.model, candidate.model, reference.tokenizer
    if eval_set and task == "classify":
        limit = reference.max_length
        return accuracy_gate.check_classifier(ref, cand, tok, eval_set, bound, max_length=limit)
    if generates(task):
        return accuracy_gate.check_llm(ref, cand, tok, bound, max_length=reference.max_length)
    return accuracy_gate.check_encoder(ref, cand, tok, task, bound, max_length=reference.max_length)
