"""WeightStore: every distinct tensor is held once per device.

Weights come from safetensors through transformers' own ``from_pretrained``, which
in transformers 5 memory-maps the file (``MAP_PRIVATE``) and, when the dtype on disk
is the dtype asked for, hands the model views of that mapping: no copy on CPU. The
store adds two kinds of sharing on top:

* instances: loading the same folder for the same task/dtype/device again returns
  the same ``LoadedModel`` (three graph nodes on one model cost one model);
* tensors: after a load, each parameter and buffer is looked up by content; when a
  byte-identical tensor is already held on that device (two fine-tunes that differ
  only in their head, or the same checkpoint loaded as a classifier and as an
  embedder), the new model is pointed at the held tensor and its own view is dropped.

Content lookup is lazy: a cheap key (device, dtype, shape, hash of three 4 KiB
samples) finds candidates without touching the rest of the file; only on a key
collision are the full bytes hashed (blake2b) to confirm, so a model with nothing
to share is never read in full at load time.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from torch import nn

from trae_groups.engine.config import QUANTIZATIONS
from trae_groups.engine.errors import ModelLoadError
from trae_groups.engine.flat_forward import forward_path
from trae_groups.engine.memory import (
    distinct,
    module_tensors,
    release_file_pages,
    tensor_bytes,
    tensor_key,
)
from trae_groups.engine.tasks import TASKS as _TASKS
from trae_groups.engine.tasks import generates

log = logging.getLogger("trae_groups.engine")

MemoryMode = Literal["shared", "isolated"]
GpuMode = Literal["shared", "dedicated"]
_SAMPLE = 4096
# what a folder with a tokenizer holds: tokenizers' JSON, sentencepiece, BPE or WordPiece
_TOKENIZER_FILES = ("tokenizer*", "*.model", "vocab.*", "merges.txt")


def has_tokenizer(folder: Path) -> bool:
    """Whether a model folder holds a tokenizer (a benchmark's random-init LLM may not)."""
    return any(any(Path(folder).glob(p)) for p in _TOKENIZER_FILES)


TASKS = tuple(_TASKS)  # what a folder can be loaded for (engine/tasks.py)


@dataclass(frozen=True)
class SharingPolicy:
    """memory: "shared" (dedupe instances and tensors) or "isolated" (each load gets
    private copies). gpu: "shared" or "dedicated"; recorded for the scheduler and
    reports (this store places weights where ``device`` says either way)."""

    memory: MemoryMode = "shared"
    gpu: GpuMode = "shared"

    def __post_init__(self) -> None:
        if self.memory not in ("shared", "isolated"):
            raise ValueError(f"memory must be 'shared' or 'isolated', not {self.memory!r}")
        if self.gpu not in ("shared", "dedicated"):
            raise ValueError(f"gpu must be 'shared' or 'dedicated', not {self.gpu!r}")


@dataclass(eq=False)
class LoadedModel:
    """One model instance as runners see it (module in eval mode, no grads)."""

    name: str
    path: str
    task: str
    model: nn.Module
    config: Any
    tokenizer: Any
    dtype: torch.dtype
    device: torch.device
    quantize: str | None = None
    policy: SharingPolicy = field(default_factory=SharingPolicy)
    loads: int = 1
    choice: str | None = None  # why these weights, when dtype/quantization was "auto"

    @property
    def max_length(self) -> int:
        """Longest token sequence the model accepts (position table and tokenizer)."""
        positions = getattr(self.config, "max_position_embeddings", None)
        if isinstance(positions, int):
            positions -= self._position_offset()
        limits = [positions, getattr(self.tokenizer, "model_max_length", None)]
        usable = [int(x) for x in limits if isinstance(x, int) and 0 < x < 1_000_000]
        return min(usable) if usable else 512

    def _position_offset(self) -> int:
        """RoBERTa-style position tables start after the padding index."""
        base = getattr(self.model, "base_model", self.model)
        table = getattr(getattr(base, "embeddings", None), "position_embeddings", None)
        pad = getattr(table, "padding_idx", None)
        return pad + 1 if isinstance(pad, int) else 0


@dataclass(frozen=True)
class ModelReport:
    """What one loaded instance holds. ``bytes`` counts every distinct tensor it uses,
    packed and quantized ones included (``engine/memory.py``); ``shared_bytes`` of it
    are also used by another loaded model; ``private_bytes`` are copies no other model
    can share (pre-packed or quantized weights, an isolated policy's copies)."""

    name: str
    path: str
    task: str
    parameters: int
    bytes: int
    shared_bytes: int  # bytes also held by another loaded model
    private_bytes: int  # copies only this model can use (packed, quantized, isolated)
    device: str
    dtype: str
    quantize: str | None
    memory: str
    gpu: str
    loads: int  # how many load() calls returned this instance
    choice: str | None = None  # why these weights, when dtype/quantization was "auto"
    forward: str | None = None  # a causal LM's forward: ours or transformers' (and why)


class _Held:
    """One distinct tensor on one device, and the models that use it."""

    __slots__ = ("_digest", "tensor", "users")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.users: set[tuple] = set()
        self._digest: bytes | None = None

    def digest(self) -> bytes:
        if self._digest is None:
            self._digest = full_digest(self.tensor)
        return self._digest


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)


