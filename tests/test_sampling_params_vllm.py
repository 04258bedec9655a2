"""``SamplingParams`` as scripts ported from vLLM use it: ``max_tokens`` / ``min_tokens`` written after
construction, ``clone()``, ``SamplingParams.from_optional(...)``, ``detokenize=False``, and messages that
name the length fields as the caller wrote them.

``detokenize=False`` runs on a real engine (tiny float32 Llama, the demo byte tokenizer): texts are ""
(streamed deltas and ``step()`` outputs too), ``Logprob.decoded_token`` is None (prompt log-probs'
too), and token ids and log-prob values are those of the same request with text. Every engine a
test builds ends with every KV block free.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest

from hf_paged import LLMEngine, SamplingParams
from hf_paged.constraints import StructuredOutputsParams
from hf_paged.demo import byte_tokenizer
from tests.helpers.tiny_models import build, single_threaded_torch

TOKENIZER = byte_tokenizer()
PROMPT = "HELLO"  # byte ids 42, 39, 46, 46, 49: inside the tiny model's vocabulary of 96
POSITIONS = 512  # the tiny Llama's max_position_embeddings
GREEDY = dict(max_tokens=8, temperature=0, ignore_eos=True)
SCORED = dict(**GREEDY, logprobs=2, prompt_logprobs=2)
SAMPLED = dict(max_tokens=8, temperature=1.0, seed=3, n=2, ignore_eos=True, logprobs=1)
BEAMS = dict(max_tokens=6, num_beams=2, n=2, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    with single_threaded_torch():
        yield LLMEngine(build("llama"), TOKENIZER, block_size=4, num_blocks=192)  # 768 tokens: a whole context fits


def generate(engine: LLMEngine, prompt=PROMPT, **params):
    out = engine.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]
    assert out.error is None, out.error
    return out


def numbers(logprobs) -> list[dict[int, tuple[float, int]]] | None:
    """Log-prob entries without their texts: ``{token: (value, rank)}`` (None entries kept)."""
    if logprobs is None:
        return None
    return [None if entry is None else {t: (lp.logprob, lp.rank) for t, lp in entry.items()} for entry in logprobs]


def decoded_tokens(logprobs) -> set:
    return {lp.decoded_token for entry in logprobs if entry is not None for lp in entry.values()}


# ---------------------------------------------------------------------------- max_tokens / min_tokens setters
def test_max_and_min_tokens_are_written_as_in_vllm(llm):
    params = SamplingParams(**GREEDY)
    params.max_tokens, params.min_tokens = 11, 2
    assert (params.max_new_tokens, params.min_new_tokens, params.max_tokens, params.min_tokens) == (11, 2, 11, 2)
    assert len(llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids) == 11
    params.max_tokens = None  # vLLM's "as many as fit"
    assert params.max_new_tokens is None
    assert len(llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids) == POSITIONS - len(PROMPT)


@pytest.mark.parametrize("start, name, value, message", [
    (dict(max_tokens=5), "max_tokens", 0, "max_tokens must be an int >= 1 or None (as many as fit), got 0"),
    (dict(max_tokens=5), "max_tokens", 2.0, "max_tokens must be an int >= 1 or None (as many as fit), got 2.0"),
    (dict(max_new_tokens=5), "max_tokens", True, "max_tokens must be an int >= 1 or None (as many as fit), got True"),
    (dict(max_tokens=5), "min_tokens", -1, "min_tokens must be an int between 0 and max_tokens, got -1"),
    (dict(max_tokens=5), "min_tokens", 6, "min_tokens must be an int between 0 and max_tokens, got 6"),
    (dict(max_new_tokens=5), "min_tokens", 6, "min_tokens must be an int between 0 and max_new_tokens, got 6"),
    (dict(max_tokens=5, min_tokens=3), "max_tokens", 2, "min_tokens must be an int between 0 and max_tokens, got 3"),
    (dict(max_tokens=4, num_beams=2, length_penalty=20.0), "max_tokens", 10**6,
     "length_penalty must be in [-5, 5] for max_tokens=1000000 (max_tokens ** length_penalty must stay within "
     "[1e-30, 1e30]), got 20.0"),
    (dict(structured_outputs=StructuredOutputsParams(choice=["A", "B"])), "min_tokens", 1,
     "min_tokens must be 0 with structured_outputs (the constraint decides where the output may end), got 1"),
])
def test_a_refused_write_names_the_field_and_changes_nothing(start, name, value, message):
    params = SamplingParams(**start)
    before = copy.deepcopy(params)
    with pytest.raises(ValueError) as refused:
        setattr(params, name, value)
    assert str(refused.value) == f"SamplingParams.{message}"
    assert params == before


# ---------------------------------------------------------------------------- messages name what was written
def test_length_messages_name_the_field_as_the_caller_wrote_it():
    cases = [
        (dict(max_tokens=0), "max_tokens must be an int >= 1 or None (as many as fit), got 0"),
        (dict(max_tokens=-1), "max_tokens must be an int >= 1 or None (as many as fit), got -1"),
        (dict(min_tokens=-1), "min_tokens must be an int between 0 and max_tokens, got -1"),
        (dict(min_tokens=17), "min_tokens must be an int between 0 and max_tokens, got 17"),
        (dict(max_tokens=4, min_tokens=5), "min_tokens must be an int between 0 and max_tokens, got 5"),
        (dict(max_new_tokens=4, min_tokens=5), "min_tokens must be an int between 0 and max_new_tokens, got 5"),
        (dict(max_tokens=10_000, num_beams=2, length_penalty=-7.6),
         "length_penalty must be in [-7.5, 7.5] for max_tokens=10000 (max_tokens ** length_penalty must stay within "
         "[1e-30, 1e30]), got -7.6"),
        (dict(min_tokens=1, structured_outputs=StructuredOutputsParams(choice=["A"])),
         "min_tokens must be 0 with structured_outputs (the constraint decides where the output may end), got 1"),
        # hf_paged's names where the caller wrote them (the server writes these and maps them back)
        (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1 or None (as many as fit), got 0"),
        (dict(min_new_tokens=17), "min_new_tokens must be an int between 0 and max_new_tokens, got 17"),
        (dict(max_new_tokens=4, min_new_tokens=5), "min_new_tokens must be an int between 0 and max_new_tokens, got 5"),
        (dict(max_new_tokens=10_000, num_beams=2, length_penalty=-7.6),
         "length_penalty must be in [-7.5, 7.5] for max_new_tokens=10000 (max_new_tokens ** length_penalty must stay "
         "within [1e-30, 1e30]), got -7.6"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError) as refused:
            SamplingParams(**kwargs)
        assert str(refused.value) == f"SamplingParams.{message}", kwargs


def test_the_engines_fill_of_max_tokens_none_names_vllms_fields(llm):
    """``max_tokens=None`` is filled per prompt (a copy through ``dataclasses.replace``): a ``min_tokens``
    beyond the room left is refused there, in vLLM's names."""
    with pytest.raises(ValueError) as refused:
        llm.add_request(PROMPT, SamplingParams(max_tokens=None, min_tokens=600))
    assert str(refused.value) == "SamplingParams.min_tokens must be an int between 0 and max_tokens, got 600"


