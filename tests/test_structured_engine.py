"""Structured outputs in LLMEngine: property tests (JSON schemas, regexes, choices) with negative
controls, every engine feature with a constraint (n > 1 seeded, stop strings, max_tokens,
preemption by recompute and swap, prefix caching), compiles off the engine thread, logit_bias,
refusals. Every output that finishes by "stop" must validate independently (``jsonschema``,
``re.fullmatch``); one cut by "length" must be a prefix the grammar accepts. Every test ends with
every KV block free."""

from __future__ import annotations

import json
import re
import string
import time
from collections import Counter

import jsonschema
import pytest
import torch
import xgrammar as xgr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_paged import LLMEngine, SamplingParams
from hf_paged.constraints import ConstraintCompiler, StructuredOutputsParams, UnsupportedSchemaError
from hf_paged.demo import byte_tokenizer
from hf_paged.engine.structured import StructuredOutputManager
from tests.helpers.serving import single_threaded_torch, tiny_model
from tests.helpers.tiny_models import assert_engine_idle

TOKENIZER = byte_tokenizer()
EOS = 2
PROPERTY = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def engine():
    with single_threaded_torch():
        yield LLMEngine(tiny_model(), TOKENIZER, num_blocks=512, max_num_seqs=64)


@pytest.fixture(autouse=True)
def all_blocks_free(request):
    yield
    if "engine" in request.fixturenames:
        assert_engine_idle(request.getfixturevalue("engine"))


def run(engine: LLMEngine, params: StructuredOutputsParams, max_new_tokens: int, prompt="Hello", **extra):
    """Greedy, and seeded sampling with n=3, side by side in one batch."""
    requests = [SamplingParams(max_new_tokens=max_new_tokens, temperature=0, structured_outputs=params, **extra),
                SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=7, n=3,
                               structured_outputs=params, **extra)]
    outputs = engine.generate([prompt, prompt], requests, use_tqdm=False)
    assert all(out.error is None for out in outputs), [out.error for out in outputs]
    return [c for out in outputs for c in out.outputs]


def grammar_accepts(engine: LLMEngine, params: StructuredOutputsParams, token_ids: list[int]) -> bool:
    """Whether a fresh matcher takes every token (the EOS that ended a "stop" output included)."""
    matcher = xgr.GrammarMatcher(engine.structured.compiler.compile(params))
    return all(matcher.accept_token(t) for t in token_ids)


def check_outputs(engine, params, completions, valid) -> Counter:
    """Each "stop" output passes ``valid(text)`` (an independent check); each "length" output is a
    prefix the grammar accepts. Returns the finish reasons."""
    reasons = Counter()
    for c in completions:
        reasons[c.finish_reason] += 1
        assert c.finish_reason in ("stop", "length"), c
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == EOS, f"stopped without EOS: {c.text!r}"
            valid(c.text)
        assert grammar_accepts(engine, params, c.token_ids), f"tokens outside the grammar: {c.text!r}"
    return reasons


# ---------------------------------------------------------------------------- JSON schemas
_NAMES = st.from_regex(r"[a-z]{1,4}", fullmatch=True)
_TEXT = st.text(alphabet=string.ascii_letters + "é中 -", min_size=1, max_size=4)


def _scalars():
    return st.one_of(
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-60, 60), st.integers(0, 150)),
        st.builds(lambda lo: {"type": "integer", "exclusiveMinimum": lo, "exclusiveMaximum": lo + 20},
                  st.integers(-10, 10)),
        st.just({"type": "boolean"}), st.just({"type": "null"}),
        st.builds(lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
                  st.integers(0, 3), st.integers(0, 3)),
        st.lists(_TEXT | st.integers(-9, 9), min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
        _TEXT.map(lambda v: {"const": v}),
    )


def _objects(inner):
    return st.dictionaries(_NAMES, inner, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda required: {"type": "object", "properties": props, "required": required}))


def _composites(inner):
    return st.one_of(
        st.builds(lambda items, hi: {"type": "array", "items": items, "maxItems": hi}, inner, st.integers(0, 3)),
        _objects(inner),
        st.lists(inner, min_size=2, max_size=2).map(lambda options: {"anyOf": options}),
    )


SCHEMAS = _objects(st.recursive(_scalars(), _composites, max_leaves=4))
FIXED_SCHEMAS = [  # the negative controls' cases (and examples the property test always runs)
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["x", "y", 3]}, "maxItems": 3},
                                      "ok": {"type": "boolean"}}, "required": ["tags", "ok"]},
    {"type": "object", "properties": {"n": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 5,
                                                                          "maximum": 9}]}}, "required": ["n"]},
]


