"""OpenAI request bodies as pydantic models, and how each option maps onto ``SamplingParams``.

Every option is honoured or refused with a 400 that names it; none is silently ignored. Beyond
OpenAI's fields the requests take vLLM's extensions: ``top_k``, ``min_p``,
``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``, beam search
(``use_beam_search`` with ``best_of`` beams, ``length_penalty``, ``early_stopping``) and
``return_token_ids`` (token ids in every choice or chunk).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hf_paged.engine.params import SamplingParams

MAX_STOP_STRINGS = 16
MAX_PROMPTS = 64  # prompts in one completions request

# SamplingParams field -> the request field that sets it (for error messages)
_API_NAME = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "num_beams": "best_of"}


class APIError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


@dataclass(frozen=True)
class Limits:
    """What this server allows, and what the model and KV cache can hold."""

    max_n: int = 16
    max_tokens: int = 4096  # the most a request may ask for
    max_logprobs: int = 20
    vocab_size: int | None = None
    context: int | None = None  # the model's positions
    kv_tokens: int | None = None  # a fixed KV budget, in tokens of one sequence (None: the pool grows)


def parse(model: type[BaseModel], data: Any) -> BaseModel:
    """Validate a decoded JSON body; a bad field gives a 400 naming it."""
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_request")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        param = _param(first["loc"], first["type"] == "extra_forbidden")
        message = "unknown parameter" if first["type"] == "extra_forbidden" else first["msg"]
        raise invalid(param, f"{param}: {message}") from None


def _param(loc: tuple, unknown: bool) -> str | None:
    """The field a validation error is about: its path up to a union's branch label (``content.str``
    is about ``content``); an unknown field names itself."""
    parts = []
    for i, part in enumerate(loc):
        if isinstance(part, str) and part not in _field_names() and not (unknown and i == len(loc) - 1):
            break
        parts.append(str(part))
    return ".".join(parts) or None


@functools.cache
def _field_names() -> set[str]:
    models = (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, StreamOptions)
    return {name for model in models for name in model.model_fields}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    """Fields completions and chat share. ``None`` means "not set" (so beam search can refuse what
    it would not apply)."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id: accepted, used for nothing
    # vLLM's extensions
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    use_beam_search: bool = False
    best_of: int | None = Field(None, ge=1)
    length_penalty: float = 1.0
    early_stopping: bool = False
    return_token_ids: bool = False

    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS or not all(stop):
            raise invalid("stop", f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")
        return stop

    def check(self, limits: Limits) -> None:
        """The request on its own (before its prompt is known): options and server limits."""
        if self.n > limits.max_n:
            raise invalid("n", f"n must be at most {limits.max_n} on this server, got {self.n}")
        if self.max_tokens is not None and self.max_tokens > limits.max_tokens:
            raise invalid("max_tokens", f"max_tokens must be at most {limits.max_tokens} on this server, "
                                        f"got {self.max_tokens}")
        if self.logit_bias:
            raise invalid("logit_bias", "logit_bias is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options", "stream_options is only allowed when stream is true")
        if limits.vocab_size is not None and any(not 0 <= t < limits.vocab_size for t in self.stop_token_ids or []):
            raise invalid("stop_token_ids", f"stop_token_ids must be token ids below {limits.vocab_size}")
        self.stop_strings()
        if self.use_beam_search:
            self._check_beam_search()
        elif self.best_of is not None and self.best_of != self.n:
            raise invalid("best_of", "best_of other than n needs use_beam_search (sampled best_of is not built)")

    def _check_beam_search(self) -> None:
        if self.stream:
            raise invalid("stream", "use_beam_search cannot stream (beams change until the search ends)")
        unused = {"temperature": self.temperature not in (None, 0), "top_p": self.top_p not in (None, 1),
                  "top_k": self.top_k not in (None, 0, -1), "min_p": self.min_p not in (None, 0),
                  "presence_penalty": self.presence_penalty not in (None, 0),
                  "frequency_penalty": self.frequency_penalty not in (None, 0),
                  "repetition_penalty": self.repetition_penalty not in (None, 1), "seed": self.seed is not None,
                  "stop": bool(self.stop), "stop_token_ids": bool(self.stop_token_ids),
                  "logprobs": self.num_logprobs() is not None}
        for name, is_set in unused.items():
            if is_set:
                raise invalid(name, f"{name} does not apply to beam search (use_beam_search)")
        if self.n > (self.best_of or self.n):
            raise invalid("n", "n must not exceed best_of (the beam width)")

    def num_logprobs(self) -> int | None:
        """Top log-probs per token the engine must report (None: no logprobs)."""
        raise NotImplementedError

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's parameters for this request (``max_tokens`` already resolved)."""
        common = dict(max_new_tokens=max_tokens, min_new_tokens=self.min_tokens, n=self.n, ignore_eos=self.ignore_eos)
        try:
            if self.use_beam_search:
                return SamplingParams(**common, temperature=0, num_beams=self.best_of or self.n,
                                      length_penalty=self.length_penalty, early_stopping=self.early_stopping)
            return SamplingParams(
                **common, temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                min_p=self.min_p or 0.0, repetition_penalty=1.0 if self.repetition_penalty is None
                else self.repetition_penalty, presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0, seed=self.seed,
                stop_token_ids=list(self.stop_token_ids or []), stop=self.stop_strings(), logprobs=self.num_logprobs(),
            )
        except ValueError as err:  # "SamplingParams.<field> ...": name the request's field
            field = str(err).split(" ", 1)[0].removeprefix("SamplingParams.")
            raise invalid(_API_NAME.get(field, field), str(err).replace("SamplingParams.", "")) from None


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    suffix: str | None = None

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def check(self, limits: Limits) -> None:
        super().check(limits)
        if self.logprobs is not None and self.logprobs > limits.max_logprobs:
            raise invalid("logprobs", f"logprobs must be at most {limits.max_logprobs}")
        if self.echo and self.logprobs is not None:
            raise invalid("echo", "echo with logprobs needs prompt log-probabilities, which are not built")
        if self.suffix:
            raise invalid("suffix", "suffix (insertion) is not supported by this server")

    def prompts(self) -> list[str | list[int]]:
        """One prompt (text or token ids) per engine request."""
        p = self.prompt
        prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not prompts or any(len(x) == 0 for x in prompts):
            raise invalid("prompt", "prompt must not be empty")
        if len(prompts) > MAX_PROMPTS:
            raise invalid("prompt", f"at most {MAX_PROMPTS} prompts per request")
        return prompts


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: list | None = None
    tool_choice: Any = None
    response_format: dict | None = None

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check(self, limits: Limits) -> None:
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        super().check(limits)
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
        if (self.top_logprobs or 0) > limits.max_logprobs:
            raise invalid("top_logprobs", f"top_logprobs must be at most {limits.max_logprobs}")
        for name in ("tools", "tool_choice", "response_format"):
            if getattr(self, name) not in (None, [], "none"):
                raise invalid(name, f"{name} is not supported by this server")

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def resolve_max_tokens(requested: int | None, default: int | None, prompt_len: int, limits: Limits,
                       prompt_param: str) -> int:
    """The request's ``max_tokens``, checked against the model's positions and the KV budget.
    ``default=None``: as many as fit (chat's default)."""
    room = [x - prompt_len for x in (limits.context, limits.kv_tokens) if x is not None]
    where = "the model's context" if limits.context is not None and room and room[0] == min(room) else "the KV cache"
    if room and min(room) < 1:
        raise invalid(prompt_param, f"the prompt ({prompt_len} tokens) leaves no room in {where} "
                                    f"({prompt_len + min(room)} tokens)")
    if requested is None:
        requested = default if default is not None else min([limits.max_tokens, *room])
    if room and requested > min(room):
        raise invalid("max_tokens", f"{prompt_len} prompt tokens plus max_tokens={requested} exceed {where} "
                                    f"({prompt_len + min(room)} tokens)")
    return requested
