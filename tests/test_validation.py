"""Load-time validation: every problem is reported at once, with file, line and node."""

from __future__ import annotations

import textwrap

import pytest

from trae_groups.graphs.compile import resolve_functions
from trae_groups.graphs.errors import GraphValidationError, ValidationIssue
from trae_groups.graphs.loader import load_graph_text


def issues_of(text: str) -> list[ValidationIssue]:
    with pytest.raises(GraphValidationError) as info:
        load_graph_text(textwrap.dedent(text), "g.yaml")
    return info.value.issues


def only(text: str) -> ValidationIssue:
    found = issues_of(text)
    assert len(found) == 1, "\n".join(map(str, found))
    return found[0]


HEAD = """\
name: g
models:
  clf: {source: ./clf, task: classify}
  llm: {source: ./llm, task: generate}
inputs: {text: str}
"""  # nodes start on line 6


def graph(nodes: str, outputs: str = "outputs: {out: a.label}\n") -> str:
    return HEAD + "nodes:\n" + textwrap.indent(textwrap.dedent(nodes), "  ") + outputs


def test_yaml_syntax_error_has_line_and_column():
    issue = only("name: g\nnodes:\n  a: {model: clf, input: [x\n")
    assert (issue.file, issue.line) == ("g.yaml", 4)
    assert "YAML syntax" in issue.message and issue.column is not None


def test_unknown_fields_with_suggestions():
    found = issues_of(
        graph("""\
        a: {model: clf, inptu: "{{ inputs.text }}"}
        b: {model: llm, prompt: x, params: {temprature: 0.5}}
        """)
        + "outputz: {}\n"
    )
    by_line = {i.line: i for i in found}
    assert "unknown field 'inptu' (did you mean 'input'?)" in by_line[7].message
    assert by_line[7].node == "a"
    assert "params: unknown field 'temprature' (did you mean 'temperature'?)" in by_line[8].message
    assert "unknown field 'outputz' (did you mean 'outputs'?)" in by_line[10].message


def test_missing_field():
    issue = only(graph("a: {model: clf}\n"))
    assert (issue.line, issue.node) == (7, "a") and "missing field 'input'" in issue.message


def test_cycle_is_reported_once_with_its_path():
    issue = only(
        graph("""\
        a: {model: clf, input: "{{ c.text }}"}
        b: {model: llm, prompt: "{{ a.label }}"}
        c: {model: llm, prompt: "{{ b.text }}"}
        """)
    )
    assert (issue.line, issue.node) == (7, "a")
    assert issue.message == "dependency cycle: a -> b -> c -> a"


def test_after_can_close_a_cycle():
    issue = only(
        graph('a: {model: clf, input: x, after: [b]}\nb: {model: clf, input: "{{ a.label }}"}\n')
    )
    assert "dependency cycle: a -> b -> a" in issue.message


def test_self_reference():
    issue = only(graph('a: {model: clf, input: "{{ a.label }}"}\n'))
    assert (issue.line, issue.message) == (7, "a node cannot reference itself")


def test_unknown_model_node_input_and_field():
    found = issues_of(
        graph("""\
        a: {kind: classify, model: clff, input: "{{ inputs.txt }}"}
        b: {model: llm, prompt: "{{ a.lable }} {{ zz }}", after: [q]}
        """)
    )
    messages = [(i.line, i.node, i.message) for i in found]
    assert (7, "a", "unknown model 'clff' (did you mean 'clf'?)") in messages
    assert (7, "a", "unknown input 'txt' (did you mean 'text'?)") in messages
    assert any(
        line == 8 and "classify node 'a' has no field 'lable'" in m for line, _, m in messages
    )
    assert any(line == 8 and "unknown name 'zz'" in m for line, _, m in messages)
    assert (8, "b", "after: unknown node 'q'") in messages
    assert len(found) == 5


def test_kind_the_model_cannot_serve():
    issue = only(graph("a: {kind: generate, model: clf, prompt: x}\n", "outputs: {o: a.text}\n"))
    assert issue.line == 7 and issue.node == "a"
    assert issue.message == "a generate node cannot run on model 'clf' (its task is classify)"


