"""Whole-graph checks and the compiled DAG the executor walks.

`check_graph` finds what pydantic cannot see one field at a time: references to
unknown models, inputs, nodes or result fields; node kinds a model's task cannot
serve; template errors; cycles; missing outputs. `compile_graph` turns a clean spec
into a `CompiledGraph`: a networkx DAG with depth, generations, parents, children
and each node's templates compiled once.

Skip rule (docs/graphs.md): a node is skipped when its `when` is false, or when any
parent (referenced or `after:`) was skipped and is not listed in its `optional:`.
A skipped node's result, and every output that reads it, is null.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from trae_groups.graphs.errors import GraphValidationError, SourceMap, ValidationIssue
from trae_groups.graphs.functions import FunctionPolicy
from trae_groups.graphs.nodes import FOLLOWED_FIELDS, RESULT_FIELDS, result_fields
from trae_groups.graphs.spec import (
    KIND_TASKS,
    GraphSpec,
    NodeSpec,
    PythonNode,
)
from trae_groups.graphs.templates import NodeTemplates, analyze, node_templates, resolve_reference


@dataclass(frozen=True)
class Problem:
    """A whole-graph problem, located by spec path (the loader turns it into a line)."""

    path: tuple
    message: str
    node: str | None = None
    template_line: int | None = None


@dataclass(frozen=True)
class Excused:
    """Names already reported broken by shape checks: references to them are not errors."""

    models: frozenset[str] = frozenset()
    inputs: frozenset[str] = frozenset()
    nodes: frozenset[str] = frozenset()
    sections: frozenset[str] = frozenset()


# ---------------------------------------------------------------- checks


@dataclass
class _Walk:
    """Accumulates problems and edges while checking one spec."""

    spec: GraphSpec
    excused: Excused
    problems: list[Problem] = field(default_factory=list)
    edges: list[tuple[str, str, str]] = field(default_factory=list)

    def add(self, path: tuple, message: str, node: str | None = None, line: int | None = None):
        self.problems.append(Problem(path, message, node, line))


def check_graph(
    spec: GraphSpec, excused: Excused = Excused(), set_aside: Mapping[str, Any] | None = None
) -> tuple[list[Problem], nx.DiGraph]:
    """Every whole-graph problem of `spec`, and the dependency graph it implies.

    `set_aside`: raw nodes that failed shape checks; their templates are checked too.
    """
    walk = _Walk(spec, excused)
    for name, raw in (set_aside or {}).items():
        if isinstance(raw, Mapping):
            _check_templates(walk, name, raw)
    if not spec.nodes and "nodes" not in excused.sections and not excused.nodes:
        walk.add(("nodes",), "the graph declares no nodes")
    policy = FunctionPolicy.from_env()
    for name, node in spec.nodes.items():
        _check_model(walk, name, node)
        _check_function(walk, name, node, policy)
        _check_templates(walk, name, node)
        _check_after(walk, name, node)
        _check_default(walk, name, node)
        _check_follows(walk, name, node)
        _check_speculative(walk, name, node)
    dag = nx.DiGraph()
    dag.add_nodes_from(spec.nodes)
    for parent, child, via in walk.edges:
        if not dag.has_edge(parent, child) or via == "reference":
            dag.add_edge(parent, child, via=via)
    for name, node in spec.nodes.items():
        _check_optional(walk, dag, name, node)
    _check_cycles(walk, dag)
    _check_holders(walk, dag)
    _check_outputs(walk)
    _check_deploy(walk)
    _check_drafts(walk)
    return walk.problems, dag


def _check_model(walk: _Walk, name: str, node: NodeSpec) -> None:
    if isinstance(node, PythonNode):
        return
    model = walk.spec.models.get(node.model)
    path = ("nodes", name, "model")
    if model is None:
        if node.model not in walk.excused.models and "models" not in walk.excused.sections:
            hint = _suggest(node.model, walk.spec.models)
            walk.add(path, f"unknown model '{node.model}'{hint}", name)
    elif (
        model.max_tokens_limit is not None
        and node.kind == "generate"
        and node.params.max_tokens > model.max_tokens_limit
    ):
        walk.add(
            ("nodes", name, "params", "max_tokens"),
            f"max_tokens {node.params.max_tokens} is over model '{node.model}''s "
            f"max_tokens_limit ({model.max_tokens_limit})",
            name,
        )
    elif model.task not in KIND_TASKS[node.kind]:
        walk.add(
            path,
            f"a {node.kind} node cannot run on model '{node.model}' (its task is {model.task})",
            name,
        )
    elif getattr(node, "adapter", None) is not None:
        _check_adapter(walk, name, node, model)


def _check_adapter(walk: _Walk, name: str, node: NodeSpec, model) -> None:
    path = ("nodes", name, "adapter")
    known = model.adapters or {}
    if model.version_adapters:
        walk.add(
            path,
            f"model '{node.model}' has versions that are adapters: a node picks its adapter "
            "or the route does, not both",
            name,
        )
    elif node.adapter not in known:
        hint = _suggest(node.adapter, known) if known else ""
        where = f"its adapters: {sorted(known)}" if known else "it has no adapters"
        walk.add(
            path, f"model '{node.model}' has no adapter '{node.adapter}' ({where}){hint}", name
        )


def _check_function(walk: _Walk, name: str, node: NodeSpec, policy: FunctionPolicy) -> None:
    if isinstance(node, PythonNode):
        problem = policy.reference_problem(node.function)
        if problem:
            walk.add(("nodes", name, "function"), problem, name)


def _check_templates(walk: _Walk, name: str, node: NodeSpec | Mapping[str, Any]) -> None:
    for sub, source, condition in node_templates(node):
        path = ("nodes", name, *sub)
        info = analyze(source, expression=condition)
        for problem in info.problems:
            walk.add(path, problem.message, name, problem.line)
        followed = _followed(node)
        for ref in info.references:
            if ref.root == followed:  # the stream it follows: the follows edge, not a wait
                message = _followed_field_problem(node, ref.field)
            elif ref.root == name and sub == ("cut_when",):  # a piece's own result
                kind = _kind(node)  # one piece's result has its kind's fields
                message = _field_problem(name, kind, RESULT_FIELDS.get(kind), ref.field)
            else:
                message = _reference_problem(walk, name, ref.root, ref.field, ref.path)
            if message:
                walk.add(path, message, name, ref.line)
            elif (
                ref.root in walk.spec.nodes
                and ref.root not in (name, followed)
                and name in walk.spec.nodes
            ):
                walk.edges.append((ref.root, name, "reference"))


def _reference_problem(
    walk: _Walk, name: str | None, root: str, attr: str | None, path: tuple[str, ...] = ()
) -> str | None:
    spec, excused = walk.spec, walk.excused
    if root == "inputs":
        if attr is None or attr in spec.inputs or attr in excused.inputs:
            return None
        if "inputs" in excused.sections:
            return None
        return f"unknown input '{attr}'{_suggest(attr, spec.inputs)}"
    if root == name:
        return "a node cannot reference itself"
    if root in spec.nodes:
        node = spec.nodes[root]
        if attr == "json" and node.kind == "generate":
            return _json_problem(root, node.output_schema, path[1:])
        return _field_problem(root, node.kind, result_fields(node), attr)
    if root in excused.nodes or "nodes" in excused.sections:
        return None
    return f"unknown name '{root}': not a node, and inputs are read as inputs.<name>" + _suggest(
        root, spec.nodes
    )


def _field_problem(
    root: str, kind: str, fields: Collection[str] | None, attr: str | None
) -> str | None:
    if attr is None or fields is None or attr in fields:
        return None
    return f"{kind} node '{root}' has no field '{attr}' (fields: {', '.join(sorted(fields))})"


def _followed(node: NodeSpec | Mapping[str, Any]) -> str | None:
    follows = getattr(node, "follows", None)
    return follows.node if follows is not None else None


def _kind(node: NodeSpec | Mapping[str, Any]) -> str:
    return str(node.get("kind") if isinstance(node, Mapping) else node.kind)


def _followed_field_problem(node: NodeSpec, attr: str | None) -> str | None:
    """A follower reads the followed node's text so far (and, per piece, the piece)."""
    fields = FOLLOWED_FIELDS if node.per_piece else ("text", "tokens")
    if attr is None or attr in fields:
        return None
    return (
        f"while '{node.follows.node}' streams, a node that follows it reads "
        f"{', '.join(fields)} of it, not '{attr}'"
    )


