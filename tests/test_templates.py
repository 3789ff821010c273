"""graphs/templates.py: the sandbox, the raw-value rule, conditions and node rendering."""

from __future__ import annotations

import pytest

from trae_groups.graphs.errors import TemplateRenderError
from trae_groups.graphs.spec import GenerateNode, PythonNode, TagNode
from trae_groups.graphs.templates import (
    ENV,
    Condition,
    GraphTemplate,
    NodeTemplates,
    analyze,
    resolve_reference,
)


def render(source, context):
    return GraphTemplate(source).render(context)


def condition(source, context):
    return Condition(source).evaluate(context)


CONTEXT = {
    "inputs": {"text": "hello", "tags": ["a", "b"], "n": 3},
    "intent": {"label": "billing", "score": 0.9, "scores": {"billing": 0.9}},
    "retrieve": {"items": ["doc1", "doc2"], "keys": 2},
    "skipped": None,
}


# ---------------------------------------------------------------- sandbox


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ inputs.__class__ }}",
        "{{ inputs['__class__'] }}",
        "{{ inputs | attr('__class__') }}",
        "{{ inputs.text | attr('upper') | attr('__self__') }}",
        "{{ (1).__class__.__base__ }}",
        "{{ '{0.__class__}'.format(inputs) }}",
        "{{ inputs.tags.append('x') }}",
        "{{ inputs.update({'text': 'x'}) }}",
        "{{ range.__globals__ }}",
        "{{ namespace.__init__.__globals__ }}",
        "{{ self }}",
        "{{ lipsum() }}",
        "{{ cycler }}",
        "{{ config }}",
        "{{ request }}",
    ],
)
def test_sandbox_refuses_code_execution(template):
    with pytest.raises(TemplateRenderError):
        render(template, CONTEXT)
    assert CONTEXT["inputs"]["tags"] == ["a", "b"] and CONTEXT["inputs"]["text"] == "hello"


@pytest.mark.parametrize(
    "template",
    [
        "{% include '/etc/passwd' %}",
        "{% import '/etc/passwd' as p %}",
        "{% from '/etc/passwd' import x %}",
        "{% extends '/etc/passwd' %}",
    ],
)
def test_sandbox_has_no_file_access(template):
    assert ENV.loader is None
    with pytest.raises(TemplateRenderError):
        render(template, CONTEXT)
    assert any("cannot include" in p.message for p in analyze(template).problems)


def test_no_extensions_and_few_globals():
    assert set(ENV.globals) == {"range", "dict", "namespace"}
    assert not ENV.extensions
    assert analyze("{% do x %}").problems  # the `do` extension is not loaded


def test_range_is_bounded():
    with pytest.raises(TemplateRenderError, match="Range too big"):
        render("{{ range(10**9) | list }}", CONTEXT)


def test_validation_never_evaluates_a_template():
    # no constant folding: analysing (and compiling) a huge expression is instant
    assert analyze("{{ 'x' * 10**12 }}").problems == ()
    GraphTemplate("{{ 'x' * 10**12 }}")


def test_undefined_is_an_error_not_an_empty_string():
    with pytest.raises(TemplateRenderError, match="no attribute 'nope'"):
        render("Intent: {{ intent.nope }}", CONTEXT)
    with pytest.raises(TemplateRenderError, match="'missing' is undefined"):
        render("{{ missing }}", CONTEXT)


# ---------------------------------------------------------------- raw-value rule


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{ inputs.tags }}", ["a", "b"]),
        ("  {{ inputs.tags }}\n", ["a", "b"]),
        ("{{- inputs.n -}}", 3),
        ("{{ inputs.n + 1 }}", 4),
        ("{{ intent }}", CONTEXT["intent"]),
        ("{{ skipped }}", None),
        ("{{ inputs.tags | map('upper') | list }}", ["A", "B"]),
        ("{{ inputs.tags }} ", ["a", "b"]),
        ("x {{ inputs.tags }}", "x ['a', 'b']"),
        ("{{ inputs.n }}{{ inputs.n }}", "33"),
        ("{{ inputs.text }}!", "hello!"),
        ("{% if inputs.n %}{{ inputs.tags }}{% endif %}", "['a', 'b']"),
        ("plain", "plain"),
    ],
)
def test_raw_value_rule(template, expected):
    assert render(template, CONTEXT) == expected


