"""Tool calling: the tools a chat request declares, the constraint its ``tool_choice`` needs, and
the parser that turns the model's tool-call syntax into OpenAI ``tool_calls``.

Supported syntax: **Hermes** (NousResearch Hermes 2/3, Qwen 2.5, Qwen 3 and the many templates that
copied them): each call is ``<tool_call>`` + a JSON object ``{"name": ..., "arguments": {...}}`` +
``</tool_call>`` (``"parameters"`` is read as ``"arguments"``); text outside the calls is the
message's content (the whitespace around calls goes; calls between two pieces of text leave one
space). The server hands the tools to the model's chat template and:

* ``tool_choice="none"`` (the default without tools): plain text, tools not shown to the template;
* ``"auto"`` (the default with tools): generates freely and parses what the model wrote;
* ``"required"``: constrains the output to one or more calls (one with ``parallel_tool_calls``
  false), each call's arguments to its function's parameter schema;
* ``{"type": "function", "function": {"name": ...}}``: exactly one call of that function.

The constraint is an xgrammar structural tag that writes the calls in the Hermes syntax, so one
parser serves every choice, streamed or not. :class:`HermesToolParser` is incremental and does
not depend on how the text is split: a stream's tool-call deltas concatenate to exactly the
non-streamed ``tool_calls`` (both run the same parser; a call's ``arguments`` is the text of its
JSON value as written, streamed as the model writes it once the name is known).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from hf_paged.constraints.compiler import clean_error, json_grammar
from hf_paged.constraints.params import MAX_STRUCTURAL_TAG_BYTES, StructuredOutputsParams
from hf_paged.constraints.schema import check_schema

START, END = "<tool_call>", "</tool_call>"
FORMATS = ("hermes",)
NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
NO_PARAMETERS = {"type": "object", "properties": {}}
_SCALAR = frozenset("0123456789+-.eE" "truefalsn")  # what a number, true, false or null is written with


class ToolError(ValueError):
    """A bad ``tools`` / ``tool_choice`` value; ``param`` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict
    entry: dict  # as the request declared it: what the chat template sees (OpenAI's shape, transformers' too)


def read_tools(tools: list[dict]) -> list[Tool]:
    """The declared functions, checked: unique names of OpenAI's form, object parameter schemas."""
    found: dict[str, Tool] = {}
    for i, entry in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(entry, dict) or entry.get("type") != "function" or not isinstance(entry.get("function"),
                                                                                           dict):
            raise ToolError(where, f'{where} must be {{"type": "function", "function": {{...}}}}')
        function = entry["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise ToolError(f"{where}.function.name", f"{where}.function.name must be 1-64 letters, digits, _ or -")
        if name in found:
            raise ToolError(f"{where}.function.name", f"two tools are named {name!r}")
        parameters = function.get("parameters", NO_PARAMETERS)
        if not isinstance(parameters, dict):
            raise ToolError(f"{where}.function.parameters", f"{where}.function.parameters must be a JSON schema object")
        found[name] = Tool(name, parameters, template_entry(entry))
    return list(found.values())


def template_entry(entry: dict) -> dict:
    """A declared tool as the chat template sees it: ``description`` and ``parameters`` always
    there, null when not declared (vLLM's; a template that prints tools as JSON writes them)."""
    function = entry["function"]
    named = {"name": function["name"], "description": function.get("description"),
             "parameters": function.get("parameters")}
    return {"type": entry["type"], **entry, "function": {**named, **function}}


def tool_choice_mode(tool_choice: Any, tools: list[Tool]) -> str | Tool:
    """``"none"``, ``"auto"``, ``"required"``, or the named tool."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ToolError("tool_choice", f"tool_choice must be 'none', 'auto', 'required' or a named function, "
                                           f"got {tool_choice!r}")
        if tool_choice != "none" and not tools:
            raise ToolError("tool_choice", f"tool_choice {tool_choice!r} needs tools")
        return tool_choice
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not (isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(name, str)):
        raise ToolError("tool_choice", 'a named tool_choice is {"type": "function", "function": {"name": ...}}')
    tool = next((t for t in tools if t.name == name), None)
    if tool is None:
        raise ToolError("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
    return tool


def call_constraint(mode: str | Tool, tools: list[Tool], parallel: bool) -> StructuredOutputsParams:
    """The constraint of a ``required`` or named ``tool_choice``: Hermes calls, each call's
    arguments compact JSON of its function's parameter schema."""
    chosen = [mode] if isinstance(mode, Tool) else tools
    tags = [_call_tag(tool, i if isinstance(mode, str) else tools.index(tool)) for i, tool in enumerate(chosen)]
    if isinstance(mode, Tool):
        tag_format = tags[0]
    else:
        tag_format = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                      "stop_after_first": not parallel}
    try:
        return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": tag_format})
    except ValueError:  # only its size can be wrong here: every part was checked
        choice = repr(mode) if isinstance(mode, str) else f"naming {mode.name!r}"
        raise ToolError("tools", f"the grammar of the calls tool_choice {choice} allows is larger than "
                                 f"{MAX_STRUCTURAL_TAG_BYTES} bytes: declare fewer or smaller tools") from None