# ---------------------------------------------------------------------------- clone()
def test_clone_is_a_deep_copy():
    params = SamplingParams(max_tokens=7, temperature=0.5, stop=["Z"], stop_token_ids=[9],
                            logit_bias={5: 1.5}, allowed_token_ids=[5, 6, 7], bad_words=["QQ"], logprobs=2,
                            structured_outputs=StructuredOutputsParams(json={"type": "object", "properties": {
                                "a": {"type": "integer"}}}))
    before = copy.deepcopy(params)
    clone = params.clone()
    assert type(clone) is SamplingParams and clone == params and clone is not params
    for name in ("stop", "stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words", "structured_outputs"):
        assert getattr(clone, name) is not getattr(params, name), name
    assert clone.structured_outputs.json is not params.structured_outputs.json
    clone.stop.append("Y")
    clone.logit_bias[6] = -2.0
    clone.structured_outputs.json["properties"]["b"] = {"type": "string"}
    clone.max_tokens = 3
    assert params == before and clone.max_new_tokens == 3
    with pytest.raises(ValueError, match=r"^SamplingParams\.min_tokens must be .* and max_new_tokens, got 6$"):
        SamplingParams(max_new_tokens=5).clone().min_tokens = 6  # a clone's messages keep the caller's spelling


def test_a_clone_generates_what_the_original_does(llm):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=4,
                            structured_outputs=StructuredOutputsParams(choice=["ABC", "XYZ"]))
    original, cloned = (llm.generate([PROMPT], p, use_tqdm=False)[0].outputs[0] for p in (params, params.clone()))
    assert original.text in ("ABC", "XYZ") and cloned == original


