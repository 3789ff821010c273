"""Reading and checking PEFT LoRA adapter folders against a loaded base model.

An adapter folder is what ``peft``'s ``save_pretrained`` writes: ``adapter_config.json``
and ``adapter_model.safetensors``. peft reads both (``PeftConfig.from_pretrained``,
``load_peft_weights``); this module decides whether the engine can serve it: plain LoRA
on linear layers only (no DoRA, no other adapter type, no trained bias or whole modules
to save), every tensor's shape fitting the base's module, its rank within the engine's
maximum, and its config agreeing with its tensors (``r`` is their rank, ``lora_alpha`` is
finite and positive, every ``target_modules`` entry is a module of the base that the
tensors cover: an adapter that would silently do nothing, or turn every reply into NaN,
is refused by name). What comes out is one ``AdapterWeights``: per targeted linear, ``A`` [r, in]
and ``B`` [r, out] with peft's scaling (``alpha / r``, or ``alpha / sqrt(r)`` for rsLoRA)
folded into ``B``, in the model's dtype.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from trae_groups.engine.errors import ModelLoadError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# LoraConfig options that change what the adapter computes in ways the engine does not do
_REFUSED = {
    "use_dora": "DoRA (use_dora) is not supported; merge it or train plain LoRA",
    "lora_bias": "a trained LoRA bias (lora_bias) is not supported",
    "modules_to_save": "modules_to_save (whole trained modules) is not supported",
    "target_parameters": "LoRA on parameters (target_parameters) is not supported",
    "layer_replication": "layer_replication is not supported",
    "trainable_token_indices": "trainable_token_indices is not supported",
    "use_qalora": "QALoRA (use_qalora) is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
}


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter, checked against its base: module path -> (A [r, in], B*scale [r, out])."""

    path: str
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _ in self.modules.values())

    @property
    def parameters(self) -> int:
        return sum(t.numel() for pair in self.modules.values() for t in pair)

    @property
    def nbytes(self) -> int:
        """What the adapter's own tensors take (at their own rank)."""
        return sum(t.numel() * t.element_size() for pair in self.modules.values() for t in pair)


def read_adapter(
    folder: str | Path, model: nn.Module, max_rank: int, dtype: torch.dtype
) -> AdapterWeights:
    """Read ``folder`` with peft and check it fits ``model``; ModelLoadError says why not."""
    path = Path(folder).expanduser().resolve()
    config = _read_config(path)
    tensors = _read_tensors(path)
    by_module = _pair_up(path, tensors)
    _check_config(path, config, by_module, model)
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, (a, b) in sorted(by_module.items()):
        base = _base_linear(path, model, name)
        rank = a.shape[0]
        _check_shapes(path, name, a, b, base)
        if rank > max_rank:
            raise ModelLoadError(
                str(path), f"{name} has rank {rank}; this model takes at most {max_rank} "
                "(max_lora_rank)"
            )  # fmt: skip
        scale = _scaling(config, name, rank)
        modules[name] = (
            a.to(dtype).contiguous(),
            (b.to(torch.float32) * scale).to(dtype).T.contiguous(),
        )
    if not modules:
        raise ModelLoadError(str(path), f"{WEIGHTS_FILE} holds no LoRA weights")
    return AdapterWeights(str(path), modules)


def _read_config(path: Path):
    try:
        from peft import PeftConfig
    except ImportError:
        raise ModelLoadError(
            str(path), "serving LoRA adapters needs peft: pip install 'trae-groups[lora]'"
        ) from None
    if not path.is_dir():
        raise ModelLoadError(str(path), "no such adapter folder")
    if not (path / CONFIG_FILE).is_file():
        raise ModelLoadError(str(path), f"no {CONFIG_FILE}: not a PEFT adapter folder")
    try:
        config = PeftConfig.from_pretrained(str(path))
    except Exception as exc:
        raise ModelLoadError(str(path), f"{CONFIG_FILE} cannot be read: {exc}") from exc
    kind = str(getattr(config.peft_type, "value", config.peft_type))
    if kind != "LORA":
        raise ModelLoadError(str(path), f"{CONFIG_FILE}: a {kind} adapter; only LORA is served")
    for option, message in _REFUSED.items():
        if getattr(config, option, None):
            raise ModelLoadError(str(path), f"{CONFIG_FILE}: {message}")
    if getattr(config, "bias", "none") != "none":
        raise ModelLoadError(str(path), f"{CONFIG_FILE}: bias={config.bias!r}; only 'none'")
    if getattr(config, "fan_in_fan_out", False):
        raise ModelLoadError(
            str(path), f"{CONFIG_FILE}: fan_in_fan_out (Conv1D bases) is not supported"
        )
    return config


