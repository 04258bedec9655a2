"""Request outputs, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

REJECTED = "rejected"  # RequestOutput.error_kind: the request can never be served by this engine
FAULT = "fault"  # RequestOutput.error_kind: the engine failed while serving the request


class Logprob(float):
    """One entry of ``CompletionOutput.logprobs``: vLLM's ``Logprob`` (``.logprob``, ``.rank``,
    ``.decoded_token``) that is still the float the entries were, so code that compares, sums or
    JSON-encodes them works unchanged. ``rank``: the token's 1-based rank in the distribution the
    log-probs were taken from. ``decoded_token``: the token decoded alone, decoded on first read
    (most readers never look) by ``texts(token)``; None without a tokenizer. A pickled one keeps
    the text it has (given or read) and decodes nothing (outputs cross to the server's process
    that way: it has its own tokenizer)."""

    __slots__ = ("rank", "_text", "_token", "_texts")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None, *,
                token: int | None = None, texts: Callable[[int], str] | None = None) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank, self._text, self._token, self._texts = rank, decoded_token, token, texts
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    @property
    def decoded_token(self) -> str | None:
        if self._texts is not None:
            self._text, self._texts = self._texts(self._token), None
        return self._text

    def __reduce__(self) -> tuple:
        return Logprob, (float(self), self.rank, self._text)

    __str__ = float.__repr__  # f-strings and str() print the number, as they did

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank}, decoded_token={self.decoded_token!r})"


def request_failure(output: RequestOutput) -> Exception:
    """What a reader of a request's outputs as they come (``stream()``, ``AsyncLLM.generate``)
    raises when the request failed: ``ValueError`` when it can never be served here, else
    ``RuntimeError`` (the engine failed while serving it)."""
    kind = ValueError if output.error_kind == REJECTED else RuntimeError
    return kind(f"request {output.request_id} failed: {output.error}")


def ended_by_token(finish_reason: str | None, stop_reason: str | int | None) -> bool:
    """Whether an output's last token ended it (EOS or a stop token, not a stop string): vLLM
    leaves that token's text out of ``text`` (its id stays in ``token_ids``)."""
    return finish_reason == "stop" and not isinstance(stop_reason, str)


class CompletionOutput:
    """One completion of a request (one of its ``n`` samples or beams).

    ``text`` may be given as a function that decodes it (``decode``): the engine hands outputs out
    every step, and decoding every running sequence's whole text there would cost the engine thread
    O(length) per token for text most readers never look at (the server detokenizes incrementally on
    its own threads). The first read of ``text`` decodes, on the reader's thread, once.

    ``stop_reason`` (vLLM's): the stop string or stop token id that ended it; None for EOS, length
    or while unfinished."""

    __slots__ = ("index", "token_ids", "_text", "_decode", "finish_reason", "cumulative_logprob", "_logprobs",
                 "_packed", "stop_reason")

    def __init__(self, index: int, token_ids: list[int], text: str = "", finish_reason: str | None = None,
                 cumulative_logprob: float | None = None, logprobs: list[dict[int, Logprob]] | None = None, *,
                 decode: Callable[[], str] | None = None, stop_reason: str | int | None = None):
        self.index, self.token_ids, self.finish_reason = index, token_ids, finish_reason
        self.cumulative_logprob, self.stop_reason = cumulative_logprob, stop_reason
        self._logprobs, self._packed, self._text, self._decode = logprobs, None, text, decode

    @property
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        if self._packed is not None:  # unpickled: built on first read (most outputs of a step are never read)
            self._logprobs, self._packed = _unpack(self._packed), None
        return self._logprobs

    @logprobs.setter
    def logprobs(self, value: list[dict[int, Logprob]] | None) -> None:
        self._logprobs, self._packed = value, None

    @property
    def text(self) -> str:
        if self._decode is not None:
            self._text, self._decode = self._decode(), None
        if self._text is None:
            raise RuntimeError("this output's text was not decoded where it was made, and no decoder was set")
        return self._text

    @text.setter
    def text(self, value: str) -> None:
        self._text, self._decode = value, None

    # vLLM's CompletionOutput fields for features not built here, at vLLM's value without them (class
    # attributes: nothing per output, and __slots__ leave them read-only)
    lora_request = None
    routed_experts = None
    sampling_mask = None
    spec_decode_metrics = None

    def finished(self) -> bool:
        """Whether it has ended (vLLM's method; ``RequestOutput.finished`` is an attribute)."""
        return self.finish_reason is not None

    # Pickled (to the server's process from an engine process: serve/engine_process.py) without the
    # decoding function: the receiver attaches its own with ``set_decoder`` (its tokenizer).
    # Log-probs go as flat lists of numbers, rebuilt on first read: a Logprob object pickles and
    # loads ~10x slower than a float, and every output carries every past token's, every step.
    def __getstate__(self) -> tuple:
        pending = self._decode is not None
        packed = self._packed if self._packed is not None else _pack(self._logprobs)
        return (self.index, self.token_ids, None if pending else self._text, self.finish_reason,
                self.cumulative_logprob, packed, self.stop_reason)

    def __setstate__(self, state: tuple) -> None:
        self.index, self.token_ids, self._text, self.finish_reason, self.cumulative_logprob, self._packed, \
            self.stop_reason = state
        self._logprobs, self._decode = None, None

    @property
    def needs_decoder(self) -> bool:
        """Its text was left undecoded where it was made (see ``set_decoder``)."""
        return self._text is None and self._decode is None

    def set_decoder(self, decode: Callable[[list[int]], str]) -> None:
        """How to decode the text on first read: ``decode(token_ids)``."""
        token_ids = self.token_ids[:-1] if ended_by_token(self.finish_reason, self.stop_reason) else self.token_ids
        self._decode = lambda: decode(token_ids)

    def _fields(self) -> tuple:
        return (self.index, self.token_ids, self.text, self.finish_reason, self.cumulative_logprob, self.logprobs,
                self.stop_reason)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CompletionOutput) and self._fields() == other._fields()

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, token_ids={self.token_ids}, text={self.text!r}, "
                f"finish_reason={self.finish_reason!r}, stop_reason={self.stop_reason!r}, "
                f"cumulative_logprob={self.cumulative_logprob}, logprobs={self.logprobs})")


