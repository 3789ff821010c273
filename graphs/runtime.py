"""Binds graphs to one engine's models: each ``ModelSpec`` becomes the engine's
``ModelLoad`` (engine/host.py), and each graph gets an executor with a client per model
version.

The engine's ``ModelHost`` loads, shares by key, counts users, groups encoder heads onto
one backbone and applies the weight budget and residency; this module only translates
specs and binds versions, routes and executors. ``Runtime`` is what the app's state
holds: this process's ``ModelRuntime``, or the Ray ingress's engine groups.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Hashable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from trae_groups.engine.config import EngineConfig
from trae_groups.engine.errors import ModelLoadError
from trae_groups.engine.host import ModelHost, ModelLoad, SharingPolicy
from trae_groups.engine.protocol import EngineStats, ModelClient
from trae_groups.engine.weights import has_tokenizer
from trae_groups.graphs.compile import CompiledGraph, compile_graph, resolve_functions
from trae_groups.graphs.errors import GraphValidationError, ValidationIssue
from trae_groups.graphs.executor import GraphExecutor
from trae_groups.graphs.resources import apply as apply_resources
from trae_groups.graphs.routing import RouteError, VersionedModel, check_split
from trae_groups.graphs.spec import GenerateNode, GraphSpec

if TYPE_CHECKING:
    from trae_groups.engine.hardware import Hardware


@runtime_checkable
class Runtime(Protocol):
    """What holds the served graphs' models and binds executors to them: a
    ``ModelRuntime`` in this process, or the cluster's ``RemoteRuntime``."""

    def bind(self, spec: GraphSpec | CompiledGraph) -> GraphExecutor: ...

    def release(self, executor: GraphExecutor) -> None: ...

    def start(self) -> None: ...

    def shutdown(self) -> None: ...

    def set_route(self, graph: str, model: str, weights: dict[str, float]) -> dict[str, float]: ...

    def add_version(
        self, graph: str, model: str, version: str, path: str | Path, adapter: bool = False
    ) -> None: ...

    def remove_version(self, graph: str, model: str, version: str) -> None: ...

    def stats(self) -> EngineStats | None: ...

    def replica_stats(self) -> dict[str, EngineStats]: ...

    def unavailable(self) -> str | None:
        """Why the models cannot take work now (an engine process restarting), or None."""
        ...


def model_load(spec: GraphSpec, name: str, version: str, folder: Path | None = None) -> ModelLoad:
    """A graph model's version as the engine loads it (``folder``: another than the
    spec's). A version that is an adapter loads its base; the model's ``adapters`` go on
    every version that is a folder."""
    model = spec.models[name]
    on_base = version in model.version_adapters or folder is not None
    named = {} if on_base else model.adapters or {}
    adapters = tuple((adapter, spec.adapter_path(path)) for adapter, path in named.items())
    return ModelLoad(
        folder=folder if folder is not None else spec.model_path(name, version),
        task=model.task,
        dtype=model.dtype,
        quantization=model.quantization,
        max_accuracy_drop=model.max_accuracy_drop,
        eval_set=spec.eval_path(name),
        resident=model.resident,
        max_batch_size=model.max_batch_size,
        max_queue_delay_ms=model.max_queue_delay_ms,
        max_prompt_tokens=model.max_prompt_tokens,
        max_tokens_limit=model.max_tokens_limit,
        max_loras=model.max_loras,
        max_lora_rank=model.max_lora_rank,
        speculative=model.speculative.config() if model.speculative is not None else None,
        adapters=adapters,
    )


def check_constrainable(spec: GraphSpec) -> None:
    """A generate node's ``output_schema`` is enforced through its model's tokenizer: a
    model folder with none cannot be constrained, so the graph fails to load, naming it."""
    for name, node in spec.nodes.items():
        if not isinstance(node, GenerateNode) or node.output_schema is None:
            continue
        for version in spec.models[node.model].sources:
            folder = spec.model_path(node.model, version)
            if folder.is_dir() and not has_tokenizer(folder):
                raise ModelLoadError(
                    str(folder),
                    f"model {node.model!r} has no tokenizer, so node {name!r}'s "
                    "output_schema cannot be constrained",
                )


def check_drafts(spec: GraphSpec) -> None:
    """A draft model reads and writes the token ids of the model it drafts for: their
    tokenizers' vocabularies must be equal, or the graph fails to load at the line of its
    ``draft:``."""
    for name, model in spec.models.items():
        draft = model.speculative.draft if model.speculative is not None else None
        if draft is None:
            continue
        theirs = _vocabulary(spec.model_path(draft, "default"))
        for version in model.sources:
            if (
                version in model.version_adapters
                or _vocabulary(spec.model_path(name, version)) == theirs
            ):
                continue
            where = ("models", name, "speculative", "draft")
            message = (
                f"model {name!r}: draft model {draft!r} has another tokenizer; a draft must "
                "read and write the same token ids"
            )
            source = spec.source
            issue = (
                source.issue(where, message)
                if source
                else ValidationIssue(spec.name, None, None, message)
            )
            raise GraphValidationError([issue])


