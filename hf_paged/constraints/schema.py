"""Which JSON-schema keywords a constraint may use: those the grammar backend enforces.

xgrammar turns a schema into a grammar and skips what it cannot express. A skipped keyword would
let the model produce JSON the schema rejects while the caller believes it was enforced, so
:func:`check_schema` refuses every keyword outside the list below, naming it and where it is
(a JSON pointer). The list was drawn up by compiling, for each keyword, a schema with a valid and
an invalid instance and checking that xgrammar 0.2.8 accepts the one and rejects the other
(``tests/test_constraints.py`` keeps checking it). Annotations that constrain nothing (``title``,
``description``, ...) are allowed.

xgrammar also builds a node with ``$ref``, ``enum``, ``const``, ``anyOf`` or ``allOf`` from that
keyword alone, skipping the node's others, and drops lookaheads and lookbehinds from a ``pattern``:
those are refused too (a ``type`` beside ``enum``/``const`` is allowed when every value has it, as
pydantic writes them). ``format`` checks the syntax, not every rule: a date's day is not checked
against its month (``2024-02-30`` passes), ipv4 parts may have leading zeros.

Some keywords are enforced more strictly than the schema asks, which keeps every output valid:
``pattern`` matches the whole string (JSON Schema searches), objects without
``additionalProperties`` get none (OpenAI's strict mode), properties come in the schema's order.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                         "readOnly", "writeOnly"})
TYPES = frozenset({"string", "integer", "number", "boolean", "null", "object", "array"})
# keyword -> how its value holds subschemas: "schema", "list" (of schemas), "map" (name -> schema) or None
ENFORCED = {
    "type": None, "enum": None, "const": None, "anyOf": "list", "allOf": "list", "$ref": None, "$defs": "map",
    "definitions": "map",
    "properties": "map", "required": None, "additionalProperties": "schema", "patternProperties": "map",
    "propertyNames": "schema", "minProperties": None, "maxProperties": None,
    "items": "schema", "prefixItems": "list", "additionalItems": "schema", "minItems": None, "maxItems": None,
    "minLength": None, "maxLength": None, "pattern": None, "format": None,
    "minimum": None, "maximum": None, "exclusiveMinimum": None, "exclusiveMaximum": None, "multipleOf": None,
}
# string formats xgrammar checks, by their syntax (others, e.g. "idn-email" or "int32", it lets any
# string through)
FORMATS = frozenset({"email", "date", "date-time", "time", "duration", "uuid", "ipv4", "ipv6", "uri", "uri-reference",
                     "hostname", "uri-template", "json-pointer", "relative-json-pointer"})
# why the keywords xgrammar leaves unenforced are refused (anything else unknown: "not a keyword it enforces")
REFUSED = {
    "uniqueItems": "items are not checked for uniqueness",
    "contains": "arrays are not checked for a matching item", "minContains": "matching items are not counted",
    "maxContains": "matching items are not counted",
    "not": "negated schemas are not enforced", "if": "conditional schemas are not enforced",
    "then": "conditional schemas are not enforced", "else": "conditional schemas are not enforced",
    "oneOf": "'exactly one' is not enforced (overlapping branches would both be allowed); use anyOf",
    "dependentRequired": "dependencies between properties are not enforced",
    "dependentSchemas": "dependencies between properties are not enforced",
    "dependencies": "dependencies between properties are not enforced",
    "unevaluatedProperties": "use additionalProperties", "unevaluatedItems": "use items",
}
# keywords xgrammar builds a node from alone; beside them only annotations and definitions may stand
ALONE = ("$ref", "enum", "const", "anyOf", "allOf")
BESIDE_ALONE = ANNOTATIONS | {"$defs", "definitions"}
_JSON_TYPES = {"string": str, "boolean": bool, "null": type(None), "object": dict, "array": list}
# a lookahead or lookbehind group, outside escapes and character classes
_LOOKAROUND = re.compile(r"\\.|\[(?:\\.|[^\]\\])*\]|(\(\?<?[=!])")
MAX_DEPTH = 32
MAX_PROPERTIES = 512  # declared properties in the whole schema: compile time grows with them


class UnsupportedSchemaError(ValueError):
    """A schema that cannot be enforced as written; ``keyword`` and ``path`` (a JSON pointer) say where."""

    def __init__(self, keyword: str, path: str, why: str):
        super().__init__(f"JSON schema keyword '{keyword}' at {path or '/'} cannot be enforced: {why}")
        self.keyword, self.path = keyword, path


def check_schema(schema: Any) -> None:
    """Raise :class:`UnsupportedSchemaError` for the first keyword the backend would not enforce,
    or ``ValueError`` for a schema that is not one (a value of the wrong kind)."""
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
    properties = 0
    for node, path, depth in _nodes(schema):
        if depth > MAX_DEPTH:
            raise UnsupportedSchemaError("(nesting)", path, f"schemas nest deeper than {MAX_DEPTH} levels")
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            raise ValueError(f"JSON schema at {path or '/'}: a schema must be an object or a boolean, "
                             f"got {type(node).__name__}")
        for keyword, value in node.items():
            _check_keyword(node, keyword, value, path)
        _check_alone(node, path)
        properties += len(node.get("properties", ()))
        if properties > MAX_PROPERTIES:
            raise UnsupportedSchemaError("properties", path, f"more than {MAX_PROPERTIES} properties in one schema")


def _check_keyword(node: dict, keyword: str, value: Any, path: str) -> None:
    where = f"{path}/{keyword}"
    if keyword in ANNOTATIONS:
        return
    if keyword in REFUSED:
        raise UnsupportedSchemaError(keyword, path, REFUSED[keyword])
    if keyword not in ENFORCED:
        raise UnsupportedSchemaError(keyword, path, "not a keyword the grammar backend enforces")
    if keyword == "type":
        types = value if isinstance(value, list) else [value]
        bad = [t for t in types if t not in TYPES]
        if bad or not types:
            raise ValueError(f"JSON schema at {where}: unknown type {bad[0] if bad else '[]'!r}")
    elif keyword == "format" and value not in FORMATS:
        raise UnsupportedSchemaError("format", path, f"format {value!r} is not checked (checked: "
                                                     f"{', '.join(sorted(FORMATS))})")
    elif keyword == "allOf" and (not isinstance(value, list) or len(value) != 1):
        raise UnsupportedSchemaError("allOf", path, "only a single-schema allOf is enforced (intersections are not)")
    elif keyword == "multipleOf" and not (node.get("type") == "integer" and _is_int(value) and value > 0):
        raise UnsupportedSchemaError("multipleOf", path, "enforced only as a positive integer on type 'integer'")
    elif keyword == "items" and isinstance(value, list):
        raise UnsupportedSchemaError("items", path, "an array of schemas in 'items' (draft 4 tuples): use prefixItems")
    elif keyword == "$ref" and not (isinstance(value, str) and value.startswith("#")):
        raise UnsupportedSchemaError("$ref", path, f"only references inside the schema ('#/...') resolve, got {value!r}")
    elif keyword == "required":
        _check_required(node, value, path)
    elif keyword == "pattern" and isinstance(value, str) and any(m.group(1) for m in _LOOKAROUND.finditer(value)):
        raise UnsupportedSchemaError("pattern", path, "lookaheads and lookbehinds are dropped by the grammar "
                                                      "backend (a regex constraint refuses them too)")
    elif keyword in ("minLength", "maxLength") and ("pattern" in node or "format" in node):
        raise UnsupportedSchemaError(keyword, path, "not enforced beside pattern or format (the pattern alone "
                                                    "is); write the length into the pattern")


def _check_alone(node: dict, path: str) -> None:
    """A keyword beside one of ``ALONE`` would be skipped: refused (a ``type`` that every value of
    ``enum``/``const`` has is redundant, so allowed)."""
    alone = next((keyword for keyword in ALONE if keyword in node), None)
    if alone is None:
        return
    for keyword in node:
        if keyword == alone or keyword in BESIDE_ALONE or (keyword == "type" and _values_typed(node, alone)):
            continue
        raise UnsupportedSchemaError(keyword, path, f"ignored beside '{alone}' (the grammar backend builds "
                                                    f"this schema from '{alone}' alone)")


def _values_typed(node: dict, alone: str) -> bool:
    """Every value ``enum``/``const`` allows has one of the node's types."""
    if alone not in ("enum", "const"):
        return False
    values = [node["const"]] if alone == "const" else node["enum"] if isinstance(node["enum"], list) else []
    types = node["type"] if isinstance(node["type"], list) else [node["type"]]
    return all(any(_has_type(value, name) for name in types) for value in values)