def text_sources(node: NodeSpec) -> list[str]:
    """The nodes whose ``text`` a node's prompt or messages read, in the order read."""
    found: list[str] = []
    for sub, source, condition in node_templates(node):
        if condition or sub[0] not in ("prompt", "messages"):
            continue
        for ref in analyze(source).references:
            if ref.field == "text" and ref.root != "inputs" and ref.root not in found:
                found.append(ref.root)
    return found


def _generate_sources(spec: GraphSpec, node: NodeSpec) -> list[str]:
    return [n for n in text_sources(node) if n in spec.nodes and spec.nodes[n].kind == "generate"]


def drafts_from(spec: GraphSpec, name: str) -> str | None:
    """The node whose text a generate node's ``speculative: {method: follows}`` drafts from:
    the one it names, else the one generate node whose text its prompt reads, else the node
    it follows on a streamed edge; None when it declares none or none fits (the checks say)."""
    node = spec.nodes[name]
    declared = getattr(node, "speculative", None)
    if declared is None:
        return None
    read = _generate_sources(spec, node)
    if declared.node is not None:
        return declared.node if declared.node in read else None
    followed = _followed(node)
    if followed in read:
        return followed
    return read[0] if len(read) == 1 else None


def _check_speculative(walk: _Walk, name: str, node: NodeSpec) -> None:
    """``speculative: {method: follows}`` needs a generate node's text in the prompt."""
    declared = getattr(node, "speculative", None)
    if declared is None or drafts_from(walk.spec, name) is not None:
        return
    nodes, named = walk.spec.nodes, declared.node
    if named is not None:
        path = ("nodes", name, "speculative", "node")
        if named not in nodes:
            if named not in walk.excused.nodes:
                walk.add(path, f"unknown node '{named}'{_suggest(named, nodes)}", name)
        elif nodes[named].kind != "generate":
            walk.add(path, f"'{named}' is a {nodes[named].kind} node; follows drafts from a "
                     "generate node's text", name)  # fmt: skip
        else:
            walk.add(path, f"the prompt of '{name}' does not read {named}.text, so there is "
                     "nothing of it to draft from", name)  # fmt: skip
        return
    path = ("nodes", name, "speculative")
    read = _generate_sources(walk.spec, node)
    if not read:
        walk.add(path, f"method follows drafts from the text of a generate node the prompt "
                 f"reads ({{{{ reply.text }}}}); the prompt of '{name}' reads none", name)  # fmt: skip
    else:
        walk.add(path, f"the prompt of '{name}' reads the text of {' and '.join(map(repr, read))}"
                 "; name the one to draft from with node:", name)  # fmt: skip