def _vocabulary(folder: Path) -> dict[str, int] | None:
    """A model folder's tokenizer vocabulary (None: it has no tokenizer)."""
    if not Path(folder).is_dir() or not has_tokenizer(folder):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder).get_vocab()


def versioned_models(
    spec: GraphSpec, clients: dict[tuple[str, str], ModelClient]
) -> dict[str, VersionedModel]:
    """A graph's models, each its versions' clients and the route between them; each
    version shows its folder (an adapter version its adapter's)."""
    models = {
        name: VersionedModel(
            name, {v: clients[(name, v)] for v in model.sources}, model.weights, model.sticky
        )
        for name, model in spec.models.items()
    }
    for name, versioned in models.items():
        adapters = spec.models[name].version_adapters
        versioned.sources = {
            v: str(spec.adapter_path(adapters[v]))
            if v in adapters
            else str(spec.model_path(name, v))
            for v in versioned.clients
        }
    return models


def find_versioned(graphs: dict[str, GraphExecutor], graph: str, model: str) -> VersionedModel:
    """A bound graph's model (KeyError naming what exists, for the admin routes)."""
    if graph not in graphs:
        raise KeyError(f"no graph named {graph!r}")
    executor = graphs[graph]
    if model not in executor.models:
        raise KeyError(f"graph {graph!r} has no model {model!r}; it has {sorted(executor.models)}")
    return executor.models[model]


def engine_name(model: str, version: str) -> str:
    """What the engine calls a graph model's version (made unique by the host)."""
    return model if version == "default" else f"{model}@{version}"


def host_for(
    specs: list[GraphSpec], config: EngineConfig | None = None, hardware: Hardware | None = None
) -> ModelHost:
    """An engine host for the graphs: their ``resources:`` fill the engine settings no
    flag set, their sharing policy holds, and every model they name is expected (pages
    sized for their LLMs, the weight budget checked against all of them)."""
    loads = [
        model_load(spec, name, version)
        for spec in specs
        for name, model in spec.models.items()
        for version in model.sources
    ]
    sharing = specs[0].sharing if specs else None
    policy = SharingPolicy(memory=sharing.memory, gpu=sharing.gpu) if sharing else None
    config = apply_resources(config or EngineConfig(), [spec.resources for spec in specs])
    return ModelHost(config, expected=loads, sharing=policy, hardware=hardware)


def load_clients(
    host: ModelHost, spec: GraphSpec, names: Iterable[str] | None = None
) -> dict[tuple[str, str], ModelClient]:
    """The clients of a graph's models (``names``, default all) and their versions,
    keyed by (model, version), loaded onto ``host``: a version that is an adapter is a
    client of its own on its base's model."""
    chosen = [n for n in spec.models if names is None or n in set(names)]
    drafts = {
        model.speculative.draft
        for name, model in spec.models.items()
        if name in chosen and model.speculative is not None and model.speculative.draft
    }
    chosen = [*drafts, *(n for n in chosen if n not in drafts)]  # a draft loads first
    wanted: list[tuple[Hashable, str, ModelLoad]] = []
    for name in chosen:
        for version in spec.models[name].sources:
            if version in spec.models[name].version_adapters:
                continue  # on its base, below
            load = model_load(spec, name, version)
            if "${" in str(load.folder):
                raise ModelLoadError(
                    str(load.folder),
                    f"model {name!r}: an environment variable in its source is not set",
                )
            wanted.append(((name, version), engine_name(name, version), load))
    clients = host.load([w for w in wanted if w[0][0] in drafts], spec.name)
    for i, ((name, version), engine, load) in enumerate(wanted):
        speculative = spec.models[name].speculative
        if speculative is not None and speculative.draft:  # the draft's name on the engine
            draft = clients[(speculative.draft, "default")].name
            load = dataclasses.replace(load, speculative=speculative.config(draft))
            wanted[i] = ((name, version), engine, load)
    clients |= host.load([w for w in wanted if w[0][0] not in drafts], spec.name)
    for name in chosen:
        model = spec.models[name]
        base = next(v for v in model.sources if v not in model.version_adapters)
        for version, folder in model.version_adapters.items():
            clients[(name, version)] = host.adapter_version(
                clients[(name, base)], version, spec.adapter_path(folder)
            )
    return clients


