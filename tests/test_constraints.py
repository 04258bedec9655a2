"""hf_paged.constraints on its own: the generate() logits processor with and without the flag
(greedy, beams, seeded sampling; ``torch.equal``), which JSON-schema keywords xgrammar enforces
(the checker's allow list, re-checked against the installed xgrammar), the compiler's cache,
errors and limits, special tokens, and the UTF-8 guard."""

from __future__ import annotations

import gc
import json
import weakref

import jsonschema
import pytest
import torch
import xgrammar as xgr

import hf_paged
from hf_paged import constraints
from hf_paged.constraints import ConstraintCompiler, ConstraintError, StructuredOutputsParams, UnsupportedSchemaError
from hf_paged.constraints.compiler import json_grammar
from hf_paged.constraints.schema import ENFORCED, FORMATS, REFUSED
from hf_paged.constraints.utf8 import Utf8Guard
from hf_paged.demo import byte_tokenizer
from tests.helpers.serving import tiny_model

TOKENIZER = byte_tokenizer()
VOCAB, EOS = 259, 2
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "n", "tags"]}


@pytest.fixture(scope="module")
def model():
    model = tiny_model()
    hf_paged.enable(model)
    return model


@pytest.fixture(scope="module")
def compiler():
    return ConstraintCompiler(TOKENIZER, VOCAB, [EOS])


# ---------------------------------------------------------------------------- generate()
def generate(model, processor_factory, flag: bool, **options):
    enc = TOKENIZER(["Hello there", "Hi"], return_tensors="pt", padding=True)
    torch.manual_seed(0)
    extra = {"cache_implementation": "hf_paged"} if flag else {}
    out = model.generate(**enc, max_new_tokens=60, logits_processor=[processor_factory()], pad_token_id=0,
                         eos_token_id=EOS, **extra, **options)
    return out, enc.input_ids.shape[1]


@pytest.mark.parametrize("options", [dict(do_sample=False), dict(num_beams=2, num_return_sequences=2,
                                                                  do_sample=False),
                                     dict(do_sample=True, num_return_sequences=3)],
                         ids=["greedy", "beam2", "seeded-n3"])
def test_the_processor_through_the_flag_equals_it_without(model, options):
    factory = lambda: constraints.json_schema(TOKENIZER, SCHEMA)  # noqa: E731
    stock, prompt_len = generate(model, factory, flag=False, **options)
    paged, _ = generate(model, factory, flag=True, **options)
    assert torch.equal(stock, paged)
    finished = 0
    for row in paged:
        tokens = row[prompt_len:].tolist()
        text = TOKENIZER.decode(tokens, skip_special_tokens=True)
        if EOS in tokens:
            jsonschema.validate(json.loads(text), SCHEMA)
            finished += 1
    assert finished >= len(paged) - 1
    if options.get("num_beams", 1) == 1 and not options.get("do_sample"):  # the negative control
        unconstrained, _ = generate(model, lambda: lambda ids, scores: scores, flag=True, **options)
        assert not torch.equal(unconstrained[:, prompt_len:], paged[:, prompt_len:])


@pytest.mark.parametrize("factory, valid", [
    (lambda: constraints.regex(TOKENIZER, r"[a-c]{2}-\d{2,3}"), lambda t: __import__("re").fullmatch(r"[a-c]{2}-\d{2,3}", t)),
    (lambda: constraints.choice(TOKENIZER, ["left", "right"]), lambda t: t in ("left", "right")),
    (lambda: constraints.grammar(TOKENIZER, 'root ::= "(" [0-9]{1,3} ")"'), lambda t: t[0] == "(" and t[-1] == ")"),
    (lambda: constraints.json_object(TOKENIZER), lambda t: isinstance(json.loads(t), dict)),
], ids=["regex", "choice", "grammar", "json_object"])
def test_other_constraints_in_generate(model, factory, valid):
    out, prompt_len = generate(model, factory, flag=True, num_beams=2, do_sample=False)
    for row in out:
        tokens = row[prompt_len:].tolist()
        if EOS in tokens:
            assert valid(TOKENIZER.decode(tokens, skip_special_tokens=True))


def test_a_bad_constraint_raises_where_the_processor_is_built():
    with pytest.raises(ConstraintError, match="invalid regex"):
        constraints.regex(TOKENIZER, "(a")
    with pytest.raises(UnsupportedSchemaError, match="uniqueItems"):
        constraints.json_schema(TOKENIZER, {"type": "array", "uniqueItems": True})