def check_schema_outputs(engine, schema) -> Counter:
    params = StructuredOutputsParams(json=schema)
    return check_outputs(engine, params, run(engine, params, max_new_tokens=160),
                         lambda text: jsonschema.validate(json.loads(text), schema))


def test_json_schema_outputs_validate(engine):
    reasons = Counter()

    @PROPERTY
    @given(SCHEMAS)
    def check(schema):
        reasons.update(check_schema_outputs(engine, schema))

    for schema in FIXED_SCHEMAS:
        reasons.update(check_schema_outputs(engine, schema))
    check()
    print(f"JSON schema outputs: {dict(reasons)}")
    assert reasons["stop"] >= 0.8 * sum(reasons.values()), reasons  # the property is not checked on prefixes alone


def _disable_mask(monkeypatch):
    """The negative control: no mask and no matcher (tokens are sampled as if unconstrained)."""
    monkeypatch.setattr(StructuredOutputManager, "mask", lambda self, *args: None)
    monkeypatch.setattr(StructuredOutputManager, "advance", lambda self, *args: None)


def test_json_schema_property_fails_without_the_mask(engine, monkeypatch):
    _disable_mask(monkeypatch)
    for schema in FIXED_SCHEMAS:
        with pytest.raises((AssertionError, ValueError, jsonschema.ValidationError)):
            check_schema_outputs(engine, schema)
    engine.structured._active.clear()  # the disabled hooks never forgot the requests


# ---------------------------------------------------------------------------- regexes and choices
_ATOMS = st.sampled_from(["a", "b", "x", "0", "7", "-", "[a-c]", "[0-9]", "[xyz]", "\\d"])


def _regex_parts(inner):
    return st.one_of(
        st.lists(inner, min_size=2, max_size=3).map("".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda alts: "(" + "|".join(alts) + ")"),
        st.tuples(inner, st.sampled_from(["?", "*", "+", "{1,3}", "{2}"])).map(lambda t: f"({t[0]}){t[1]}"),
    )


REGEXES = st.recursive(_ATOMS, _regex_parts, max_leaves=8)
FIXED_REGEXES = [r"[a-c]{3}-\d{2,4}", r"(yes|no)!", r"x[0-9]+y"]


def check_regex_outputs(engine, pattern) -> Counter:
    params = StructuredOutputsParams(regex=pattern)

    def valid(text):
        assert re.fullmatch(pattern, text), f"{text!r} does not match {pattern!r}"

    return check_outputs(engine, params, run(engine, params, max_new_tokens=48), valid)


def test_regex_outputs_match(engine):
    reasons = Counter()

    @PROPERTY
    @given(REGEXES)
    def check(pattern):
        reasons.update(check_regex_outputs(engine, pattern))

    for pattern in FIXED_REGEXES:
        reasons.update(check_regex_outputs(engine, pattern))
    check()
    print(f"regex outputs: {dict(reasons)}")
    assert reasons["stop"] >= 0.7 * sum(reasons.values()), reasons


def test_regex_property_fails_without_the_mask(engine, monkeypatch):
    _disable_mask(monkeypatch)
    for pattern in FIXED_REGEXES:
        with pytest.raises(AssertionError):
            check_regex_outputs(engine, pattern)
    engine.structured._active.clear()


CHOICES = st.lists(st.text(alphabet=string.ascii_letters + "é中\"\\ \n", min_size=1, max_size=6),
                   min_size=1, max_size=5, unique=True)


def check_choice_outputs(engine, options) -> Counter:
    params = StructuredOutputsParams(choice=options)

    def valid(text):
        assert text in options, f"{text!r} is none of {options}"

    reasons = check_outputs(engine, params, run(engine, params, max_new_tokens=40), valid)
    assert reasons == {"stop": 4}, reasons  # a choice is always short enough to finish
    return reasons


def test_choice_outputs_are_an_option(engine):
    @PROPERTY
    @given(CHOICES)
    def check(options):
        check_choice_outputs(engine, options)

    check()


def test_choice_property_fails_without_the_mask(engine, monkeypatch):
    _disable_mask(monkeypatch)
    with pytest.raises(AssertionError):
        check_choice_outputs(engine, ["yes", "no"])
    engine.structured._active.clear()