class ModelRuntime:
    """Every model of every served graph, on one engine host."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        reserve_for: Iterable[str | Path] = (),
        sharing: SharingPolicy | None = None,
        hardware: Hardware | None = None,
        host: ModelHost | None = None,
    ):
        """``hardware``: what "auto" weights are chosen for (None: detected when needed);
        ``host``: one made already (``host_for``), instead of one from the other arguments."""
        self.host = host or ModelHost(
            config, reserve_for=list(reserve_for), sharing=sharing, hardware=hardware
        )
        self.graphs: dict[str, GraphExecutor] = {}

    @classmethod
    def for_specs(
        cls, specs: list[GraphSpec], config: EngineConfig | None = None,
        hardware: Hardware | None = None,
    ) -> ModelRuntime:  # fmt: skip
        return cls(host=host_for(specs, config, hardware))

    # what tools and tests read of the engine behind it
    @property
    def config(self) -> EngineConfig:
        return self.host.config

    @property
    def engine(self):
        return self.host.engine

    @property
    def store(self):
        return self.host.store

    def start(self) -> None:
        self.host.start()

    def shutdown(self) -> None:
        self.host.shutdown()

    # -- graphs ----------------------------------------------------------------------
    def bind(self, spec: GraphSpec | CompiledGraph) -> GraphExecutor:
        """An executor for the graph, its models loaded (once) onto this runtime."""
        graph = spec if isinstance(spec, CompiledGraph) else compile_graph(spec)
        functions = resolve_functions(graph.spec)
        check_constrainable(graph.spec)
        check_drafts(graph.spec)
        clients = self.load_models(graph.spec)
        models = versioned_models(graph.spec, clients)
        executor = GraphExecutor(graph, models, functions)
        self.graphs[graph.spec.name] = executor
        return executor

    def load_models(
        self, spec: GraphSpec, names: Iterable[str] | None = None
    ) -> dict[tuple[str, str], ModelClient]:
        """The clients of a graph's models (``names``, default all), keyed by (model,
        version); each model is loaded once onto this runtime (``load_clients``)."""
        return load_clients(self.host, spec, names)

    def release(self, executor: GraphExecutor) -> None:
        """A graph no longer served (replaced by a reload, or removed): drop its models'
        references; models nobody else uses are unloaded."""
        for model in executor.models.values():
            for client in model.clients.values():
                self.host.release(client)

    # -- versions ----------------------------------------------------------------------
    def versioned(self, graph: str, model: str) -> VersionedModel:
        return find_versioned(self.graphs, graph, model)

    def add_version(
        self, graph: str, model: str, version: str, path: str | Path, adapter: bool = False
    ) -> None:
        """Load a new version (0% of traffic until a route gives it some): a model folder,
        or with ``adapter`` a LoRA adapter folder on the model's base (no second copy)."""
        versioned = self.versioned(graph, model)
        if version in versioned.clients:
            raise RouteError(f"model {model!r} already has a version {version!r}")
        spec = self.graphs[graph].graph.spec
        if adapter:
            base = next((c for c in versioned.clients.values() if self.host.adaptable(c)), None)
            if base is None:
                raise RouteError(f"model {model!r} is not a generate model: adapters need one")
            named = spec.models[model].adapters
            if named and version in named:
                raise RouteError(f"model {model!r} has an adapter named {version!r}; rename one")
            versioned.add(version, self.host.adapter_version(base, version, Path(path)), str(path))
            return
        load = model_load(spec, model, version, folder=Path(path))
        versioned.add(version, self.host.acquire(engine_name(model, version), load), str(path))

    def set_route(self, graph: str, model: str, weights: dict[str, float]) -> dict[str, float]:
        versioned = self.versioned(graph, model)
        versioned.router.set_weights(check_split(weights, list(versioned.clients)))
        return versioned.router.weights

    def remove_version(self, graph: str, model: str, version: str) -> None:
        """Unload a version no route uses; its memory is freed once nobody holds it."""
        versioned = self.versioned(graph, model)
        if version not in versioned.clients:
            raise RouteError(f"model {model!r} has no version {version!r}")
        if len(versioned.clients) == 1:
            raise RouteError(f"{version!r} is the only version of {model!r}")
        client = versioned.clients[version]
        busy = self.host.adapter_users(client)
        if busy:
            raise RouteError(f"version {version!r} still serves {busy} request(s)")
        self.host.release(versioned.remove(version))
        self.host.drop_adapter(client)

    # -- reading -----------------------------------------------------------------------
    def adapter_report(self) -> dict:
        """Engine model name -> its LoRA adapters (what they cost, which hold a slot)."""
        return self.host.adapter_report()

    def adapter_bytes(self) -> int:
        """What adapters take on the device now: every model's resident slots."""
        return self.host.adapter_bytes()

    def stats(self) -> EngineStats:
        """The engine's typed stats (what metrics and the CLI read)."""
        return self.host.stats()

    def replica_stats(self) -> dict[str, EngineStats]:
        """Stats by engine replica: one process is one replica, "local"."""
        return {"local": self.stats()}

    def unavailable(self) -> str | None:
        return None  # the engine is this process: when it is gone, so is the server


def settle_heap(refreeze: bool = False) -> int:
    """Collect once, then move every object alive now out of the cyclic collector's
    way (``gc.freeze``); returns how many objects that is.

    Loaded models leave hundreds of thousands of long-lived objects behind. Under load,
    each full collection walked them all and paused every thread for 100-300 ms
    (bench/server.py: p99 295-409 ms before, 107-111 ms after). ``refreeze`` first
    thaws what an earlier call froze, so that models unloaded since can be collected.
    """
    if refreeze:
        gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