# ---------------------------------------------------------------------------- what xgrammar enforces
ENFORCED_CASES = {  # keyword -> (schema, a valid instance, an invalid one)
    "type": ({"type": "integer"}, "1", '"x"'), "enum": ({"enum": ["x", 1]}, "1", '"y"'),
    "const": ({"const": "x"}, '"x"', '"y"'),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "null", "true"),
    "allOf": ({"allOf": [{"type": "integer", "maximum": 3}]}, "2", "5"),
    "$ref": ({"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a"}, "1", '"x"'),
    "properties": ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a": 1}', '{"a": "x"}'),
    "required": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, '{"a": 1}', "{}"),
    "additionalProperties": ({"type": "object", "additionalProperties": {"type": "integer"}}, '{"b": 1}',
                             '{"b": "x"}'),
    "patternProperties": ({"type": "object", "patternProperties": {"^a": {"type": "integer"}},
                           "additionalProperties": False}, '{"a": 1}', '{"a": "x"}'),
    "propertyNames": ({"type": "object", "additionalProperties": {"type": "integer"},
                       "propertyNames": {"pattern": "^a"}}, '{"a": 1}', '{"b": 1}'),
    "minProperties": ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1},
                      '{"a": 1}', "{}"),
    "maxProperties": ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
                      '{"a": 1}', '{"a": 1, "b": 2}'),
    "items": ({"type": "array", "items": {"type": "integer"}}, "[1]", '["x"]'),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, "[1]", "[1, 2]"),
    "minItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[1, 2]", "[1]"),
    "maxItems": ({"type": "array", "items": {"type": "integer"}, "maxItems": 1}, "[1]", "[1, 2]"),
    "minLength": ({"type": "string", "minLength": 2}, '"ab"', '"a"'),
    "maxLength": ({"type": "string", "maxLength": 2}, '"ab"', '"abc"'),
    "pattern": ({"type": "string", "pattern": "^a+$"}, '"aa"', '"ab"'),
    "format": ({"type": "string", "format": "date"}, '"2024-01-02"', '"soon"'),
    "minimum": ({"type": "number", "minimum": 1.5}, "2.5", "1"),
    "maximum": ({"type": "integer", "maximum": 5}, "5", "6"),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 5}, "6", "5"),
    "exclusiveMaximum": ({"type": "number", "exclusiveMaximum": 5}, "4.5", "5"),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "6", "7"),
}
NOT_ENFORCED = {  # what xgrammar lets through: why the checker refuses these
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    "not": ({"not": {"type": "integer"}}, "1"),
    "if": ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 7}}, "9"),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1"),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "[1]"),
    "dependentRequired": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
}


def matches(compiler, schema, text: str) -> bool:
    params = StructuredOutputsParams.__new__(StructuredOutputsParams)  # unchecked: the backend alone is tested
    params.__dict__.update(json=schema, kind="json", key=("probe", json.dumps(schema, sort_keys=True)),
                           disable_any_whitespace=True)
    matcher = xgr.GrammarMatcher(compiler.compile(params))
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("keyword", sorted(ENFORCED))
def test_every_allowed_keyword_is_enforced(compiler, keyword):
    if keyword in ("$defs", "definitions", "additionalItems"):
        pytest.skip("holds subschemas only (enforced through $ref / with prefixItems)")
    schema, good, bad = ENFORCED_CASES[keyword]
    checker = jsonschema.FormatChecker()
    jsonschema.validate(json.loads(good), schema, format_checker=checker)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(bad), schema, format_checker=checker)
    assert matches(compiler, schema, good) and not matches(compiler, schema, bad)


@pytest.mark.parametrize("keyword", sorted(NOT_ENFORCED))
def test_refused_keywords_are_not_enforced_by_xgrammar(compiler, keyword):
    """If a newer xgrammar enforces one of these, it can move to the allow list."""
    schema, invalid = NOT_ENFORCED[keyword]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(invalid), schema)
    assert matches(compiler, schema, invalid)
    assert keyword in REFUSED
    with pytest.raises(UnsupportedSchemaError, match=keyword):
        StructuredOutputsParams(json=schema)