def _check_follows(walk: _Walk, name: str, node: NodeSpec) -> None:
    """Only a generate node streams; a granularity it can reach; no waiting on it."""
    if node.follows is None:
        return
    path = ("nodes", name, "follows")
    target = node.follows.node
    followed = walk.spec.nodes.get(target)
    if target == name:
        walk.add(path, "a node cannot follow itself", name)
    elif followed is None:
        if target not in walk.excused.nodes and "nodes" not in walk.excused.sections:
            walk.add(path, f"unknown node '{target}'{_suggest(target, walk.spec.nodes)}", name)
    elif followed.kind != "generate":
        walk.add(path, f"only a generate node streams; '{target}' is a {followed.kind} node", name)
    elif followed.follows is not None and followed.follows.node == name:
        return  # the cycle check reports it
    else:
        tokens, limit = node.follows.tokens, followed.params.max_tokens
        if tokens is not None and tokens > limit:
            walk.add(
                (*path, "tokens"),
                f"a piece of {tokens} tokens never ends before '{target}' does (its "
                f"max_tokens is {limit})",
                name,
            )
        if target in node.after:
            walk.add(path, f"follows '{target}' and waits for it in after:; choose one", name)
        walk.edges.append((target, name, "follows"))


def _check_holders(walk: _Walk, dag: nx.DiGraph) -> None:
    """A holding follower must not wait for anything that waits for the node it holds:
    that node's end waits for the follower to pass its text."""
    for name, node in walk.spec.nodes.items():
        if not node.holds or node.follows.node not in dag:
            continue
        target = node.follows.node
        for parent, _, via in dag.in_edges(name, data="via"):
            if via != "follows" and (parent == target or target in nx.ancestors(dag, parent)):
                walk.add(
                    ("nodes", name, "follows"),
                    f"'{name}' holds back '{target}''s text until it passes it, so it "
                    f"cannot wait for '{parent}', which waits for '{target}'",
                    name,
                )


