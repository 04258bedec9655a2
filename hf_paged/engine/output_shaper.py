"""What ``step()`` hands out of a request's outputs: vLLM's ``output_kind`` and ``stream_interval``.

The engine makes a request's whole output (everything so far) every step it changes; vLLM's
``SamplingParams`` can ask for less: ``DELTA`` (only what is new: token ids, text, log-probs since
the last output, prompt log-probs once), ``FINAL_ONLY`` (nothing until it finishes), and a
``stream_interval`` of ``k`` (an output once ``k`` new tokens are in, besides the first and the
last). :class:`OutputShaper` keeps what one request has been sent and cuts each output to that.
``stream()`` reads its deltas through one as well.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from hf_paged.engine.detokenize import TextStream, TokenStream
from hf_paged.engine.outputs import CompletionOutput, RequestOutput
from hf_paged.engine.params import RequestOutputKind

if TYPE_CHECKING:
    from hf_paged.engine.params import SamplingParams


def shapes_outputs(params: SamplingParams) -> bool:
    """Whether ``params`` ask ``step()`` for anything but every step's whole output."""
    return params.output_kind is not RequestOutputKind.CUMULATIVE or (params.stream_interval or 1) > 1


class OutputShaper:
    """One request's outputs as its ``SamplingParams`` ask (see the module docstring).

    A delta's text is what the request's text grew by: a character split over tokens goes out
    whole, and what may begin a stop string is held back until it does not, so the deltas add up
    to the final text. A completion that finished is not sent again; one with nothing new (held
    back by ``stream_interval``) is left out of the output; an output with nothing in it is not
    sent at all. A beam search's beams change until it ends: it sends nothing before, then its
    ``n`` best beams whole (``SamplingParams`` refuses ``DELTA`` with it; ``stream()`` asks)."""

    def __init__(self, params: SamplingParams, tokenizer: Any, prompt_token_ids: list[int],
                 kind: RequestOutputKind | None = None):
        self.kind = params.output_kind if kind is None else kind
        # beams change until the search ends: no deltas of them before
        self._final_only = self.kind is RequestOutputKind.FINAL_ONLY or (
            self.kind is RequestOutputKind.DELTA and params.beam_search)
        self.interval = params.stream_interval or 1
        self._params, self._tokenizer, self._prompt_token_ids = params, tokenizer, prompt_token_ids
        self._streams: dict[int, TextStream | TokenStream] = {}  # per completion index: what it was sent
        self._sent_tokens: dict[int, int] = {}
        self._sent_finished: set[int] = set()
        self._sent_prompt_logprobs = False

    def shape(self, out: RequestOutput) -> RequestOutput | None:
        """What to hand out of ``out`` (the request's whole output now); None: nothing this step."""
        if self._final_only and not out.finished:
            return None
        if self.kind is RequestOutputKind.FINAL_ONLY:
            return out
        due = [c for c in out.outputs if self._due(c)]
        for c in due:
            self._sent_tokens[c.index] = len(c.token_ids)
            if c.finished():
                self._sent_finished.add(c.index)
        if self.kind is RequestOutputKind.CUMULATIVE:
            return out if due or out.finished else None
        deltas = [self._delta(c) for c in due]
        prompt_logprobs = None
        if not self._sent_prompt_logprobs and out.has_whole_prompt_logprobs:
            prompt_logprobs, self._sent_prompt_logprobs = out.prompt_logprobs, True
        if not deltas and prompt_logprobs is None and not out.finished:
            return None
        shaped = copy.copy(out)  # a dataclass: copy.copy is several times faster than dataclasses.replace
        shaped.outputs, shaped.prompt_logprobs = deltas, prompt_logprobs
        return shaped

    def _due(self, c: CompletionOutput) -> bool:
        """Whether completion ``c`` goes out now: it finished (and was not sent finished yet), or
        it has new tokens and is sending its first or has ``stream_interval`` of them."""
        if c.index in self._sent_finished:
            return False
        sent = self._sent_tokens.get(c.index, 0)
        new = len(c.token_ids) - sent
        return c.finished() or (new > 0 and (sent == 0 or new >= self.interval))

    def _delta(self, c: CompletionOutput) -> CompletionOutput:
        """What completion ``c`` (due: new tokens, or finished) adds to what it was sent."""
        if c.index not in self._streams:
            self._streams[c.index] = TextStream.of(self._tokenizer, self._params, self._prompt_token_ids)
        text, new_ids = self._streams[c.index].update(c)
        logprobs = c.logprobs
        if logprobs is not None:
            logprobs = logprobs[len(logprobs) - len(new_ids):]
        return CompletionOutput(c.index, new_ids, text, c.finish_reason, c.cumulative_logprob, logprobs,
                                stop_reason=c.stop_reason)