IGNORED_BESIDE = {  # xgrammar builds these nodes from $ref / enum / const / anyOf / allOf alone
    "const+minimum": ({"type": "integer", "const": 5, "minimum": 6}, "5", "minimum", "/"),
    "enum+type": ({"type": "integer", "enum": [1, "a"]}, '"a"', "type", "/"),
    "enum+const": ({"enum": ["a"], "const": "b"}, '"b"', "const", "/"),
    "anyOf+type": ({"anyOf": [{"type": "integer"}, {"type": "string"}], "type": "integer"}, '"a"', "type", "/"),
    "$ref+maxLength": ({"$defs": {"s": {"type": "string"}}, "type": "object", "properties": {
        "s": {"$ref": "#/$defs/s", "maxLength": 2}}, "required": ["s"]}, '{"s": "abc"}', "maxLength", "/properties/s"),
    "allOf+maxLength": ({"allOf": [{"type": "string"}], "maxLength": 2}, '"abc"', "maxLength", "/"),
    "lookahead": ({"type": "string", "pattern": "^(?!a)[a-z]+$"}, '"abc"', "pattern", "/"),
    "lookbehind": ({"type": "array", "items": {"type": "string", "pattern": "(?<!x)a"}}, None, "pattern", "/items"),
}


@pytest.mark.parametrize("case", sorted(IGNORED_BESIDE))
def test_keywords_xgrammar_would_skip_are_refused(compiler, case):
    """The backend lets the invalid instance through (lookbehinds it refuses itself, in the C++
    log's words); the checker names the skipped keyword and where it is."""
    schema, invalid, keyword, path = IGNORED_BESIDE[case]
    if invalid is not None:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(invalid), schema)
        assert matches(compiler, schema, invalid)
    with pytest.raises(UnsupportedSchemaError, match=f"'{keyword}' at {path} cannot be enforced"):
        StructuredOutputsParams(json=schema)


def test_redundant_keywords_beside_enum_const_and_ref_are_allowed():
    """What pydantic writes: a type every enum/const value has, annotations, a root's $defs; and a
    pattern whose "(?=" is escaped or in a character class."""
    for schema in ({"enum": ["red", "green"], "title": "Color", "type": "string"}, {"const": "x", "type": "string"},
                   {"type": ["integer", "null"], "enum": [1, 2.0, None]}, {"anyOf": [{"type": "null"}], "default": None},
                   {"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n", "description": "n", "default": 1},
                   {"type": "string", "pattern": r"^\(?=[(?=]$"}):
        StructuredOutputsParams(json=schema)


def test_formats_listed_as_checked_are_checked(compiler):
    for name in sorted(FORMATS):
        assert not matches(compiler, {"type": "string", "format": name}, '"not ! valid ~"'), name


def test_length_bounded_strings_stay_valid_json(compiler):
    """xgrammar alone lets raw control characters into a length-bounded string; json_grammar does not."""
    schema = {"type": "string", "maxLength": 4}
    loose = compiler._compiler().compile_json_schema(schema, any_whitespace=False)
    assert xgr.GrammarMatcher(loose).accept_string('"a\tb"')  # the xgrammar behaviour worked around
    assert not matches(compiler, schema, '"a\tb"')
    assert matches(compiler, schema, '"abcd"') and not matches(compiler, schema, '"abcde"')
    assert "\\x1f" in json_grammar(schema)
    with pytest.raises(UnsupportedSchemaError, match="maxLength"):
        StructuredOutputsParams(json={"type": "string", "pattern": "^a+$", "maxLength": 3})


# ---------------------------------------------------------------------------- params, compiler, guard
@pytest.mark.parametrize("fields, match", [
    ({}, "exactly one"), ({"regex": "a", "choice": ["b"]}, "exactly one"), ({"choice": []}, "choice"),
    ({"choice": ["a", ""]}, "non-empty"), ({"json": "{not json"}, "not valid JSON"), ({"json": [1]}, "JSON object"),
    ({"regex": "a" * 70_000}, "larger than"), ({"json_object": False}, "exactly one"),
    ({"json": {"type": "object", "x-extension": 1}}, "x-extension"),
    ({"json": {"type": "wat"}}, "unknown type"),
])
def test_params_are_checked(fields, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**fields)


def test_grammar_kind_and_keys():
    assert StructuredOutputsParams(grammar='start: "a"').is_lark
    assert not StructuredOutputsParams(grammar='root ::= "a"').is_lark
    assert StructuredOutputsParams(json='{"type": "object"}').key == StructuredOutputsParams(json={"type": "object"}).key
    assert StructuredOutputsParams(json={"type": "object"}).key != \
        StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=False).key


