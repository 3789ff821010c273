"""LLMEngine: one loop thread, one memory pool, any number of models.

Batch use: ``engine.generate(prompts, params)``; from asyncio code,
``engine.add_request(...)`` streams one request's outputs (leaving early aborts it).
Both wrap the model's ``LocalLLM`` (``engine.client(model)``), the one way a generation
enters the engine; serving reaches models through those clients (engine/protocol.py).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from transformers import AutoConfig

from trae_groups.engine.auto_weights import load_auto
from trae_groups.engine.clients import LocalLLM
from trae_groups.engine.compile_choice import auto_compile_reason, compile_sizes
from trae_groups.engine.config import EngineConfig
from trae_groups.engine.deadlines import Priority
from trae_groups.engine.draft import DraftProposer, same_vocabulary
from trae_groups.engine.errors import EngineError, EngineStopped, ModelLoadError, RequestError
from trae_groups.engine.hardware import detect
from trae_groups.engine.llm_runner import ATTN_NAME, kv_layout, prepare_forward
from trae_groups.engine.llm_worker import LLMWorker
from trae_groups.engine.loop import EngineLoop
from trae_groups.engine.memory import bound_kernel_caches
from trae_groups.engine.memory_pool import MemoryPool
from trae_groups.engine.outputs import OutputStream
from trae_groups.engine.passing_threads import release_openmp_team
from trae_groups.engine.protocol import EngineStats, GenerateRequest, WeightStats, new_request_id
from trae_groups.engine.residency import Residency
from trae_groups.engine.sampling import SamplingParams
from trae_groups.engine.sequence import RequestOutput
from trae_groups.engine.spec_config import Reference, SpeculativeConfig
from trae_groups.engine.weights import WeightStore
from trae_groups.engine.worker import Worker
from trae_groups.kernels import select_backend

log = logging.getLogger("trae_groups.engine")


def _named(models: Mapping[str, str | Path] | Sequence[str | Path]) -> dict[str, str]:
    if isinstance(models, Mapping):
        return {name: str(path) for name, path in models.items()}
    return {Path(p).name or str(p): str(p) for p in models}


def read_config(path: str):
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ModelLoadError(path, "no config.json: not a transformers model folder")
    try:
        return AutoConfig.from_pretrained(folder)
    except Exception as exc:
        raise ModelLoadError(path, f"config.json cannot be read: {exc}") from exc


def load_causal_lm(
    store: WeightStore, path: str, dtype: torch.dtype, device: str, quantize: str | None = None
):
    """The model class transformers picks for the folder, with our paged attention,
    through the weight store (memory-mapped, byte-identical tensors held once)."""
    read_config(path)
    loaded = store.load(
        path, "generate", dtype=dtype, device=device, quantize=quantize,
        attn_implementation=ATTN_NAME,
    )  # fmt: skip
    return loaded.model, loaded.tokenizer


def load_auto_causal_lm(store: WeightStore, path: str, device: str):
    """``load_causal_lm`` in the dtype the hardware runs fast, if the accuracy gate allows it
    (``dtype="auto"``; engine/auto_weights.py); the choice is logged and kept on the model."""
    read_config(path)
    loaded, _ = load_auto(
        store, path, "generate", detect(device), dtype_auto=True, quant_auto=False,
        device=device, attn_implementation=ATTN_NAME,
    )  # fmt: skip
    return loaded.model, loaded.tokenizer


_LIVE: weakref.WeakSet = weakref.WeakSet()  # what a process-wide memory profiler reads


def live_engines() -> list[LLMEngine]:
    """Every engine of this process still alive (``trae_groups.monitor`` samples them)."""
    return list(_LIVE)


class LLMEngine:
    def __init__(
        self,
        models: Mapping[str, str | Path] | Sequence[str | Path] = (),
        config: EngineConfig | None = None,
        store: WeightStore | None = None,
        reserve_for: Sequence[str | Path] = (),
    ):
        """``reserve_for``: folders of LLMs to be added later (``add_llm``); pages are
        sized for the largest of them and ``models``."""
        self.config = config or EngineConfig()
        self.store = store or WeightStore()
        bound_kernel_caches()
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)

        self.loop = EngineLoop(policy=self.config.scheduling)
        self.backend = select_backend(self.config.device, self.config.attention_backend)
        named = _named(models)
        paths = [*named.values(), *(str(p) for p in reserve_for)]
        self.backend.check_kv(self.config.kv_cache_dtype, self.config.device)
        storage = self.config.kv_storage
        layouts = [kv_layout(read_config(p), self.config.torch_dtype, storage) for p in paths]
        self.pool = self._make_pool(layouts)
        self._pool_sized = False  # final size, KV capacity logged (size_pool)
        self._to_compile: list[tuple[LLMWorker, tuple[int, ...]]] = []  # until then
        self._compiling: list[threading.Thread] = []  # compile="auto": beside serving
        self.llms: dict[str, LLMWorker] = {}
        self.clients: dict[str, LocalLLM] = {}  # each LLM's one way in
        self.residency = Residency(
            self.store.total_bytes, self.config.weight_budget, self.config.load_wait
        )
        self._lock = threading.Lock()
        _LIVE.add(self)
        for name, path in named.items():
            self.add_llm(name, path)
        log.info(
            "engine on %s, attention backend %s, KV pages %s",
            self.config.device,
            self.backend.name,
            self.config.kv_cache_dtype,
        )

    def _make_pool(self, layouts) -> MemoryPool:
        """The pool: of its final size when ``pool_bytes`` says it; else one page until
        ``size_pool`` runs, once the weights are loaded."""
        page_bytes = self.config.page_bytes
        if page_bytes is None:
            biggest = max((lay.bytes_per_token for lay in layouts), default=4096)
            page_bytes = -(-biggest * self.config.tokens_per_page // 64) * 64
        size = self.config.pool_bytes if self.config.pool_bytes is not None else page_bytes
        return MemoryPool.from_size(size, page_bytes, self.config.device)

    def size_pool(self) -> None:
        """Give the pool its size, once, when serving starts (the weights are in memory
        by then): ``pool_bytes``, else ``EngineConfig.pool_size``. Logs how many KV tokens
        each LLM can hold, then prepares the fixed-size decode steps that wait for it."""
        if self._pool_sized:
            return
        if self.config.pool_bytes is None:
            size, source = self.config.pool_size()
            if size < self.pool.page_bytes:
                raise EngineError(
                    f"no memory left for the pool ({source}: {size} bytes, less than one "
                    f"{self.pool.page_bytes}-byte page); set pool_bytes or a larger reservation"
                )
            self.loop.call(lambda: self.pool.resize(size // self.pool.page_bytes))
            log.info(
                "pool: %d pages x %d bytes = %.1f MiB (%s)",
                self.pool.num_pages, self.pool.page_bytes,
                self.pool.num_pages * self.pool.page_bytes / 2**20, source,
            )  # fmt: skip
        self._pool_sized = True
        for worker in self.llms.values():
            self._log_capacity(worker)
        while self._to_compile:
            self._compile(*self._to_compile.pop(0))

    def _compile(self, worker: LLMWorker, sizes: tuple[int, ...]) -> None:
        """Fixed-size decode steps (compiled on CPU, CUDA graphs on a GPU) see the pool's
        final buffer: a graph holds its addresses. compile="auto" compiles on a thread of
        its own while the model already serves eagerly (a cold compile of SmolLM2's batch-1
        step takes ~50 s on 2 cores, a warm one ~7 s; start-up must not wait for either),
        and the thread ends with it, taking its OpenMP team along."""
        if self.config.compile == "auto":
            thread = threading.Thread(
                target=self._compile_now, args=(worker, sizes), name=f"trae-compile-{worker.name}",
                daemon=True,
            )  # fmt: skip
            self._compiling.append(thread)
            thread.start()
        else:
            self._compile_now(worker, sizes)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for the compiles ``compile="auto"`` runs beside serving (benchmarks that
        time the compiled path, tests); whether none is left running."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in list(self._compiling):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            thread.join(left)
        self._compiling = [t for t in self._compiling if t.is_alive()]
        return not self._compiling

    def _compile_now(self, worker: LLMWorker, sizes: tuple[int, ...]) -> None:
        def prepare() -> float:
            return worker.runner.enable_compile(sizes, worker.max_model_len)

        # a CUDA graph capture must not overlap other models' kernels (a model added while
        # serving): it runs between steps on the engine thread; compiling on CPU does not
        cuda = worker.runner.device.type == "cuda"
        try:
            seconds = self.loop.call(prepare) if cuda else prepare()
        except Exception as exc:  # the default ("auto") must not fail a load
            if self.config.compile is True:
                raise
            worker.runner.compiled = None
            log.warning("model %s: compiling its decode failed, it stays eager: %s: %s",
                        worker.name, type(exc).__name__, exc)  # fmt: skip
            return
        log.info(
            "model %s: fixed-size decode for batch sizes %s in %.1f s", worker.name, sizes, seconds
        )

    def _log_capacity(self, worker: LLMWorker) -> None:
        tokens = self.pool.num_pages * worker.kv.tokens_per_page
        log.info("model %s: the pool holds %d tokens of its KV cache", worker.name, tokens)

    def kv_capacity(self) -> dict[str, int]:
        """Tokens of KV each LLM could hold if it had the whole pool."""
        return {n: self.pool.num_pages * w.kv.tokens_per_page for n, w in self.llms.items()}

    # -- models --------------------------------------------------------------------
    def add_llm(
        self,
        name: str,
        path: str | Path,
        model=None,
        tokenizer=None,
        cache_key=None,
        max_num_seqs: int | None = None,
        max_prompt_tokens: int | None = None,
        max_tokens_limit: int | None = None,
        max_loras: int | None = None,
        max_lora_rank: int | None = None,
        speculative: SpeculativeConfig | None = None,
        on_demand: bool = False,
    ) -> LLMWorker:
        """Load a causal LM (or take one already loaded with our attention) onto the
        engine; ``max_num_seqs``, ``max_prompt_tokens``, ``max_tokens_limit``,
        ``max_loras``, ``max_lora_rank`` and ``speculative`` override the engine's for
        this model. ``on_demand``: it is resident on demand (evicted and loaded again), so
        ``compile="auto"`` leaves it eager: torch keeps a compiled graph's artifacts after
        the model is gone (~6,000 Python objects and a few MB per load, measured), and
        each load would pay the compile again."""
        if name in self.loop.workers:
            raise ValueError(f"a model named {name!r} is already on this engine")
        if model is None and self.config.dtype == "auto" and self.config.quantization is None:
            model, tokenizer = load_auto_causal_lm(self.store, str(path), self.config.device)
        elif model is None:
            model, tokenizer = load_causal_lm(
                self.store,
                str(path),
                self.config.torch_dtype,
                self.config.device,
                self.config.quantization,
            )
        slow = detect(self.config.device).slow_dtype(getattr(model, "dtype", None))
        if slow:
            log.warning("model %s: %s", name, slow)
        if prepare_forward(model, self.config):
            # the plain weights fusing and packing replaced: not counted, their file pages
            # given back
            self.store.settle(model)
        eager_on_demand = on_demand and self.config.compile == "auto"
        overrides = {
            "max_num_seqs": max_num_seqs,
            "max_prompt_tokens": max_prompt_tokens,
            "max_tokens_limit": max_tokens_limit,
            "max_loras": max_loras,
            "max_lora_rank": max_lora_rank,
            "speculative": speculative,
            "compile": False if eager_on_demand else None,
        }
        config = dataclasses.replace(
            self.config, **{k: v for k, v in overrides.items() if v is not None}
        )
        if config.speculative is not None and config.speculative.draft == name:
            config = dataclasses.replace(config, speculative=None)  # a draft drafts for others
        drafter = self._drafter(name, config.speculative, model, tokenizer)
        worker = LLMWorker(
            name,
            model,
            tokenizer,
            self.pool,
            config,
            self.backend,
            self.loop.wake,
            cache_key=cache_key or (name, str(path)),
            drafter=drafter,
        )
        sizes = compile_sizes(config, worker.runner)
        if eager_on_demand:
            log.info("model %s: decode stays eager: it is resident on demand", name)
        elif config.compile == "auto" and not sizes:
            log.info("model %s: decode stays eager: %s", name, auto_compile_reason(worker.runner))
        if sizes:
            if self._pool_sized:  # a model added while serving: now, before it takes work
                self._compile(worker, sizes)
            else:  # at start, once the pool has its size (the other models' weights loaded)
                self._to_compile.append((worker, sizes))
        self.llms[name] = worker
        self.clients[name] = LocalLLM(worker, lambda: self.loop.running)
        self.loop.add_worker(worker)
        if self._pool_sized and self.loop.running:  # an on-demand model, a new version
            self._log_capacity(worker)
        self._release_openmp()
        return worker

    def _drafter(self, name: str, spec: SpeculativeConfig | None, model, tokenizer):
        """For method "draft": the proposer of the draft model ``spec.draft``, a model
        already on this engine with the same vocabulary (ModelLoadError otherwise)."""
        if spec is None or spec.method != "draft":
            return None
        draft = self.llms.get(spec.draft)
        if draft is None:
            raise ModelLoadError(
                name, f"speculative draft model {spec.draft!r} is not on this engine "
                f"(add it first); models: {sorted(self.llms)}"
            )  # fmt: skip
        sizes = (
            draft.model.config.get_text_config().vocab_size,
            model.config.get_text_config().vocab_size,
        )
        if not same_vocabulary(draft.tokenizer, tokenizer, *sizes):
            raise ModelLoadError(
                name, f"speculative draft model {spec.draft!r} has another tokenizer; a draft "
                "must read and write the same token ids"
            )  # fmt: skip
        return DraftProposer(draft.model, draft.kv, self.pool, self.backend, f"{name}/draft")

    def _release_openmp(self) -> None:
        """A thread other than the loop's that loaded or warmed a model gives up its OpenMP
        team, so that the loop's team is the process's only one (engine/passing_threads.py)."""
        if threading.current_thread() is not self.loop.thread:
            release_openmp_team()

    def add_adapter(self, model: str, name: str, path: str | Path):
        """Register a PEFT LoRA adapter folder on a model of this engine (checked now);
        requests name it with ``adapter=``."""
        return self.llm(model).add_adapter(name, str(path))

    def remove_adapter(self, model: str, name: str) -> None:
        """Take an adapter off; refused while a request still uses it."""
        self.llm(model).remove_adapter(name)

    def remove_worker(self, name: str) -> Worker:
        """Take a model off the engine: its pending requests fail, its pages return
        (the prefix cache's too: nobody can use them any more)."""
        worker = self.loop.remove_worker(name)
        self.llms.pop(name, None)
        self.clients.pop(name, None)
        self.loop.call(lambda: self.pool.clear_cache(owner=name))
        return worker

    def add_worker(self, worker: Worker) -> None:
        """Any other worker (encoders) steps on the same loop."""
        self.loop.add_worker(worker)
        self._release_openmp()

    def llm(self, model: str | None) -> LLMWorker:
        return self.client(model).worker

    def client(self, model: str | None) -> LocalLLM:
        """The model's local client (``model`` may be left out when there is one LLM)."""
        if model is None:
            if len(self.clients) != 1:
                raise RequestError("model", f"name one of {sorted(self.clients)}")
            return next(iter(self.clients.values()))
        if model not in self.clients:
            raise RequestError("model", f"unknown model {model!r}; known: {sorted(self.clients)}")
        return self.clients[model]

    # -- life cycle ------------------------------------------------------------------
    def start(self) -> LLMEngine:
        self.size_pool()  # compiles, warms: parallel ops on this thread
        self._release_openmp()
        self.loop.start()
        return self

    def shutdown(self) -> None:
        self.loop.stop()
        self.residency.close()

    def __enter__(self) -> LLMEngine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- requests --------------------------------------------------------------------
    def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        sink: Callable[[RequestOutput], None],
        request_id: str | None = None,
        model: str | None = None,
        priority: Priority | None = None,
        adapter: str | None = None,
    ) -> str:
        """Queue one request; ``sink(output)`` is called on the engine thread."""
        if not self.loop.running:
            raise EngineStopped("the engine is not running; call start()")
        request = _request(prompt, params, request_id, priority, adapter)
        self.client(model).submit(request, sink)
        return request.request_id

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        model: str | None = None,
        priority: Priority | None = None,
        adapter: str | None = None,
    ) -> OutputStream:
        """From a running asyncio loop: validate and queue now, stream outputs later."""
        if not self.loop.running:
            raise EngineStopped("the engine is not running; call start()")
        request = _request(prompt, params, request_id, priority, adapter)
        return self.client(model).stream(request)

    def abort(self, request_id: str) -> None:
        for worker in self.loop.workers.values():
            worker.abort(request_id)

    def generate(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        model: str | None = None,
        adapters: Sequence[str | None] | None = None,
        references: Sequence[Reference | None] | None = None,
    ) -> list[RequestOutput]:
        """Blocking batch generation (``adapters``: one LoRA adapter name or None per
        prompt). With the loop thread running (serving), the requests join it; otherwise
        the engine steps right here, in the calling thread — faster for offline batches,
        as torch's OpenMP threads then serve one caller only (a second thread running
        torch ops makes both slower). ``references``: one ``Reference`` or None per prompt,
        a text its reply is likely to copy (speculative ``follows``, engine/speculative.py)."""
        if not isinstance(params, Sequence):
            params = [params or SamplingParams()] * len(prompts)
        if any(p.num_sequences > 1 for p in params):  # one output per prompt comes back
            raise RequestError("n", "generate() returns one output per prompt; use submit()")
        adapters = [None] * len(prompts) if adapters is None else list(adapters)
        refs = [None] * len(prompts) if references is None else list(references)
        inline = not self.loop.running
        if inline:
            self.size_pool()
        results: dict[int, RequestOutput] = {}
        done = threading.Event()

        def sink_for(index: int) -> Callable[[RequestOutput], None]:
            scores: list = []  # the prompt's, sent once (SamplingParams.prompt_logprobs)

            def sink(out: RequestOutput) -> None:
                scores.extend(out.prompt_logprobs or ())
                if out.finished:
                    results[index] = dataclasses.replace(out, prompt_logprobs=scores or None)
                    if len(results) == len(prompts):
                        done.set()

            return sink

        client = self.client(model)
        batch = [
            (_request(prompt, p, None, None, adapter, reference=ref, final_only=True), sink_for(i))
            for i, (prompt, p, adapter, ref) in enumerate(
                zip(prompts, params, adapters, refs, strict=True)
            )
        ]
        # one batch, queued at once (a bad prompt refuses all of it): a running loop thread
        # admits it as the inline steps do, not a prompt at a time as they come
        client.submit_all(batch)
        if inline:  # nobody streams these: the steps may be as long as throughput wants
            scheduler = client.worker.scheduler
            scheduler.hold_prompts = False
            try:
                self.loop.run_until(done.is_set)
            finally:
                scheduler.hold_prompts = True
                self.loop.trim()  # as the loop thread does once idle after a burst
        elif prompts:
            done.wait()
        return [results[i] for i in range(len(prompts))]

    def engine_stats(self) -> EngineStats:
        """Typed stats of the whole engine: what metrics and autoscaling read. Safe from
        any thread: a read that races the engine thread is tried again."""
        for attempt in range(5):
            try:
                return self._engine_stats()
            except RuntimeError:  # a dict or deque changed while we read it
                if attempt == 4:
                    raise
        raise AssertionError("unreachable")

    def _engine_stats(self) -> EngineStats:
        workers = self.loop.workers
        return EngineStats(
            device=str(self.config.device),
            dtype=str(self.config.dtype),
            attention_backend=self.backend.name,
            steps=self.loop.steps,
            busy_seconds=self.loop.busy_seconds,
            pool=self.pool.stats(),
            models={name: w.model_stats() for name, w in workers.items()},
            weights={r.name: WeightStats.of(r) for r in self.store.report(wait=False)},
            residency=self.residency.stats(),
            weight_budget=self.config.weight_budget,
            kv_cache_dtype=self.config.kv_cache_dtype,
        )

    def stats(self) -> dict:
        return {
            "pool": self.pool.stats(),
            "workers": {name: w.stats() for name, w in self.loop.workers.items()},
            "attention_backend": self.backend.name,
        }


def _request(
    prompt: str | list[int],
    params: SamplingParams | None,
    request_id: str | None,
    priority: Priority | None,
    adapter: str | None,
    reference: Reference | None = None,
    final_only: bool = False,
) -> GenerateRequest:
    """The offline API's arguments as the one typed request every client takes
    (``reference``: a text the reply is likely to copy, speculative ``follows``;
    ``final_only``: GenerateRequest's)."""
    if isinstance(prompt, str):
        text: str | tuple[int, ...] = prompt
    elif isinstance(prompt, Sequence):
        text = tuple(prompt)
    else:
        raise RequestError("prompt", "must be a text or a list of token ids")
    return GenerateRequest(
        request_id or new_request_id(),
        params or SamplingParams(),
        prompt=text,
        priority=priority or Priority(),
        adapter=adapter,
        reference=reference,
        final_only=final_only,
    )