def _json_problem(root: str, schema: Any, keys: tuple[str, ...]) -> str | None:
    """A reference into a generate node's typed output names a field its schema has."""
    if schema is None:
        return f"generate node '{root}' has no output_schema: its result has no 'json'"
    where = f"{root}.json"
    for key in keys:
        properties = schema.get("properties") if isinstance(schema, dict) else None
        if properties is None:
            return None  # the schema does not say: any key may be there
        if key not in properties:
            known = ", ".join(sorted(properties))
            return f"'{where}' has no field '{key}' (fields: {known}){_suggest(key, properties)}"
        schema, where = properties[key], f"{where}.{key}"
    return None


def _check_after(walk: _Walk, name: str, node: NodeSpec) -> None:
    for i, other in enumerate(node.after):
        path = ("nodes", name, "after", i)
        if other == name:
            walk.add(path, "a node cannot wait for itself", name)
        elif other in walk.spec.nodes:
            walk.edges.append((other, name, "after"))
        elif other not in walk.excused.nodes and "nodes" not in walk.excused.sections:
            walk.add(path, f"after: unknown node '{other}'{_suggest(other, walk.spec.nodes)}", name)


def _check_default(walk: _Walk, name: str, node: NodeSpec) -> None:
    """An `on_error: default` value stands in for a result, so it has a result's fields."""
    fields = result_fields(node)
    if node.default is None or fields is None:
        return
    if not isinstance(node.default, dict) or not set(node.default) <= fields:
        walk.add(
            ("nodes", name, "default"),
            f"default stands in for a {node.kind} result: a mapping with some of the "
            f"fields {', '.join(sorted(fields))}",
            name,
        )


def _check_optional(walk: _Walk, dag: nx.DiGraph, name: str, node: NodeSpec) -> None:
    for i, other in enumerate(node.optional):
        if not dag.has_edge(other, name) and other not in walk.excused.nodes:
            walk.add(
                ("nodes", name, "optional", i),
                f"optional: '{other}' is not a node this one references or waits for",
                name,
            )


def _check_cycles(walk: _Walk, dag: nx.DiGraph) -> None:
    order = list(walk.spec.nodes)
    for component in nx.strongly_connected_components(dag):
        if len(component) < 2:
            continue
        cycle = [edge[0] for edge in nx.find_cycle(dag.subgraph(component))]
        start = min(range(len(cycle)), key=lambda i: order.index(cycle[i]))
        cycle = cycle[start:] + cycle[:start]
        text = " -> ".join([*cycle, cycle[0]])
        walk.add(("nodes", cycle[0]), f"dependency cycle: {text}", cycle[0])


def _check_outputs(walk: _Walk) -> None:
    spec = walk.spec
    if not spec.outputs and "outputs" not in walk.excused.sections:
        walk.add(("outputs",), "the graph declares no outputs")
    for key, reference in spec.outputs.items():
        root, _, rest = reference.partition(".")
        path = tuple(rest.split(".")) if rest else ()
        attr = path[0] if path else None
        if root == "inputs" and attr is None:
            message = "an output reads one input: inputs.<name>"
        else:
            message = _reference_problem(walk, None, root, attr, path)
        if message:
            walk.add(("outputs", key), f"output '{key}': {message}")