def _call_tag(tool: Tool, index: int) -> dict:
    where = f"tools[{index}].function.parameters"
    try:
        check_schema(tool.parameters)
        grammar = json_grammar(tool.parameters, compact=True)
    except ValueError as err:
        raise ToolError(where, f"{where}: {err}") from None
    except Exception as err:  # noqa: BLE001 - xgrammar's own schema errors
        raise ToolError(where, f"{where}: not a usable JSON schema ({clean_error(err)})") from None
    begin = f'{START}\n{{"name": {json.dumps(tool.name)}, "arguments": '
    return {"type": "tag", "begin": begin, "content": {"type": "grammar", "grammar": grammar}, "end": "}\n" + END}


# ---------------------------------------------------------------------------- the parser
@dataclass
class ToolCallDelta:
    """One streamed piece of a call: the first carries its id and name."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def body(self) -> dict:
        out: dict = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
        function = {"arguments": self.arguments}
        if self.name is not None:
            function = {"name": self.name, "arguments": self.arguments}
        out["function"] = function
        return out


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def body(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class _Value:
    """Scans a JSON value character by character: where it ends, strings and escapes included. A
    number, ``true``, ``false`` or ``null`` ends only at a character that is not its own
    (:meth:`ends_before`)."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    started: bool = False

    def take(self, ch: str) -> bool:
        """Add ``ch``; True once the value is complete (``ch`` was its last character)."""
        self.started = True
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                return self.depth == 0
            return False
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            return self.depth <= 0
        return False

    def ends_before(self, ch: str) -> bool:
        """True when the value is a scalar that ended before ``ch``."""
        return self.started and self.depth == 0 and not self.in_string and ch not in _SCALAR