def sample_key(t: torch.Tensor) -> tuple:
    """Cheap content key: touches at most three pages of the tensor."""
    raw = _bytes_of(t)
    n = raw.numel()
    h = hashlib.blake2b(digest_size=16)
    for start in sorted({0, max(0, n // 2 - _SAMPLE // 2), max(0, n - _SAMPLE)}):
        h.update(raw[start : start + _SAMPLE].cpu().numpy().tobytes())
    return (str(t.device), t.dtype, tuple(t.shape), h.digest())


def full_digest(t: torch.Tensor) -> bytes:
    raw = _bytes_of(t).cpu()
    return hashlib.blake2b(memoryview(raw.numpy()), digest_size=32).digest()


def tensor_slots(model: nn.Module):
    """Every (module, kind, name, tensor) that holds model memory: parameters, buffers
    and what modules hold elsewhere ("held": packed and quantized weights; see
    ``engine/memory.py`` for the hook a new module kind implements)."""
    return module_tensors(model)


class WeightStore:
    """Loads models for tasks and keeps each distinct tensor once per device."""

    def __init__(self, policy: SharingPolicy | None = None):
        self.policy = policy or SharingPolicy()
        self._lock = threading.RLock()
        self._models: dict[tuple, LoadedModel] = {}
        self._held: dict[tuple, list[_Held]] = {}  # sample key -> candidates
        self._by_ptr: dict[tuple, _Held] = {}
        self._tokenizers: dict[str, Any] = {}
        self._isolated_count = 0
        self._reports: list[ModelReport] | None = None  # until what is loaded changes
        self._last_reports: list[ModelReport] = []

    # -- loading -----------------------------------------------------------------
    def load(
        self,
        folder: str | Path,
        task: str,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        quantize: str | None = None,
        name: str | None = None,
        policy: SharingPolicy | None = None,
        **model_kwargs: Any,
    ) -> LoadedModel:
        """Load ``folder`` for ``task`` (one of ``TASKS``: classify, tag, embed, rerank, generate).
        Extra keyword arguments (e.g. ``attn_implementation``) go to transformers."""
        policy = policy or self.policy
        path = Path(folder).expanduser().resolve()
        device = torch.device(device)
        _check_options(str(path), task, dtype, device, quantize)
        key = (str(path), task, dtype, str(device), quantize, tuple(sorted(model_kwargs.items())))
        with self._lock:
            if policy.memory == "shared" and key in self._models:
                loaded = self._models[key]
                loaded.loads += 1
                self._reports = None
                return loaded
            model, config = _read_model(path, task, dtype, device, model_kwargs)
            tokenizer = self._tokenizer(path, task)
            if policy.memory == "isolated":
                self._isolated_count += 1
                key = (*key, "isolated", self._isolated_count)
                _privatize(model)
            added = self._share(model) if policy.memory == "shared" else []
            if quantize == "int8":
                _quantize_int8(model, task)
            self._register(key, model, added)
            loaded = LoadedModel(
                name=name or path.name,
                path=str(path),
                task=task,
                model=model,
                config=config,
                tokenizer=tokenizer,
                dtype=dtype,
                device=device,
                quantize=quantize,
                policy=policy,
            )
            self._models[key] = loaded
            return loaded

    def _tokenizer(self, path: Path, task: str) -> Any:
        """The folder's tokenizer. An LLM folder with none (a benchmark's random-init
        model, say) loads without one and takes token-id prompts only."""
        if generates(task) and not has_tokenizer(path):
            log.info("%s has no tokenizer: its prompts must be token ids", path)
            return None
        if str(path) not in self._tokenizers:
            from transformers import AutoTokenizer

            try:
                self._tokenizers[str(path)] = AutoTokenizer.from_pretrained(str(path))
            except Exception as exc:
                raise ModelLoadError(str(path), f"cannot load its tokenizer: {exc}") from exc
        tokenizer = self._tokenizers[str(path)]
        if task == "tag" and not getattr(tokenizer, "is_fast", False):
            raise ModelLoadError(str(path), "tagging needs a fast tokenizer (character offsets)")
        return tokenizer

    # -- sharing -----------------------------------------------------------------
    def _share(self, model: nn.Module) -> list[_Held]:
        """Point every tensor of ``model`` at an already held identical one; returns
        the tensors held for the first time."""
        added: list[_Held] = []
        replaced: dict[int, torch.Tensor] = {}  # id(old) -> new, keeps tied weights tied
        for module, kind, name, t in list(tensor_slots(model)):
            if kind == "held":  # packed or quantized weights are private by construction
                continue
            if id(t) not in replaced:
                same = self._canonical(t, added)
                if kind == "param" and same is not t:
                    same = nn.Parameter(same, requires_grad=False)
                replaced[id(t)] = same
            if replaced[id(t)] is t:
                continue
            slots = module._parameters if kind == "param" else module._buffers
            slots[name] = replaced[id(t)]
        return added

    def _canonical(self, t: torch.Tensor, added: list[_Held]) -> torch.Tensor:
        held = self._by_ptr.get(tensor_key(t))
        if held is not None:
            return held.tensor
        candidates = self._held.setdefault(sample_key(t), [])
        if candidates:
            digest = full_digest(t)
            for held in candidates:
                if held.digest() == digest:
                    return held.tensor
        held = _Held(t.detach())
        candidates.append(held)
        self._by_ptr[tensor_key(t)] = held
        added.append(held)
        return t

    def _register(self, key: tuple, model: nn.Module, added: list[_Held]) -> None:
        for _, _, _, t in tensor_slots(model):
            held = self._by_ptr.get(tensor_key(t))
            if held is not None:
                held.users.add(key)
        self._reports = None
        if any(not held.users for held in added):  # e.g. Linear weights quantized away
            self._forget(None)

    def settle(self, model: nn.Module) -> int:
        """``model``'s modules were replaced in place (linears packed, say): tensors it
        no longer uses are dropped, and so are their file pages when nobody else uses
        them; returns the bytes given back. Its report counts what it holds now."""
        with self._lock:
            keys = [k for k, loaded in self._models.items() if loaded.model is model]
            now = {tensor_key(t) for _, _, _, t in tensor_slots(model)}
            for candidates in self._held.values():
                for held in candidates:
                    if tensor_key(held.tensor) not in now:
                        held.users.difference_update(keys)
            return self._forget(None)

    # -- unloading -----------------------------------------------------------------
    def unload(self, folder: str | Path) -> int:
        """Drop every instance loaded from ``folder`` and every tensor nobody else
        uses; returns how many instances were dropped."""
        path = str(Path(folder).expanduser().resolve())
        with self._lock:
            keys = [k for k in self._models if k[0] == path]
            for key in keys:
                del self._models[key]
                self._forget(key)
            self._tokenizers.pop(path, None)
            return len(keys)

    def unload_model(self, loaded: LoadedModel) -> bool:
        """One ``load()`` of this instance is over; when it was the last, the instance
        and every tensor nobody else uses are dropped (True)."""
        with self._lock:
            key = next((k for k, m in self._models.items() if m is loaded), None)
            if key is None:
                return False
            loaded.loads -= 1
            self._reports = None
            if loaded.loads > 0:
                return False
            del self._models[key]
            self._forget(key)
            return True

    def _forget(self, key: tuple | None) -> int:
        """Drop ``key`` from every held tensor, then every tensor nobody uses (and the
        file pages under it); returns the bytes of pages given back."""
        self._reports = None
        dropped: list[torch.Tensor] = []
        for skey, candidates in list(self._held.items()):
            kept = []
            for held in candidates:
                held.users.discard(key)
                if held.users:
                    kept.append(held)
                else:
                    self._by_ptr.pop(tensor_key(held.tensor), None)
                    dropped.append(held.tensor)
            if kept:
                self._held[skey] = kept
            else:
                del self._held[skey]
        if not dropped:
            return 0
        live = [t for loaded in self._models.values() for t in distinct(loaded.model).values()]
        return release_file_pages(dropped, live)

    # -- reporting -------------------------------------------------------------------
    def models(self) -> list[LoadedModel]:
        with self._lock:
            return list(self._models.values())

    def report(self, wait: bool = True) -> list[ModelReport]:
        """One row per loaded instance; computed once per change of what is loaded.
        ``wait=False`` (metrics): while a load holds the store, the last rows computed."""
        if not self._lock.acquire(blocking=wait):
            return list(self._last_reports)
        try:
            if self._reports is None:
                self._reports = [self._report(key, m) for key, m in self._models.items()]
                self._last_reports = self._reports
            return list(self._reports)
        finally:
            self._lock.release()

    def _report(self, key: tuple, loaded: LoadedModel) -> ModelReport:
        tensors = distinct(loaded.model)
        total = shared = private = 0
        for tkey, t in tensors.items():
            nbytes = tensor_bytes(t)
            total += nbytes
            held = self._by_ptr.get(tkey)
            if held is None:
                private += nbytes
            elif len(held.users - {key}) > 0:
                shared += nbytes
        return ModelReport(
            name=loaded.name,
            path=loaded.path,
            task=loaded.task,
            parameters=sum(t.numel() for t in tensors.values()),
            bytes=total,
            shared_bytes=shared,
            private_bytes=private,
            device=str(loaded.device),
            dtype=str(loaded.dtype).removeprefix("torch."),
            quantize=loaded.quantize,
            memory=loaded.policy.memory,
            gpu=loaded.policy.gpu,
            loads=loaded.loads,
            choice=loaded.choice,
            forward=forward_path(loaded.model) if loaded.task == "generate" else None,
        )

    def total_bytes(self) -> int:
        """Bytes of distinct tensors held by all loaded models together."""
        with self._lock:
            seen: dict[tuple, int] = {}
            for loaded in self._models.values():
                for tkey, t in distinct(loaded.model).items():
                    seen[tkey] = tensor_bytes(t)
            return sum(seen.values())


def estimate_bytes(folder: str | Path, dtype: torch.dtype) -> int:
    """What a model folder's weights will hold in ``dtype``, from the file headers (no
    tensor is read): floating tensors convert to ``dtype``, others keep their size."""
    path = Path(folder).expanduser().resolve()
    itemsize = torch.empty((), dtype=dtype).element_size()
    total = 0
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                part = f.get_slice(key)
                numel = math.prod(part.get_shape())
                dtype_name = part.get_dtype()
                size = itemsize if dtype_name.startswith(("F", "BF")) else _SIZES.get(dtype_name, 4)
                total += numel * size
    return total


_SIZES = {"I8": 1, "U8": 1, "BOOL": 1, "I16": 2, "I32": 4, "I64": 8}


# -- tasks -------------------------------------------------------------------------
def model_class(task: str) -> Any:
    import transformers

    return getattr(transformers, _TASKS[task].auto_class)


def _type_names(mapping: str) -> dict[str, Any]:
    from transformers.models.auto import modeling_auto

    return getattr(modeling_auto, mapping + "_MAPPING_NAMES")


def check_task(path: str, config: Any, task: str) -> None:
    """Refuse a task the architecture cannot do, before reading any weights."""
    model_type = getattr(config, "model_type", None)
    if model_type not in _type_names(_TASKS[task].mapping):
        raise ModelLoadError(path, f"a {model_type!r} model cannot do {task!r}")
    if _TASKS[task].generates and _is_encoder(config):
        raise ModelLoadError(
            path, f"{model_type!r} here is a bidirectional encoder (is_decoder is false)"
        )
    if _TASKS[task].labels and not getattr(config, "id2label", None):
        raise ModelLoadError(path, f"{task!r} needs labels (id2label) in config.json")
    head = _TASKS[task].head
    saved_as = list(getattr(config, "architectures", None) or ())
    if head and saved_as and not any(a.endswith(head) for a in saved_as):
        # same head names and shapes would load silently: trust what it was saved as
        raise ModelLoadError(path, f"saved as {saved_as[0]}, not a {task!r} model ({head})")


def _is_encoder(config: Any) -> bool:
    """Encoder families (those with a masked-LM head) generate only as decoders."""
    masked = _type_names("MODEL_FOR_MASKED_LM")
    return config.model_type in masked and not getattr(config, "is_decoder", False)


def missing_weights_error(task: str, info: dict) -> str | None:
    """A head missing from the file would be random: refuse it. A missing pooler
    does not matter for embeddings (they pool the hidden states)."""
    missing = sorted(info.get("missing_keys") or ())
    if _TASKS[task].whole_backbone:
        missing = [k for k in missing if "pooler" not in k]
    if not missing:
        return None
    shown = ", ".join(missing[:4]) + (" ..." if len(missing) > 4 else "")
    return f"the checkpoint has no weights for {shown}: this is not a {task!r} checkpoint"


# -- helpers: one job each ---------------------------------------------------------
def _check_options(
    path: str, task: str, dtype: torch.dtype, device: torch.device, quantize: str | None
) -> None:
    if task not in _TASKS:
        raise ModelLoadError(path, f"unknown task {task!r}; expected one of {TASKS}")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ModelLoadError(path, f"unsupported dtype {dtype}")
    if quantize not in (None, *QUANTIZATIONS):
        raise ModelLoadError(
            path, f"unknown quantization {quantize!r}; expected one of {list(QUANTIZATIONS)}"
        )
    if quantize == "int8" and (device.type != "cpu" or dtype != torch.float32):
        raise ModelLoadError(path, "int8 dynamic quantization runs on CPU from float32 weights")


def _weight_files(path: Path) -> list[Path]:
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        import json

        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(str(path), f"corrupt {index.name}: {exc}") from exc
        return [path / n for n in names]
    if any(path.glob("*.bin")):
        raise ModelLoadError(str(path), "only pickle (.bin) weights; convert them to safetensors")
    raise ModelLoadError(str(path), "no safetensors weights (model.safetensors)")


def _read_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor in the folder's safetensors files: name -> (shape, file name).
    Reads the headers only."""
    header: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in _weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    header[key] = (tuple(f.get_slice(key).get_shape()), file.name)
        except Exception as exc:
            raise ModelLoadError(str(path), f"corrupt safetensors file {file.name}: {exc}") from exc
    return header


def _header_key(name: str, header: dict, prefix: str) -> str | None:
    """The file's name for a model tensor (the base-model prefix may differ)."""
    for key in (name, name.removeprefix(prefix + "."), f"{prefix}.{name}"):
        if key in header:
            return key
    return None


def _check_config_fits(path: Path, cls: Any, config: Any, header: dict) -> None:
    """Build the model config.json describes on the meta device (no memory) and
    compare it with the file's header, so a config that asks for far more than the
    weights hold is refused before anything is allocated."""
    layers = getattr(config.get_text_config(), "num_hidden_layers", None)
    if isinstance(layers, int) and layers > len(header):  # every layer has a tensor
        raise ModelLoadError(
            str(path), f"config.json says {layers} layers; the weights hold {len(header)} tensors"
        )
    try:
        with torch.device("meta"):
            meta = cls.from_config(config)
    except Exception as exc:
        raise ModelLoadError(str(path), f"config.json does not describe a model: {exc}") from exc
    prefix = getattr(meta, "base_model_prefix", "") or ""
    wanted = 0
    for name, p in meta.named_parameters():  # a tied tensor once
        wanted += p.numel()
        key = _header_key(name, header, prefix)
        if key is not None and header[key][0] != tuple(p.shape):
            shape, file = header[key]
            raise ModelLoadError(
                str(path),
                f"{file}: tensor {key} has shape {list(shape)}; config.json makes it "
                f"{list(p.shape)}",
            )
    held = sum(math.prod(shape) for shape, _ in header.values())
    if wanted > 2 * held + (1 << 20):  # room for tied copies and a missing pooler
        raise ModelLoadError(
            str(path),
            f"config.json describes {wanted:,} parameters; the weights hold {held:,}",
        )


def _check_finite(path: Path, model: nn.Module, header: dict) -> None:
    """A NaN or infinity in the weights would poison every output: refuse it."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point() and not _all_finite(t):
            key = _header_key(name, header, prefix)
            where = f"{header[key][1]}: tensor {key}" if key else f"tensor {name}"
            raise ModelLoadError(str(path), f"{where} holds NaN or infinite values")


def _all_finite(t: torch.Tensor, chunk: int = 1 << 16) -> bool:
    """A sum carries any NaN or infinity through and allocates nothing the size of the
    tensor (weights stay zero-copy); only when it is not finite (or overflowed, as an
    fp16 sum can) are the values checked, in small chunks."""
    if bool(torch.isfinite(t.detach().sum())):
        return True
    flat = t.detach().reshape(-1)
    return all(
        bool(torch.isfinite(flat[i : i + chunk]).all()) for i in range(0, flat.numel(), chunk)
    )


def _read_config(path: Path) -> Any:
    from transformers import AutoConfig

    if not path.is_dir():
        raise ModelLoadError(str(path), "no such model folder")
    if not (path / "config.json").is_file():
        raise ModelLoadError(str(path), "no config.json in the model folder")
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(str(path), f"config.json is not a valid config: {exc}") from exc


def _read_model(
    path: Path, task: str, dtype: torch.dtype, device: torch.device, kwargs: dict
) -> tuple[nn.Module, Any]:
    config = _read_config(path)
    check_task(str(path), config, task)
    header = _read_header(path)
    cls = model_class(task)
    _check_config_fits(path, cls, config, header)
    try:
        model, info = cls.from_pretrained(
            str(path),
            config=config,
            dtype=dtype,
            local_files_only=True,
            use_safetensors=True,
            output_loading_info=True,
            **kwargs,
        )
    except Exception as exc:
        raise ModelLoadError(str(path), f"cannot load weights for {task!r}: {exc}") from exc
    problem = missing_weights_error(task, info)
    if problem:
        raise ModelLoadError(str(path), problem)
    _check_finite(path, model, header)
    if device.type != "cpu":
        model = model.to(device)
    model.eval().requires_grad_(False)
    return model, model.config


def _privatize(model: nn.Module) -> None:
    """Isolated policy: every tensor becomes a private copy (tied ones stay tied)."""
    copies: dict[int, torch.Tensor] = {}
    for module, kind, name, t in list(tensor_slots(model)):
        if kind == "held":  # packed or quantized: already this model's own
            continue
        if id(t) not in copies:
            clone = t.detach().clone()
            copies[id(t)] = nn.Parameter(clone, requires_grad=False) if kind == "param" else clone
        if kind == "param":
            module._parameters[name] = copies[id(t)]
        elif kind == "buffer":
            module._buffers[name] = copies[id(t)]


def _quantize_int8(model: nn.Module, task: str) -> None:
    """int8 Linears (per-channel int8 weights, activations quantized per call): the one
    mechanism for encoders and LLMs (``engine/quant.py`` says why this op). An LLM keeps its
    MLP float (``LLM_KEEP_FLOAT``: outlier features in its activations)."""
    from trae_groups.engine.quant import LLM_KEEP_FLOAT, quantize_linears

    quantize_linears(model, keep_float=LLM_KEEP_FLOAT if generates(task) else ())