def test_mapping_keys_win_over_methods():
    assert render("{{ retrieve.items }}", CONTEXT) == ["doc1", "doc2"]
    assert render("{{ retrieve.keys }}", CONTEXT) == 2
    loop = "{% for k, v in intent.scores.items() %}{{ k }}{% endfor %}"
    assert render(loop, CONTEXT) == "billing"


# ---------------------------------------------------------------- conditions


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("intent.label != 'spam'", True),
        ("intent.score > 0.95", False),
        ("inputs.tags | length == 2", True),
        ("skipped is none", True),
        ("not skipped", True),
        ("'a' in inputs.tags and inputs.n >= 3", True),
    ],
)
def test_conditions(expression, expected):
    assert condition(expression, CONTEXT) is expected


def test_condition_errors():
    with pytest.raises(TemplateRenderError, match="condition"):
        condition("intent.nope == 1", CONTEXT)
    with pytest.raises(TemplateRenderError):
        condition("skipped.label == 'x'", CONTEXT)
    assert analyze("a b", expression=True).problems
    assert analyze("a }} {{ b", expression=True).problems


# ---------------------------------------------------------------- analysis


def test_references_found_by_analysis():
    info = analyze(
        "{{ intent.label }}\n{% for t in inputs.tags %}{{ t.x }}{% endfor %}\n{{ retrieve['items'] }}"
        "{% set y = 1 %}{{ y }}{{ skipped }}"
    )
    found = {(r.root, r.field, r.line) for r in info.references}
    assert found == {
        ("intent", "label", 1),
        ("inputs", "tags", 2),
        ("retrieve", "items", 3),
        ("skipped", None, 3),
    }


def test_syntax_error_line():
    info = analyze("line 1\nline 2 {{ x }\n")
    assert info.problems[0].line == 2 and "template syntax" in info.problems[0].message


# ---------------------------------------------------------------- node rendering


def test_model_node_input():
    node = TagNode(kind="tag", model="ner", input="{{ inputs.text }}", when="intent.score > 0.5")
    templates = NodeTemplates(node)
    assert templates.render(CONTEXT) == {"input": "hello"}
    assert templates.should_run(CONTEXT)


def test_generate_prompt_and_messages():
    prompt = GenerateNode(kind="generate", model="llm", prompt="Intent: {{ intent.label }}")
    assert NodeTemplates(prompt).render(CONTEXT) == {"prompt": "Intent: billing"}
    chat = GenerateNode(
        kind="generate",
        model="llm",
        messages=[
            {"role": "system", "content": "Intent {{ intent.label }}"},
            {"role": "user", "content": "{{ inputs.text }}"},
        ],
    )
    assert NodeTemplates(chat).render(CONTEXT)["messages"] == [
        {"role": "system", "content": "Intent billing"},
        {"role": "user", "content": "hello"},
    ]


def test_messages_from_one_reference():
    node = GenerateNode(kind="generate", model="llm", messages="{{ inputs.history }}")
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    context = {**CONTEXT, "inputs": {"history": history}}
    assert NodeTemplates(node).render(context) == {"messages": history}
    with pytest.raises(TemplateRenderError, match="messages must be"):
        NodeTemplates(node).render({"inputs": {"history": "not a list"}})


def test_python_args_render_recursively():
    node = PythonNode(
        kind="python",
        function="m:f",
        args={"query": "{{ inputs.text }}", "k": 3, "tags": ["{{ inputs.tags }}", "x"], "opts": {"s": "{{ intent.score }}"}},
    )  # fmt: skip
    assert NodeTemplates(node).render(CONTEXT)["args"] == {
        "query": "hello",
        "k": 3,
        "tags": [["a", "b"], "x"],
        "opts": {"s": 0.9},
    }


def test_node_condition_false():
    node = TagNode(kind="tag", model="ner", input="x", when="intent.label == 'spam'")
    assert not NodeTemplates(node).should_run(CONTEXT)


# ---------------------------------------------------------------- output references


def test_resolve_reference():
    assert resolve_reference("intent.label", CONTEXT) == "billing"
    assert resolve_reference("retrieve.items.1", CONTEXT) == "doc2"
    assert resolve_reference("inputs.text", CONTEXT) == "hello"
    assert resolve_reference("skipped.text", CONTEXT) is None
    assert resolve_reference("skipped", CONTEXT) is None
    with pytest.raises(TemplateRenderError, match="no field 'nope'"):
        resolve_reference("intent.nope", CONTEXT)
    with pytest.raises(TemplateRenderError, match="no value yet"):
        resolve_reference("later.text", CONTEXT)
