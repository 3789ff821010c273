"""Fuzzing the loader: whatever the document, the only error is GraphValidationError."""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trae_groups.graphs.compile import compile_graph
from trae_groups.graphs.errors import GraphValidationError
from trae_groups.graphs.loader import load_graph_text

EXAMPLE = yaml.safe_load((Path(__file__).parents[1] / "examples" / "support.yaml").read_text())
WORDS = [
    "name", "models", "inputs", "nodes", "outputs", "model", "task", "kind", "input",
    "prompt", "messages", "params", "when", "after", "optional", "timeout", "on_error",
    "default", "function", "args", "source", "type", "intent", "entities", "reply",
    "classify", "generate", "python", "str", "messages", "inputs.text", "intent.label",
    "{{ intent.label }}", "{{ reply.text }}", "{{ inputs.text", "os:getcwd", "1s",
    "{% include 'x' %}", "{{ ''.__class__ }}", "role", "content", "max_tokens", "[1]",
]  # fmt: skip
# TRAE_FUZZ_EXAMPLES=5000 for a deep (random, not derandomized) run.
_EXAMPLES = int(os.environ.get("TRAE_FUZZ_EXAMPLES", "0"))
FUZZ = settings(
    max_examples=_EXAMPLES or 100,
    derandomize=not _EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(WORDS),
    st.text(max_size=12),
)
keys = st.one_of(st.sampled_from(WORDS), st.text(max_size=8), st.integers(-3, 3), st.booleans())
documents = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=5)),
    max_leaves=30,
)


def _load(text: str, located: bool = False) -> None:
    try:
        spec = load_graph_text(text, "fuzz.yaml")
    except GraphValidationError as exc:
        assert exc.issues, "a validation error must carry at least one issue"
        assert all(issue.file == "fuzz.yaml" for issue in exc.issues)
        str(exc)
        if located:  # a mapping document: every issue can name its line
            assert all(issue.line is not None for issue in exc.issues), str(exc)
        return
    compile_graph(spec)  # a spec that loads must compile
    assert load_graph_text(spec.to_yaml(), "again.yaml") == spec


@FUZZ
@given(documents)
def test_random_documents(document):
    _load(yaml.safe_dump(document, allow_unicode=True))


@FUZZ
@given(st.text(alphabet=st.sampled_from(list("ab:- \n{}[]&*!|>'\"#%@`\t,?") + ["\x00"])))
def test_random_text(text):
    _load(text)


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _paths(item, (*prefix, i))


PATHS = list(_paths(EXAMPLE))[1:]


def _mutate(document, path, action, value):
    *parents, last = path
    target = document
    for step in parents:
        target = target[step]
    if action == "delete" and isinstance(target, dict):
        del target[last]
    elif action == "rename" and isinstance(target, dict):
        target[value if isinstance(value, str) else str(value)] = target.pop(last)
    else:
        target[last] = value


@FUZZ
@given(
    st.lists(
        st.tuples(st.sampled_from(PATHS), st.sampled_from(["set", "delete", "rename"]), documents),
        min_size=1,
        max_size=4,
    )
)
def test_mutated_valid_graph(mutations):
    document = yaml.safe_load(yaml.safe_dump(EXAMPLE))
    for path, action, value in mutations:
        try:
            _mutate(document, path, action, value)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed or replaced this path
    _load(yaml.safe_dump(document, allow_unicode=True), located=True)


NAMES = ["a", "b", "c", "d", "e"]
MODELS = {
    "clf": {"source": "./clf", "task": "classify"},
    "ner": {"source": "./ner", "task": "tag"},
    "emb": {"source": "./emb", "task": "embed"},
    "llm": {"source": "./llm", "task": "generate"},
}
FIELD = {"clf": "label", "ner": "spans", "emb": "embedding", "llm": "text", None: "x"}


@st.composite
def random_graph(draw):
    """Mostly valid DAGs (nodes read earlier nodes), with a random wrong reference now
    and then: a cycle, an unknown name or field, a self reference."""
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=5, unique=True))
    models = {name: draw(st.sampled_from([*MODELS, None])) for name in names}

    def ref(pool):
        root = draw(st.sampled_from([*pool, "inputs"]))
        return "inputs.text" if root == "inputs" else f"{root}.{FIELD[models[root]]}"

    def wrong():
        return (
            draw(st.sampled_from([*NAMES, "inputs", "zz"]))
            + "."
            + draw(st.sampled_from(["label", "text", "nope", "spans"]))
        )

    nodes = {}
    for i, name in enumerate(names):
        refs = [ref(names[:i]) for _ in range(draw(st.integers(0, 2)))]
        if draw(st.integers(0, 9)) == 0:
            refs.append(wrong())
        template = " ".join("{{ " + r + " }}" for r in refs) or "plain"
        model = models[name]
        if model is None:
            node = {"function": "json:dumps", "args": {"obj": template, "n": 1}}
        else:
            node = {"model": model, "prompt" if model == "llm" else "input": template}
        if draw(st.booleans()):
            node["when"] = ref(names[:i]) + " is not none"
        parents = sorted({r.split(".")[0] for r in refs} - {"inputs", name} & set(names))
        node["optional"] = draw(st.lists(st.sampled_from(parents), unique=True)) if parents else []
        node["after"] = draw(st.lists(st.sampled_from(names[:i]), unique=True)) if i else []
        nodes[name] = node
    outputs = {f"o{i}": ref(names) for i in range(draw(st.integers(0, 3)))}
    return {"name": "fuzz", "models": MODELS, "inputs": {"text": "str"}, "nodes": nodes,
            "outputs": outputs}  # fmt: skip


@FUZZ
@given(random_graph())
def test_random_graphs(document):
    _load(yaml.safe_dump(document), located=True)


def test_valid_example_survives_the_harness():
    _load(yaml.safe_dump(EXAMPLE))