def test_grammar_json_object_and_structural_tag(engine):
    cases = [
        (StructuredOutputsParams(grammar='root ::= "(" [a-z]+ ")" | "none"'),
         lambda t: re.fullmatch(r"\([a-z]+\)|none", t)),
        (StructuredOutputsParams(grammar='start: "yes" | "no" | NUMBER\nNUMBER: /[0-9]{1,3}/'),  # Lark
         lambda t: re.fullmatch(r"yes|no|[0-9]{1,3}", t)),
        (StructuredOutputsParams(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9}}, "required": ["a"]},
                                 disable_any_whitespace=False), lambda t: json.loads(t)["a"] in range(10)),
    ]
    for params, valid in cases:
        completions = run(engine, params, max_new_tokens=64)
        check_outputs(engine, params, completions, lambda text, valid=valid: (valid(text) or
                                                                              pytest.fail(f"invalid: {text!r}")))


# ---------------------------------------------------------------------------- engine features
SCHEMA = FIXED_SCHEMAS[0]
PARAMS = StructuredOutputsParams(json=SCHEMA)


def tokens(outputs) -> list[torch.Tensor]:
    return [torch.tensor(c.token_ids) for out in outputs for c in out.outputs]


def test_seeded_samples_repeat_and_differ(engine):
    params = SamplingParams(max_new_tokens=80, temperature=1.0, seed=11, n=3, structured_outputs=PARAMS)
    first = engine.generate(["Hi"], params, use_tqdm=False)
    again = engine.generate(["Hi"], params, use_tqdm=False)
    assert all(torch.equal(a, b) for a, b in zip(tokens(first), tokens(again)))
    texts = [c.text for c in first[0].outputs]
    assert len(set(texts)) > 1, texts  # each sample its own matcher: they went separate ways
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_max_tokens_cuts_to_a_valid_prefix(engine):
    out = engine.generate(["Hi"], SamplingParams(max_new_tokens=6, temperature=0, structured_outputs=PARAMS),
                          use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    assert grammar_accepts(engine, PARAMS, out.token_ids)
    full = engine.generate(["Hi"], SamplingParams(max_new_tokens=80, temperature=0, structured_outputs=PARAMS),
                           use_tqdm=False)[0].outputs[0]
    assert full.text.startswith(out.text)


def test_stop_strings_cut_a_constrained_output(engine):
    full = engine.generate(["Hi"], SamplingParams(max_new_tokens=80, temperature=0, structured_outputs=PARAMS),
                           use_tqdm=False)[0].outputs[0]
    cut = engine.generate(["Hi"], SamplingParams(max_new_tokens=80, temperature=0, structured_outputs=PARAMS,
                                                 stop=['"age"']), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index('"age"')]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_valid_and_equal(mode):
    """A KV budget that forces preemption gives the tokens of an ample budget, every one valid."""
    prompts = [f"Request {i}: " + "context " * (3 + i) for i in range(10)]
    params = [SamplingParams(max_new_tokens=64, temperature=0, structured_outputs=PARAMS),
              SamplingParams(max_new_tokens=64, temperature=1.0, seed=3, n=2, structured_outputs=PARAMS)] * 5
    with single_threaded_torch():
        ample = LLMEngine(tiny_model(), TOKENIZER, num_blocks=512, block_size=8)
        reference = ample.generate(prompts, params, use_tqdm=False)
        tight = LLMEngine(tiny_model(), TOKENIZER, num_blocks=40, block_size=8, preemption_mode=mode,
                          max_num_batched_tokens=64)
        outputs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.stats()[f"preemptions_{mode}"] >= 3, tight.stats()
    assert all(torch.equal(a, b) for a, b in zip(tokens(outputs), tokens(reference)))
    for out in outputs:
        for c in out.outputs:
            if c.finish_reason == "stop":
                jsonschema.validate(json.loads(c.text), SCHEMA)
            else:
                assert grammar_accepts(tight, PARAMS, c.token_ids)
    assert_engine_idle(ample)
    assert_engine_idle(tight)


def test_prefix_caching_with_constraints():
    shared = "A long shared system prompt that fills several blocks of the cache. " * 3
    prompts = [shared + f"Question {i}?" for i in range(6)]
    params = SamplingParams(max_new_tokens=64, temperature=1.0, seed=5, n=2, structured_outputs=PARAMS)
    with single_threaded_torch():
        cached = LLMEngine(tiny_model(), TOKENIZER, num_blocks=256, block_size=8, enable_prefix_caching=True)
        first = cached.generate(prompts[:1], params, use_tqdm=False)
        outputs = first + cached.generate(prompts[1:], params, use_tqdm=False)
        plain = LLMEngine(tiny_model(), TOKENIZER, num_blocks=256, block_size=8, enable_prefix_caching=False)
        reference = plain.generate(prompts[:1], params, use_tqdm=False) + plain.generate(prompts[1:], params,
                                                                                          use_tqdm=False)
    assert cached.stats()["prefix_cache_hit_tokens"] > 0
    assert all(torch.equal(a, b) for a, b in zip(tokens(outputs), tokens(reference)))
    for c in (c for out in outputs for c in out.outputs):
        assert c.finish_reason == "length" or jsonschema.validate(json.loads(c.text), SCHEMA) is None
    assert_engine_idle(cached)
    assert_engine_idle(plain)


def test_a_compile_waits_off_the_engine_thread_while_others_proceed(engine, monkeypatch):
    schema = {"type": "object", "properties": {"slow": {"type": "boolean"}}, "required": ["slow"]}
    original = ConstraintCompiler._compile

    def slow(self, params):
        time.sleep(1.5)
        return original(self, params)

    monkeypatch.setattr(ConstraintCompiler, "_compile", slow)
    engine.structured.compiler._cache.pop(StructuredOutputsParams(json=schema).key, None)
    waiting = engine.add_request("Hi", SamplingParams(max_new_tokens=40, temperature=0,
                                                      structured_outputs=StructuredOutputsParams(json=schema)))
    other = engine.add_request("Hi", SamplingParams(max_new_tokens=5, temperature=0))
    assert engine.structured.has_waiting() and engine.stats()["waiting"] == 1  # only the other is queued
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (engine.structured.has_waiting(), out)
    assert done[other][0], "the unconstrained request waited for the compile"
    assert json.loads(done[waiting][1].outputs[0].text)["slow"] in (True, False)


def test_a_compile_over_the_time_limit_fails_its_request_alone(monkeypatch):
    original = ConstraintCompiler._compile
    monkeypatch.setattr(ConstraintCompiler, "_compile", lambda self, p: time.sleep(0.6) or original(self, p))
    with single_threaded_torch():
        engine = LLMEngine(tiny_model(), TOKENIZER, num_blocks=64)
        engine.structured._compiler = ConstraintCompiler(TOKENIZER, 259, [EOS], timeout_s=0.2)
        outputs = engine.generate(["Hi", "Hi"], [SamplingParams(max_new_tokens=8, structured_outputs=PARAMS),
                                                 SamplingParams(max_new_tokens=8, temperature=0)], use_tqdm=False)
    assert outputs[0].error_kind == "rejected" and "did not compile within 0.2 s" in outputs[0].error
    assert outputs[1].error is None and len(outputs[1].outputs[0].token_ids) == 8
    assert_engine_idle(engine)


def test_an_invalid_constraint_fails_its_request_alone(engine):
    bad = SamplingParams(max_new_tokens=8, structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    outputs = engine.generate(["Hi", "Hi"], [bad, SamplingParams(max_new_tokens=4, temperature=0)], use_tqdm=False)
    assert outputs[0].error_kind == "rejected" and "invalid regex" in outputs[0].error
    assert outputs[1].error is None
    with pytest.raises(ValueError, match="invalid regex"):  # the error is cached: refused at once now
        engine.add_request("Hi", bad)


@pytest.mark.parametrize("options, match", [
    (dict(num_beams=2), "beam search"), (dict(min_new_tokens=2), "min_new_tokens"),
    (dict(ignore_eos=True), "ignore_eos")])
def test_options_that_would_override_the_constraint_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(max_new_tokens=8, structured_outputs=PARAMS, **options)


@pytest.mark.parametrize("keyword, schema", [
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
    ("not", {"not": {"type": "integer"}}),
    ("if", {"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 7}}),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "number"}]}),
    ("multipleOf", {"type": "number", "multipleOf": 0.5}),
    ("format", {"type": "string", "format": "idn-email"}),
    ("required", {"type": "object", "required": ["missing"]}),
    ("contains", {"type": "array", "contains": {"const": 1}}),
    ("dependentRequired", {"type": "object", "properties": {"a": {}}, "dependentRequired": {"a": ["b"]}}),
    ("x-vendor", {"type": "object", "x-vendor": 1}),
])
def test_unenforceable_schema_keywords_are_refused_by_name(keyword, schema):
    wrapped = {"type": "object", "properties": {"field": schema}, "required": ["field"]}
    with pytest.raises(UnsupportedSchemaError, match=f"'{keyword}' at /properties/field"):
        SamplingParams(structured_outputs=StructuredOutputsParams(json=wrapped))


# ---------------------------------------------------------------------------- logit_bias, the fast path
def test_logit_bias_forces_and_bans_tokens(engine):
    forced = engine.generate(["Hi"], SamplingParams(max_new_tokens=6, temperature=0, logit_bias={72: 100}),
                             use_tqdm=False)[0].outputs[0]
    assert torch.equal(torch.tensor(forced.token_ids), torch.full((6,), 72))
    plain = engine.generate(["Hi"], SamplingParams(max_new_tokens=6, temperature=0), use_tqdm=False)[0].outputs[0]
    banned = engine.generate(["Hi"], SamplingParams(max_new_tokens=6, temperature=0,
                                                    logit_bias={plain.token_ids[0]: -100}),
                             use_tqdm=False)[0].outputs[0]
    assert banned.token_ids[0] != plain.token_ids[0]
    sampled = engine.generate(["Hi"], SamplingParams(max_new_tokens=20, temperature=1.0, seed=1,
                                                     logit_bias={t: -100 for t in range(3, 200)}),
                              use_tqdm=False)[0].outputs[0]
    assert all(t < 3 or t >= 200 for t in sampled.token_ids)
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("Hi", SamplingParams(logit_bias={259: 1.0}))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: float("inf")})  # any finite bias is taken (vLLM's); the server bounds it


def test_an_unconstrained_batch_never_calls_the_hooks(engine, monkeypatch):
    def boom(self, *args):
        raise AssertionError("a structured-output hook ran for an unconstrained batch")

    monkeypatch.setattr(StructuredOutputManager, "mask", boom)
    monkeypatch.setattr(StructuredOutputManager, "advance", boom)
    outputs = engine.generate(["Hi", "There"], SamplingParams(max_new_tokens=8, temperature=1.0, seed=0, n=2),
                              use_tqdm=False)
    assert all(out.error is None for out in outputs)


def test_mixed_batch_leaves_unconstrained_rows_alone(engine):
    """An unconstrained request gives the same tokens beside constrained ones as alone."""
    alone = engine.generate(["Hi"], SamplingParams(max_new_tokens=20, temperature=1.0, seed=4), use_tqdm=False)
    mixed = engine.generate(["Hi", "Hi"], [SamplingParams(max_new_tokens=20, temperature=1.0, seed=4),
                                           SamplingParams(max_new_tokens=40, structured_outputs=PARAMS, seed=2)],
                            use_tqdm=False)
    assert torch.equal(tokens(alone)[0], tokens(mixed)[0])


@pytest.mark.parametrize("value", ["éA", "ü1", "ບ1", "😀a"])
def test_a_non_ascii_character_before_a_hex_digit_is_kept(engine, value):
    """xgrammar 0.2.9 prints ``const: "éA"`` as the literal ``"\\xe9A"`` and reads that text back as
    U+0E9A ("ບ"): the grammar hf_paged compiles from the text refused the value itself
    (``hf_paged.constraints.compiler.split_escape_runs``). Every output, greedy and sampled, is the value."""
    for schema in ({"type": "object", "properties": {"a": {"const": value}}, "required": ["a"]},
                   {"type": "object", "properties": {"a": {"enum": [value, "zz"]}}, "required": ["a"]}):
        params = StructuredOutputsParams(json=schema)
        outputs = run(engine, params, max_new_tokens=40)
        assert all(c.finish_reason == "stop" and json.loads(c.text)["a"] in (value, "zz") for c in outputs), outputs
        assert any(json.loads(c.text)["a"] == value for c in outputs) or "enum" in schema["properties"]["a"]
    if ord(value[0]) > 0xFF:  # printed as \\u / \\U escapes, which xgrammar reads back right: split anyway
        return
    # negative control: xgrammar's grammar text read back as it is (what json_grammar returned before)
    text = str(xgr.Grammar.from_json_schema(json.dumps({"const": value}), any_whitespace=False, strict_mode=True))
    matcher = xgr.GrammarMatcher(engine.structured.compiler._compiler().compile_grammar(xgr.Grammar.from_ebnf(text)))
    assert not all(matcher.accept_token(t) for t in TOKENIZER(json.dumps(value, ensure_ascii=False),
                                                               add_special_tokens=False).input_ids)
