"""OpenAI request bodies as pydantic models, and how each option maps onto ``SamplingParams``.

Every option is honoured or refused with a 400 that names it; none is silently ignored. Beyond
OpenAI's fields the requests take vLLM's extensions: ``top_k``, ``min_p``,
``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``, ``allowed_token_ids``
(token ids below the vocabulary: only they may be generated), ``bad_words`` (strings never
generated), beam search (``use_beam_search`` with ``best_of`` beams, ``length_penalty``,
``early_stopping``, ``repetition_penalty``, ``stop_token_ids``), the text options
``include_stop_str_in_output`` (the stop string that ended a choice stays in its text),
``skip_special_tokens`` and ``spaces_between_special_tokens`` (special tokens in the text, and how
consecutive ones are joined; beam search too), ``return_token_ids`` (token ids in every choice
or chunk), ``return_tokens_as_token_ids`` (log-probs' tokens read ``token_id:<id>``),
``truncate_prompt_tokens`` with ``truncation_side`` (the prompt served is its last, or first,
``k`` tokens), ``stream_options.continuous_usage_stats`` (usage so far in every chunk), ``model``
left out (the served one), and in chat the chat-template fields of :class:`ChatTemplateFields`.
The bodies of vLLM's ``/tokenize`` and ``/detokenize``, and of its LoRA routes
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, are here too.

Structured outputs: OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``, and
vLLM's ``structural_tag``: ``format``, or the older ``structures`` with ``triggers``),
vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``,
``structural_tag``, ``disable_any_whitespace``) and its older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` (at most one of them per request), ``logit_bias`` and, in
chat, ``tools`` with ``tool_choice`` and ``parallel_tool_calls`` (:mod:`hf_paged.serve.tools`). A
constraint is built and checked here (a 400 names the field that holds it); it compiles in the
handler before the request is queued.

A body is checked before the models see it (:func:`decode_body`): JSON nested deeper than
``MAX_JSON_DEPTH`` and strings that are not valid Unicode (a lone surrogate, from ``"\\ud800"`` or
the raw bytes ``ED A0 80``) are a 400 naming where they are. ``null`` means "not set" for every
optional field (as the ``openai`` package types them), OpenAI's own fields this server does not
implement included; a value for one of those is a 400 naming it. Numeric ranges are
``SamplingParams``' own (one validation for the engine and the server); the models check types,
strictly (a JSON string is not a number, ``true`` is not ``1``: a quietly converted value would
serve something the client did not ask for).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from hf_paged.constraints.params import StructuredOutputsParams
from hf_paged.engine.params import LOGIT_BIAS_RANGE, SamplingParams
from hf_paged.serve import tools as tool_calling

MAX_STOP_STRINGS = 16
MAX_PROMPTS = 64  # prompts in one completions request
MAX_JSON_DEPTH = 32  # nesting of arrays and objects in a request body
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]

# OpenAI's request fields this server does not implement: null is accepted (not set), and so is a
# value that asks for what the server does anyway (SDKs send some explicitly: ``store: false``, a
# reply's ``annotations: []`` sent back); any other value is a 400 naming the field.
OPENAI_UNSUPPORTED = {
    "completion": frozenset(),
    "chat": frozenset({"audio", "modalities", "moderation", "prediction", "prompt_cache_key",
                       "prompt_cache_options", "prompt_cache_retention", "reasoning_effort", "safety_identifier",
                       "service_tier", "store", "verbosity", "web_search_options", "functions", "function_call"}),
    "message": frozenset({"refusal", "audio", "function_call", "annotations"}),
}
OPENAI_NO_OP = {"store": (False,), "service_tier": ("auto", "default"), "modalities": (["text"],),
                "annotations": ([],)}
_SURROGATE = re.compile("[\ud800-\udfff]")

# SamplingParams field -> the request field that sets it (for error messages)
_API_NAME = {"min_new_tokens": "min_tokens", "num_beams": "best_of"}


class APIError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def invalid(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


@dataclass(frozen=True)
class Limits:
    """What this server allows, and what the model and KV cache can hold."""

    max_n: int = 16
    max_tokens: int = 4096  # the most a request may ask for
    max_logprobs: int = 20  # the most top log-probs a request may ask for (-1 asks for the vocabulary)
    vocab_size: int | None = None
    context: int | None = None  # the model's positions
    kv_tokens: int | None = None  # a fixed KV budget, in tokens of one sequence (None: the pool grows)
    kv_block_size: int = 1  # its blocks' size (samples share the prompt's full blocks, not its partial last one)
    scheduling_policy: str = "fcfs"  # the engine's: "priority" honours a request's priority


def checked_logprobs(name: str, value: int, limits: Limits) -> int:
    """A request's count of top log-probs, -1 read as the whole vocabulary (vLLM's), within the
    server's ``--max-logprobs``."""
    asked = limits.vocab_size if value == -1 and limits.vocab_size is not None else value
    if asked > limits.max_logprobs:
        raise invalid(name, f"{name} must be at most {limits.max_logprobs} on this server (--max-logprobs), got "
                            f"{value}" + (" (the whole vocabulary)" if value == -1 else ""))
    return asked


