"""Model tasks, declared once, the way graphs/nodes.py declares node kinds.

A task says which transformers class loads a folder and how the engine serves it: a
causal LM on an LLM worker, or an encoder head on an encoder worker that may share its
backbone with other heads. A new encoder task is an entry here and its results in
engine/encoder_runner.py; nothing else compares task names.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Task:
    name: str
    auto_class: str  # the transformers Auto class that loads it
    mapping: str  # the transformers model mapping that lists the families it takes
    generates: bool = False  # a causal LM (an LLM worker); else an encoder head
    pair: bool = False  # items are (query, document) pairs, not one text
    labels: bool = False  # its config must name its labels (id2label)
    whole_backbone: bool = False  # the task model is the backbone itself (no head on top)
    head: str | None = None  # what a saved architecture's name must end with, if anything

    def backbone(self, model: nn.Module) -> nn.Module:
        """The part of the model that heads of one backbone share."""
        return model if self.whole_backbone else model.base_model


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("classify", "AutoModelForSequenceClassification",
             "MODEL_FOR_SEQUENCE_CLASSIFICATION", labels=True, head="ForSequenceClassification"),
        Task("tag", "AutoModelForTokenClassification", "MODEL_FOR_TOKEN_CLASSIFICATION",
             labels=True, head="ForTokenClassification"),
        Task("embed", "AutoModel", "MODEL", whole_backbone=True),
        Task("rerank", "AutoModelForSequenceClassification",
             "MODEL_FOR_SEQUENCE_CLASSIFICATION", pair=True, head="ForSequenceClassification"),
        Task("generate", "AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM", generates=True),
    )
}  # fmt: skip

ENCODER_TASKS: tuple[str, ...] = tuple(n for n, t in TASKS.items() if not t.generates)
#: Tasks whose items are (query, document) pairs rather than one text.
PAIR_TASKS: frozenset[str] = frozenset(n for n, t in TASKS.items() if t.pair)


def generates(task: str) -> bool:
    """Whether ``task`` is served by an LLM worker (unknown tasks: no)."""
    found = TASKS.get(task)
    return found is not None and found.generates