def _pack(logprobs: list[dict[int, float]] | None) -> tuple | None:
    """Log-prob entries as flat lists: sizes, token ids, values, ranks, texts (None where not read)."""
    if logprobs is None:
        return None
    sizes, ids, entries = [len(entry) for entry in logprobs], [], []
    for entry in logprobs:
        ids += entry
        entries += entry.values()
    ranks = [getattr(e, "rank", None) for e in entries]
    return sizes, ids, list(map(float, entries)), ranks, [getattr(e, "_text", None) for e in entries]


def _unpack(packed: tuple) -> list[dict[int, Logprob]]:
    sizes, ids, values, ranks, texts = packed
    entries = iter(zip(ids, map(Logprob, values, ranks, texts)))
    return [dict(itertools.islice(entries, size)) for size in sizes]


class PromptLogprobs:
    """A request's prompt log-probs (vLLM's ``RequestOutput.prompt_logprobs``) as the engine fills
    them, one prefill chunk at a time.

    Row ``i`` scores prompt token ``i + 1`` under the model given the tokens before it: that token's
    id, log-prob and rank, then the ``k`` most likely tokens' ids and log-probs (ranks 1..k). They
    stay in flat typed arrays (float32 as computed, no Python object per entry) until the prompt is
    all scored; then :meth:`output` builds vLLM's list once, which every later output of the request
    shares (as vLLM's outputs share theirs). ``texts``: the engine's ``Logprob.decoded_token``
    decoder."""

    __slots__ = ("num_prompt_tokens", "k", "ids", "values", "ranks", "texts", "_list")

    def __init__(self, num_prompt_tokens: int, k: int):
        self.num_prompt_tokens, self.k = num_prompt_tokens, k
        self.ids = array("i")  # k + 1 per row: the prompt token, then the top k
        self.values = array("f")  # their log-probs, as ids
        self.ranks = array("i")  # one per row: the prompt token's rank
        self.texts: Callable[[int], str] | None = None
        self._list: PromptLogprobsList | None = None

    @property
    def num_rows(self) -> int:
        """Prompt positions scored so far (positions 0 .. num_rows - 1: tokens 1 .. num_rows)."""
        return len(self.ranks)

    @property
    def complete(self) -> bool:
        return self.num_rows >= self.num_prompt_tokens - 1

    def add_rows(self, first: int, ids, values, ranks) -> None:
        """Add the rows of positions ``first ..`` (buffers: int32 ``ids`` and float32 ``values``, k + 1
        per row, int32 ``ranks``, one per row). Rows come in order, each once: a preempted request
        recomputes its prompt without scoring it again."""
        if first != self.num_rows:
            raise RuntimeError(f"prompt log-prob rows from position {first}, but {self.num_rows} are in")
        for into, buffer in ((self.ids, ids), (self.values, values), (self.ranks, ranks)):
            into.frombytes(memoryview(buffer).cast("B"))

    def output(self) -> list[dict[int, Logprob] | None]:
        """What an output carries: vLLM's list once every prompt position is scored (built here,
        once); before that ``[None]`` (the first position's entry), as vLLM's outputs have it until
        the prompt's last chunk."""
        if self._list is None:
            if not self.complete:
                return [None]
            self._list = PromptLogprobsList.build(self.k, self.ids, self.values, self.ranks, self.texts)
        return self._list


