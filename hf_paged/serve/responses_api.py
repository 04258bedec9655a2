"""OpenAI's Responses API (``POST /v1/responses``) as a thin layer over chat completions.

A Responses request is read here (:class:`ResponsesRequest`, :func:`read_request`), turned into the
chat request it amounts to (:meth:`ResponsesRequest.chat_request`: ``instructions`` as a system
message first, the input items as chat messages, function tools in chat's shape, ``text.format``
as ``response_format``) and served by the chat machinery: same chat template, same engine request,
same constraints and tool-call parser. Only the answer differs: :class:`ResponseRenderer` builds
the ``Response`` object, or the typed SSE events OpenAI streams, from the engine's outputs.

Errors the chat machinery raises name chat's fields; :func:`in_responses_terms` renames them to the
fields the client sent (``messages`` is ``input``, ``max_tokens`` is ``max_output_tokens``,
``response_format`` is ``text.format``, ``tools[i].function.name`` is ``tools[i].name``).

Nothing is stored (as vLLM with its store disabled, its default): ``store`` is accepted, true or
false, and the request served the same; ``previous_response_id`` and ``conversation`` (which need a
stored response) are refused with a 400 naming them. OpenAI's fields that are not built take
``null`` (or, for a few, the value that asks for what the server does anyway: ``truncation:
"disabled"``, ``background: false``, ``service_tier: "auto"`` or ``"default"``); any other value is
a 400 naming the field, as an unknown field is.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag, ValidationError

from hf_paged.engine.detokenize import TextStream
from hf_paged.engine.outputs import RequestOutput
from hf_paged.engine.params import SamplingParams
from hf_paged.serve.engine_loop import EngineFailure, RequestStream
from hf_paged.serve.protocol import (APIError, ChatCompletionRequest, Limits, StrictModel, invalid, json_path,
                                     parse)
from hf_paged.serve.responses import sse
from hf_paged.serve.tools import HermesToolParser, ToolCallDelta

# OpenAI's Responses request fields this server does not implement: null is accepted, any other
# value is a 400 naming the field (with the reason, where there is one to give).
RESPONSES_UNSUPPORTED = {
    "previous_response_id": "no responses are stored: send the whole conversation in input",
    "conversation": "no conversations are stored: send the whole conversation in input",
    "include": "", "top_logprobs": "", "reasoning": "", "prompt": "", "max_tool_calls": "",
    "prompt_cache_key": "", "prompt_cache_options": "", "prompt_cache_retention": "",
    "safety_identifier": "", "context_management": "", "background_options": "", "moderation": "",
    "access_programs": "", "image": "",
}
ITEM_STATUS = Literal["in_progress", "completed", "incomplete"]


# ---------------------------------------------------------------------------- the request
# (protocol's rules: unknown fields refused, types strict, ``null`` is "not set")
class InputText(StrictModel):
    type: Literal["input_text"]
    text: str


class OutputText(StrictModel):
    """A reply's text sent back: its ``annotations`` (citations) must be empty, its ``logprobs``
    are how it was produced and mean nothing as input."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict] | None = Field(None, max_length=0)
    logprobs: list[dict] | None = None


def _kind(value: Any, default: str | None = None) -> str | None:
    """The ``type`` of an input item or content part (what the unions below pick a model by)."""
    return value.get("type", default) if isinstance(value, dict) else getattr(value, "type", default)


TextPart = Annotated[
    Annotated[InputText, Tag("input_text")] | Annotated[OutputText, Tag("output_text")],
    Discriminator(_kind, custom_error_type="unsupported_part",
                  custom_error_message="only input_text and output_text parts are supported (the models served read "
                                       "text)")]


