"""What a sequence sends back after a step: whether it finished, its text, its output.

The worker appends each sampled token and asks ``Outputs`` whether the sequence ends
there (a constraint completed, a stop token, a stop string, the length limit) and what
to send (a ``RequestOutput`` with the delta since the last one, text that may still
become a stop string held back). ``OutputStream`` carries outputs to asyncio code.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from trae_groups.engine.detokenizer import find_stop, text_decoder, update_text
from trae_groups.engine.loop_post import loop_post
from trae_groups.engine.protocol import TokenLogprob
from trae_groups.engine.sequence import RequestOutput, Sequence


def eos_ids(model, tokenizer) -> set[int]:
    """Every end-of-sequence id the model's generation config, config or tokenizer name."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    return ids


class Outputs:
    """Finish detection, incremental detokenizing and the outputs of one model."""

    def __init__(self, name: str, tokenizer, eos: set[int], max_model_len: int):
        self.name = name
        self.tokenizer = tokenizer
        self._decode = None if tokenizer is None else text_decoder(tokenizer)
        self.eos_ids = eos
        self.max_model_len = max_model_len
        self._texts: dict[int, str] = {}  # each token's own text, as logprobs show it

    def finish_reason(self, seq: Sequence, token: int) -> str | None:
        """After ``token`` was appended: why the sequence ends here, or None."""
        params = seq.params
        decode = self._decode
        if seq.matcher is not None:
            seq.matcher.consume_token(token)
            if seq.matcher.is_stopped() and token not in self.eos_ids:  # complete: no token fits
                if decode is not None:
                    update_text(seq, decode, params.skip_special_tokens, final=True)
                return "stop"
        if token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos):
            if decode is not None:  # the stop token's own text is not part of the reply
                update_text(seq, decode, params.skip_special_tokens, final=True, upto=-1)
            return "stop"
        if decode is not None:
            searched = len(seq.text)
            update_text(seq, decode, params.skip_special_tokens)
            cut = find_stop(seq.text, params.stop, searched)
            if cut is not None:
                seq.text = seq.text[:cut]
                return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            if decode is not None:
                update_text(seq, decode, params.skip_special_tokens, final=True)
            return "length"
        return None

    def output(self, seq: Sequence, error: str | None = None) -> RequestOutput:
        """The sequence's output now, with what is new since the last one (which it
        marks as sent)."""
        text_ready = len(seq.text)
        if not seq.finished and seq.params.stop:  # hold back what may become a stop string
            text_ready -= max(len(s) for s in seq.params.stop) - 1
        text_ready = max(text_ready, seq.sent_text_len)
        out = RequestOutput(
            request_id=seq.request_id,
            model=self.name,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=seq.text if seq.finished else seq.text[:text_ready],
            delta_text=seq.text[seq.sent_text_len : len(seq.text) if seq.finished else text_ready],
            delta_token_ids=seq.output_token_ids[seq.sent_tokens :],
            finished=seq.finished,
            finish_reason=seq.stop_reason if seq.finished else None,
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            top_logprobs=list(seq.top_logprobs) if seq.params.logprobs is not None else None,
            num_cached_tokens=seq.num_cached_tokens,
            error=error,
            metrics={
                "preemptions": seq.preemptions,
                "arrival": seq.arrival,
                "first_token_time": seq.first_token_time,
                "first_scheduled": seq.first_scheduled,
                "last_token_time": seq.last_token_time,
            },
            delta_logprobs=self._delta_logprobs(seq),
            index=seq.index,
            prompt_logprobs=self._prompt_logprobs(seq),
        )
        seq.sent_text_len = len(seq.text) if seq.finished else text_ready
        seq.sent_tokens = len(seq.output_token_ids)
        return out

    def token_text(self, token: int) -> str:
        """One token's own text (special tokens included; a token that is part of a
        character shows U+FFFD), or "" without a tokenizer."""
        text = self._texts.get(token)
        if text is None:
            tokenizer = self.tokenizer
            text = "" if tokenizer is None else tokenizer.decode([token])
            self._texts[token] = text
        return text

    def _entry(self, token: int, logprob: float | None, top: dict[int, float]) -> TokenLogprob:
        alternatives = tuple((t, self.token_text(t), lp) for t, lp in top.items())
        return TokenLogprob(token, self.token_text(token), logprob, alternatives)

    def _delta_logprobs(self, seq: Sequence) -> list[TokenLogprob] | None:
        if seq.params.logprobs is None:
            return None
        new = slice(seq.sent_tokens, len(seq.logprobs))
        return [
            self._entry(t, lp, top)
            for t, lp, top in zip(
                seq.output_token_ids[new], seq.logprobs[new], seq.top_logprobs[new], strict=True
            )
        ]

    def _prompt_logprobs(self, seq: Sequence) -> list[TokenLogprob] | None:
        """The prompt's scores, in the first output after they are complete."""
        if seq.params.prompt_logprobs is None or seq.prompt_logprobs_sent:
            return None
        if not seq.prompt_scored:
            return None
        seq.prompt_logprobs_sent = True
        first, *rest = seq.prompt_token_ids
        scores = zip(rest, seq.prompt_logprobs, strict=True)
        return [self._entry(first, None, {})] + [self._entry(t, lp, top) for t, (lp, top) in scores]


class OutputStream:
    """Async iterator over one request's outputs (of each of its ``sequences``: it ends
    when all have finished); closing it early aborts the request (``abort(request_id)``:
    the engine's, or the one worker's that holds it)."""

    def __init__(
        self, abort: Callable[[str], None], loop: asyncio.AbstractEventLoop, sequences: int = 1
    ):
        self._abort = abort
        self._post = loop_post(loop).post  # one wake-up of the loop per step, not per output
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.request_id = ""
        self.finished = False
        self._running = sequences

    def put(self, out: RequestOutput) -> None:  # engine thread
        self._post(self._queue.put_nowait, out)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                out = await self._queue.get()
                self._running -= out.finished
                self.finished = self._running == 0
                yield out
        finally:
            self.abort()

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)

    async def final(self) -> RequestOutput:
        """Consume the stream; the last output."""
        last = None
        async for out in self:
            last = out
        return last