def decode_body(body: bytes) -> Any:
    """The JSON value of a request body, checked for depth and valid Unicode (400s name where)."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise invalid(None, f"the request body nests arrays or objects deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}", code="invalid_json") from None
    check_json(data)
    return data


def check_json(data: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Refuse nesting deeper than ``max_depth`` and strings (or keys) that are not valid Unicode:
    a lone surrogate cannot be encoded, so it would fail deep inside tokenization instead."""
    stack = [(data, (), 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                where = json_path(path)
                raise invalid(where, f"{where or 'the body'}: the string is not valid Unicode (a lone surrogate)")
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth >= max_depth:
            field = str(path[0]) if path else None
            raise invalid(field, f"{field or 'the request body'} nests arrays or objects deeper than "
                                 f"{max_depth} levels")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str) and _SURROGATE.search(key):
                raise invalid(json_path(path), "a key is not valid Unicode (a lone surrogate)")
            stack.append((item, (*path, key), depth + 1))


def parse(model: type[BaseModel], data: Any) -> BaseModel:
    """Validate a decoded JSON body; a bad field gives a 400 naming it."""
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_request")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        unknown = first["type"] == "extra_forbidden"
        param = _param(first["loc"], unknown)
        message = first["msg"]
        if unknown:
            name = str(first["loc"][-1])
            message = "unknown parameter"
            if name in set().union(*OPENAI_UNSUPPORTED.values()):
                accepted = ", ".join(json.dumps(v) for v in (None, *OPENAI_NO_OP.get(name, ())))
                message = f"not supported by this server (accepted: {accepted})"
        raise invalid(param, f"{param}: {message}") from None


def _param(loc: tuple, unknown: bool) -> str | None:
    """The field a validation error is about, spelled as OpenAI spells it (``messages[0].role``):
    its path up to a union's branch label (``content.str`` is about ``content``), through a list
    branch's (``content.list[TextPart].0.x`` is about ``content[0].x``); an unknown field names itself."""
    parts = []
    for i, part in enumerate(loc):
        if isinstance(part, str) and part.startswith("list["):
            continue
        if isinstance(part, str) and part not in _field_names() and not (unknown and i == len(loc) - 1):
            break
        parts.append(part)
    return json_path(parts)


def json_path(parts) -> str | None:
    """A place in the request body as OpenAI names it: ``("messages", 0, "role")`` is
    ``messages[0].role``."""
    path = ""
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path or None


@functools.cache
def _field_names() -> set[str]:
    models = (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, StreamOptions, ResponseFormat,
              JSONSchemaFormat, LegacyStructure, StructuredOutputsRequest, ChatToolCall, FunctionCall,
              TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest, LoadLoRAAdapterRequest,
              UnloadLoRAAdapterRequest)
    return {key for model in models for name, f in model.model_fields.items() for key in (name, f.alias) if key}


class StrictModel(BaseModel):
    """Unknown fields are refused; ``null`` for an optional field means "not set" (its default)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)  # "3" is not 3, true not 1
    unsupported_fields: ClassVar[frozenset[str]] = frozenset()  # OpenAI's, not implemented: null accepted

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_unset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        optional = {name for name, f in cls.model_fields.items() if not f.is_required()}
        unset = optional | cls.unsupported_fields
        return {k: v for k, v in data.items()
                if not ((v is None and k in unset) or (k in cls.unsupported_fields and _no_op(k, v)))}


def _no_op(name: str, value: Any) -> bool:
    """``value`` asks field ``name`` for what this server does anyway (``False`` is not ``0``)."""
    return any(type(value) is type(x) and value == x for x in OPENAI_NO_OP.get(name, ()))


class StreamOptions(StrictModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: with include_usage, every chunk carries usage so far


class JSONSchemaFormat(StrictModel):
    """``response_format.json_schema``: OpenAI's named schema (``strict`` is always how it is enforced)."""

    model_config = ConfigDict(**StrictModel.model_config, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class LegacyStructure(StrictModel):
    """One of vLLM's older ``response_format.structures``: text from ``begin`` to ``end`` whose
    content follows ``schema``."""

    model_config = ConfigDict(**StrictModel.model_config, populate_by_name=True)
    begin: str
    schema_: dict = Field(alias="schema")
    end: str


class ResponseFormat(StrictModel):
    """OpenAI's formats, and vLLM's ``structural_tag``: xgrammar's ``format``, or the older
    ``structures`` with ``triggers`` (each field only with the type that reads it)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JSONSchemaFormat | None = None
    format: dict | None = None
    structures: list[LegacyStructure] | None = None
    triggers: list[str] | None = None


class StructuredOutputsRequest(StrictModel):
    """vLLM's ``structured_outputs``: one of its constraint fields."""

    model_config = ConfigDict(**StrictModel.model_config, populate_by_name=True)
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict | str | None = None
    disable_any_whitespace: bool | None = None


class _GenerationRequest(StrictModel):
    """Fields completions and chat share. ``None`` means "not set" (so beam search can refuse what
    it would not apply). Ranges are checked by ``SamplingParams`` (and the server's limits)."""

    model: str | None = None  # as vLLM: left out, the served model
    max_tokens: int | None = Field(None, ge=0)  # 0: only completions' echo (the prompt scored, nothing generated)
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = Field(1, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id: accepted, used for nothing
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(0, ge=0)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = Field(None, ge=-1)  # -1: the whole vocabulary (as logprobs, top_logprobs)
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    use_beam_search: bool | None = False
    best_of: int | None = Field(None, ge=1)
    length_penalty: float | None = 1.0
    early_stopping: bool | None = False
    return_token_ids: bool | None = False
    priority: int | None = 0  # --scheduling-policy priority: lower first (fcfs refuses another value)
    return_tokens_as_token_ids: bool | None = False  # logprobs' tokens read "token_id:<id>"
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep this many prompt tokens (-1: what fits)
    truncation_side: Literal["left", "right"] | None = None  # which end truncation cuts (default left: keep the last)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict | str | None = None  # vLLM's names before structured_outputs (removed upstream in 0.12)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    _constraint: StructuredOutputsParams | None = PrivateAttr(None)  # set by check()
    _constraint_param: str | None = PrivateAttr(None)

    def truncated(self, ids: list[int], limits: Limits, default_max_tokens: int | None = None) -> list[int]:
        """The prompt's token ids after ``truncate_prompt_tokens`` (vLLM's): its last ``k`` (or, with
        ``truncation_side: "right"``, its first). -1 keeps what fits in the model's context (and a
        fixed KV budget, with each sample's) beside the ``max_tokens`` the request gets: its own, else
        ``default_max_tokens``, else one token (vLLM keeps ``max_model_len - 1`` and then cuts
        ``max_tokens`` to fit; this server refuses a ``max_tokens`` that does not fit instead)."""
        keep = self.truncate_prompt_tokens
        if keep == -1:
            wanted = max(self.max_tokens if self.max_tokens is not None else default_max_tokens or 1, 1)
            room = [total - width * wanted for total, width in ((limits.context, 1), (limits.kv_tokens, self.samples))
                    if total is not None]
            keep = min(room) if room else None
            while limits.kv_tokens is not None and keep > 1 and kv_room(limits, keep, self.samples) < wanted:
                keep -= 1  # (the samples' partial blocks: fewer than a block per sample)
        if keep is None or len(ids) <= keep:
            return ids
        keep = max(keep, 1)
        return ids[:keep] if self.truncation_side == "right" else ids[-keep:]

    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS or not all(stop):
            raise invalid("stop", f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")
        return stop

    def check(self, limits: Limits) -> None:
        """The request on its own (before its prompt is known): options and server limits."""
        if self.truncate_prompt_tokens == 0:
            raise invalid("truncate_prompt_tokens", "truncate_prompt_tokens must be -1 (what fits in the context) "
                                                    "or the number of prompt tokens to keep (>= 1), got 0")
        if limits.context and (self.truncate_prompt_tokens or 0) > limits.context:
            raise invalid("truncate_prompt_tokens", f"truncate_prompt_tokens={self.truncate_prompt_tokens} is more "
                                                    f"than the model's context ({limits.context} tokens)")
        if self.priority and limits.scheduling_policy != "priority":
            raise invalid("priority", f"priority={self.priority} needs a server started with --scheduling-policy "
                                      "priority (this one serves first come, first served and would ignore it)")
        for name in ("n", "best_of"):  # --max-n bounds the samples and the beams alike
            if (getattr(self, name) or 0) > limits.max_n:
                raise invalid(name, f"{name} must be at most {limits.max_n} on this server, got {getattr(self, name)}")
        if self.max_tokens is not None and self.max_tokens > limits.max_tokens:
            name = self.max_tokens_param
            raise invalid(name, f"{name} must be at most {limits.max_tokens} on this server, got {self.max_tokens}")
        if self.max_tokens == 0 and not self.prompt_only():
            name = self.max_tokens_param
            raise invalid(name, f"{name} must be at least 1 (0 only with echo on completions, not streamed: the "
                                "prompt alone, with its log-probs)")
        self._check_logit_bias(limits)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = checked_logprobs("prompt_logprobs", self.prompt_logprobs, limits)
            if self.stream:
                raise invalid("prompt_logprobs", "prompt_logprobs are not available when stream is true")
        self._constraint, self._constraint_param = self._requested_constraint()
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options", "stream_options is only allowed when stream is true")
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name) or []
            if limits.vocab_size is not None and any(not 0 <= t < limits.vocab_size for t in ids):
                raise invalid(name, f"{name} must be token ids below {limits.vocab_size}")
        self.stop_strings()
        if self.use_beam_search:
            self._check_beam_search()
        elif self.best_of is not None and self.best_of != self.n:
            raise invalid("best_of", "best_of other than n needs use_beam_search (sampled best_of is not built)")

    @property
    def max_tokens_param(self) -> str:
        """The field that set ``max_tokens`` (what a 400 about it names)."""
        return "max_tokens"

    @property
    def constraint_field(self) -> str | None:
        """The request field that holds its constraint (what a 400 about it names)."""
        return self._constraint_param

    def _check_logit_bias(self, limits: Limits) -> None:
        """Keys are token ids in ASCII digits: "²" and "１" pass ``str.isdigit`` too (and ``int``
        fails on the one, reads the other as 1)."""
        low, high = LOGIT_BIAS_RANGE
        for key, value in (self.logit_bias or {}).items():
            is_id = key.isascii() and key.isdigit()
            if not is_id or (limits.vocab_size is not None and int(key) >= limits.vocab_size):
                raise invalid("logit_bias", f"logit_bias keys must be token ids below the vocabulary size "
                                            f"{limits.vocab_size}, got {key!r}")
            if not low <= value <= high:
                raise invalid("logit_bias", f"logit_bias values must be in [{low:g}, {high:g}], got {value!r} "
                                            f"for token {key}")

    def _requested_constraint(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The one constraint the request asks for (a 400 names the field when it is invalid)."""
        if self.guided_decoding_backend not in (None, "auto", "xgrammar"):
            raise invalid("guided_decoding_backend", "guided_decoding_backend: this server uses 'xgrammar'")
        if self.guided_whitespace_pattern is not None:
            raise invalid("guided_whitespace_pattern", "guided_whitespace_pattern is not supported (JSON "
                                                       "whitespace is bounded: see disable_any_whitespace)")
        sources = [source for source in self._constraint_sources() if source is not None]
        if len(sources) > 1:
            names = ", ".join(param for param, _ in sources)
            raise invalid(sources[1][0], f"one constraint per request, got {names}")
        if not sources:
            return None, None
        param, build = sources[0]
        try:
            return build(), param
        except ValueError as err:
            raise invalid(param, f"{param}: {str(err).replace('StructuredOutputsParams.', '')}") from None

    def _constraint_sources(self):
        """``(param, builder)`` per field that asks for a constraint (None where it does not)."""
        fmt, so = self.response_format, self.structured_outputs
        yield None if fmt is None else self._response_format_source(fmt)
        if so is not None:
            fields = {name: getattr(so, "json_" if name == "json" else name) for name in
                      ("json", "regex", "choice", "grammar", "json_object", "structural_tag")}
            whitespace = {} if so.disable_any_whitespace is None else {"disable_any_whitespace":
                                                                           so.disable_any_whitespace}
            yield "structured_outputs", lambda: StructuredOutputsParams(**fields, **whitespace)
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                yield f"guided_{name}", lambda name=name, value=value: StructuredOutputsParams(**{name: value})

    @staticmethod
    def _response_format_source(fmt: ResponseFormat):
        tag_fields = [name for name in ("format", "structures", "triggers") if getattr(fmt, name) is not None]
        if fmt.type == "structural_tag":
            return _structural_tag_source(fmt, tag_fields)
        if tag_fields:
            raise invalid(f"response_format.{tag_fields[0]}", f"response_format.{tag_fields[0]} is only read with "
                                                              "type structural_tag")
        if fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return "response_format", lambda: StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise invalid("response_format.json_schema", "response_format of type json_schema needs "
                                                         "json_schema.schema")
        return "response_format.json_schema.schema", lambda: StructuredOutputsParams(json=fmt.json_schema.schema_)

    def _check_beam_search(self) -> None:
        if self.stream:
            raise invalid("stream", "use_beam_search cannot stream (beams change until the search ends)")
        unused = {"temperature": self.temperature not in (None, 0), "top_p": self.top_p not in (None, 1),
                  "top_k": self.top_k not in (None, 0, -1), "min_p": self.min_p not in (None, 0),
                  "presence_penalty": self.presence_penalty not in (None, 0),
                  "frequency_penalty": self.frequency_penalty not in (None, 0),
                  "stop": bool(self.stop),
                  "logprobs": self.num_logprobs() is not None, "logit_bias": bool(self.logit_bias),
                  "allowed_token_ids": self.allowed_token_ids is not None, "bad_words": bool(self.bad_words),
                  self._constraint_param or "": self._constraint is not None}
        for name, is_set in unused.items():
            if is_set:
                raise invalid(name, f"{name} does not apply to beam search (use_beam_search)")
        if self.n > (self.best_of or self.n):
            raise invalid("n", "n must not exceed best_of (the beam width)")

    def num_logprobs(self) -> int | None:
        """Top log-probs per token the engine must report (None: no logprobs)."""
        raise NotImplementedError

    def num_prompt_logprobs(self) -> int | None:
        """Top log-probs per prompt token the engine must report (None: none)."""
        return self.prompt_logprobs

    def prompt_only(self) -> bool:
        """Whether the answer is the prompt alone (completions' ``echo`` with ``max_tokens=0``: the
        engine still draws one token, which the answer leaves out)."""
        return False

    @property
    def samples(self) -> int:
        """Sequences that each generate up to ``max_tokens`` of their own in the KV cache (the ``n``
        samples; beams are not counted: they share what they generated so far)."""
        return 1 if self.use_beam_search else self.n or 1

    def fill_defaults(self, defaults: dict[str, float | int]) -> None:
        """Sampling fields the request leaves unset take ``defaults`` (the model's recommended values:
        :func:`hf_paged.engine.params.generation_defaults`; ``max_tokens`` is the server's to
        resolve). Beam search reads only ``repetition_penalty``."""
        for name, value in defaults.items():
            if name == "max_tokens" or (self.use_beam_search and name != "repetition_penalty"):
                continue
            if getattr(self, name) is None:
                setattr(self, name, value)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's parameters for this request (``max_tokens`` already resolved)."""
        common = dict(max_new_tokens=max_tokens, min_new_tokens=self.min_tokens, n=self.n, ignore_eos=self.ignore_eos,
                      repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                      stop_token_ids=list(self.stop_token_ids or []),
                      include_stop_str_in_output=self.include_stop_str_in_output,
                      skip_special_tokens=self.skip_special_tokens,
                      spaces_between_special_tokens=self.spaces_between_special_tokens,
                      prompt_logprobs=self.num_prompt_logprobs())
        try:
            if self.use_beam_search:
                return SamplingParams(**common, temperature=0, num_beams=self.best_of or self.n,
                                      length_penalty=self.length_penalty, early_stopping=self.early_stopping)
            return SamplingParams(
                **common, temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                min_p=self.min_p or 0.0, presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0, seed=self.seed,
                stop=self.stop_strings(), logprobs=self.num_logprobs(), structured_outputs=self._constraint,
                logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
                allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words or None,
            )
        except ValueError as err:  # "SamplingParams.<field> ...": name the request's field
            field = str(err).split(" ", 1)[0].removeprefix("SamplingParams.")
            if field == "structured_outputs":
                field = self._constraint_param or field
            name = self.max_tokens_param if field == "max_new_tokens" else _API_NAME.get(field, field)
            raise invalid(name, str(err).replace("SamplingParams.", "")) from None


def _structural_tag_source(fmt: ResponseFormat, tag_fields: list[str]):
    """vLLM's ``response_format`` structural tag, as ``structured_outputs.structural_tag`` takes it
    (vLLM passes the whole object on): ``{"type": "structural_tag", "format": {...}}``, or the older
    ``structures`` with ``triggers`` (converted to xgrammar's ``triggered_tags`` there)."""
    if fmt.json_schema is not None:
        raise invalid("response_format.json_schema", "response_format.json_schema is only read with type json_schema")
    if tag_fields == ["format"]:
        tag = {"type": "structural_tag", "format": fmt.format}
        return "response_format.format", lambda: StructuredOutputsParams(structural_tag=tag)
    if tag_fields == ["structures", "triggers"]:
        structures = [{"begin": s.begin, "schema": s.schema_, "end": s.end} for s in fmt.structures]
        tag = {"type": "structural_tag", "structures": structures, "triggers": fmt.triggers}
        return "response_format.structures", lambda: StructuredOutputsParams(structural_tag=tag)
    if not tag_fields:
        raise invalid("response_format.format", "response_format of type structural_tag needs format (xgrammar's "
                                                "structural tag) or the older structures with triggers")
    if "format" in tag_fields:
        other = f"response_format.{tag_fields[1]}"
        raise invalid(other, f"{other}: the older structural tag's fields do not go with format")
    missing = f"response_format.{'triggers' if tag_fields == ['structures'] else 'structures'}"
    raise invalid(missing, f"{missing}: the older structural tag needs both structures and triggers")


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]] | None = None  # None: the start of a document
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=-1)
    suffix: str | None = None

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_only(self) -> bool:
        return bool(self.echo) and self.max_tokens == 0 and not self.stream

    def num_prompt_logprobs(self) -> int | None:
        """``echo`` with ``logprobs`` echoes the prompt's log-probs too (as OpenAI's legacy API and
        vLLM: the prompt's first token has none), with as many top ones as the output's."""
        if self.prompt_logprobs is None and self.echo and self.logprobs is not None:
            return self.logprobs
        return self.prompt_logprobs

    def check(self, limits: Limits) -> None:
        super().check(limits)
        if self.logprobs is not None:
            self.logprobs = checked_logprobs("logprobs", self.logprobs, limits)
        if self.suffix:
            raise invalid("suffix", "suffix (insertion) is not supported by this server")

    def prompts(self, document_start: list[int]) -> list[str | list[int]]:
        """One prompt (text or token ids) per engine request; no prompt is ``document_start`` (as
        OpenAI: the model generates as if from the beginning of a new document)."""
        p = document_start if self.prompt is None else self.prompt
        prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not prompts or any(len(x) == 0 for x in prompts):
            raise invalid("prompt", "prompt must not be empty")
        if len(prompts) > MAX_PROMPTS:
            raise invalid("prompt", f"at most {MAX_PROMPTS} prompts per request")
        return prompts


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: str
    arguments: str


class ChatToolCall(StrictModel):
    """A tool call in an assistant message sent back (the conversation goes on after it)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    unsupported_fields: ClassVar[frozenset[str]] = OPENAI_UNSUPPORTED["message"]

    role: ChatRole
    content: list[TextPart] | str | None = None  # a list's errors name its parts (not "a valid string")
    name: str | None = None
    tool_call_id: str | None = None  # a tool message's answer to an assistant's tool call
    tool_calls: list[ChatToolCall] | None = None  # an assistant's calls

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        for j, part in enumerate(value if isinstance(value, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(f"part {j} is {kind!r}: only text parts are supported (the models served read text)")
        return value

    def template_entry(self) -> dict[str, Any]:
        """What the chat template sees: OpenAI's ``developer`` role is its ``system`` role (templates
        know only the latter); a call's arguments as an object (what templates render, as vLLM
        gives them) when they are one, else their text."""
        entry: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_call_id is not None:
            entry["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            entry["tool_calls"] = [{"id": call.id, "type": "function",
                                    "function": {"name": call.function.name,
                                                 "arguments": _arguments_value(call.function.arguments)}}
                                   for call in self.tool_calls]
        return entry

    def text(self) -> str:
        """The content as the template sees it: text parts one per line (as vLLM joins them)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