# ---------------------------------------------------------------------------- from_optional()
def test_from_optional_gives_defaults_for_none():
    nothing = dict(n=None, temperature=None, top_p=None, top_k=None, min_p=None, presence_penalty=None,
                   frequency_penalty=None, repetition_penalty=None, seed=None, stop=None, stop_token_ids=None,
                   bad_words=None, include_stop_str_in_output=None, ignore_eos=None, min_tokens=None, logprobs=None,
                   prompt_logprobs=None, detokenize=None, skip_special_tokens=None,
                   spaces_between_special_tokens=None, structured_outputs=None, logit_bias=None,
                   allowed_token_ids=None)
    assert SamplingParams.from_optional(**nothing) == SamplingParams()
    assert SamplingParams.from_optional(**nothing).max_new_tokens == 16
    unlimited = SamplingParams.from_optional(**nothing, max_tokens=None)  # None here: as many as fit (vLLM's)
    assert unlimited == SamplingParams(max_tokens=None) and unlimited.max_tokens is None
    given = SamplingParams.from_optional(max_tokens=7, temperature=0.0, stop="Z", top_p=None, stop_token_ids=[4])
    assert given == SamplingParams(max_tokens=7, temperature=0.0, stop=["Z"], stop_token_ids=[4])


def test_from_optional_refuses_what_the_constructor_refuses():
    with pytest.raises(ValueError, match=r"^SamplingParams\.max_tokens must be an int >= 1"):
        SamplingParams.from_optional(max_tokens=0, temperature=None)
    with pytest.raises(ValueError, match=r"^SamplingParams\.stop is only supported when detokenize is True"):
        SamplingParams.from_optional(stop="Z", detokenize=False)
    with pytest.raises(TypeError, match=r"^SamplingParams has no parameter 'best_of'"):
        SamplingParams.from_optional(best_of=None)  # an unknown name is refused even with None


def test_from_optional_reads_logit_bias_as_vllm_does():
    params = SamplingParams.from_optional(logit_bias={"70": 150, 71: -1e4, " 72": 0.5, 73: float("-inf")})
    assert params.logit_bias == {70: 100.0, 71: -100.0, 72: 0.5, 73: -100.0}
    with pytest.raises(ValueError, match=r"^SamplingParams\.logit_bias contains key\(s\) that cannot be converted "
                                         r"to integer token ids: \['x'\]$"):
        SamplingParams.from_optional(logit_bias={"x": 1.0, "5": 1.0})
    with pytest.raises(ValueError, match=r"^SamplingParams\.logit_bias must map token ids"):
        SamplingParams.from_optional(logit_bias={5: float("nan")})


# ---------------------------------------------------------------------------- detokenize=False
def test_detokenize_is_a_bool_and_refuses_stop_strings_as_vllm_does():
    assert SamplingParams().detokenize is True and SamplingParams(detokenize=False).detokenize is False
    with pytest.raises(ValueError, match=r"^SamplingParams\.detokenize must be a bool, got 0$"):
        SamplingParams(detokenize=0)
    with pytest.raises(ValueError) as refused:
        SamplingParams(stop=["Z"], detokenize=False)
    assert str(refused.value) == ("SamplingParams.stop is only supported when detokenize is True (set detokenize=True "
                                  "to use stop strings), got ['Z']")
    SamplingParams(stop_token_ids=[5], detokenize=False)  # stop tokens need no text


