"""Request outputs, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

REJECTED = "rejected"  # RequestOutput.error_kind: the request can never be served by this engine
FAULT = "fault"  # RequestOutput.error_kind: the engine failed while serving the request


class CompletionOutput:
    """One completion of a request (one of its ``n`` samples or beams).

    ``text`` may be given as a function that decodes it (``decode``): the engine hands outputs out
    every step, and decoding every running sequence's whole text there would cost the engine thread
    O(length) per token for text most readers never look at (the server detokenizes incrementally on
    its own threads). The first read of ``text`` decodes, on the reader's thread, once."""

    __slots__ = ("index", "token_ids", "_text", "_decode", "finish_reason", "cumulative_logprob", "logprobs")

    def __init__(self, index: int, token_ids: list[int], text: str = "", finish_reason: str | None = None,
                 cumulative_logprob: float | None = None, logprobs: list[dict[int, float]] | None = None, *,
                 decode: Callable[[], str] | None = None):
        self.index, self.token_ids, self.finish_reason = index, token_ids, finish_reason
        self.cumulative_logprob, self.logprobs = cumulative_logprob, logprobs
        self._text, self._decode = text, decode

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
    def __getstate__(self) -> tuple:
        pending = self._decode is not None
        return (self.index, self.token_ids, None if pending else self._text, self.finish_reason,
                self.cumulative_logprob, self.logprobs)

    def __setstate__(self, state: tuple) -> None:
        self.index, self.token_ids, self._text, self.finish_reason, self.cumulative_logprob, self.logprobs = state
        self._decode = None

    @property
    def needs_decoder(self) -> bool:
        """Its text was left undecoded where it was made (see ``set_decoder``)."""
        return self._text is None and self._decode is None

    def set_decoder(self, decode: Callable[[list[int]], str]) -> None:
        """How to decode the text on first read: ``decode(token_ids)``."""
        token_ids = self.token_ids
        self._decode = lambda: decode(token_ids)

    def _fields(self) -> tuple:
        return (self.index, self.token_ids, self.text, self.finish_reason, self.cumulative_logprob, self.logprobs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CompletionOutput) and self._fields() == other._fields()

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, token_ids={self.token_ids}, text={self.text!r}, "
                f"finish_reason={self.finish_reason!r}, cumulative_logprob={self.cumulative_logprob}, "
                f"logprobs={self.logprobs})")


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