def _text_of(content: str | list[InputText | OutputText]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


class InputMessage(StrictModel):
    """A message item (``type`` may be left out); an ``id`` or ``status`` sent back with a reply is
    the reply's own and carries nothing the template reads."""

    unsupported_fields: ClassVar[frozenset[str]] = frozenset({"phase"})

    type: Literal["message"] | None = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[TextPart] | str  # a list's errors name its parts (not "a valid string")
    id: str | None = None
    status: ITEM_STATUS | None = None

    def chat_message(self) -> dict[str, Any]:
        return {"role": self.role, "content": _text_of(self.content)}


class FunctionCallItem(StrictModel):
    """A call the model made (a reply's ``function_call`` item sent back)."""

    unsupported_fields: ClassVar[frozenset[str]] = frozenset({"namespace", "caller", "async"})

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str
    id: str | None = None
    status: ITEM_STATUS | None = None

    def chat_call(self) -> dict[str, Any]:
        return {"id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class FunctionCallOutputItem(StrictModel):
    """The client's answer to a call: a ``tool`` message for the template."""

    unsupported_fields: ClassVar[frozenset[str]] = frozenset({"name", "namespace", "caller"})

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: list[InputText] | str
    id: str | None = None
    status: ITEM_STATUS | None = None

    def chat_message(self) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": self.call_id, "content": _text_of(self.output)}


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(lambda item: _kind(item, "message"), custom_error_type="unsupported_item",
                  custom_error_message="only message, function_call and function_call_output items are supported")]


class FunctionTool(StrictModel):
    """A function tool in the Responses shape (flat: no ``function`` object)."""

    unsupported_fields: ClassVar[frozenset[str]] = frozenset({"allowed_callers", "async", "defer_loading",
                                                              "output_schema"})

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # as chat's: a forced call is always held to its parameters

    def chat_tool(self) -> dict[str, Any]:
        """Chat's shape of the same tool (what the chat template is given)."""
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    """``text.format``: plain text, any JSON object, or JSON of a named schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def response_format(self) -> dict[str, Any]:
        """Chat's ``response_format`` of the same constraint."""
        if self.type != "json_schema":
            extra = next((name for name in ("name", "schema_", "description", "strict")
                          if getattr(self, name) is not None), None)
            if extra is not None:
                field = f"text.format.{extra.rstrip('_')}"
                raise invalid(field, f"{field} is only read with type json_schema")
            return {"type": self.type}
        if self.schema_ is None:
            raise invalid("text.format.schema", "text.format of type json_schema needs schema")
        return {"type": "json_schema",
                "json_schema": self.model_dump(exclude={"type"}, exclude_none=True, by_alias=True)}


class ResponsesStreamOptions(StrictModel):
    include_obfuscation: Literal[False] | None = None  # no padding is sent: false asks for nothing


class TextConfig(StrictModel):
    unsupported_fields: ClassVar[frozenset[str]] = frozenset({"verbosity"})

    format: TextFormat | None = None


class ResponsesRequest(StrictModel):
    """``POST /v1/responses``: OpenAI's fields that are built, and vLLM's sampling extensions that
    the chat endpoint takes (mapped by the same code)."""

    unsupported_fields: ClassVar[frozenset[str]] = frozenset(RESPONSES_UNSUPPORTED)

    model: str | None = None  # unset: the served model (as vLLM)
    input: list[InputItem] | str
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)  # echoed in the response
    user: str | None = None  # an end-user id: echoed, used for nothing
    store: bool | None = None  # nothing is stored, either way (vLLM's behaviour with its store disabled)
    truncation: Literal["disabled"] | None = None  # "auto" (dropping input to fit) is not built
    background: Literal[False] | None = None
    service_tier: Literal["auto", "default"] | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None

    PASSED_ON: ClassVar[tuple[str, ...]] = (  # fields chat takes as they are
        "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "presence_penalty",
        "frequency_penalty", "stop", "stop_token_ids", "ignore_eos", "logit_bias", "skip_special_tokens",
        "include_stop_str_in_output", "parallel_tool_calls", "stream", "user", "metadata")

    def chat_request(self, model: str, limits: Limits, defaults: dict[str, float | int]) -> ChatCompletionRequest:
        """The chat request this one amounts to, checked against ``limits`` and given the server's
        sampling ``defaults`` (its errors name chat's fields: see :func:`in_responses_terms`)."""
        body: dict[str, Any] = {name: getattr(self, name) for name in self.PASSED_ON if getattr(self, name) is not None}
        body.update(model=model, messages=self.messages(), max_tokens=self.max_output_tokens)
        if self.tools:
            body["tools"] = [tool.chat_tool() for tool in self.tools]
        choice = self.effective_tool_choice()
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}} \
            if isinstance(choice, NamedToolChoice) else choice
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.response_format()
        chat = parse(ChatCompletionRequest, body)
        chat.check(limits)
        chat.fill_defaults(defaults)
        return chat

    def effective_tool_choice(self) -> str | NamedToolChoice:
        """``tool_choice``, unset: ``auto`` with tools, else ``none``; ``auto`` without tools is
        ``none`` too (as vLLM: there is nothing to call; chat refuses ``auto`` without tools)."""
        if not self.tools and self.tool_choice in (None, "auto"):
            return "none"
        return "auto" if self.tool_choice is None else self.tool_choice

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages: ``instructions`` first (a system message), then the
        items in order; a ``function_call`` joins the assistant message before it (as vLLM: one
        message with all its calls), else starts one of its own."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        items = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        if not items:
            raise invalid("input", "input must not be empty")
        for item in items:
            if isinstance(item, FunctionCallItem):
                last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
                if last is None:
                    last = {"role": "assistant", "content": None}
                    messages.append(last)
                last.setdefault("tool_calls", []).append(item.chat_call())
            else:
                messages.append(item.chat_message())
        self._check_last_item(items)
        return messages

    @staticmethod
    def _check_last_item(items: list) -> None:
        """vLLM continues a last assistant message that is still ``in_progress`` or ``incomplete``
        (instead of starting a new one); that is not built here, so it is refused, not ignored."""
        last = items[-1]
        if isinstance(last, InputMessage) and last.role == "assistant" and last.status in ("in_progress",
                                                                                           "incomplete"):
            where = f"input[{len(items) - 1}].status"
            raise invalid(where, f"{where}: continuing an unfinished assistant message is not supported")