@dataclass
class HermesToolParser:
    """Text in (any split), ``(content delta, tool-call deltas)`` out; see the module docstring."""

    calls_only: bool = False  # "required" or named: the constraint lets the model write calls only
    calls: list[ToolCall] = field(default_factory=list)
    _buffer: str = ""
    _state: str = "text"  # "text" | "head" (before the arguments) | "arguments" | "tail" (until END)
    _held_space: str = ""  # whitespace that may turn out to precede a call (then dropped)
    _value: _Value | None = None
    _after_call: bool = False
    _wrote: bool = False  # content has been written
    _gap: bool = False  # a call came since: text written next is joined with one space (not glued on)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        self._buffer += text
        content, deltas = [], []
        while self._step(content, deltas, final):
            pass
        if final:
            self._write(self._finish(), content)
        return "".join(content), deltas

    def _write(self, text: str, content: list[str]) -> None:
        """Content out; text after calls that follows earlier text is set apart by one space (the
        whitespace around a call goes with it: "Sure! <call> done" reads "Sure! done")."""
        if not text:
            return
        if self._gap and self._wrote:
            text = " " + text
        content.append(text)
        self._wrote, self._gap = True, False

    def _step(self, content: list[str], deltas: list[ToolCallDelta], final: bool) -> bool:
        """Consume what can be decided now; True when there may be more."""
        if self._state == "text":
            return self._text(content, final)
        if self._state == "head":
            return self._head(content, deltas)
        if self._state == "arguments":
            return self._arguments(deltas)
        return self._tail()

    def _text(self, content: list[str], final: bool) -> bool:
        at = self._buffer.find(START)
        if at >= 0:
            self._emit_text(self._buffer[:at], content)
            self._buffer, self._state = self._buffer[at + len(START):], "head"
            return True
        keep = 0 if final and not self.calls_only else _partial_suffix(self._buffer, START)  # may begin a call
        self._emit_text(self._buffer[: len(self._buffer) - keep], content)
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return False

    def _emit_text(self, text: str, content: list[str]) -> None:
        """Content, without the whitespace between calls: trailing whitespace is held until what
        follows it is known (dropped before a call, written before text or a ``<tool_call>`` that
        is none)."""
        text = self._held_space + text
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        stripped = text.rstrip()
        self._write(stripped, content)
        self._held_space = text[len(stripped):]

    def _head(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        found = _HEAD.match(self._buffer)
        if found is None:
            end = self._buffer.find(END)
            if end < 0:
                return False
            is_call = self._whole_call(self._buffer[:end], content, deltas)  # another key order, or no call
            self._buffer = self._buffer[end + len(END):]
            self._state, self._after_call = "text", is_call
            return True
        name = json.loads(f'"{found.group(1)}"')
        self._held_space = ""
        call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", name)
        self.calls.append(call)
        deltas.append(ToolCallDelta(len(self.calls) - 1, "", call.id, name))
        self._buffer, self._state, self._value = self._buffer[found.end():], "arguments", _Value()
        return True

    def _whole_call(self, body: str, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        try:
            value = json.loads(body)
            name, arguments = value["name"], value.get("arguments", value.get("parameters", {}))
            if not isinstance(name, str):
                raise TypeError(name)
        except (ValueError, KeyError, TypeError):
            self._write(self._held_space + START + body + END, content)  # not a call: the model's text
            self._held_space = ""
            return False
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        self._held_space = ""
        call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, text)
        self.calls.append(call)
        deltas.append(ToolCallDelta(len(self.calls) - 1, text, call.id, name))
        self._gap = True
        return True

    def _arguments(self, deltas: list[ToolCallDelta]) -> bool:
        taken, done = 0, False
        for ch in self._buffer:
            if self._value.ends_before(ch):
                done = True
                break
            taken += 1
            if not self._value.started and ch.isspace():
                continue  # before the value
            if self._value.take(ch):
                done = True
                break
        call, piece = self.calls[-1], self._buffer[:taken]
        if not call.arguments:
            piece = piece.lstrip()
        self._buffer = self._buffer[taken:]
        if piece:
            call.arguments += piece
            deltas.append(ToolCallDelta(len(self.calls) - 1, piece))
        if done:
            self._state = "tail"
        return done

    def _tail(self) -> bool:
        end = self._buffer.find(END)
        if end < 0:
            return False
        self._buffer, self._state, self._after_call = self._buffer[end + len(END):], "text", True
        self._gap = True
        return True

    def _finish(self) -> str:
        """At the end of the text: what is left. An unfinished call stays as far as it got; a
        ``<tool_call>`` that never named a function is text, unless :attr:`calls_only` (then it
        is a call cut off by ``max_tokens`` before its name: no content, no call)."""
        rest, self._buffer = self._buffer, ""
        held, self._held_space = self._held_space, ""
        if self._state == "head":
            self._state = "text"
            return "" if self.calls_only else held + (START + rest).rstrip()
        if self._state == "text":
            if self.calls_only and START.startswith(rest.strip()):
                return ""  # a call's first characters
            text = held + rest
            return text.rstrip() if self.calls else text
        return ""


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (held back: it may become one)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse_tool_calls(text: str, calls_only: bool = False) -> tuple[str | None, list[ToolCall]]:
    """A whole message: ``(content or None, calls)``, exactly what a stream of it sends."""
    parser = HermesToolParser(calls_only)
    content, _ = parser.feed(text, final=True)
    return (content or None) if parser.calls or calls_only else content, parser.calls