class PromptLogprobsList(list):
    """vLLM's prompt log-probs list: ``None`` for the first prompt token, then one ``{token id:
    Logprob}`` per token: the prompt token (its rank) and the ``k`` most likely ones (ranks 1..k; a
    prompt token among them keeps the entry of its place there, as vLLM's dict does).

    A plain list to its readers. It pickles as the flat arrays it was built from (a few byte strings
    instead of an object per entry: outputs cross to the server's process every step), so a pickled
    copy has the engine's numbers, ranks and no ``decoded_token`` texts (the receiver has its own
    tokenizer); a list changed in length after it was built pickles as a plain list."""

    __slots__ = ("_arrays",)

    @classmethod
    def build(cls, k: int, ids: array, values: array, ranks: array,
              texts: Callable[[int], str] | None = None) -> PromptLogprobsList:
        width, top_ranks = k + 1, range(1, k + 1)
        flat_ids, flat_values = ids.tolist(), values.tolist()
        rows = cls([None])
        for row, rank in enumerate(ranks.tolist()):
            lo = row * width
            rows.append({t: Logprob(v, r, token=t, texts=texts) for t, v, r in
                         zip(flat_ids[lo : lo + width], flat_values[lo : lo + width],
                             itertools.chain((rank,), top_ranks))})
        rows._arrays = (k, ids, values, ranks)
        return rows

    def __reduce__(self) -> tuple:
        if len(self) != len(self._arrays[3]) + 1:
            return list, (list(self),)
        return PromptLogprobsList.build, self._arrays


@dataclass
class RequestOutput:
    """What a request has produced so far (all of it, not a delta).

    ``prompt_logprobs`` (vLLM's): None unless the request asked for them
    (``SamplingParams.prompt_logprobs``); then one entry per prompt token, the first None, each other
    ``{token id: Logprob}`` (the prompt token with its rank, and the most likely ones), complete from
    the output that carries the first generated token on (``[None]`` while the prompt is prefilled).
    ``num_cached_tokens`` (vLLM's): prompt tokens whose K/V came from the prefix cache when the
    request was first scheduled (0 when nothing hit, prefix caching is off, or the request asked
    for prompt log-probs, which skip reading the cache)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    prompt: str | None = None
    error: str | None = None  # set when the request was refused or failed
    # why ``error`` is set: "rejected" (the request can never be served here: bad parameters or a
    # prompt, or it needs more KV blocks than the cache has) or "fault" (the engine failed while
    # serving it: its step raised, or the model produced non-finite logits for it); None otherwise
    error_kind: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int | None = None
    lora_request: Any = None  # vLLM's: the request's LoRARequest (None: the base model)
    # vLLM's RequestOutput attributes for features not built here, at vLLM's offline value without them
    # (class attributes, not fields: an output is made per request every step). ``metrics``: vLLM's
    # offline LLM collects none either; ``num_cache_creation_tokens``: not counted here (vLLM counts
    # the prompt tokens a request wrote to its prefix cache).
    metrics: ClassVar[None] = None
    encoder_prompt: ClassVar[None] = None  # decoder-only models
    encoder_prompt_token_ids: ClassVar[None] = None
    num_cache_creation_tokens: ClassVar[None] = None
    prompt_token_id_logprobs: ClassVar[None] = None  # no SamplingParams.prompt_logprob_token_ids here
    kv_transfer_params: ClassVar[None] = None
    ec_transfer_params: ClassVar[None] = None

    @property
    def has_whole_prompt_logprobs(self) -> bool:
        """Whether ``prompt_logprobs`` holds every prompt token's: the prompt was prefilled (the
        output has a token, or is finished)."""
        return self.prompt_logprobs is not None and (self.finished or any(c.token_ids for c in self.outputs))