def _has_type(value: Any, name: str) -> bool:
    if name == "integer":
        return _is_int(value) or (isinstance(value, float) and value.is_integer())
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _JSON_TYPES[name])


def _check_required(node: dict, required: Any, path: str) -> None:
    """A required name missing from ``properties`` is not enforced by xgrammar (``{}`` passes)."""
    if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
        raise ValueError(f"JSON schema at {path}/required: must be a list of property names")
    declared = node.get("properties", {})
    missing = [name for name in required if name not in declared]
    if missing:
        raise UnsupportedSchemaError("required", path, f"'{missing[0]}' is required but not declared in properties")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _nodes(schema: Any) -> Iterator[tuple[Any, str, int]]:
    """Every subschema with its JSON pointer and depth (iterative: no recursion limit to hit)."""
    stack = [(schema, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        yield node, path, depth
        if not isinstance(node, dict):
            continue
        for keyword, kind in ENFORCED.items():
            value = node.get(keyword)
            if kind is None or value is None:
                continue
            where = f"{path}/{keyword}"
            if kind == "schema" and not isinstance(value, list):
                stack.append((value, where, depth + 1))
            elif kind == "list" and isinstance(value, list):
                stack += [(item, f"{where}/{i}", depth + 1) for i, item in enumerate(value)]
            elif kind == "map" and isinstance(value, dict):
                stack += [(item, f"{where}/{_escape(name)}", depth + 1) for name, item in value.items()]
            elif kind in ("list", "map"):
                raise ValueError(f"JSON schema at {where}: must be {'a list' if kind == 'list' else 'an object'}")


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