def test_unknown_kind():
    issue = only(graph("a: {kind: summarize, model: clf, input: x}\n"))
    assert issue.line == 7 and "unknown kind 'summarize'" in issue.message


def test_template_syntax_error_line_inside_a_literal_block():
    issue = only(
        graph("""\
        a:
          model: llm
          prompt: |
            line one
            {{ inputs.text
        """, "outputs: {o: a.text}\n")
    )  # fmt: skip
    assert issue.line == 11 and issue.node == "a" and "template syntax" in issue.message


def test_condition_syntax_error():
    issue = only(graph('a: {model: clf, input: x, when: "inputs.text =="}\n'))
    assert issue.line == 7 and "template syntax" in issue.message


def test_condition_references_are_checked():
    issue = only(graph('a: {model: clf, input: x, when: "inputs.nope"}\n'))
    assert "unknown input 'nope'" in issue.message


@pytest.mark.parametrize(
    ("template", "fragment"),
    [
        ("{% include 'secrets.txt' %}", "cannot include"),
        ("{% import 'm.j2' as m %}", "cannot include"),
        ("{% extends 'base' %}", "cannot include"),
        ("{{ inputs.text.__class__ }}", "'__class__' is not allowed"),
        ("{{ inputs['_x'] }}", "'_x' is not allowed"),
        ("{{ inputs | attr('__dict__') }}", "'__dict__' is not allowed"),
        ("{{ self }}", "'self' is not allowed"),
    ],
)
def test_forbidden_template_constructs(template, fragment):
    issue = issues_of(graph(f'a: {{model: clf, input: "{template}"}}\n'))[0]
    assert issue.line == 7 and fragment in issue.message


def test_missing_outputs():
    issue = only(graph("a: {model: clf, input: x}\n", "outputs: {}\n"))
    assert (issue.line, issue.message) == (8, "the graph declares no outputs")
    assert "declares no outputs" in only(graph("a: {model: clf, input: x}\n", "")).message


def test_unknown_and_malformed_outputs():
    found = issues_of(
        graph(
            "a: {model: clf, input: x}\n",
            "outputs:\n  x: b.label\n  y: a.text\n  z: inputs.nope\n  w: 'a label'\n  v: inputs\n",
        )
    )
    assert [(i.line, i.node) for i in found] == [
        (9, None),
        (10, None),
        (11, None),
        (12, None),
        (13, None),
    ]
    assert "output 'x': unknown name 'b'" in found[0].message
    assert "output 'y': classify node 'a' has no field 'text'" in found[1].message
    assert "output 'z': unknown input 'nope'" in found[2].message
    assert "output 'w'" in found[3].message and "must look like" in found[3].message
    assert "output 'v': an output reads one input" in found[4].message


def test_bad_input_types():
    text = graph("a: {model: clf, input: x}\n").replace(
        "inputs: {text: str}", "inputs:\n  text: string\n  n: {type: int, default: 1.5}"
    )
    found = issues_of(text)
    assert [(i.line, i.message.split(":")[0]) for i in found] == [
        (6, "input 'text'"),
        (7, "input 'n'"),
    ]
    assert "is not of type int" in found[1].message


@pytest.mark.parametrize("function", ["os.path", "os:", "os:getcwd()", "1mod:f", "a.b:class"])
def test_bad_function_strings(function):
    issue = only(graph(f'a: {{function: "{function}"}}\n', "outputs: {o: a}\n"))
    assert issue.line == 7 and issue.node == "a" and "package.module:function" in issue.message


def test_function_is_not_imported_at_load():
    spec = load_graph_text(
        textwrap.dedent(graph('a: {function: "no_such_module_xyz:f"}\n', "outputs: {o: a}\n")),
        "g.yaml",
    )
    assert spec.nodes["a"].function == "no_such_module_xyz:f"


def test_resolve_functions_reports_every_node():
    text = graph(
        """\
        ok: {function: "json:dumps", args: {obj: 1}}
        gone: {function: "no_such_module_xyz:f"}
        attr: {function: "json:no_such_function"}
        value: {function: "json.decoder:NaN"}
        """,
        "outputs: {o: ok}\n",
    )
    spec = load_graph_text(textwrap.dedent(text), "g.yaml")
    with pytest.raises(GraphValidationError) as info:
        resolve_functions(spec)
    found = [(i.line, i.node) for i in info.value.issues]
    assert found == [(8, "gone"), (9, "attr"), (10, "value")]
    assert "cannot import 'no_such_module_xyz'" in info.value.issues[0].message
    assert "ModuleNotFoundError" in info.value.issues[0].message
    assert "no attribute 'no_such_function'" in info.value.issues[1].message
    assert "not callable" in info.value.issues[2].message


