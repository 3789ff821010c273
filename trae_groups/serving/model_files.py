"""What the HTTP front reads from a served LLM's folder itself: its tokenizer (for
``/tokenize``, ``/detokenize`` and the tool-call syntax its chat template shows) and its
context length. The engine may run in another process, so the front loads the tokenizer
from the same folder the engine did, once per folder."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from trae_groups.engine.llm_worker import context_length as engine_context_length
from trae_groups.engine.weights import has_tokenizer
from trae_groups.serving.http_errors import HTTPError

_LOCK = threading.Lock()
_LOADED: dict[str, Any] = {}  # folder -> its tokenizer (None: the folder has none)


def folder(target: Any) -> Path:
    """The model folder a ``model`` id reaches (an adapter's: its base model's)."""
    spec = target.served.spec
    version = target.version if target.version in spec.models[target.model].sources else None
    return spec.model_path(target.model, version)


def tokenizer(target: Any, field: str = "model") -> Any:
    """The target's tokenizer; a 422 naming ``field`` when its folder has none."""
    path = str(folder(target))
    with _LOCK:
        if path not in _LOADED:
            _LOADED[path] = _load(path)
        found = _LOADED[path]
    if found is None:
        raise HTTPError(422, f"'{target.id}' has no tokenizer: it takes token ids", field=field)
    return found


def _load(path: str) -> Any:
    if not has_tokenizer(Path(path)):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def context_length(target: Any, configured: int | None) -> int:
    """The model's context length as the engine takes it: ``max_position_embeddings``
    (2048 when the config has none), lowered to the engine's ``max_model_len``."""
    config = json.loads((folder(target) / "config.json").read_text(encoding="utf-8"))
    text = config.get("text_config") or config
    return engine_context_length(text.get("max_position_embeddings"), configured)