def _bad(path: Path, field: str, message: str) -> ModelLoadError:
    return ModelLoadError(str(path), f"{CONFIG_FILE}: {message}", field=field)


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_config(path: Path, config, pairs: dict[str, tuple], model: nn.Module) -> None:
    """The config says what the tensors are (their rank, checked against max_lora_rank
    with their shapes), and names only what the base has."""
    from peft.utils.other import get_pattern_key

    alphas = {"lora_alpha": config.lora_alpha}
    alphas |= {f"alpha_pattern[{k!r}]": v for k, v in (config.alpha_pattern or {}).items()}
    for key, alpha in alphas.items():
        if not (_number(alpha) and math.isfinite(alpha) and alpha > 0):
            raise _bad(path, "lora_alpha", f"{key} is {alpha!r}; it must be a finite number > 0")
    ranks = {"r": config.r, **{f"rank_pattern[{k!r}]": v for k, v in (config.rank_pattern or {}).items()}}  # fmt: skip
    for key, rank in ranks.items():
        if not (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1):
            raise _bad(path, "r", f"{key} is {rank!r}; it must be a whole number >= 1")
    patterns = config.rank_pattern or {}
    for name, (a, _) in sorted(pairs.items()):
        said = patterns.get(get_pattern_key(patterns.keys(), name), config.r)
        if a.dim() == 2 and a.shape[0] != said:
            raise _bad(
                path, "r", f"says rank {said} for {name}; its tensors in {WEIGHTS_FILE} have "
                f"rank {a.shape[0]}"
            )  # fmt: skip
    _check_targets(path, config.target_modules, pairs, model)


def _check_targets(path: Path, targets, pairs: dict[str, tuple], model: nn.Module) -> None:
    """Each ``target_modules`` entry is a module of the base and the tensors cover it, as
    peft matches them (a name is the module's last parts; a string is a regex)."""
    if targets is None or targets == "all-linear":
        return
    names = [n for n, _ in model.named_modules() if not n.endswith(".base_layer")]
    if isinstance(targets, str):
        if not any(re.fullmatch(targets, n) for n in names):
            raise _bad(path, "target_modules", f"target_modules {targets!r} matches no module "
                                               "of the base model")  # fmt: skip
        return

    def matches(name: str, entry: str) -> bool:
        return name == entry or name.endswith("." + entry)

    for entry in sorted(targets):
        if not any(matches(n, entry) for n in names):
            raise _bad(
                path, "target_modules", f"target_modules names {entry!r}, which is not a "
                "module of the base model (another base?)"
            )  # fmt: skip
        if not any(matches(n, entry) for n in pairs):
            raise _bad(
                path, "target_modules", f"target_modules names {entry!r}, but {WEIGHTS_FILE} "
                "has no weights for it"
            )  # fmt: skip


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from peft.utils import load_peft_weights

    if not (path / WEIGHTS_FILE).is_file():
        raise ModelLoadError(str(path), f"no {WEIGHTS_FILE} (pickle .bin adapters are not read)")
    try:
        return load_peft_weights(str(path), device="cpu")
    except Exception as exc:
        raise ModelLoadError(str(path), f"corrupt {WEIGHTS_FILE}: {exc}") from exc


def _pair_up(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """Tensor names -> module path -> (lora_A, lora_B); anything else is refused."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        stem = key.removeprefix(_PREFIX)
        for kind in ("lora_A", "lora_B"):
            suffix = f".{kind}.weight"
            if stem.endswith(suffix):
                parts.setdefault(stem.removesuffix(suffix), {})[kind] = tensor
                break
        else:
            what = "embedding LoRA" if "lora_embedding" in key else "a tensor LoRA does not have"
            raise ModelLoadError(str(path), f"{WEIGHTS_FILE}: {key} is {what}; not supported")
    pairs = {}
    for name, found in parts.items():
        if set(found) != {"lora_A", "lora_B"}:
            raise ModelLoadError(str(path), f"{WEIGHTS_FILE}: {name} lacks lora_A or lora_B")
        pairs[name] = (found["lora_A"], found["lora_B"])
    return pairs


def _base_linear(path: Path, model: nn.Module, name: str) -> nn.Module:
    """The base model's module the adapter targets, seen through a LoRA wrapper."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        raise ModelLoadError(
            str(path), f"targets {name}, which the base model does not have (another base?)"
        ) from None
    module = getattr(module, "base_layer", module)  # our wrapper exposes its base here
    if not isinstance(getattr(module, "in_features", None), int):
        raise ModelLoadError(
            str(path), f"targets {name}, a {type(module).__name__}; only linear layers are served"
        )
    return module


def _check_shapes(path: Path, name: str, a, b, base: nn.Module) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise ModelLoadError(
            str(path), f"{name}: lora_A {list(a.shape)} and lora_B {list(b.shape)} disagree"
        )
    if a.shape[1] != base.in_features or b.shape[0] != base.out_features:
        raise ModelLoadError(
            str(path),
            f"{name}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit the base's "
            f"{base.in_features} -> {base.out_features} linear (an adapter for another base?)",
        )


def _scaling(config, name: str, rank: int) -> float:
    """peft's scaling for this module: alpha over r (or its square root with rsLoRA)."""
    from peft.utils.other import get_pattern_key

    patterns = getattr(config, "alpha_pattern", None) or {}
    alpha = patterns.get(get_pattern_key(patterns.keys(), name), config.lora_alpha)
    return alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