def test_resolve_functions_returns_callables():
    spec = load_graph_text(
        textwrap.dedent(graph('a: {function: "json:dumps"}\n', "outputs: {o: a}\n")), "g.yaml"
    )
    import json

    assert resolve_functions(spec) == {"a": json.dumps}


def test_duplicate_keys():
    issue = only(graph("a: {model: clf, input: x}\na: {model: clf, input: y}\n"))
    assert (issue.line, issue.node) == (8, "a")
    assert issue.message == "duplicate key 'a' (first at line 7)"


@pytest.mark.parametrize("name", ["inputs", "range", "my-node", "if"])
def test_bad_node_names(name):
    issue = only(graph(f"'{name}': {{model: clf, input: x}}\n", "outputs: {o: inputs.text}\n"))
    assert issue.line == 7 and "node name" in issue.message


def test_optional_must_name_a_parent():
    issue = only(
        graph(
            'b: {model: clf, input: x}\na: {model: clf, input: "{{ inputs.text }}", optional: [b]}\n'
        )
    )
    assert issue.line == 8 and "optional: 'b' is not a node this one" in issue.message


def test_default_only_with_on_error_default_and_shaped_like_a_result():
    found = issues_of(
        graph("""\
        a: {model: clf, input: x, default: {label: none}}
        b: {model: clf, input: x, on_error: default, default: {lable: x}}
        """)
    )
    assert [(i.line, i.node) for i in found] == [(7, "a"), (8, "b")]
    assert "only used with 'on_error: default'" in found[0].message
    assert "default stands in for a classify result" in found[1].message


def test_broken_model_is_reported_once():
    text = graph("a: {model: clf, input: x}\n").replace("task: classify", "task: clasify")
    issue = only(text)
    assert issue.line == 3 and issue.message.startswith("model 'clf': task:")


def test_every_error_at_once_sorted_by_line():
    text = """\
    name: g
    models:
      clf: {source: ./clf, task: classify, max_batch_size: 0}
      llm: {source: ./llm, task: generate}
    inputs: {text: str, n: {type: integer}}
    nodes:
      a: {model: clf, input: "{{ inputs.txt }}", colour: red}
      b: {model: llm, prompt: "{{ c.text }}", params: {temperature: -1}}
      c: {model: llm, prompt: "{{ b.text }} {{ d }}"}
      e: {function: "not a function"}
      f: {model: llm, prompt: "{% if %}"}
    outputs: {x: zz.text}
    extra: 1
    """
    found = issues_of(text)
    assert [i.line for i in found] == [3, 5, 7, 7, 8, 9, 10, 11, 12, 13]
    nodes = [i.node for i in found]
    assert nodes == [None, None, "a", "a", "b", "c", "e", "f", None, None]
    # b is set aside for its params, so the b <-> c cycle is not reported; the
    # templates of a set-aside node are still checked (a's unknown input)
    assert "unknown input 'txt'" in found[3].message


def test_string_form_of_the_error():
    with pytest.raises(GraphValidationError) as info:
        load_graph_text(textwrap.dedent(graph("a: {model: nope, input: x}\n")), "g.yaml")
    assert str(info.value) == "g.yaml:7: node 'a': unknown model 'nope'"
    assert str(ValidationIssue("f.yaml", None, None, "bad")) == "f.yaml: bad"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("", "got empty"), ("- a\n- b\n", "got a list"), ("just text\n", "got a str")],
)
def test_documents_that_are_not_graphs(text, fragment):
    assert fragment in only(text).message


def test_section_of_the_wrong_type():
    issue = only(
        graph("a: {model: clf, input: x}\n").replace("inputs: {text: str}", "inputs: [text]")
    )
    assert issue.line == 5 and "inputs" in issue.message and "dictionary" in issue.message
