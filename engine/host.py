"""The engine's model manager: what is loaded, who uses it, and the clients to reach it.

The layers above describe a model as a ``ModelLoad`` (folder, task, weights, limits,
residency, batcher, adapters) and get a ``ModelClient`` back. Loads with the same key
(``ModelLoad.key``) share one loaded model, one worker and one batcher, counted by
reference so that releasing one user leaves the others serving. Encoder heads whose
backbones hold the very same tensors (the weight store dedupes them) share one worker,
so for a text that several heads need the backbone runs once. Generate models are
resident on demand when they say so, or when the weight budget cannot hold every model
(``under_pressure``); ``start`` refuses a budget that could never serve one.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import time
from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from trae_groups.engine.accuracy_gate import DEFAULT_MAX_DROP, read_eval_set
from trae_groups.engine.auto_weights import load_auto
from trae_groups.engine.batcher import BatcherConfig
from trae_groups.engine.clients import AdapterClient, LocalEncoder, LocalLLM
from trae_groups.engine.config import DTYPES, EngineConfig
from trae_groups.engine.encoder_runner import backbone_tensors
from trae_groups.engine.encoder_worker import EncoderWorker
from trae_groups.engine.engine import LLMEngine
from trae_groups.engine.errors import ModelLoadError
from trae_groups.engine.hardware import Hardware, detect
from trae_groups.engine.llm_runner import ATTN_NAME
from trae_groups.engine.lora import AdapterReport
from trae_groups.engine.memory import trim_heap
from trae_groups.engine.protocol import EngineStats, ModelClient
from trae_groups.engine.residency import Loaded as Resident
from trae_groups.engine.residency import OnDemandLLM
from trae_groups.engine.spec_config import SpeculativeConfig
from trae_groups.engine.tasks import generates
from trae_groups.engine.weights import LoadedModel, SharingPolicy, WeightStore, estimate_bytes

__all__ = ["ModelHost", "ModelLoad", "SharingPolicy"]

log = logging.getLogger("trae_groups.engine")


@dataclasses.dataclass(frozen=True)
class ModelLoad:
    """One model as the engine is asked to load it.

    dtype/quantization: "auto" picks them from the hardware, then the accuracy gate
    (bound ``max_accuracy_drop``, examples from ``eval_set``); None: the engine's.
    resident: "always", "on_demand" (generate models), or None (on demand only when the
    weight budget cannot hold every model). ``adapters``: LoRA adapters (name, folder)
    registered on a generate model for requests to name.
    """

    folder: Path
    task: str
    dtype: str | None = None
    quantization: str | None = None
    max_accuracy_drop: float | None = None
    eval_set: Path | None = None
    resident: str | None = None
    max_batch_size: int | None = None
    max_queue_delay_ms: float | None = None
    max_prompt_tokens: int | None = None
    max_tokens_limit: int | None = None
    max_loras: int | None = None
    max_lora_rank: int | None = None
    speculative: SpeculativeConfig | None = None  # None: the engine's
    adapters: tuple[tuple[str, Path], ...] = ()

    @property
    def quantize(self) -> str | None:
        return None if self.quantization in (None, "none") else self.quantization

    def torch_dtype(self, config: EngineConfig):
        """The dtype asked for ("auto": the engine's, which "auto" starts from)."""
        return DTYPES.get(self.dtype or "", config.torch_dtype)

    def dtype_choice(self, config: EngineConfig) -> str | None:
        """The load's own dtype, else the engine's when that is "auto" (None: the engine's)."""
        return self.dtype or ("auto" if config.dtype == "auto" else None)

    def key(self, config: EngineConfig) -> tuple:
        """What makes two loads one loaded model: folder, task, the weight options (dtype,
        quantization, gate bound), residency, adapter capacity and the per-request limits
        an LLM enforces (its weights are shared all the same)."""
        auto = self.dtype_choice(config) == "auto"
        dtype = "auto" if auto else self.torch_dtype(config)
        weights = (dtype, self.quantization, self.max_accuracy_drop)
        limits = (self.max_prompt_tokens, self.max_tokens_limit, self.max_loras,
                  self.max_lora_rank, self.speculative)  # fmt: skip
        return (str(Path(self.folder).resolve()), self.task, *weights, self.resident, *limits)

    def batcher(self) -> BatcherConfig:
        batch = self.max_batch_size or 32
        delay = self.max_queue_delay_ms
        return BatcherConfig(
            max_batch_size=batch,
            timeout_ms=delay if delay is not None else 5.0,
            preferred_batch_size=min(16, batch),
        )


@dataclasses.dataclass
class _Held:
    client: ModelClient
    worker: Any  # None for an on-demand model (the engine's residency holds it)
    path: str
    users: int = 1


class ModelHost:
    """Every model of one engine and one weight store, shared by key, counted by user."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        expected: Sequence[ModelLoad] = (),
        reserve_for: Sequence[str | Path] = (),
        sharing: SharingPolicy | None = None,
        hardware: Hardware | None = None,
    ):
        """``expected``: what will be loaded (pages are sized for its LLMs, and the weight
        budget is checked against all of it); ``hardware``: what "auto" weights are chosen
        for (None: detected when needed)."""
        self.config = config or EngineConfig()
        self.hardware = hardware
        self.store = WeightStore(policy=sharing or SharingPolicy())
        llms = [str(load.folder) for load in expected if generates(load.task)]
        self.engine = LLMEngine(
            (), self.config, store=self.store, reserve_for=[*llms, *map(str, reserve_for)]
        )
        self._held: dict[tuple, _Held] = {}
        self._bar: tqdm | None = None  # the load progress bar while load() runs
        # the weight budget cannot hold every model at once: generate models that do not
        # say `resident: always` are resident on demand
        self.under_pressure = over_budget(expected, self.config)

    # -- life cycle --------------------------------------------------------------------
    def start(self) -> None:
        self._check_budget()
        self.engine.start()

    def shutdown(self) -> None:
        self.engine.shutdown()

    @property
    def running(self) -> bool:
        return self.engine.loop.running

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

    # -- loading -------------------------------------------------------------------------
    def load(
        self, wanted: Iterable[tuple[Hashable, str, ModelLoad]], label: str = "models"
    ) -> dict[Hashable, ModelClient]:
        """A client per ``(key, name, load)``: each model loaded once (``name``: what the
        engine calls it, made unique), new encoders grouped onto shared backbones, and each
        generate model's ``adapters`` registered."""
        wanted = list(wanted)
        new = {load.key(self.config) for _, _, load in wanted} - set(self._held)
        self._bar = tqdm(total=len(new), desc=f"loading {label}", unit="model",
                         disable=None if new else True, leave=False)  # fmt: skip
        try:
            shared = self._load_encoders([w for w in wanted if not generates(w[2].task)])
            clients = {
                key: shared.get(key) or self.acquire(name, load) for key, name, load in wanted
            }
            for key, _, load in wanted:
                for adapter, folder in load.adapters:
                    self.add_adapter(clients[key], adapter, folder)
            return clients
        finally:
            self._bar.close()
            self._bar = None

    def acquire(self, name: str, load: ModelLoad) -> ModelClient:
        """A client of the model ``load`` describes: the one already held (one more user),
        or a new one (loaded now, or registered to load on demand)."""
        key = load.key(self.config)
        if key in self._held:
            self._held[key].users += 1
            return self._held[key].client
        if not generates(load.task):
            return self._load_encoders([(key, name, load)])[key]
        name = self._free_name(name)
        if load.resident == "on_demand" or (load.resident is None and self.under_pressure):
            client = self._on_demand(name, load)
            self._held[key] = _Held(client, None, str(load.folder))
            return client
        client, _ = self._load_llm(name, load)
        self._held[key] = _Held(client, client.worker, str(load.folder))
        return client

    def release(self, client: ModelClient) -> None:
        """One user less; a model nobody uses any more is unloaded (an adapter version's
        reference is its base's)."""
        client = client.base if isinstance(client, AdapterClient) else client
        for key, held in list(self._held.items()):
            if held.client is client:
                held.users -= 1
                if held.users == 0:
                    del self._held[key]
                    if held.worker is None:  # on demand: evicted if resident, forgotten
                        self.engine.residency.remove(client.name)
                        return
                    if not any(h.worker is held.worker for h in self._held.values()):
                        self.engine.remove_worker(held.worker.name)
                    self.store.unload(held.path)
                return

    def _load_weights(self, load: ModelLoad, name: str, **kwargs: Any) -> LoadedModel:
        """A model's weights as its load asks: a fixed dtype/quantization, or "auto"
        (picked from the hardware, then the accuracy gate; ``engine/auto_weights.py``)."""
        quantize = load.quantize
        dtype_auto = load.dtype_choice(self.config) == "auto"
        if not dtype_auto and quantize != "auto":
            return self._timed(load, name, dtype=load.torch_dtype(self.config),
                               quantize=quantize, **kwargs)  # fmt: skip
        if self.hardware is None:
            self.hardware = detect(self.config.device)
        examples = None
        if load.eval_set is not None:
            try:
                examples = read_eval_set(load.eval_set)
            except (OSError, ValueError) as exc:
                raise ModelLoadError(
                    str(load.eval_set), f"model {name!r}: eval_set: {exc}"
                ) from exc
        loader = functools.partial(
            load_auto, hw=self.hardware, dtype_auto=dtype_auto,
            quant_auto=quantize == "auto", base=load.torch_dtype(self.config),
            bound=load.max_accuracy_drop or DEFAULT_MAX_DROP, eval_set=examples,
        )  # fmt: skip
        return self._timed(load, name, loader=loader, **kwargs)

    def _timed(self, load: ModelLoad, name: str, loader=None, **kwargs: Any) -> LoadedModel:
        """One model through the weight store (or ``loader``, which returns it and its
        decision), with a log line (and a tick of the load bar): loading a real model takes
        seconds to minutes."""
        started = time.perf_counter()
        before = self.store.total_bytes()
        path, task, device = load.folder, load.task, self.config.device
        if loader is None:
            loaded = self.store.load(path, task, device=device, name=name, **kwargs)
        else:
            loaded, _ = loader(self.store, path, task, device=device, name=name, **kwargs)
        added = self.store.total_bytes() - before
        log.info(
            "loaded model '%s' (%s) from %s in %.1f s: %.1f MB new in memory",
            name, task, path, time.perf_counter() - started, added / 1e6,
        )  # fmt: skip
        if self._bar is not None:
            self._bar.set_postfix_str(name)
            self._bar.update(1)
        return loaded

    def _load_llm(
        self, name: str, load: ModelLoad, on_demand: bool = False
    ) -> tuple[LocalLLM, LoadedModel]:
        """A causal LM loaded and put on the engine: its client and its store entry."""
        loaded = self._load_weights(load, name, attn_implementation=ATTN_NAME)
        self.engine.add_llm(
            name, load.folder, model=loaded.model, tokenizer=loaded.tokenizer,
            max_num_seqs=load.max_batch_size, max_prompt_tokens=load.max_prompt_tokens,
            max_tokens_limit=load.max_tokens_limit, max_loras=load.max_loras,
            max_lora_rank=load.max_lora_rank, speculative=load.speculative,
            on_demand=on_demand,
        )  # fmt: skip
        return self.engine.client(name), loaded

    def _on_demand(self, name: str, load: ModelLoad) -> OnDemandLLM:
        """Registered with the engine's residency, loaded at its first request."""

        def make_resident() -> Resident:
            client, loaded = self._load_llm(name, load, on_demand=True)

            def unload() -> None:
                self.engine.remove_worker(name)  # between two steps; its cached pages return
                self.store.unload_model(loaded)
                gc.collect()  # the model's own reference cycles
                trim_heap()

            return Resident(client, unload)

        auto = load.dtype_choice(self.config) == "auto"
        dtype = self.config.torch_dtype if auto else load.torch_dtype(self.config)
        self.engine.residency.add(name, make_resident, estimate_bytes(load.folder, dtype))
        return OnDemandLLM(self.engine.residency, name)

    def _load_encoders(
        self, wanted: list[tuple[Hashable, str, ModelLoad]]
    ) -> dict[Hashable, LocalEncoder]:
        """Load encoders new to this host, one worker per backbone: heads whose backbones
        hold the very same tensors share a worker (``encoder_runner.backbone_tensors``)."""
        groups: list[tuple[set, list]] = []  # backbone tensors, members
        seen: set[tuple] = set()
        for key, name, load in wanted:
            held_key = load.key(self.config)
            if held_key in self._held or held_key in seen:
                continue  # already served (or listed twice): acquire shares it
            seen.add(held_key)
            head = self._free_name(name)
            loaded = self._load_weights(load, head)
            tensors = backbone_tensors(loaded)
            member = (key, load, head, loaded)
            # one backbone may carry a pooler that another head's copy leaves out
            vocab = loaded.tokenizer.get_vocab()
            group = next(
                (g for g in groups
                 if (tensors <= g[0] or g[0] <= tensors)
                 and g[1][0][-1].tokenizer.get_vocab() == vocab),
                None,
            )  # fmt: skip
            if group is None:
                groups.append((tensors, [member]))
            else:
                group[0].update(tensors)
                group[1].append(member)
        clients: dict[Hashable, LocalEncoder] = {}
        for _, members in groups:
            heads = {head: loaded for *_, head, loaded in members}
            worker = EncoderWorker("+".join(heads), heads, batcher=members[0][1].batcher(),
                                   pool=self.engine.pool, wake=self.engine.loop.wake)  # fmt: skip
            self.engine.add_worker(worker)
            for key, load, head, _ in members:
                client = LocalEncoder(worker, head, load.task)
                self._held[load.key(self.config)] = _Held(client, worker, str(load.folder))
                clients[key] = client
        return clients

    def _free_name(self, name: str) -> str:
        taken = set(self.engine.loop.workers) | set(self.engine.residency.stats())
        if name not in taken:
            return name
        n = 2
        while f"{name}-{n}" in taken:
            n += 1
        return f"{name}-{n}"

    # -- adapters ------------------------------------------------------------------------
    def adaptable(self, client: ModelClient) -> bool:
        """Whether LoRA adapters can go on this client's model (a loaded LLM of this host)."""
        return isinstance(client, LocalLLM)

    def add_adapter(self, client: ModelClient, adapter: str, folder: str | Path) -> None:
        """Register an adapter on the client's LLM once; the same name from another
        folder is refused (ModelLoadError)."""
        folder = Path(folder).expanduser().resolve()
        if not self.adaptable(client):  # on demand: no resident worker to hold adapters
            raise ModelLoadError(
                str(folder),
                f"model {client.name!r} is loaded on demand (resident: on_demand, or a "
                "weight_budget that cannot hold every model); LoRA adapters need their base "
                "resident: give it resident: always",
                field="adapters",
            )
        worker = client.worker  # type: ignore[attr-defined]
        held = worker.adapters.get(adapter) if worker.adapters is not None else None
        if held is None:
            worker.add_adapter(adapter, str(folder))
        elif held.path != str(folder):
            raise ModelLoadError(
                str(folder),
                f"model {worker.name!r} already has an adapter {adapter!r} from {held.path}",
            )

    def adapter_version(
        self, base: ModelClient, adapter: str, folder: str | Path, *, share: bool = True
    ) -> AdapterClient:
        """A LoRA adapter on ``base``'s LLM as a model of its own (no second copy). It
        holds a reference to the base; ``share=False``: the caller's own reference to the
        base becomes the adapter's."""
        self.add_adapter(base, adapter, folder)
        if share:
            for held in self._held.values():
                if held.client is base:
                    held.users += 1
        return AdapterClient(base, adapter)

    def adapter_users(self, client: ModelClient) -> int:
        """Requests running or waiting on an adapter version now (0 for other clients)."""
        if not isinstance(client, AdapterClient):
            return 0
        return client.base.worker.adapter_users(client.adapter)

    def drop_adapter(self, client: ModelClient) -> None:
        """Take an adapter version's adapter off its base (other clients: nothing)."""
        if isinstance(client, AdapterClient):
            client.base.worker.remove_adapter(client.adapter)

    # -- reading -------------------------------------------------------------------------
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


def over_budget(loads: Iterable[ModelLoad], config: EngineConfig) -> bool:
    """Whether every model, each folder once, would overflow the weight budget
    (estimated from the files' headers; nothing is loaded)."""
    if config.weight_budget is None:
        return False
    wanted = {(str(Path(load.folder).resolve()), load.torch_dtype(config)) for load in loads}
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
