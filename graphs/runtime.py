"""Binds graphs to one engine: loads each model once and gives the executor a client
per model version.

Models are keyed by (folder, task, weights): two graphs — or two model entries —
naming the same folder share one worker, one instance and one batcher, counted by
reference so that unloading one user leaves the others serving. Versions are loaded
like any model; the weight store holds their byte-identical tensors once.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from trae_groups.engine.accuracy_gate import DEFAULT_MAX_DROP, read_eval_set
from trae_groups.engine.auto_weights import load_auto
from trae_groups.engine.batcher import BatcherConfig
from trae_groups.engine.clients import AdapterClient, LocalEncoder, LocalLLM
from trae_groups.engine.config import DTYPES, EngineConfig
from trae_groups.engine.encoder_worker import EncoderWorker
from trae_groups.engine.engine import LLMEngine
from trae_groups.engine.errors import ModelLoadError
from trae_groups.engine.hardware import Hardware, detect
from trae_groups.engine.llm_runner import ATTN_NAME
from trae_groups.engine.lora import AdapterReport
from trae_groups.engine.memory import trim_heap
from trae_groups.engine.protocol import EngineStats
from trae_groups.engine.residency import Loaded as Resident
from trae_groups.engine.residency import OnDemandLLM
from trae_groups.engine.weights import SharingPolicy, WeightStore, estimate_bytes
from trae_groups.graphs.compile import CompiledGraph, compile_graph, resolve_functions
from trae_groups.graphs.executor import GraphExecutor
from trae_groups.graphs.resources import apply as apply_resources
from trae_groups.graphs.routing import RouteError, VersionedModel, check_split
from trae_groups.graphs.spec import GraphSpec, ModelSpec

log = logging.getLogger("trae_groups.graphs")


@dataclasses.dataclass
class _Loaded:
    client: LocalEncoder | LocalLLM | OnDemandLLM
    worker: Any  # None for an on-demand model (the engine's residency holds it)
    path: str
    users: int = 1


class ModelRuntime:
    """Every model of every served graph, on one engine and one weight store."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        reserve_for: list[str | Path] = (),
        sharing: SharingPolicy | None = None,
        hardware: Hardware | None = None,
    ):
        """``hardware``: what "auto" weights are chosen for (None: detected when needed)."""
        self.config = config or EngineConfig()
        self.hardware = hardware
        self.store = WeightStore(policy=sharing or SharingPolicy())
        self.engine = LLMEngine((), self.config, store=self.store, reserve_for=reserve_for)
        self._by_key: dict[tuple, _Loaded] = {}
        self.graphs: dict[str, GraphExecutor] = {}
        self._bar: tqdm | None = None  # the model-load progress bar while bind() runs
        # the weight budget cannot hold every model at once: generate models that do not
        # say `resident: always` are resident on demand
        self.under_pressure = False
        self._eval_paths: dict[int, Path | None] = {}  # id(ModelSpec) -> its eval_set file

    @classmethod
    def for_specs(
        cls, specs: list[GraphSpec], config: EngineConfig | None = None,
        hardware: Hardware | None = None,
    ) -> ModelRuntime:  # fmt: skip
        llms = [
            spec.model_path(name, version)
            for spec in specs
            for name, model in spec.models.items()
            if model.task == "generate"
            for version in model.sources
        ]
        sharing = specs[0].sharing if specs else None
        policy = SharingPolicy(memory=sharing.memory, gpu=sharing.gpu) if sharing else None
        config = apply_resources(config or EngineConfig(), [spec.resources for spec in specs])
        runtime = cls(config, reserve_for=llms, sharing=policy, hardware=hardware)
        runtime.under_pressure = _over_budget(specs, config)
        return runtime

    def start(self) -> None:
        self._check_budget()
        self.engine.start()

    def _check_budget(self) -> None:
        """Refuse to start when an on-demand model could never fit next to the models
        that are always resident."""
        budget = self.config.weight_budget
        if budget is None:
            return
        held = self.store.total_bytes()
        for name, stats in self.engine.residency.stats().items():
            if not stats.resident and held + stats.bytes > budget:
                raise ModelLoadError(
                    name,
                    f"weight_budget is {budget / 2**20:.0f} MiB; the always-resident models "
                    f"hold {held / 2**20:.0f} MiB, this on-demand model needs about "
                    f"{stats.bytes / 2**20:.0f} MiB more",
                )

    def shutdown(self) -> None:
        self.engine.shutdown()

    # -- graphs ----------------------------------------------------------------------
    def bind(self, spec: GraphSpec | CompiledGraph) -> GraphExecutor:
        """An executor for the graph, its models loaded (once) onto this runtime."""
        graph = spec if isinstance(spec, CompiledGraph) else compile_graph(spec)
        functions = resolve_functions(graph.spec)
        clients = self.load_models(graph.spec)
        models = {
            name: VersionedModel(
                name, {v: clients[(name, v)] for v in model.sources}, model.weights, model.sticky
            )
            for name, model in graph.spec.models.items()
        }
        for name, versioned in models.items():
            adapters = graph.spec.models[name].version_adapters  # those show their own folder
            versioned.sources = {
                v: str(graph.spec.adapter_path(adapters[v]))
                if v in adapters
                else str(graph.spec.model_path(name, v))
                for v in versioned.clients
            }
        executor = GraphExecutor(graph, models, functions)
        self.graphs[graph.spec.name] = executor
        return executor

    def load_models(
        self, spec: GraphSpec, names: Iterable[str] | None = None
    ) -> dict[tuple[str, str], LocalEncoder | LocalLLM | OnDemandLLM]:
        """The clients of a graph's models (``names``, default all) and their versions,
        keyed by (model, version); each model is loaded once onto this runtime (an
        engine replica of a Ray group loads its group's share this way)."""
        chosen = [n for n in spec.models if names is None or n in set(names)]
        wanted = [
            (name, version, spec.models[name], spec.model_path(name, version))
            for name in chosen
            for version in spec.models[name].sources
        ]
        for name, _, _, path in wanted:
            if "${" in str(path):
                raise ModelLoadError(
                    str(path), f"model {name!r}: an environment variable in its source is not set"
                )
        # eval_set files resolve like sources (from the graph file's folder); read when loading
        self._eval_paths = {id(m): spec.eval_path(n) for n, m in spec.models.items()}
        new = {self._key(m, p) for _, _, m, p in wanted} - set(self._by_key)
        self._bar = tqdm(total=len(new), desc=f"loading {spec.name}", unit="model",
                         disable=None if new else True, leave=False)  # fmt: skip
        try:
            shared = self._load_encoders([w for w in wanted if w[2].task != "generate"])
            clients = {
                (name, version): shared.get((name, version))
                or self._acquire(name, version, model, path)
                for name, version, model, path in wanted
            }
            for name in chosen:
                clients.update(self._with_adapters(spec, name, clients))
            return clients
        finally:
            self._bar.close()
            self._bar = None

    def _with_adapters(self, spec: GraphSpec, name: str, clients: dict) -> dict:
        """Register the model's LoRA adapters on its worker(s); a version that is an adapter
        gets a client of its own on the base's worker (returned, keyed (model, version))."""
        model = spec.models[name]
        for version in model.sources:
            if version not in model.version_adapters and model.adapters:
                worker = clients[(name, version)].worker
                for adapter, folder in model.adapters.items():
                    self._register(worker, adapter, spec.adapter_path(folder))
        versions = {}
        for version, folder in model.version_adapters.items():
            base = clients[(name, version)]
            self._register(base.worker, version, spec.adapter_path(folder))
            versions[(name, version)] = AdapterClient(base, version)
        return versions

    @staticmethod
    def _register(worker, adapter: str, folder: Path) -> None:
        """Register an adapter once; the same name from another folder is refused."""
        folder = Path(folder).expanduser().resolve()
        held = worker.adapters.get(adapter) if worker.adapters is not None else None
        if held is None:
            worker.add_adapter(adapter, str(folder))
        elif held.path != str(folder):
            raise ModelLoadError(
                str(folder),
                f"model {worker.name!r} already has an adapter {adapter!r} from {held.path}",
            )

    def release(self, executor: GraphExecutor) -> None:
        """A graph no longer served (replaced by a reload, or removed): drop its models'
        references; models nobody else uses are unloaded."""
        for model in executor.models.values():
            for client in model.clients.values():
                self._release(client)

    # -- versions ----------------------------------------------------------------------
    def versioned(self, graph: str, model: str) -> VersionedModel:
        if graph not in self.graphs:
            raise KeyError(f"no graph named {graph!r}")
        executor = self.graphs[graph]
        if model not in executor.models:
            raise KeyError(
                f"graph {graph!r} has no model {model!r}; it has {sorted(executor.models)}"
            )
        return executor.models[model]

    def add_version(
        self, graph: str, model: str, version: str, path: str | Path, adapter: bool = False
    ) -> None:
        """Load a new version (0% of traffic until a route gives it some): a model folder,
        or with ``adapter`` a LoRA adapter folder on the model's base (no second copy)."""
        versioned = self.versioned(graph, model)
        if version in versioned.clients:
            raise RouteError(f"model {model!r} already has a version {version!r}")
        spec = self.graphs[graph].graph.spec.models[model]
        if adapter:
            client = self._adapter_version(versioned, model, version, spec, path)
            versioned.add(version, client, str(path))
            return
        versioned.add(version, self._acquire(model, version, spec, Path(path)), str(path))

    def _adapter_version(
        self, versioned: VersionedModel, model: str, version: str, spec: ModelSpec, path
    ) -> AdapterClient:
        base = next((c for c in versioned.clients.values() if isinstance(c, LocalLLM)), None)
        if spec.task != "generate" or base is None:
            raise RouteError(f"model {model!r} is not a generate model: adapters need one")
        if spec.adapters and version in spec.adapters:
            raise RouteError(f"model {model!r} has an adapter named {version!r}; rename one")
        self._register(base.worker, version, Path(path))
        self._share(base)
        return AdapterClient(base, version)

    def _share(self, client: LocalLLM) -> None:
        for entry in self._by_key.values():
            if entry.client is client:
                entry.users += 1

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
        if isinstance(client, AdapterClient):
            busy = client.base.worker.adapter_users(client.adapter)
            if busy:
                raise RouteError(f"version {version!r} still serves {busy} request(s)")
        self._release(versioned.remove(version))
        if isinstance(client, AdapterClient):
            client.base.worker.remove_adapter(client.adapter)

    # -- models ------------------------------------------------------------------------
    def _key(self, spec: ModelSpec, path: Path) -> tuple:
        """What makes two model entries one loaded model: folder, task, the weight options
        (dtype, quantization, gate bound), residency, adapter capacity and the per-request
        limits an LLM enforces (its weights are shared all the same)."""
        dtype = spec.dtype if spec.dtype == "auto" else self._dtype(spec)
        weights = (dtype, spec.quantization, spec.max_accuracy_drop)
        limits = (spec.max_prompt_tokens, spec.max_tokens_limit, spec.max_loras, spec.max_lora_rank)
        return (str(Path(path).resolve()), spec.task, *weights, spec.resident, *limits)

    def _dtype(self, spec: ModelSpec):
        return DTYPES.get(spec.dtype or "", self.config.torch_dtype)

    def _load_weights(self, spec: ModelSpec, path: Path, task: str, name: str, **kwargs: Any):
        """A model's weights as its spec asks: a fixed dtype/quantization, or "auto" (picked
        from the hardware, then the accuracy gate; ``engine/auto_weights.py``)."""
        quantize = None if spec.quantization in (None, "none") else spec.quantization
        if "auto" not in (spec.dtype, quantize):
            return self._load(path, task, name, dtype=self._dtype(spec), quantize=quantize,
                              **kwargs)  # fmt: skip
        if self.hardware is None:
            self.hardware = detect(self.config.device)
        bound = spec.max_accuracy_drop or DEFAULT_MAX_DROP
        eval_path = self._eval_paths.get(id(spec))
        examples = None
        if eval_path is not None:
            try:
                examples = read_eval_set(eval_path)
            except (OSError, ValueError) as exc:
                raise ModelLoadError(str(eval_path), f"model {name!r}: eval_set: {exc}") from exc
        loader = functools.partial(load_auto, hw=self.hardware, dtype_auto=spec.dtype == "auto",
                                   quant_auto=quantize == "auto", base=self._dtype(spec),
                                   bound=bound, eval_set=examples)  # fmt: skip
        return self._load(path, task, name, loader=loader, **kwargs)

    def _load(self, path: Path, task: str, name: str, loader=None, **kwargs: Any):
        """One model through the weight store (or ``loader``, which returns it and its
        decision), with a log line (and a tick of the load bar during ``bind``): loading a
        real model takes seconds to minutes."""
        started = time.perf_counter()
        before = self.store.total_bytes()
        if loader is None:
            loaded = self.store.load(path, task, device=self.config.device, name=name, **kwargs)
        else:
            loaded, _ = loader(self.store, path, task, device=self.config.device, name=name,
                               **kwargs)  # fmt: skip
        added = self.store.total_bytes() - before
        log.info(
            "loaded model '%s' (%s) from %s in %.1f s: %.1f MB new in memory",
            name, task, path, time.perf_counter() - started, added / 1e6,
        )  # fmt: skip
        if self._bar is not None:
            self._bar.set_postfix_str(name)
            self._bar.update(1)
        return loaded

    def _acquire(
        self, name: str, version: str, spec: ModelSpec, path: Path
    ) -> LocalEncoder | LocalLLM | OnDemandLLM:
        key = self._key(spec, path)
        if key in self._by_key:
            self._by_key[key].users += 1
            return self._by_key[key].client
        if spec.task != "generate":
            return self._load_encoders([(name, version, spec, path)])[(name, version)]
        worker_name = self._free_name(name if version == "default" else f"{name}@{version}")
        if spec.resident == "on_demand" or (spec.resident is None and self.under_pressure):
            client = self._on_demand(worker_name, spec, path)
            self._by_key[key] = _Loaded(client, None, str(path))
            return client
        client, _ = self._load_llm(worker_name, spec, path)
        self._by_key[key] = _Loaded(client, client.worker, str(path))
        return client

    def _load_llm(self, name: str, spec: ModelSpec, path: Path) -> tuple[LocalLLM, Any]:
        """A causal LM loaded and put on the engine: its client and its store entry."""
        loaded = self._load_weights(spec, path, "generate", name, attn_implementation=ATTN_NAME)
        worker = self.engine.add_llm(
            name, path, model=loaded.model, tokenizer=loaded.tokenizer,
            max_num_seqs=spec.max_batch_size, max_prompt_tokens=spec.max_prompt_tokens,
            max_tokens_limit=spec.max_tokens_limit, max_loras=spec.max_loras,
            max_lora_rank=spec.max_lora_rank,
        )  # fmt: skip
        return LocalLLM(worker, lambda: self.engine.loop.running), loaded

    def _on_demand(self, name: str, spec: ModelSpec, path: Path) -> OnDemandLLM:
        """Registered with the engine's residency, loaded at its first request."""

        def load() -> Resident:
            client, loaded = self._load_llm(name, spec, path)

            def unload() -> None:
                self.engine.remove_worker(name)  # between two steps; its cached pages return
                self.store.unload_model(loaded)
                gc.collect()  # the model's own reference cycles
                trim_heap()

            return Resident(client, unload)

        dtype = self.config.torch_dtype if spec.dtype == "auto" else self._dtype(spec)
        self.engine.residency.add(name, load, estimate_bytes(path, dtype))
        return OnDemandLLM(self.engine.residency, name)

    def _load_encoders(self, wanted: list) -> dict[tuple[str, str], LocalEncoder]:
        """Load encoders new to this runtime, one worker per backbone: heads whose
        backbones hold the very same tensors (the weight store dedupes them) share a
        worker, so for a text that several heads need the backbone runs once."""
        groups: list[tuple[set[int], list]] = []  # backbone tensor pointers, members
        seen: set[tuple] = set()
        for name, version, spec, path in wanted:
            key = self._key(spec, path)
            if key in self._by_key or key in seen:
                continue  # already served (or listed twice): _acquire shares it
            seen.add(key)
            head = self._free_name(name if version == "default" else f"{name}@{version}")
            loaded = self._load_weights(spec, path, spec.task, head)
            backbone = loaded.model if spec.task == "embed" else loaded.model.base_model
            ptrs = {p.data_ptr() for p in backbone.parameters()}
            member = (name, version, spec, path, head, loaded)
            # one backbone may carry a pooler that another head's copy leaves out
            vocab = loaded.tokenizer.get_vocab()
            group = next(
                (g for g in groups
                 if (ptrs <= g[0] or g[0] <= ptrs) and g[1][0][-1].tokenizer.get_vocab() == vocab),
                None,
            )  # fmt: skip
            if group is None:
                groups.append((ptrs, [member]))
            else:
                group[0].update(ptrs)
                group[1].append(member)
        clients = {}
        for _, members in groups:
            heads = {head: loaded for *_, head, loaded in members}
            worker = EncoderWorker("+".join(heads), heads, batcher=_batcher(members[0][2]),
                                   pool=self.engine.pool, wake=self.engine.loop.wake)  # fmt: skip
            self.engine.add_worker(worker)
            for name, version, spec, path, head, _loaded in members:
                client = LocalEncoder(worker, head, spec.task)
                key = self._key(spec, path)
                self._by_key[key] = _Loaded(client, worker, str(path))
                clients[(name, version)] = client
        return clients

    def _release(self, client: Any) -> None:
        client = getattr(client, "base", client)  # an adapter version: its base's reference
        for key, entry in list(self._by_key.items()):
            if entry.client is client:
                entry.users -= 1
                if entry.users == 0:
                    del self._by_key[key]
                    if entry.worker is None:  # on demand: evicted if resident, forgotten
                        self.engine.residency.remove(client.name)
                        return
                    if not any(e.worker is entry.worker for e in self._by_key.values()):
                        self.engine.remove_worker(entry.worker.name)
                    self.store.unload(entry.path)
                return

    def _free_name(self, name: str) -> str:
        taken = set(self.engine.loop.workers) | set(self.engine.residency.stats())
        if name not in taken:
            return name
        n = 2
        while f"{name}-{n}" in taken:
            n += 1
        return f"{name}-{n}"

    def adapter_report(self) -> dict[str, list[AdapterReport]]:
        """Engine model name -> its LoRA adapters (what they cost, which hold a slot)."""
        return {
            name: worker.adapters.report()
            for name, worker in self.engine.llms.items()
            if worker.adapters is not None
        }

    def adapter_bytes(self) -> int:
        """What adapters take on the device now: every model's resident slots."""
        return sum(w.adapters.slot_bytes() for w in self.engine.llms.values() if w.adapters)

    def stats(self) -> EngineStats:
        """The engine's typed stats (what metrics and the CLI read)."""
        return self.engine.engine_stats()

    def replica_stats(self) -> dict[str, EngineStats]:
        """Stats by engine replica: one process is one replica, "local"."""
        return {"local": self.stats()}