def read_request(data: Any) -> ResponsesRequest:
    """Validate a decoded JSON body; a bad field gives a 400 naming it (as OpenAI names it:
    ``input[2].content[0].text``), an OpenAI field that is not built says so."""
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_request")
    try:
        return ResponsesRequest.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        loc, unknown = first["loc"], first["type"] == "extra_forbidden"
        where = json_path([part for i, part in enumerate(loc)
                           if isinstance(part, int) or part in _field_names() or (unknown and i == len(loc) - 1)])
        message = _unsupported(str(loc[-1])) if unknown else first["msg"]
        raise invalid(where, f"{where}: {message}") from None


def _unsupported(name: str) -> str:
    reason = RESPONSES_UNSUPPORTED.get(name)
    if reason is None and not any(name in model.unsupported_fields for model in _MODELS):
        return "unknown parameter"
    return f"not supported by this server: {reason}" if reason else "not supported by this server (accepted: null)"


_MODELS = (ResponsesRequest, InputMessage, InputText, OutputText, FunctionCallItem, FunctionCallOutputItem,
           FunctionTool, NamedToolChoice, TextFormat, TextConfig, ResponsesStreamOptions)


@functools.cache
def _field_names() -> frozenset[str]:
    """Every field name of the request's models: the parts of an error's location that are not
    pydantic's labels of union branches (``str``, ``list[...]``, an item's ``type`` tag)."""
    return frozenset(key for model in _MODELS for name, f in model.model_fields.items() for key in (name, f.alias)
                     if key)


# ---------------------------------------------------------------------------- errors in the client's terms
_CHAT_TERMS = [(re.compile(r"\bresponse_format(\.json_schema)?\b"), "text.format"),
               (re.compile(r"\btools\[(\d+)\]\.function\b"), r"tools[\1]"),
               (re.compile(r"\bmessages(\[\d+\])?(\.[a-z_]+)*"), "input"),
               (re.compile(r"\bmax_tokens\b"), "max_output_tokens")]


def renamed(err: APIError) -> APIError:
    """``err`` with chat's field names replaced by the Responses fields they came from."""
    def rename(text: str | None) -> str | None:
        for pattern, replacement in _CHAT_TERMS if text else ():
            text = pattern.sub(replacement, text)
        return text

    return APIError(err.status, rename(err.message), param=rename(err.param), code=err.code, type=err.type)


@contextmanager
def in_responses_terms() -> Iterator[None]:
    """Errors raised inside name the Responses request's fields (see :func:`renamed`)."""
    try:
        yield
    except APIError as err:
        raise renamed(err) from None


# ---------------------------------------------------------------------------- the output items
def _message() -> dict[str, Any]:
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "in_progress",
            "content": []}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _function_call(call_id: str, name: str) -> dict[str, Any]:
    return {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress", "call_id": call_id,
            "name": name, "arguments": ""}


