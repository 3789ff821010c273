"""A compiled graph drawn as text, Mermaid or Graphviz dot (``trae show``).

Reads only the compiled DAG and the templates' references; imports no model code,
so drawing a graph is instant and runs nothing.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from trae_groups.graphs.compile import CompiledGraph
from trae_groups.graphs.spec import NodeSpec
from trae_groups.graphs.templates import analyze, node_templates


def inputs_read(node: NodeSpec) -> list[str]:
    """The graph inputs a node's templates read (``inputs.text`` -> "text")."""
    names: list[str] = []
    for _path, source, condition in node_templates(node):
        for ref in analyze(source, expression=condition).references:
            if ref.root == "inputs" and ref.field and ref.field not in names:
                names.append(ref.field)
    return names


def _label(graph: CompiledGraph, name: str) -> str:
    node = graph.spec.nodes[name]
    runs_on = getattr(node, "model", None) or getattr(node, "function", "")
    return f"{node.kind}: {runs_on}"


def as_text(graph: CompiledGraph) -> str:
    """One line per node, level by level (a level's nodes can run at the same time)."""
    spec = graph.spec
    lines = [f"graph {spec.name}: {len(spec.nodes)} nodes, {len(spec.models)} models"]
    if spec.inputs:
        lines.append("inputs: " + ", ".join(f"{n} ({i.type})" for n, i in spec.inputs.items()))
    for level, names in enumerate(graph.generations):
        lines.append(f"level {level}:")
        for name in names:
            node = spec.nodes[name]
            sources = list(graph.parents(name)) + [f"inputs.{i}" for i in inputs_read(node)]
            line = f"  {name} [{_label(graph, name)}]"
            if sources:
                line += " <- " + ", ".join(sources)
            if node.follows is not None:
                f = node.follows
                grain = f"every {f.every}" if f.every else f"every {f.tokens or f.chars} "
                grain += "" if f.every else ("tokens" if f.tokens else "chars")
                line += f"  (follows {f.node}'s stream, {grain})"
            if node.when:
                line += f"  (when {node.when})"
            lines.append(line)
    outputs = ", ".join(f"{name} = {ref}" for name, ref in spec.outputs.items())
    lines.append(f"outputs: {outputs}")
    return "\n".join(lines) + "\n"


def _edges(graph: CompiledGraph) -> list[tuple[str, str, str]]:
    """(from, to, via): every DAG edge (via reference, after or follows), plus inputs ->
    node and node -> outputs."""
    edges = [("inputs", n, "reference") for n in graph.order if inputs_read(graph.spec.nodes[n])]
    edges += [(a, b, data.get("via", "reference")) for a, b, data in graph.dag.edges(data=True)]
    for name in dict.fromkeys(n for o in graph.spec.outputs if (n := graph.output_node(o))):
        edges.append((name, "outputs", "reference"))
    return edges


#: How each kind of edge is drawn: a wait without data dashed, a stream thick.
_MERMAID_ARROWS = {"reference": "-->", "after": "-.->", "follows": "==>|streams|"}
_DOT_STYLES = {
    "reference": "",
    "after": " [style=dashed]",
    "follows": ' [style=bold, label="streams"]',
}


def as_mermaid(graph: CompiledGraph) -> str:
    spec = graph.spec
    lines = ["flowchart TD", f"  inputs([inputs: {', '.join(spec.inputs) or 'none'}])"]
    for name in graph.order:
        shape = '{{"%s"}}' if spec.nodes[name].when else '["%s"]'
        lines.append(f"  {name}" + shape % f"{name}<br/>{_label(graph, name)}")
    lines.append(f"  outputs([outputs: {', '.join(spec.outputs)}])")
    for a, b, via in _edges(graph):
        lines.append(f"  {a} {_MERMAID_ARROWS[via]} {b}")
    return "\n".join(lines) + "\n"


def _quote(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def as_dot(graph: CompiledGraph) -> str:
    spec = graph.spec
    lines = [f"digraph {_quote(spec.name)} {{", "  rankdir=TB;", "  node [shape=box];"]
    lines.append(f"  inputs [shape=oval, label={_quote('inputs: ' + ', '.join(spec.inputs))}];")
    for name in graph.order:
        style = ", style=dashed" if spec.nodes[name].when else ""
        label = _quote(f"{name}\n{_label(graph, name)}")
        lines.append(f"  {_quote(name)} [label={label}{style}];")
    lines.append(f"  outputs [shape=oval, label={_quote('outputs: ' + ', '.join(spec.outputs))}];")
    for a, b, via in _edges(graph):
        lines.append(f"  {_quote(a)} -> {_quote(b)}{_DOT_STYLES[via]};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_png(dot_source: str, path: Path) -> None:
    """A PNG through Graphviz; RuntimeError when ``dot`` is not installed."""
    dot = shutil.which("dot")
    if dot is None:
        raise RuntimeError("PNG needs Graphviz's `dot` on PATH; use --format dot or mermaid")
    subprocess.run([dot, "-Tpng", "-o", str(path)], input=dot_source.encode(), check=True)
