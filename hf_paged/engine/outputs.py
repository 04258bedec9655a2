"""Request outputs, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

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

    @property
    def finished(self) -> bool:
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


@dataclass
class RequestOutput:
    """What a request has produced so far (all of it, not a delta)."""

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
