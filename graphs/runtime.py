"""Binds graphs to one engine: loads each model once and gives the executor a client
per model.

Models are keyed by (folder, task): two graphs — or two model entries — naming the
same folder share one worker, one instance and one batcher. Encoder heads whose
backbone tensors are byte-identical (the weight store dedupes them) join one worker,
so a classify head and a tag head over one backbone run it once per text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch

from trae_groups.engine.batcher import BatcherConfig
from trae_groups.engine.config import DTYPES, EngineConfig
from trae_groups.engine.encoder_worker import EncoderWorker
from trae_groups.engine.engine import LLMEngine, read_config
from trae_groups.engine.llm_runner import ATTN_NAME, kv_layout
from trae_groups.engine.llm_worker import LLMWorker
from trae_groups.engine.sampling import SamplingParams
from trae_groups.engine.weights import SharingPolicy, WeightStore
from trae_groups.engine.worker import Priority
from trae_groups.graphs.compile import CompiledGraph, compile_graph, resolve_functions
from trae_groups.graphs.executor import GraphExecutor
from trae_groups.graphs.spec import GraphSpec, ModelSpec

log = logging.getLogger("trae_groups.graphs")


class EncoderClient:
    """A classify/tag/embed model as the executor sees it."""

    def __init__(self, worker: EncoderWorker, head: str):
        self.worker = worker
        self.head = head

    async def encode(self, text: str, *, request_id: str, priority: Priority) -> dict:
        future = self.worker.submit(text, head=self.head, request_id=request_id, priority=priority)
        result = await asyncio.wrap_future(future)
        if "vector" in result:  # the graph-level name of an embedding
            result = {
                "embedding": result["vector"],
                **{k: v for k, v in result.items() if k != "vector"},
            }
        return result

    def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)


class LLMClient:
    """A causal LM on the engine."""

    def __init__(self, engine: LLMEngine, worker: LLMWorker):
        self.engine = engine
        self.worker = worker

    def generate(
        self, prompt: str, params: SamplingParams, *, request_id: str, priority: Priority
    ) -> AsyncIterator[Any]:
        return self.engine.add_request(
            prompt, params, request_id=request_id, model=self.worker.name, priority=priority
        )

    def chat_prompt(self, messages: list[dict]) -> str:
        tokenizer = self.worker.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            # no chat template: a plain transcript the model can continue
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            return "\n".join(lines) + "\nassistant:"
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)


@dataclasses.dataclass
class _Loaded:
    client: EncoderClient | LLMClient
    worker: Any
    key: tuple


class ModelRuntime:
    """Every model of every served graph, on one engine and one weight store."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        reserve_for: list[str | Path] = (),
        sharing: SharingPolicy | None = None,
    ):
        self.config = config or EngineConfig()
        layouts_of = [str(p) for p in reserve_for]
        self.store = WeightStore(policy=sharing or SharingPolicy())
        self.engine = LLMEngine((), self._sized(layouts_of))
        self._by_key: dict[tuple, _Loaded] = {}

    def _sized(self, llm_paths: list[str]) -> EngineConfig:
        """Pages sized for the largest LLM that will be served."""
        if self.config.page_bytes is not None or not llm_paths:
            return self.config
        biggest = max(
            kv_layout(read_config(p), self.config.torch_dtype).bytes_per_token for p in llm_paths
        )
        page = -(-biggest * self.config.tokens_per_page // 64) * 64
        return dataclasses.replace(self.config, page_bytes=page)

    @classmethod
    def for_specs(cls, specs: list[GraphSpec], config: EngineConfig | None = None) -> ModelRuntime:
        llms = [
            spec.model_path(name)
            for spec in specs
            for name, model in spec.models.items()
            if model.task == "generate"
        ]
        sharing = specs[0].sharing if specs else None
        policy = SharingPolicy(memory=sharing.memory, gpu=sharing.gpu) if sharing else None
        return cls(config, reserve_for=llms, sharing=policy)

    def start(self) -> None:
        self.engine.start()

    def shutdown(self) -> None:
        self.engine.shutdown()

    # -- models -----------------------------------------------------------------
    def client(self, name: str, spec: ModelSpec, path: Path) -> EncoderClient | LLMClient:
        dtype = DTYPES.get(spec.dtype or "", self.config.torch_dtype)
        key = (str(Path(path).resolve()), spec.task, dtype)
        if key in self._by_key:
            return self._by_key[key].client
        if spec.task == "generate":
            loaded = self.store.load(
                path,
                "generate",
                dtype=dtype,
                device=self.config.device,
                name=name,
                attn_implementation=ATTN_NAME,
            )
            worker_name = self._free_name(name)
            worker = self.engine.add_llm(
                worker_name, path, model=loaded.model, tokenizer=loaded.tokenizer
            )
            entry = _Loaded(LLMClient(self.engine, worker), worker, key)
        else:
            loaded = self.store.load(
                path, spec.task, dtype=dtype, device=self.config.device, name=name
            )
            batcher = BatcherConfig(
                max_batch_size=spec.max_batch_size or 32,
                timeout_ms=spec.max_queue_delay_ms if spec.max_queue_delay_ms is not None else 5.0,
                preferred_batch_size=min(16, spec.max_batch_size or 32),
            )
            worker = EncoderWorker(
                self._free_name(name),
                {name: loaded},
                batcher=batcher,
                pool=self.engine.pool,
                wake=self.engine.loop.wake,
            )
            self.engine.add_worker(worker)
            entry = _Loaded(EncoderClient(worker, name), worker, key)
        self._by_key[key] = entry
        return entry.client

    def _free_name(self, name: str) -> str:
        taken = set(self.engine.loop.workers)
        if name not in taken:
            return name
        n = 2
        while f"{name}-{n}" in taken:
            n += 1
        return f"{name}-{n}"

    def bind(self, spec: GraphSpec | CompiledGraph) -> GraphExecutor:
        """An executor for the graph, its models loaded (once) onto this runtime."""
        graph = spec if isinstance(spec, CompiledGraph) else compile_graph(spec)
        functions = resolve_functions(graph.spec)
        clients = {
            name: self.client(name, model, graph.spec.model_path(name))
            for name, model in graph.spec.models.items()
        }
        return GraphExecutor(graph, clients, functions)

    def stats(self) -> dict:
        return self.engine.stats()


def default_engine_config() -> EngineConfig:
    return EngineConfig(num_threads=torch.get_num_threads())
