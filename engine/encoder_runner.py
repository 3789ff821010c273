"""Run one batch of texts (or (query, document) pairs) through an encoder: classify,
tag, embed or rerank.

A runner holds one or more *heads* (loaded models) on one backbone. With one head
it simply calls the model. With several (a classifier and a tagger fine-tuned on one
frozen backbone, loaded through one WeightStore so their backbone tensors are the
same memory) it runs the backbone once per batch and feeds its output to every head
through a *head view*: a shallow copy of the task model whose backbone slot returns
the output already computed. Any transformers ``XFor...`` model that calls its
``base_model`` once works this way, with no per-family head code.

Texts are tokenized with truncation to the model's max positions (a longer text is
cut and its result says ``truncated: true``) and padded to the longest in the batch.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trae_groups.engine.chat import probe
from trae_groups.engine.errors import RequestError
from trae_groups.engine.memory import tensor_key
from trae_groups.engine.ner import aggregate
from trae_groups.engine.protocol import EncodeOptions
from trae_groups.engine.tasks import ENCODER_TASKS, PAIR_TASKS, TASKS
from trae_groups.engine.weights import LoadedModel, tensor_slots

Text = str | tuple[str, str]


def check_text(text: Any, pair: bool = False) -> Text:
    """Refuse what cannot be encoded before it reaches a batch: one non-empty string,
    or, for a pair task, a (query, document) pair of them."""
    if pair:
        if not (isinstance(text, tuple | list) and len(text) == 2):
            raise RequestError("text", "must be a (query, document) pair")
        return (check_text(text[0]), check_text(text[1]))
    if not isinstance(text, str):
        raise RequestError("text", f"must be a string, not {type(text).__name__}")
    if not text.strip():
        raise RequestError("text", "is empty")
    return text


@dataclass
class Encoded:
    """A tokenized, padded batch and what results need from tokenization."""

    texts: list[Text]
    inputs: dict[str, torch.Tensor]
    truncated: list[bool]
    offsets: list[list[tuple[int, int]]] | None
    word_ids: list[list[int | None]] | None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.inputs["input_ids"].shape)  # type: ignore[return-value]


def encode(loaded: LoadedModel, texts: Sequence[Text]) -> Encoded:
    """Tokenize one batch: texts, or (query, document) pairs (all one or the other)."""
    tok = loaded.tokenizer
    fast = bool(getattr(tok, "is_fast", False))
    max_length = loaded.max_length
    pairs = bool(texts) and isinstance(texts[0], tuple)
    if any(isinstance(t, tuple) != pairs for t in texts):
        raise ValueError("a batch is texts or (query, document) pairs, not both")
    first = [t[0] for t in texts] if pairs else [_cut(tok, t, max_length) for t in texts]
    second = [t[1] for t in texts] if pairs else None
    batch = tok(
        first,
        second,
        padding="longest",
        truncation=True,
        max_length=max_length,
        return_tensors="pt",
        return_offsets_mapping=fast,
    )
    offsets = batch.pop("offset_mapping", None)
    names = getattr(tok, "model_input_names", None) or list(batch.keys())
    inputs = {k: v.to(loaded.device) for k, v in batch.items() if k in names}
    if fast:
        truncated = [bool(e.overflowing) for e in batch.encodings]
        word_ids = [batch.word_ids(i) for i in range(len(texts))]
        offsets_list = [[(int(a), int(b)) for a, b in row] for row in offsets.tolist()]
    else:
        truncated = [len(tok(*_parts(t))["input_ids"]) > max_length for t in texts]
        word_ids, offsets_list = None, None
    return Encoded(list(texts), inputs, truncated, offsets_list, word_ids)


#: Tokens past the truncation a long text's probe (``chat.probe``) must hold to stand for
#: the whole: more than its cut edge may change.
CUT_SLACK = 16


def _cut(tok: Any, text: str, max_length: int) -> str:
    """The beginning of a long text that tokenizes, up to truncation, as the whole does:
    the tokenizer would read all of a 1 MB text only to keep its first 512 tokens. A probe
    with CUT_SLACK tokens past ``max_length`` gives the same ids, offsets and
    ``truncated``; text whose probe holds fewer (very long words) is read whole."""
    prefix = probe(text, max_length + CUT_SLACK)
    if prefix is None:
        return text
    if len(tok(prefix, add_special_tokens=False)["input_ids"]) >= max_length + CUT_SLACK:
        return prefix
    return text


def _parts(text: Text) -> tuple[str, ...]:
    return text if isinstance(text, tuple) else (text,)


class _Given(nn.Module):
    """Stands in for a backbone whose output this batch already computed."""

    def __init__(self) -> None:
        super().__init__()
        self.output: Any = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.output


def _head_view(model: nn.Module) -> tuple[nn.Module, _Given]:
    prefix = getattr(model, "base_model_prefix", "")
    if prefix not in model._modules:
        raise ValueError(f"{type(model).__name__} has no separable backbone {prefix!r}")
    view = copy.copy(model)
    view._modules = dict(model._modules)  # the original model is left untouched
    given = _Given()
    view._modules[prefix] = given
    return view, given


def _backbone(loaded: LoadedModel) -> nn.Module:
    return TASKS[loaded.task].backbone(loaded.model)


def _ptrs(module: nn.Module) -> set[tuple]:
    return {tensor_key(t) for _, _, _, t in tensor_slots(module)}


def backbone_tensors(loaded: LoadedModel) -> set[tuple]:
    """The distinct tensors of a head's backbone: heads whose sets nest (one may carry a
    pooler the other leaves out) and that share a vocabulary can share one runner."""
    return _ptrs(_backbone(loaded))


class EncoderRunner:
    """Batches of texts in, per-head outputs out. Engine thread only."""

    def __init__(self, heads: LoadedModel | Mapping[str, LoadedModel]):
        if isinstance(heads, LoadedModel):
            heads = {heads.name: heads}
        if not heads:
            raise ValueError("an encoder runner needs at least one head")
        for name, loaded in heads.items():
            if loaded.task not in ENCODER_TASKS:
                raise ValueError(f"head {name!r}: task {loaded.task!r} is not an encoder task")
        self.heads = dict(heads)
        self.default_head = next(iter(self.heads))
        self.primary = max(self.heads.values(), key=lambda m: len(_ptrs(_backbone(m))))
        self._views: dict[str, tuple[nn.Module, _Given]] = {}
        if len(self.heads) > 1:
            self._check_shared_backbone()
            for name, loaded in self.heads.items():
                if not TASKS[loaded.task].whole_backbone:
                    self._views[name] = _head_view(loaded.model)

    def _check_shared_backbone(self) -> None:
        mine = _ptrs(_backbone(self.primary))
        vocab = self.primary.tokenizer.get_vocab()
        for name, loaded in self.heads.items():
            if not _ptrs(_backbone(loaded)) <= mine:
                raise ValueError(
                    f"head {name!r} does not share the backbone of {self.primary.name!r}: "
                    "its backbone tensors must be byte-identical (load both through one "
                    "WeightStore with memory='shared')"
                )
            if loaded.tokenizer.get_vocab() != vocab:
                raise ValueError(f"head {name!r} uses another tokenizer than the backbone")

    @property
    def hidden_size(self) -> int:
        return int(getattr(self.primary.config, "hidden_size", 768))

    def encode(self, texts: Sequence[Text]) -> Encoded:
        return encode(self.primary, texts)

    # -- forward -------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, encoded: Encoded, heads: Sequence[str] | None = None) -> dict[str, Any]:
        """Raw per-head batch outputs: class probabilities [B, C], token
        probabilities [B, T, C], or hidden states [B, T, H]."""
        wanted = list(heads or [self.default_head])
        if len(self.heads) == 1:
            loaded = self.heads[wanted[0]]
            return {wanted[0]: _from_output(loaded, loaded.model(**encoded.inputs))}
        out = _backbone(self.primary)(**encoded.inputs)
        results: dict[str, Any] = {}
        for name in wanted:
            loaded = self.heads[name]
            if TASKS[loaded.task].whole_backbone:
                results[name] = out.last_hidden_state.float()
                continue
            view, given = self._views[name]
            given.output = out
            try:
                results[name] = _from_output(loaded, view(**encoded.inputs))
            finally:
                given.output = None
        return results

    # -- results -------------------------------------------------------------------
    def result(
        self, head: str, output: Any, encoded: Encoded, row: int, options: EncodeOptions
    ) -> dict[str, Any]:
        """One item's result from its head's batch output."""
        loaded = self.heads[head]
        truncated = encoded.truncated[row]
        if loaded.task == "classify":
            return {**classify_result(loaded, output[row]), "truncated": truncated}
        if loaded.task == "rerank":
            return {"score": float(output[row]), "truncated": truncated}
        if loaded.task == "tag":
            return {"spans": tag_spans(loaded, output[row], encoded, row), "truncated": truncated}
        mask = encoded.inputs["attention_mask"][row]
        return {**embed_result(output[row], mask, options), "truncated": truncated}

    def tasks(self, heads: Sequence[str]) -> list[str]:
        for head in heads:
            if head not in self.heads:
                raise RequestError("head", f"unknown head {head!r}; have {list(self.heads)}")
        return [self.heads[h].task for h in heads]

    def run(self, texts: Sequence[Text], head: str | None = None, **options: Any) -> list[dict]:
        """One batch, one head: validate, encode, forward, results (tests, tools)."""
        head = head or self.default_head
        (task,) = self.tasks([head])
        item_options = EncodeOptions(**options)
        texts = [check_text(t, task in PAIR_TASKS) for t in texts]
        encoded = self.encode(texts)
        output = self.forward(encoded, [head])[head]
        return [self.result(head, output, encoded, i, item_options) for i in range(len(texts))]


def _from_output(loaded: LoadedModel, output: Any) -> torch.Tensor:
    if loaded.task == "embed":
        return output.last_hidden_state.float()
    logits = output.logits.float()
    if loaded.task == "rerank":  # relevance: the logit of a one-label head, else the last label's
        return logits[:, 0] if logits.shape[-1] == 1 else torch.log_softmax(logits, -1)[:, -1]
    if loaded.task == "classify" and _sigmoid(loaded.config):
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


def _sigmoid(config: Any) -> bool:
    """As transformers' text-classification pipeline: one label or multi-label."""
    return config.problem_type == "multi_label_classification" or config.num_labels == 1