@pytest.mark.parametrize("options", [SCORED, SAMPLED, BEAMS], ids=["greedy", "sampled", "beams"])
def test_detokenize_false_decodes_nothing_and_changes_no_number(llm, options):
    text = generate(llm, **options)
    bare = generate(llm, **options, detokenize=False)
    assert len(bare.outputs) == len(text.outputs) == options.get("n", 1)
    assert bare.prompt == text.prompt == PROMPT and bare.prompt_token_ids == text.prompt_token_ids
    for plain, with_text in zip(bare.outputs, text.outputs, strict=True):
        assert with_text.text != "" and plain.text == ""
        assert plain.token_ids == with_text.token_ids
        assert (plain.finish_reason, plain.stop_reason, plain.cumulative_logprob) == \
            (with_text.finish_reason, with_text.stop_reason, with_text.cumulative_logprob)
        assert numbers(plain.logprobs) == numbers(with_text.logprobs)
        if options.get("logprobs") is not None:
            assert decoded_tokens(plain.logprobs) == {None} and None not in decoded_tokens(with_text.logprobs)
    assert numbers(bare.prompt_logprobs) == numbers(text.prompt_logprobs)
    if options.get("prompt_logprobs") is not None:
        assert decoded_tokens(bare.prompt_logprobs) == {None}
        assert None not in decoded_tokens(text.prompt_logprobs)


def test_detokenize_false_streams_token_ids_and_empty_text(llm):
    whole = generate(llm, **GREEDY).outputs[0]
    deltas = list(llm.stream(PROMPT, SamplingParams(**GREEDY, detokenize=False)))
    assert [d["text"] for d in deltas] == [""] * len(deltas) and deltas[-1]["finished"]
    assert [t for d in deltas for t in d["token_ids"]] == whole.token_ids
    with_text = list(llm.stream(PROMPT, SamplingParams(**GREEDY)))  # control: the same stream has text
    assert "".join(d["text"] for d in with_text) == whole.text != ""


def test_detokenize_false_step_outputs_carry_no_text(llm):
    reference = generate(llm, **SCORED)
    rid = llm.add_request(PROMPT, SamplingParams(**SCORED, detokenize=False))
    seen = []
    while llm.has_unfinished_requests():
        seen += [out for out in llm.step() if out.request_id == rid]
    assert len(seen) >= 2 and seen[-1].finished
    for out in seen:
        assert [c.text for c in out.outputs] == [""]
        assert decoded_tokens(out.outputs[0].logprobs or []) <= {None}
        assert decoded_tokens(out.prompt_logprobs) <= {None}
    assert seen[-1].outputs[0].token_ids == reference.outputs[0].token_ids
    assert numbers(seen[-1].outputs[0].logprobs) == numbers(reference.outputs[0].logprobs)
    assert numbers(seen[-1].prompt_logprobs) == numbers(reference.prompt_logprobs)


def test_a_request_next_to_one_without_text_is_served_as_before(llm):
    """The same batch with the third request's text on and off: the other two get the same
    outputs, texts and decoded tokens included."""
    prompts, first = [PROMPT, "HOLA", PROMPT], [SamplingParams(**SCORED), SamplingParams(**SAMPLED)]
    before = llm.generate(prompts, [*first, SamplingParams(**SCORED)], use_tqdm=False)
    mixed = llm.generate(prompts, [*first, SamplingParams(**SCORED, detokenize=False)], use_tqdm=False)
    for got, want in zip(mixed[:2], before[:2], strict=True):
        assert got.outputs == want.outputs
        assert got.outputs[0].text == TOKENIZER.decode(got.outputs[0].token_ids, skip_special_tokens=True)
        assert numbers(got.prompt_logprobs) == numbers(want.prompt_logprobs)
        for output, reference in zip(got.outputs, want.outputs, strict=True):
            assert [lp.decoded_token for e in output.logprobs for lp in e.values()] == \
                [lp.decoded_token for e in reference.logprobs for lp in e.values()]
    assert decoded_tokens(mixed[0].prompt_logprobs) == decoded_tokens(before[0].prompt_logprobs) != {None}
    assert mixed[2].outputs[0].text == "" and before[2].outputs[0].text != ""
    assert mixed[2].outputs[0].token_ids == before[2].outputs[0].token_ids


def test_detokenize_is_no_longer_refused_as_vllm_only():
    assert "detokenize" in {f.name for f in dataclasses.fields(SamplingParams)}
    assert SamplingParams(detokenize=True) == SamplingParams()