def _check_deploy(walk: _Walk) -> None:
    """Each model a deploy group lists exists, and is in one group only."""
    seen: dict[str, str] = {}
    for group, spec in walk.spec.deploy.groups.items():
        for i, model in enumerate(spec.models):
            path = ("deploy", "groups", group, "models", i)
            if model not in walk.spec.models and model not in walk.excused.models:
                walk.add(path, f"group '{group}': unknown model '{model}'"
                         f"{_suggest(model, walk.spec.models)}")  # fmt: skip
            elif model in seen:
                walk.add(path, f"model '{model}' is in groups '{seen[model]}' and '{group}'")
            seen.setdefault(model, group)


def _check_drafts(walk: _Walk) -> None:
    """A ``speculative: {method: draft, draft: M}`` names another generate model of the graph,
    one with a single ``source`` that is always resident (it runs beside the model it serves)."""
    for name, model in walk.spec.models.items():
        draft = model.speculative.draft if model.speculative is not None else None
        if draft is None:
            continue
        path = ("models", name, "speculative", "draft")
        other = walk.spec.models.get(draft)
        if other is None:
            if draft not in walk.excused.models:
                walk.add(path, f"model '{name}': unknown draft model '{draft}'"
                         f"{_suggest(draft, walk.spec.models)}")  # fmt: skip
        elif draft == name:
            walk.add(path, f"model '{name}' cannot be its own draft model")
        elif other.task != "generate":
            walk.add(path, f"model '{name}': draft model '{draft}' is a {other.task} model")
        elif other.source is None or other.resident == "on_demand":
            walk.add(path, f"model '{name}': draft model '{draft}' needs one source and "
                     "to stay resident (no versions, not on_demand)")  # fmt: skip


def _suggest(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.7)
    return f" (did you mean '{close[0]}'?)" if close else ""


def issues_from(problems: Iterable[Problem], source: SourceMap) -> list[ValidationIssue]:
    """Problems located in the declaring file."""
    return [source.issue(p.path, p.message, p.node, p.template_line) for p in problems]


# ---------------------------------------------------------------- the compiled graph


#: How many distinct sets of requested outputs a graph remembers the needed nodes of.
NEEDED_CACHE_SIZE = 256


@dataclass(frozen=True, eq=False)
class CompiledGraph:
    """A validated graph as the executor needs it. Nothing here changes per request."""

    spec: GraphSpec
    dag: nx.DiGraph
    depth: Mapping[str, int]
    generations: tuple[tuple[str, ...], ...]
    order: tuple[str, ...]
    templates: Mapping[str, NodeTemplates]
    _parents: Mapping[str, tuple[str, ...]] = field(default_factory=dict, repr=False)
    _needed: dict[frozenset[str] | None, tuple[str, ...]] = field(default_factory=dict, repr=False)
    #: generate node -> the node whose text it drafts from (``speculative: follows``)
    references: Mapping[str, str] = field(default_factory=dict)

    @property
    def roots(self) -> tuple[str, ...]:
        return tuple(n for n in self.order if not self._parents[n])

    def parents(self, node: str) -> tuple[str, ...]:
        """The nodes this one waits for (a followed node is not one: see followers)."""
        return self._parents[node]

    def followers(self, node: str) -> tuple[str, ...]:
        """The nodes that follow this one's stream, in run order."""
        return tuple(n for n in self.order if (f := self.spec.nodes[n].follows) and f.node == node)

    def children(self, node: str) -> tuple[str, ...]:
        return tuple(c for c in self.order if node in self._parents[c])

    def skipped_because(self, node: str, skipped: Collection[str]) -> str | None:
        """The skip rule's first half: a skipped parent that is not `optional:`, if any."""
        spec = self.spec.nodes[node]
        optional = spec.optional
        followed = (spec.follows.node,) if spec.follows is not None else ()
        for parent in (*self._parents[node], *followed):
            if parent in skipped and parent not in optional:
                return parent
        return None

    def output_node(self, output: str) -> str | None:
        """The node an output reads, or None when it reads an input."""
        root = self.spec.outputs[output].split(".")[0]
        return None if root == "inputs" else root

    def needed_for(self, outputs: Iterable[str] | None = None) -> tuple[str, ...]:
        """The nodes that must run to produce these outputs (all outputs by default),
        in run order. ``outputs`` must be known outputs (the caller checked them); each
        set is worked out once, and at most NEEDED_CACHE_SIZE sets are remembered."""
        key = None if outputs is None else frozenset(outputs)
        needed = self._needed.get(key)
        if needed is None:
            found: set[str] = set()
            for output in self.spec.outputs if key is None else key:
                node = self.output_node(output)
                if node is not None:
                    found |= {node} | nx.ancestors(self.dag, node)
            # a node's holding followers (guards) run whenever it does
            holders = {n for n in self.order if self.spec.nodes[n].holds}
            while extra := {h for h in holders - found if self.spec.nodes[h].follows.node in found}:
                for holder in extra:
                    found |= {holder} | nx.ancestors(self.dag, holder)
            needed = tuple(n for n in self.order if n in found)
            if len(self._needed) < NEEDED_CACHE_SIZE:
                self._needed[key] = needed
        return needed

    def outputs(
        self, context: Mapping[str, Any], names: Iterable[str] | None = None, *, partial=False
    ) -> dict:
        """Output values from a finished context; outputs of skipped nodes are None, and
        with ``partial`` (a run a guard cut short) so are those of nodes that never ran."""
        names = self.spec.outputs if names is None else names
        return {
            name: None
            if partial and self.output_node(name) not in (None, *context)
            else resolve_reference(self.spec.outputs[name], context)
            for name in names
        }