def _label(config: Any, index: int) -> str:
    return str(config.id2label.get(index, f"LABEL_{index}"))


def classify_result(loaded: LoadedModel, probs: torch.Tensor) -> dict[str, Any]:
    values = probs.tolist()
    best = max(range(len(values)), key=values.__getitem__)
    scores = {_label(loaded.config, i): p for i, p in enumerate(values)}
    return {"label": _label(loaded.config, best), "score": values[best], "scores": scores}


def tag_spans(loaded: LoadedModel, probs: torch.Tensor, encoded: Encoded, row: int) -> list[dict]:
    if encoded.offsets is None:
        raise RequestError("text", "tagging needs a fast tokenizer (character offsets)")
    best, index = probs.max(dim=-1)
    labels = [_label(loaded.config, i) for i in index.tolist()]
    spans = aggregate(
        labels, best.tolist(), encoded.offsets[row], encoded.texts[row], encoded.word_ids[row]
    )
    return [s.as_dict() for s in spans]


def embed_result(
    hidden: torch.Tensor, mask: torch.Tensor, options: EncodeOptions = EncodeOptions()
) -> dict[str, Any]:
    if options.pooling == "cls":
        vector = hidden[0]
    else:
        weights = mask.to(hidden.dtype).unsqueeze(-1)
        vector = (hidden * weights).sum(0) / weights.sum().clamp(min=1.0)
    if options.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return {"vector": vector.tolist(), "dim": int(vector.numel())}