class OutputItems:
    """A response's output items, built from its text as it arrives (all at once when not
    streamed), with the stream events that build them: a ``message`` item for text, a
    ``function_call`` item per call (parsed by chat's tool-call parser when the request has tools),
    in the order the model wrote them. Streamed or not, the same text gives the same items."""

    def __init__(self, tools: bool, calls_only: bool):
        self.items: list[dict[str, Any]] = []  # finished items, then the one being written
        self._parser = HermesToolParser(calls_only) if tools else None
        self._writing: dict[str, Any] | None = None  # the last item, while it is written

    def feed(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        """Events for the next piece of the text (``final``: its last piece)."""
        events: list[dict[str, Any]] = []
        if self._parser is None:
            self._text(text, events)
            return events
        pieces = _after_call_ends(text)
        for i, piece in enumerate(pieces):
            content, calls = self._parser.feed(piece, final=final and i == len(pieces) - 1)
            self._text(content, events)
            for call in calls:
                self._call(call, events)
        return events

    def close(self, status: str) -> list[dict[str, Any]]:
        """Events finishing the last item with ``status`` (``completed`` or ``incomplete``); a
        response that wrote nothing gets an empty message (its ``output_text`` is ``""``)."""
        events: list[dict[str, Any]] = []
        if not self.items:
            self._open_message(events)
        self._finish(status, events)
        return events

    def _text(self, text: str, events: list[dict[str, Any]]) -> None:
        if not text:
            return
        if self._writing is None or self._writing["type"] != "message":
            self._finish("completed", events)
            self._open_message(events)
        part = self._writing["content"][0]
        part["text"] += text
        events.append({"type": "response.output_text.delta", "item_id": self._writing["id"],
                       "output_index": len(self.items) - 1, "content_index": 0, "delta": text, "logprobs": []})

    def _call(self, call: ToolCallDelta, events: list[dict[str, Any]]) -> None:
        if call.id is not None:  # a new call: its first delta names it
            self._finish("completed", events)
            self._writing = _function_call(call.id, call.name)
            self.items.append(self._writing)
            events.append(self._added())
        if call.arguments:
            self._writing["arguments"] += call.arguments
            events.append({"type": "response.function_call_arguments.delta", "item_id": self._writing["id"],
                           "output_index": len(self.items) - 1, "delta": call.arguments})

    def _open_message(self, events: list[dict[str, Any]]) -> None:
        self._writing = _message()
        self.items.append(self._writing)
        events.append(self._added())
        self._writing["content"].append(_output_text(""))
        events.append({"type": "response.content_part.added", "item_id": self._writing["id"],
                       "output_index": len(self.items) - 1, "content_index": 0, "part": _output_text("")})

    def _added(self) -> dict[str, Any]:
        snapshot = {**self._writing, "content": []} if self._writing["type"] == "message" else dict(self._writing)
        return {"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": snapshot}

    def _finish(self, status: str, events: list[dict[str, Any]]) -> None:
        item, self._writing = self._writing, None
        if item is None:
            return
        item["status"] = status
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "message":
            part = item["content"][0]
            events.append({"type": "response.output_text.done", **where, "content_index": 0, "text": part["text"],
                           "logprobs": []})
            events.append({"type": "response.content_part.done", **where, "content_index": 0, "part": dict(part)})
        else:
            events.append({"type": "response.function_call_arguments.done", **where, "name": item["name"],
                           "arguments": item["arguments"]})
        events.append({"type": "response.output_item.done", "output_index": where["output_index"],
                       "item": {**item, "content": [dict(p) for p in item["content"]]} if "content" in item
                       else dict(item)})


def _after_call_ends(text: str) -> list[str]:
    """``text`` cut after each ``>``: the parser hands back a piece's content and calls separately,
    so a piece must not hold the end of a call (``</tool_call>``) and the text after it, or that
    text could not be put after the call. The parser's results do not depend on the cuts."""
    return re.split(r"(?<=>)", text) if ">" in text else [text]


# ---------------------------------------------------------------------------- the response
class ResponseRenderer:
    """Answers one chat job as a Response: the object (:meth:`body`) or its event stream
    (:meth:`events`). Echoes what the types require: the request's settings and the effective
    ``temperature``, ``top_p`` and ``max_output_tokens`` (the engine's, as vLLM echoes them)."""

    def __init__(self, request: ResponsesRequest, params: SamplingParams, tokenizer: Any, model: str, *,
                 tools: bool, calls_only: bool, failure: Callable[[RequestOutput], APIError]):
        self.request, self.params, self.tokenizer, self.model = request, params, tokenizer, model
        self.tools, self.calls_only, self.failure = tools, calls_only, failure
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())

    def body(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        """The finished Response of the (one) engine output."""
        output = outputs[0]
        items = OutputItems(self.tools, self.calls_only)
        items.feed(output.outputs[0].text, final=True)
        status = _status(output)
        items.close("incomplete" if status == "incomplete" else "completed")
        return self._response(status, items.items, output)

    def _response(self, status: str, output: list[dict[str, Any]], final: RequestOutput | None) -> dict[str, Any]:
        req = self.request
        tool_choice = req.effective_tool_choice()
        text = req.text.model_dump(exclude_none=True, by_alias=True) if req.text and req.text.format else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "model": self.model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": self.params.temperature, "top_p": self.params.top_p,
            "max_output_tokens": self.params.max_new_tokens,
            "tool_choice": tool_choice.model_dump() if isinstance(tool_choice, NamedToolChoice) else tool_choice,
            "tools": [tool.model_dump(exclude_none=True) for tool in req.tools or []],
            "text": text or {"format": {"type": "text"}},
            "truncation": "disabled", "background": False, "previous_response_id": None, "reasoning": None,
            "metadata": req.metadata or {}, "user": req.user,
            "usage": None if final is None else _usage(final),
        }

    async def events(self, stream: RequestStream, watcher: asyncio.Task) -> AsyncIterator[str]:
        """The SSE events OpenAI sends, each with its ``sequence_number``: ``response.created``,
        ``response.in_progress``, the items' events, then ``response.completed`` (or
        ``response.incomplete``). An error is an ``error`` event (which also carries chat's
        ``{"error": {...}}``, so clients raise it as they do for a chat stream) and ends the
        stream; the engine request is aborted however the stream stops."""
        numbers = itertools.count()
        try:
            start = self._response("in_progress", [], None)
            for kind in ("response.created", "response.in_progress"):
                yield _event({"type": kind, "response": start}, numbers)
            async for event in self._output_events(stream):
                yield _event(event, numbers)
        except EngineFailure as err:
            yield _event(_error(APIError(503, str(err), code=err.code)), numbers)
        finally:
            watcher.cancel()
            stream.abort()

    async def _output_events(self, stream: RequestStream) -> AsyncIterator[dict[str, Any]]:
        """The events after ``response.in_progress``: the items', then the finished response
        (nothing more when the request was aborted: the client left)."""
        text, items, final = None, OutputItems(self.tools, self.calls_only), None
        async for _, out in stream:
            if out.error:
                yield _error(self.failure(out))
                return
            text = text or TextStream.of(self.tokenizer, self.params, out.prompt_token_ids)
            for completion in out.outputs[:1]:  # one: the Responses API has no n
                delta, _ = text.update(completion)
                for event in items.feed(delta, final=text.finished):
                    yield event
            final = out if out.finished else None
        if final is not None:
            status = _status(final)
            for event in items.close("incomplete" if status == "incomplete" else "completed"):
                yield event
            yield {"type": f"response.{status}", "response": self._response(status, items.items, final)}


def _status(output: RequestOutput) -> str:
    """``incomplete`` when ``max_output_tokens`` (or the context) cut the text, else ``completed``."""
    return "incomplete" if output.outputs[0].finish_reason == "length" else "completed"


def _usage(output: RequestOutput) -> dict[str, Any]:
    prompt, generated = len(output.prompt_token_ids), len(output.outputs[0].token_ids)
    return {"input_tokens": prompt, "output_tokens": generated, "total_tokens": prompt + generated,
            "input_tokens_details": {"cached_tokens": output.num_cached_tokens or 0, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _event(event: dict[str, Any], numbers: Iterator[int]) -> str:
    """One SSE event as OpenAI writes it: its type on the ``event:`` line, then its data."""
    return f"event: {event['type']}\n" + sse({**event, "sequence_number": next(numbers)})


def _error(err: APIError) -> dict[str, Any]:
    """OpenAI's ``error`` event, with chat's error object beside its fields."""
    error = renamed(err)
    return {"type": "error", "code": error.code, "message": error.message, "param": error.param, **error.body()}
