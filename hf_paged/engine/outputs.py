"""Request outputs, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field

REJECTED = "rejected"  # RequestOutput.error_kind: the request can never be served by this engine
FAULT = "fault"  # RequestOutput.error_kind: the engine failed while serving the request


@dataclass
class CompletionOutput:
    """One completion of a request (one of its ``n`` samples or beams)."""

    index: int
    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
