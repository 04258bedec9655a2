"""``StructuredOutputsParams``: one request's output constraint (vLLM's name and fields), validated once.

Exactly one of ``json`` (a JSON schema), ``json_object`` (any JSON object), ``regex``, ``choice``
(one of some strings), ``grammar`` (EBNF as xgrammar and llama.cpp's GBNF write it, or Lark when
it has no ``::=``) or ``structural_tag`` (xgrammar's format: what tool calling builds; vLLM's older
``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`` is converted to it) is set.
Everything that can be checked without compiling is checked here, so the engine, the server and
``generate()``'s processors refuse the same things with the same messages: sizes (a constraint is
at most ``MAX_CONSTRAINT_BYTES`` of text, a structural tag ``MAX_STRUCTURAL_TAG_BYTES``, choices
``MAX_CHOICES`` options) and JSON-schema keywords the backend would not enforce
(:mod:`hf_paged.constraints.schema`). Syntax errors in a regex or a grammar surface when it compiles
(:mod:`hf_paged.constraints.compiler`).

JSON whitespace is bounded: ``disable_any_whitespace=True`` (the default, vLLM's
``disable-any-whitespace``) gives compact JSON (``{"a": 1, "b": [2, 3]}``: one space after ``:``
and ``,``, none elsewhere); False allows up to ``MAX_JSON_WHITESPACE`` whitespace characters between
tokens. Either way a weak model cannot spend its tokens on spaces.
"""

from __future__ import annotations

import json as json_module
from dataclasses import dataclass, field
from typing import Any

from hf_paged.constraints.schema import check_schema

MAX_CONSTRAINT_BYTES = 64 * 1024  # a schema's JSON text, a regex, a grammar, or all choices together
# A structural tag bundles one grammar per tag: tool calling's has one per declared tool (~2 KB for a
# few parameters), so an agent's 50-200 tools need more than one schema's limit. Compiling stays
# bounded by the compiler's timeout and compiled-size limit (200 such tools compile in ~0.1 s).
MAX_STRUCTURAL_TAG_BYTES = 1024 * 1024
MAX_CHOICES = 1024
MAX_JSON_WHITESPACE = 4  # whitespace characters between JSON tokens when any whitespace is allowed
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """One output constraint; invalid values raise ``ValueError`` naming the field
    (``StructuredOutputsParams.<field> ...``)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict | str | None = None
    disable_any_whitespace: bool = True
    kind: str = field(init=False, default="")
    key: tuple = field(init=False, default=(), repr=False)  # what the compile cache is keyed by

    def __post_init__(self) -> None:
        chosen = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError("StructuredOutputsParams takes exactly one of " + ", ".join(KINDS)
                             + (f"; got {', '.join(chosen)}" if chosen else "; got none"))
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("StructuredOutputsParams.disable_any_whitespace must be a bool")
        self.kind = chosen[0]
        text = getattr(self, f"_check_{self.kind}")()
        limit = MAX_STRUCTURAL_TAG_BYTES if self.kind == "structural_tag" else MAX_CONSTRAINT_BYTES
        if len(text.encode("utf-8", "surrogatepass")) > limit:
            raise ValueError(f"StructuredOutputsParams.{self.kind} is larger than {limit} bytes")
        self.key = (self.kind, text, self.disable_any_whitespace)

    def _check_json(self) -> str:
        self.json = _json_value(self.json, "json")
        check_schema(self.json)
        return _canonical(self.json)

    def _check_json_object(self) -> str:
        if self.json_object is not True:
            raise ValueError("StructuredOutputsParams.json_object must be true when set")
        return ""

    def _check_regex(self) -> str:
        return _text(self.regex, "regex")

    def _check_grammar(self) -> str:
        return _text(self.grammar, "grammar")

    def _check_choice(self) -> str:
        choice = self.choice
        if not isinstance(choice, (list, tuple)) or not choice or len(choice) > MAX_CHOICES:
            raise ValueError(f"StructuredOutputsParams.choice must be a list of 1 to {MAX_CHOICES} strings")
        if not all(isinstance(c, str) and c for c in choice):
            raise ValueError("StructuredOutputsParams.choice must hold non-empty strings")
        self.choice = list(choice)
        return _canonical(self.choice)

    def _check_structural_tag(self) -> str:
        self.structural_tag = _current_tag(_json_value(self.structural_tag, "structural_tag"))
        for schema in _embedded_schemas(self.structural_tag):
            check_schema(schema)
        return _canonical(self.structural_tag)

    @property
    def is_lark(self) -> bool:
        """A grammar without ``::=`` is read as Lark (``start: ...``), as vLLM does."""
        return self.kind == "grammar" and "::=" not in self.grammar


def _json_value(value: Any, name: str) -> dict:
    if isinstance(value, str):
        try:
            value = json_module.loads(value)
        except ValueError as err:
            raise ValueError(f"StructuredOutputsParams.{name} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"StructuredOutputsParams.{name} must be a JSON object, got {type(value).__name__}")
    return value


def _current_tag(tag: dict) -> dict:
    """vLLM's older structural tag in xgrammar's current format, as xgrammar converts it (free text
    until a trigger, then a tag whose content follows its schema), so its schemas are checked."""
    if "structures" not in tag:
        return tag
    structures, triggers = tag["structures"], tag.get("triggers")
    if not (isinstance(structures, list) and isinstance(triggers, list) and all(isinstance(t, str) for t in triggers)
            and all(isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
                    and isinstance(s.get("schema"), dict) for s in structures)):
        raise ValueError('StructuredOutputsParams.structural_tag: the older format is {"type": "structural_tag", '
                         '"structures": [{"begin": str, "schema": {...}, "end": str}], "triggers": [str]}; '
                         'otherwise xgrammar\'s {"type": "structural_tag", "format": {...}}')
    tags = [{"type": "tag", "begin": s["begin"], "content": {"type": "json_schema", "json_schema": s["schema"]},
             "end": s["end"]} for s in structures]
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"StructuredOutputsParams.{name} must be a non-empty string")
    return value


def _canonical(value: Any) -> str:
    try:
        return json_module.dumps(value, sort_keys=True, ensure_ascii=False, allow_nan=False)
    except ValueError as err:  # NaN or inf in a schema
        raise ValueError(f"StructuredOutputsParams: not valid JSON ({err})") from None


def _embedded_schemas(value: Any):
    """The JSON schemas inside a structural tag (``{"type": "json_schema", "json_schema": {...}}``)."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and isinstance(node.get("json_schema"), dict):
                yield node["json_schema"]
            stack += list(node.values())
        elif isinstance(node, list):
            stack += node