def _over_budget(specs: list[GraphSpec], config: EngineConfig) -> bool:
    """Whether every model of the graphs, each folder once, would overflow the weight
    budget (estimated from the files' headers; nothing is loaded)."""
    if config.weight_budget is None:
        return False
    wanted = {
        (str(spec.model_path(name, version).resolve()),
         DTYPES.get(model.dtype or "", config.torch_dtype))
        for spec in specs
        for name, model in spec.models.items()
        for version in model.sources
    }  # fmt: skip
    try:
        total = sum(estimate_bytes(path, dtype) for path, dtype in wanted)
    except (ModelLoadError, OSError):
        return False  # a missing folder fails at load, with its own message
    if total > config.weight_budget:
        log.info(
            "weight_budget %.0f MiB cannot hold every model (%.0f MiB): generate models "
            "are resident on demand unless they say resident: always",
            config.weight_budget / 2**20, total / 2**20,
        )  # fmt: skip
        return True
    return False


def _batcher(spec: ModelSpec) -> BatcherConfig:
    batch = spec.max_batch_size or 32
    return BatcherConfig(
        max_batch_size=batch,
        timeout_ms=spec.max_queue_delay_ms if spec.max_queue_delay_ms is not None else 5.0,
        preferred_batch_size=min(16, batch),
    )


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
