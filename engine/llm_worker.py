"""One causal LM on the engine: its scheduler, runner and sampler.

``step()`` reads top to bottom: take new requests and aborts, propose tokens (speculative
decoding, when configured), schedule, run the model, sample (verify), then update every
sequence and send its output.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Hashable

import torch

from trae_groups.engine import chat, forks, prompt_logprobs
from trae_groups.engine.config import EngineConfig
from trae_groups.engine.constraints import Grammars, fill_masks
from trae_groups.engine.deadlines import rank
from trae_groups.engine.errors import EngineStopped, RequestError
from trae_groups.engine.llm_runner import LLMRunner, activation_dtype, kv_layout
from trae_groups.engine.llm_stats import LLMCounters
from trae_groups.engine.lora import Adapter, LoraSlots
from trae_groups.engine.memory_pool import MemoryPool
from trae_groups.engine.outputs import Outputs, eos_ids
from trae_groups.engine.protocol import GenerateRequest, ModelStats
from trae_groups.engine.sampling import Sampler
from trae_groups.engine.scheduler import (
    ScheduledSeq,
    Scheduler,
    SchedulerOutput,
    SchedulerSettings,
)
from trae_groups.engine.sequence import RequestOutput, Sequence
from trae_groups.engine.spec_config import Reference, SpeculativeConfig
from trae_groups.engine.speculative import Speculator
from trae_groups.engine.verify import Verdict, verdicts_of, verify
from trae_groups.engine.worker import Urgency, Worker
from trae_groups.kernels import AttentionBackend
from trae_groups.kernels.lora import select_lora_kernel

log = logging.getLogger("trae_groups.engine")

_STALL_POLL_S = 0.005  # waiting for pages another model holds


def context_length(positions: int | None, configured: int | None) -> int:
    """The context a model is served with: its ``max_position_embeddings`` (2048 when its
    config has none), lowered to the engine's ``max_model_len`` when that is set."""
    length = positions or 2048
    return min(configured or length, length)


#: Tokens past the limit a long prompt's probe (``chat.probe``) must hold to refuse it:
#: more than its cut edge may add.
PROBE_SLACK = 64