def compile_graph(spec: GraphSpec) -> CompiledGraph:
    """Check `spec` as a whole and build its DAG; GraphValidationError lists every issue."""
    problems, dag = check_graph(spec)
    if problems:
        raise GraphValidationError(issues_from(problems, spec.source or SourceMap("<spec>")))
    order = tuple(nx.lexicographical_topological_sort(dag, key=list(spec.nodes).index))
    depth: dict[str, int] = {}
    for node in order:
        depth[node] = max((depth[p] + 1 for p in dag.predecessors(node)), default=0)
        dag.nodes[node].update(kind=spec.nodes[node].kind, depth=depth[node])
    generations = tuple(tuple(sorted(g, key=order.index)) for g in nx.topological_generations(dag))
    templates = {name: NodeTemplates(node) for name, node in spec.nodes.items()}
    parents = {
        n: tuple(p for p in order if dag.has_edge(p, n) and dag.edges[p, n]["via"] != "follows")
        for n in order
    }
    references = {n: source for n in spec.nodes if (source := drafts_from(spec, n)) is not None}
    return CompiledGraph(
        spec, dag, depth, generations, order, templates, parents, references=references
    )


# ---------------------------------------------------------------- python functions


def resolve_functions(
    spec: GraphSpec, policy: FunctionPolicy | None = None
) -> dict[str, Callable[..., Any]]:
    """Import every python node's function (a separate step: importing runs user code).

    Returns node name -> callable (sync or async); GraphValidationError lists every
    node whose function the policy refuses (default: ``FunctionPolicy.from_env()``),
    or that cannot be imported, is missing, or is not callable.
    """
    policy = policy or FunctionPolicy.from_env()
    source = spec.source or SourceMap("<spec>")
    found, issues = {}, []
    for name, node in spec.nodes.items():
        if isinstance(node, PythonNode):
            try:
                found[name] = _import(node.function, policy)
            except _ResolveError as exc:
                issues.append(source.issue(("nodes", name, "function"), str(exc), name))
    if issues:
        raise GraphValidationError(issues)
    return found


class _ResolveError(Exception):
    pass


def _import(reference: str, policy: FunctionPolicy) -> Callable[..., Any]:
    problem = policy.reference_problem(reference)
    if problem:  # refused before anything is imported
        raise _ResolveError(problem)
    module_name, _, attr_path = reference.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise _ResolveError(f"cannot import '{module_name}': {type(exc).__name__}: {exc}") from exc
    for attr in attr_path.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            raise _ResolveError(f"'{reference}': no attribute '{attr}'") from None
        problem = policy.object_problem(reference, obj)
        if problem:
            raise _ResolveError(problem)
    if not callable(obj):
        raise _ResolveError(f"'{reference}' is not callable")
    return obj