def _arguments_value(text: str) -> dict | str:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


# apply_chat_template's own arguments: chat_template_kwargs may not set them (the request's fields do)
_TEMPLATE_ARGUMENTS = frozenset({"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                                 "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                                 "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class ChatTemplateFields(StrictModel):
    """vLLM's chat-template fields (chat completions and ``/tokenize``): ``add_generation_prompt``,
    ``continue_final_message`` (the last message is left open for the model to go on with; with
    ``add_generation_prompt`` true, as it is by default, it is a 400, as vLLM's template call refuses
    the pair: send ``add_generation_prompt: false``), ``chat_template`` (a Jinja
    template for this request: only on a server started with ``--trust-request-chat-template``)
    and ``chat_template_kwargs`` (variables the template reads, e.g. ``{"enable_thinking": false}``)."""

    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check_template_fields(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:  # its default (True) too, as vLLM
            raise invalid("continue_final_message", "continue_final_message and add_generation_prompt cannot both "
                                                    "be true (add_generation_prompt is true unless set to false): "
                                                    "the last message is continued, no new one started")
        for key in self.chat_template_kwargs or {}:
            if key in _TEMPLATE_ARGUMENTS:
                raise invalid(f"chat_template_kwargs.{key}", f"chat_template_kwargs cannot set {key!r}: it is "
                                                             "apply_chat_template's own argument (use the request field)")

    def template_kwargs(self) -> dict[str, Any]:
        """``apply_chat_template``'s keyword arguments besides the conversation and tools (the
        template is the caller's choice: this request's, the server's or the tokenizer's)."""
        return {**(self.chat_template_kwargs or {}), "continue_final_message": bool(self.continue_final_message),
                "add_generation_prompt": bool(self.add_generation_prompt) and not self.continue_final_message}


class ChatCompletionRequest(ChatTemplateFields, _GenerationRequest):
    """``POST /v1/chat/completions``."""

    unsupported_fields: ClassVar[frozenset[str]] = OPENAI_UNSUPPORTED["chat"]

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=-1)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)  # tags for stored replies: none are stored
    echo: bool | None = False  # vLLM's: the reply starts with the last message's text when it has the reply's role
    _tools: list[tool_calling.Tool] = PrivateAttr(default_factory=list)  # set by check()
    _tool_mode: Any = PrivateAttr("none")

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    def check(self, limits: Limits) -> None:
        if self.max_completion_tokens is not None:  # OpenAI's current name wins over the deprecated one (as vLLM)
            self.max_tokens = self.max_completion_tokens
        super().check(limits)
        self.check_template_fields()
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
        if self.top_logprobs is not None:
            self.top_logprobs = checked_logprobs("top_logprobs", self.top_logprobs, limits)
        self._check_messages()
        try:
            self._tools = tool_calling.read_tools(self.tools or [])
            self._tool_mode = tool_calling.tool_choice_mode(self.tool_choice, self._tools)
            if self._tool_mode not in ("none", "auto"):
                if self._constraint is not None:
                    raise invalid("tool_choice", f"tool_choice {self.tool_choice!r} constrains the output itself; "
                                                 f"{self._constraint_param} cannot be added")
                self._constraint = tool_calling.call_constraint(self._tool_mode, self._tools,
                                                                self.parallel_tool_calls is not False)
                self._constraint_param = "tool_choice"
        except tool_calling.ToolError as err:
            raise invalid(err.param, str(err)) from None
        if self._constraint is not None and self.use_beam_search:
            raise invalid(self._constraint_param, f"{self._constraint_param} does not apply to beam search "
                                                  "(use_beam_search)")

    def _check_messages(self) -> None:
        """Only assistant messages carry tool calls; a tool message names the call it answers. A
        call's ``arguments`` may be any text (as OpenAI: a reply cut by ``max_tokens`` sent back)."""
        for i, message in enumerate(self.messages):
            if message.tool_calls and message.role != "assistant":
                raise invalid(f"messages[{i}].tool_calls", "only assistant messages carry tool_calls")
            if message.role == "tool" and not message.tool_call_id:
                raise invalid(f"messages[{i}].tool_call_id", f"messages[{i}] (role tool) needs the tool_call_id of "
                                                             "the call it answers")

    @property
    def tool_mode(self):
        """``"none"``, ``"auto"``, ``"required"`` or the named :class:`~hf_paged.serve.tools.Tool`."""
        return self._tool_mode

    def template_tools(self) -> list[dict] | None:
        """The tools the chat template is given: all declared ones, also under ``tool_choice``
        ``"none"`` (the model sees them and calls none; vLLM's default), None without any."""
        return [tool.entry for tool in self._tools] or None

    def conversation(self) -> list[dict[str, Any]]:
        return [m.template_entry() for m in self.messages]

    def response_role(self) -> str:
        """The reply's role: the assistant's after a generation prompt, else the last message's
        (which the model goes on with), as vLLM answers."""
        return "assistant" if self.template_kwargs()["add_generation_prompt"] else self.messages[-1].role

    def echoed_text(self) -> str:
        """What each choice's content starts with: with ``echo``, the last message's text when the
        reply has its role (``continue_final_message``: the whole message, prefill and all; vLLM's)."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == self.response_role() else ""


def kv_room(limits: Limits, prompt_len: int, samples: int = 1) -> int:
    """Tokens each of ``samples`` sequences can generate beside a prompt of ``prompt_len`` in the
    fixed KV budget (``limits.kv_tokens``): they share the prompt's full blocks; each copies the
    partial last one on its first write and fills blocks of its own (one sequence: the tokens left)."""
    size = limits.kv_block_size
    return (limits.kv_tokens // size - prompt_len // size) // samples * size - prompt_len % size


def resolve_max_tokens(requested: int | None, default: int | None, prompt_len: int, limits: Limits,
                       prompt_param: str, max_tokens_param: str = "max_tokens", samples: int = 1) -> int:
    """The request's ``max_tokens``, checked against the model's positions and a fixed KV budget,
    which its ``samples`` sequences (``n``: they share the prompt's blocks, not what each of them
    generates) fill together. Unset, it is ``default`` or as many as fit (chat's default), at most
    what fits. A requested one too long is OpenAI's ``context_length_exceeded`` (what clients test
    for to trim a conversation), whichever of the two limits it is."""
    rooms = []  # (tokens each sequence may generate, the limit's tokens, sequences, the limit)
    if limits.context is not None:
        rooms.append((limits.context - prompt_len, limits.context, 1, "the model's context"))
    if limits.kv_tokens is not None:
        rooms.append((kv_room(limits, prompt_len, samples), limits.kv_tokens, samples, "the KV cache"))
    room, total, width, where = min(rooms, key=lambda r: r[0]) if rooms else (None, None, 1, "")  # (a tie: context)
    if room is not None and room < 1:
        shared = f" for n={width} samples" if width > 1 else ""
        raise APIError(400, f"the prompt ({prompt_len} tokens) leaves no room in {where} ({total} tokens){shared}",
                       param=prompt_param, code=CONTEXT_LENGTH_EXCEEDED)
    if requested is None:
        wanted = min(limits.max_tokens if default is None else default, limits.max_tokens)
        return wanted if room is None else min(wanted, room)
    if room is not None and requested > room:
        what, shared = f"{max_tokens_param}={requested}", ""
        if width > 1:
            what, shared = f"n={width} samples of {what}", "; the samples share the prompt"
        raise APIError(400, f"{prompt_len} prompt tokens plus {what} exceed {where} ({total} tokens{shared})",
                       param=max_tokens_param, code=CONTEXT_LENGTH_EXCEEDED)
    return requested


class TokenizeCompletionRequest(StrictModel):
    """``POST /tokenize`` with a ``prompt`` (vLLM's): its token ids as a completion would see them."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(ChatTemplateFields):
    """``POST /tokenize`` with ``messages`` (vLLM's): the prompt a chat completion would get, through
    the same template (``tools`` as a chat request's: the template sees them as sent)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict] | None = None
    add_special_tokens: bool | None = False  # the template writes them
    return_token_strs: bool | None = False

    def conversation(self) -> list[dict[str, Any]]:
        return [m.template_entry() for m in self.messages]


class DetokenizeRequest(StrictModel):
    """``POST /detokenize`` (vLLM's): the text of token ids (special tokens included, as vLLM)."""

    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(StrictModel):
    """``POST /v1/load_lora_adapter`` (vLLM's): serve the adapter in folder ``lora_path`` as
    ``lora_name``; ``load_inplace``: read it again under a name already served (a retrained adapter)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool | None = False


class UnloadLoRAAdapterRequest(StrictModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's): stop serving an adapter, named by ``lora_name`` or
    by its ``lora_int_id``."""

    lora_name: str | None = Field(None, min_length=1)
    lora_int_id: int | None = None