def test_the_compiler_caches_grammars_and_errors():
    compiler = ConstraintCompiler(TOKENIZER, VOCAB, [EOS])
    params = StructuredOutputsParams(regex="[ab]+")
    assert compiler.cached(params) is None
    first = compiler.compile(params)
    assert compiler.compile(StructuredOutputsParams(regex="[ab]+")) is first and compiler.cached(params) is first
    assert compiler.stats["compiled"] == 1 and compiler.stats["cache_hits"] == 1
    bad = StructuredOutputsParams(regex="(a")
    with pytest.raises(ConstraintError, match=r"^invalid regex: Regex parsing error"):  # no C++ source location
        compiler.compile(bad)
    with pytest.raises(ConstraintError):
        compiler.cached(bad)
    assert compiler.stats["failed"] == 1
    small = ConstraintCompiler(TOKENIZER, VOCAB, [EOS], max_grammar_bytes=1000)
    with pytest.raises(ConstraintError, match="MiB, over the limit"):
        small.compile(StructuredOutputsParams(json={"type": "string", "maxLength": 5000}))
    tiny_cache = ConstraintCompiler(TOKENIZER, VOCAB, [EOS], cache_size=1)
    tiny_cache.compile(StructuredOutputsParams(regex="a"))
    tiny_cache.compile(StructuredOutputsParams(regex="b"))
    assert tiny_cache.cached(StructuredOutputsParams(regex="a")) is None


class _Request:
    """Stands for what a caller's frame holds while it waits for a compile (a request, its prompt)."""


def test_a_cached_error_does_not_keep_its_callers_alive():
    """Each request that sends a bad constraint again gets the cached error: a fresh copy, so its raise
    does not chain the caller's frames onto the cached one (a server kept every such request's body
    alive while the bad schema stayed in the cache)."""
    compiler = ConstraintCompiler(TOKENIZER, VOCAB, [EOS])
    bad = StructuredOutputsParams(regex="(a")

    def ask(how: str) -> weakref.ref:
        request = _Request()
        try:
            if how == "compile":
                compiler.compile(bad)
            elif how == "cached":
                compiler.cached(bad)
            else:
                compiler.submit(bad).result()
        except ConstraintError:
            pass
        return weakref.ref(request)

    asked = [ask(how) for how in ("compile", "compile", "cached", "submit", "cached")]
    gc.collect()
    assert all(ref() is None for ref in asked)
    assert compiler.stats["failed"] == 1 and compiler.stats["cache_hits"] >= 2
    raised = []
    for _ in range(2):
        with pytest.raises(ConstraintError, match="invalid regex") as info:
            compiler.cached(bad)
        raised.append(info.value)
    assert raised[0] is not raised[1] and raised[0].kind == raised[1].kind == "regex"


def test_special_tokens_are_never_allowed(compiler):
    """<pad> and <s> have text to xgrammar's eyes; the engine's text skips them."""
    matcher = xgr.GrammarMatcher(compiler.compile(StructuredOutputsParams(json={"type": "string"})))
    matcher.accept_string('"')
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    matcher.fill_next_token_bitmask(bitmask)
    logits = torch.zeros(1, VOCAB)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    assert torch.isinf(logits[0, :3]).all() and torch.isfinite(logits[0, 3:]).sum() > 100


def test_the_utf8_guard_clears_overlong_forms_and_surrogates():
    byte_of = {i: bytes([b]) for i, b in enumerate(range(256), start=3)}
    vocab = [b"<pad>", b"<s>", b"</s>"] + [byte_of[i] for i in range(3, VOCAB)]
    width = xgr.get_bitmask_shape(1, VOCAB)[1]
    guard = Utf8Guard(vocab, width)
    for lead, (low, high) in {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}.items():
        bitmask = torch.full((1, width), -1, dtype=torch.int32)
        guard.apply(bitmask, [0], [3 + lead])
        logits = torch.zeros(1, VOCAB)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        allowed = {i - 3 for i in torch.isfinite(logits[0]).nonzero()[:, 0].tolist()}
        continuations = {b for b in allowed if 0x80 <= b <= 0xBF}
        assert continuations == set(range(low, high + 1)), hex(lead)
    multi = vocab + [b"\xed\xa0\x80", b"ok"]
    guard = Utf8Guard(multi, xgr.get_bitmask_shape(1, len(multi))[1])
    bitmask = torch.full((1, guard.always.shape[0]), -1, dtype=torch.int32)
    guard.apply(bitmask, [0], [None])
    logits = torch.zeros(1, len(multi))
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    assert torch.isinf(logits[0, VOCAB]) and torch.isfinite(logits[0, VOCAB + 1])