class LLMWorker(Worker):
    def __init__(
        self,
        name: str,
        model: torch.nn.Module,
        tokenizer,
        pool: MemoryPool,
        config: EngineConfig,
        backend: AttentionBackend,
        wake: Callable[[], None],
        cache_key: Hashable | None = None,
        drafter=None,  # method "draft": the draft model's proposer (engine/draft.py)
    ):
        self.name = name
        self.model = model
        self.tokenizer = tokenizer
        self.pool = pool
        self.wake = wake
        self.layout = kv_layout(model.config, activation_dtype(model), config.kv_storage)
        self.kv = pool.kv_view(self.layout)  # smaller models fit more tokens in a page
        self.runner = LLMRunner(model, self.kv, backend)
        text_config = model.config.get_text_config()
        positions = getattr(text_config, "max_position_embeddings", None)
        self.max_model_len = context_length(positions, config.max_model_len)
        self.max_tokens_limit = config.max_tokens_limit
        self.max_prompt_tokens = min(
            config.max_prompt_tokens or self.max_model_len - 1, self.max_model_len - 1
        )
        settings = SchedulerSettings.from_config(
            config, self.kv.tokens_per_page, cache_key or name, backend.needs_zeroed_pages
        )
        self.scheduler = Scheduler(pool, name, settings, admissible=self._adapter_ready)
        self.max_loras = config.max_loras
        self.max_lora_rank = config.max_lora_rank
        self._constraint_bytes = (config.max_constraint_bytes, config.constraint_cache_bytes)
        self.sampler = Sampler()
        self.eos_ids = eos_ids(model, tokenizer)
        self.outputs = Outputs(name, tokenizer, self.eos_ids, self.max_model_len)
        self._lock = threading.Lock()
        self._inbox: deque[Sequence] = deque()
        self._aborts: set[str] = set()
        self._live: dict[str, Sequence] = {}
        self._stalled_until = 0.0
        self._grammars: Grammars | None = None
        self.counters = LLMCounters()  # what metrics read (engine/llm_stats.py)
        spec = config.speculative
        self.speculator = None if spec is None else Speculator(spec, self.max_model_len, drafter)

    # -- submitting (any thread) ------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(
                    "prompt", f"model {self.name!r} has no tokenizer; send token ids"
                )
            return chat.encode(self.tokenizer, prompt)
        return list(prompt)

    def prompt_tokens(self, request: GenerateRequest) -> list[int] | str:
        """The request's prompt as token ids: chat messages through the model's template
        (engine/chat.py); text when the model has no tokenizer (``submit`` refuses it).
        RequestError for text that is certainly too long, before tokenizing all of it."""
        self._refuse_text_past_the_limit(request)
        if request.messages is not None:  # what users wrote stays text (engine/chat.py)
            messages = list(request.messages)
            tools = list(request.tools) if request.tools else None
            if self.tokenizer is None:
                return chat.render(None, messages)
            return chat.chat_token_ids(self.tokenizer, messages, tools)
        if request.inlined and isinstance(request.prompt, str) and self.tokenizer is not None:
            return chat.prompt_token_ids(self.tokenizer, request.prompt, request.inlined)
        return self.encode(request.prompt)

    def _check_token_ids(self, field: str, tokens) -> int:
        """RequestError on ``field`` unless every token id is in the vocabulary; its size."""
        vocab = self.model.config.get_text_config().vocab_size
        try:  # in C: submit runs on the event loop, and a 0.9 MB prompt is ~200k ids
            ids = array("q", tokens)
        except (TypeError, OverflowError):
            ids = None
        if ids is None or (ids and (min(ids) < 0 or max(ids) >= vocab)):
            raise RequestError(field, f"token ids must be integers in [0, {vocab})")
        return vocab

    @functools.cached_property
    def _chars_per_token_bound(self) -> int:
        """No token of this tokenizer covers more characters than this: its longest
        vocabulary entry, times 4 for normalizers that fold several characters into one."""
        vocab = self.tokenizer.get_vocab() if self.tokenizer is not None else {}
        return 4 * max((len(piece) for piece in vocab), default=1)

    def _refuse_text_past_the_limit(self, request: GenerateRequest) -> None:
        """Text too long for ``max_prompt_tokens`` is refused before the tokenizer reads
        all of it (a 1 MB prompt costs it 0.6 s of both cores, which starve the server).

        First a bound that needs no tokenizing (more characters than the longest tokens
        could cover), which only catches text past ~300 characters a token; then a probe
        (``chat.probe``) of the longest text a user wrote, tokenized alone: one past the
        limit by ``PROBE_SLACK`` is past it in the whole; one under it says nothing, and
        the whole is tokenized as before."""
        if self.tokenizer is None:
            return
        if isinstance(request.prompt, str):
            texts = [request.prompt]
        elif request.messages is not None:  # templates may drop earlier assistant turns
            texts = [m["content"] for m in request.messages if isinstance(m, dict)
                     and isinstance(m.get("content"), str) and m.get("role") != "assistant"]  # fmt: skip
        else:
            return
        limit = self.max_prompt_tokens
        chars = sum(map(len, texts))
        fewest = chars // self._chars_per_token_bound
        if fewest > limit:
            raise RequestError(
                "prompt",
                f"has {chars} characters, at least {fewest} tokens; model {self.name!r} "
                f"takes at most {limit} (max_prompt_tokens)",
            )
        longest = max(texts, key=len, default="")
        prefix = chat.probe(longest, limit + PROBE_SLACK)
        if prefix is None:
            return  # tokenized whole
        counted = len(chat.encode(self.tokenizer, prefix))
        if counted > limit + PROBE_SLACK:
            raise RequestError(
                "prompt",
                f"has more than {limit} tokens (the first {len(prefix)} characters of its "
                f"{len(longest)} are {counted} alone); model {self.name!r} takes at most "
                f"{limit} (max_prompt_tokens)",
            )

    def submit(self, request: GenerateRequest, sink: Callable[[RequestOutput], None]) -> None:
        """Validate, then queue; ``sink`` gets each output on the engine thread. Raises
        RequestError before any work is done."""
        self.submit_all([(request, sink)])

    def submit_all(self, items: list[tuple[GenerateRequest, Callable[[RequestOutput], None]]]):
        """``submit`` for requests that arrive together: every one validated first (a
        RequestError queues none of them), then all queued at once, so that the engine
        thread's next step sees the whole batch — an offline batch is admitted as one
        whether or not the loop thread is stepping meanwhile."""
        seqs = [self._sequence(request, sink) for request, sink in items]
        with self._lock:
            seen: set[str] = set()
            for seq in seqs:
                if seq.request_id in self._live or seq.request_id in seen:
                    raise RequestError("request_id", f"{seq.request_id!r} is already running")
                seen.add(seq.request_id)
            for seq in seqs:
                self._live[seq.request_id] = seq
                self._inbox.append(seq)
        self.wake()

    def _sequence(self, request: GenerateRequest, sink: Callable[[RequestOutput], None]):
        """The request checked and made a ``Sequence`` (prompt tokens, grammar), not queued."""
        params, request_id, adapter = request.params, request.request_id, request.adapter
        salt = self._adapter_salt(adapter)
        tokens = self.encode(self.prompt_tokens(request))  # still text: no tokenizer, refused
        if not tokens:
            raise RequestError("prompt", "is empty")
        vocab = self._check_token_ids("prompt", tokens)
        if any(not 0 <= token < vocab for token, _ in params.logit_bias):
            raise RequestError("logit_bias", f"token ids must be integers in [0, {vocab})")
        if len(tokens) >= self.max_model_len:
            raise RequestError(
                "prompt",
                f"has {len(tokens)} tokens; model {self.name!r} takes at most "
                f"{self.max_model_len - 1} so that one can be generated",
            )
        if len(tokens) > self.max_prompt_tokens:
            raise RequestError(
                "prompt",
                f"has {len(tokens)} tokens; model {self.name!r} takes at most "
                f"{self.max_prompt_tokens} (max_prompt_tokens)",
            )
        if self.max_tokens_limit is not None and params.max_tokens > self.max_tokens_limit:
            raise RequestError(
                "max_tokens",
                f"asks for {params.max_tokens}; model {self.name!r} generates at most "
                f"{self.max_tokens_limit} per request (max_tokens_limit)",
            )
        pages = self.scheduler.pages_needed(len(tokens) + 1)
        if pages > self.pool.num_pages:
            raise RequestError("prompt", f"needs {pages} pages; the pool has {self.pool.num_pages}")
        if params.stop and self.tokenizer is None:
            raise RequestError(
                "stop", f"model {self.name!r} has no tokenizer to match stop strings"
            )
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        seq = Sequence(
            request_id,
            tokens,
            params,
            sink,
            request.priority,
            generator=generator,
            adapter=adapter,
            cache_salt=salt,
        )
        seq.final_only = request.final_only
        if request.reference is not None:
            seq.reference = self._reference_tokens(request.reference)
        if params.constraint is not None:  # compiled here, on the submitting thread
            seq.matcher = self.grammars().matcher(params.constraint)
        if params.num_sequences > 1:
            forks.make_children(seq, lambda: self.grammars().matcher(params.constraint))
        return seq

    def _reference_tokens(self, reference: Reference) -> Reference:
        """The reference as this model's token ids; a model that speculates for no request
        gets a speculator for the ones with a reference (method "follows")."""
        text = reference.text
        if isinstance(text, str) and self.tokenizer is None:
            raise RequestError("reference", f"model {self.name!r} has no tokenizer; send ids")
        tokens = tuple(self.encode(text if isinstance(text, str) else list(text)))
        self._check_token_ids("reference", tokens)
        with self._lock:
            if self.speculator is None:
                config = SpeculativeConfig(method="follows")
                self.speculator = Speculator(config, self.max_model_len)
        return Reference(tokens, reference.num_tokens)

    # -- adapters (any thread) -----------------------------------------------------------
    @property
    def adapters(self) -> LoraSlots | None:
        """This model's LoRA adapters (None until the first is added)."""
        return self.runner.lora

    def add_adapter(self, name: str, folder: str) -> Adapter:
        """Register a PEFT LoRA folder under ``name`` (checked now: ModelLoadError); it takes
        a slot when a request first needs it."""
        with self._lock:
            if self.runner.lora is None:
                device = next(self.model.parameters()).device
                dtype = next(self.model.parameters()).dtype
                self.runner.lora = LoraSlots(
                    self.model,
                    self.max_loras,
                    self.max_lora_rank,
                    dtype,
                    device,
                    kernel=select_lora_kernel(device),
                )
        return self.runner.lora.register(name, folder)

    def remove_adapter(self, name: str) -> None:
        """Forget an adapter; refused (RequestError) while a request still uses it."""
        with self._lock:
            lora = self.runner.lora
            if lora is None or lora.get(name) is None:
                raise RequestError("adapter", f"model {self.name!r} has no adapter {name!r}")
            busy = self._adapter_users(name)
            if busy:
                raise RequestError("adapter", f"{name!r} still serves {busy} request(s)")
            lora.unregister(name)

    def adapter_users(self, name: str) -> int:
        """Requests running or waiting with this adapter now."""
        with self._lock:
            return self._adapter_users(name)

    def _adapter_users(self, name: str) -> int:
        return sum(1 for seq in self._live.values() if seq.adapter == name)

    def _adapter_salt(self, adapter: str | None) -> int:
        if adapter is None:
            return 0
        found = self.runner.lora.get(adapter) if self.runner.lora is not None else None
        if found is None:
            known = self.runner.lora.names() if self.runner.lora is not None else []
            raise RequestError(
                "adapter", f"model {self.name!r} has no adapter {adapter!r}; known: {known}"
            )
        return found.uid

    def _adapter_ready(self, seq: Sequence) -> bool:
        return self.runner.lora is None or self.runner.lora.is_resident(seq.adapter)

    def _load_adapters(self) -> None:
        """Engine thread, before scheduling: slots for the adapters waiting requests need
        (most urgent first); a request whose adapter cannot be read any more fails."""
        lora = self.runner.lora
        if lora is None:
            return
        wanted = [s.adapter for s in self.scheduler.waiting if s.adapter is not None]
        in_use = {s.adapter for s in self.scheduler.running if s.adapter is not None}
        for name, exc in lora.make_room(wanted, in_use):
            for seq in [s for s in self.scheduler.waiting if s.adapter == name]:
                self._fail(seq, f"adapter {name!r} could not be loaded: {exc}")

    @property
    def idle(self) -> bool:
        """No queued submissions or aborts left to take."""
        with self._lock:
            return not self._inbox and not self._aborts

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id not in self._live:
                return
            self._aborts.add(request_id)
        self.wake()

    # -- the loop's questions ------------------------------------------------------
    def urgency(self, now: float) -> Urgency | None:
        with self._lock:
            pending = list(self._inbox) + ([None] if self._aborts else [])
        if not pending and not self.scheduler.has_work():
            return None
        if not pending and now < self._stalled_until:
            return None
        seqs = (
            [s for s in pending if s is not None]
            + self.scheduler.running
            + self.scheduler.waiting[:1]
        )
        if not seqs:
            return Urgency(False, -math.inf, 0, -now)
        best = min(seqs, key=lambda s: rank(s.priority, self.scheduler.policy))
        return Urgency.of(False, best.priority)

    def next_wakeup(self, now: float) -> float | None:
        return self._stalled_until if self._stalled_until > now else None

    # -- one step --------------------------------------------------------------------
    def step(self) -> None:
        self._take_new_and_aborts()
        self._drop_expired()
        self._load_adapters()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if not sched:
            if self.scheduler.waiting:  # pages are held elsewhere; look again soon
                self._stalled_until = time.monotonic() + _STALL_POLL_S
            return
        self._stalled_until = 0.0
        if self.runner.lora is not None:  # an adapter's rows contiguous: one run each
            slot = self.runner.lora.slot_of
            sched.decodes.sort(key=lambda item: slot(item.seq.adapter))
            sched.prefills.sort(key=lambda item: slot(item.seq.adapter))
        self._note_first_scheduled(sched)
        started = time.perf_counter()
        try:
            inputs = self.runner.prepare(sched)
            logits = self.runner.run(inputs)
            if inputs.scored:
                prompt_logprobs.record(inputs.scored, logits)
                logits = inputs.sampling_logits(logits)
            sampling = [item for item in sched.scheduled if item.samples]
            verdicts = self._sample(logits, sampling)
        except Exception as exc:  # a model failure fails this batch, not the engine
            log.exception("model %s failed a step", self.name)
            for item in sched.scheduled:
                self._fail(item.seq, f"{type(exc).__name__}: {exc}")
            return
        if self.runner.lora is not None:
            self.runner.lora.touch(i.seq.adapter for i in sched.scheduled if i.seq.adapter)
        self.counters.step(sched.num_tokens)
        self._postprocess(sched, sampling, verdicts)
        verifying = sum(1 for item in sched.prefills if item.draft)  # each a decode, plus k
        prompt_tokens = sum(item.num_new for item in sched.prefills) - verifying
        self.scheduler.cost.observe(
            len(sched.decodes) + verifying, prompt_tokens, time.perf_counter() - started
        )

    def _sample(self, logits: torch.Tensor, sampling: list[ScheduledSeq]) -> list[Verdict]:
        """Each sampling sequence's new tokens: one, or its verified proposals and one."""
        seqs = [item.seq for item in sampling]
        if any(item.draft for item in sampling):
            return verify(self.sampler, logits, sampling, self._masks(seqs))
        result = self.sampler(
            logits,
            [s.params for s in seqs],
            [s.token_ids for s in seqs],
            [s.generator for s in seqs],
            self._masks(seqs),
        )
        return verdicts_of(result)

    def _note_first_scheduled(self, sched: SchedulerOutput) -> None:
        now = time.monotonic()
        for item in sched.scheduled:
            if item.seq.first_scheduled is None:
                self.counters.first_scheduled(item.seq, now)

    def _take_new_and_aborts(self) -> None:
        with self._lock:
            new, self._inbox = list(self._inbox), deque()
            aborts, self._aborts = self._aborts, set()
        for seq in new:
            self.scheduler.add(seq)
        for request_id in aborts:
            first = self._live.get(request_id)
            for seq in forks.family(first) if first is not None else ():
                if not seq.finished:
                    self.scheduler.finish(seq, "abort")
                    self._emit(seq)

    def _drop_expired(self) -> None:
        """Work past its deadline (``drop``) ends now as ``deadline``, pages freed."""
        for seq in self.scheduler.expired(time.time()):
            self.scheduler.finish(seq, "deadline")
            self.counters.deadline_drops += 1
            self._emit(seq)

    def grammars(self) -> Grammars:
        """This model's constraint matchers (made at the first constrained request)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise RequestError("constraint", f"model {self.name!r} has no tokenizer")
            vocab = self.model.config.get_text_config().vocab_size
            limit, cache = self._constraint_bytes
            self._grammars = Grammars(self.tokenizer, vocab, self.eos_ids, limit, cache)
        return self._grammars

    def _masks(self, sampling: list[Sequence]) -> tuple[list[int], torch.Tensor] | None:
        rows = [i for i, s in enumerate(sampling) if s.matcher is not None]
        if not rows:
            return None
        return rows, fill_masks([sampling[i].matcher for i in rows], self._grammars.words())

    def _postprocess(
        self, sched: SchedulerOutput, sampling: list[ScheduledSeq], verdicts: list[Verdict]
    ) -> None:
        now = time.monotonic()
        for item in sched.scheduled:
            if item.draft:  # computed once verified, below
                continue
            item.seq.num_computed += item.num_new
            self.scheduler.publish_full_pages(item.seq)
            if item.seq.unforked and item.samples:  # its prompt is computed: fork the rest
                for child in forks.fork(item.seq, self.pool, self.kv.tokens_per_page):
                    self.scheduler.add(child)
        for item, verdict in zip(sampling, verdicts, strict=True):
            seq = item.seq
            if seq.params.scores_prompt_only:  # the prompt is scored: nothing to generate
                self.scheduler.finish(seq, "length")
                self._emit(seq)
                continue
            for token, logprob, top in zip(
                verdict.tokens, verdict.logprobs, verdict.top_logprobs, strict=True
            ):
                seq.output_token_ids.append(token)
                if seq.params.logprobs is not None:
                    seq.logprobs.append(logprob)
                    seq.top_logprobs.append(top)
                self.counters.token(seq, now)
                reason = self.outputs.finish_reason(seq, token)
                if reason is not None:
                    self.scheduler.finish(seq, reason)
                    break
            if item.draft:
                self.speculator.record(seq, len(item.draft), verdict.accepted)
                if not seq.finished:  # every token but the newest has its KV now
                    seq.num_computed = seq.num_tokens - 1
                    self.scheduler.publish_full_pages(seq)
                    self.scheduler.settle(seq)
            self._emit(seq)

    # -- outputs ---------------------------------------------------------------------------
    def _emit(self, seq: Sequence, error: str | None = None) -> None:
        if seq.final_only and not seq.finished:
            return
        out = self.outputs.output(seq, error)
        if seq.finished and self.speculator is not None:
            self.speculator.forget(seq)
        if seq.finished:
            with self._lock:
                first = self._live.get(seq.request_id)
                if first is not None and all(s.finished for s in forks.family(first)):
                    del self._live[seq.request_id]  # every sequence of the request ended
        try:
            seq.sink(out)
        except Exception:  # a caller's callback must not take the engine down
            log.exception("output sink of %s failed", seq.request_id)
        if seq.finished and seq.unforked:  # ended before its prompt was computed
            for child in forks.end_unforked(seq):
                self._emit(child, error)

    def _fail(self, seq: Sequence, message: str) -> None:
        self.scheduler.finish(seq, "error")
        self._emit(seq, error=message)

    def close(self) -> None:
        self._take_new_and_aborts()
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._fail(seq, str(EngineStopped("the engine stopped")))

    # -- accounting ----------------------------------------------------------------------
    def model_stats(self) -> ModelStats:
        """The typed form of ``stats()`` that the layers above read."""
        s = self.stats()
        keys = ("steps", "generated_tokens", "prompt_tokens", "cached_tokens", "preemptions",
                "fragmentation", "deadline_drops")  # fmt: skip
        lora = self.runner.lora
        adapters = {} if lora is None else {
            "adapters": float(len(lora.names())),
            "adapter_slot_bytes": float(lora.slot_bytes()),
            "adapter_loads": float(lora.num_loads),
            "adapter_evictions": float(lora.num_evictions),
        }  # fmt: skip
        spec = {} if self.speculator is None else self.speculator.stats()
        grammars = self._grammars
        constraints = {} if grammars is None else {
            "constraint_cache_bytes": float(grammars.cache_bytes),
            "constraint_cache_entries": float(grammars.cache_entries),
            "constraint_refusals": float(grammars.refusals),
        }  # fmt: skip
        return ModelStats(
            self.name,
            "llm",
            running=s["running"],
            waiting=s["waiting"],
            counters={**{k: float(s[k]) for k in keys}, **adapters, **constraints, **spec},
            windows=self.counters.windows(),
        )

    def stats(self) -> dict:
        sched, counts = self.scheduler, self.counters
        slots = sum(len(s.pages) for s in sched.running) * self.kv.tokens_per_page
        used = sum(s.num_computed for s in sched.running)
        return {
            "kind": "llm",
            "running": len(sched.running),
            "waiting": len(sched.waiting) + len(self._inbox),
            "steps": counts.steps,
            "generated_tokens": counts.generated,
            "prompt_tokens": counts.prompt_tokens,
            "cached_tokens": counts.cached_tokens,
            "preemptions": sched.num_preemptions,
            "deadline_drops": counts.deadline_drops,
            "tokens_per_page": self.kv.tokens_per_page,
            "kv_slots_allocated": slots,
            "kv_slots_used": used,
            "fragmentation": (1 - used / slots) if slots else 0.0,
        }
