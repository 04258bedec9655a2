"""The last gaps between ``hf_paged.LLM`` and vLLM 0.32's offline API (an audit ran both side by side):
``CompletionOutput.finished()`` is a method, vLLM's output attributes for features not built here
read vLLM's offline values, vLLM's per-call keywords are taken where they ask for nothing (and
refused by name otherwise), ``continue_final_message`` with the default ``add_generation_prompt``
is refused (offline and served), ``dataclasses.replace`` works with either length name,
``logit_bias`` takes any finite bias offline (the server keeps OpenAI's [-100, 100]),
``max_logprobs`` is an engine option, and vLLM's other ``SamplingParams`` fields are taken at
their defaults. Nothing here needs vLLM."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from hf_paged import LLM, BeamSearchParams, LLMEngine, SamplingParams
from hf_paged.demo import byte_tokenizer
from hf_paged.engine.params import VLLM_DEFAULT_ONLY, RequestOutputKind
from tests.helpers.serving import MODEL, NUM_BLOCKS, post_then_all_free, serving, single_threaded_torch, tiny_model
from tests.helpers.tiny_models import assert_engine_idle

PROMPTS = ["Hello there", "Once upon"]
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
MESSAGES = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Well, the"}]


@pytest.fixture(scope="module")
def llm():
    llm = LLM(tiny_model(), byte_tokenizer(), block_size=4, num_blocks=128, max_logprobs=3, enforce_eager=True)
    yield llm
    assert_engine_idle(llm.llm_engine)


def tokens(outputs) -> list[list[int]]:
    return [c.token_ids for out in outputs for c in out.outputs]


def beam_tokens(outputs) -> list[list[int]]:
    return [seq.tokens for out in outputs for seq in out.sequences]


# ---------------------------------------------------------------- outputs
def test_completion_finished_is_vllms_method_and_request_finished_a_bool(llm):
    engine = llm.llm_engine
    request_id, seen = engine.add_request(PROMPTS[0], GREEDY), []
    while engine.has_unfinished_requests():
        seen += [out for out in engine.step() if out.request_id == request_id]
    assert [c.finished() for out in seen for c in out.outputs] == [False] * (len(seen) - 1) + [True]
    assert [out.finished for out in seen] == [False] * (len(seen) - 1) + [True]
    landed = pickle.loads(pickle.dumps(seen[-1].outputs[0]))  # as outputs reach the server's process
    assert landed.finished() is True and pickle.loads(pickle.dumps(seen[0].outputs[0])).finished() is False
    deltas = list(engine.stream(PROMPTS[0], GREEDY))  # its internal readers: a bound method would read as True
    assert [d["finished"] for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert all(c.finished() for c in llm.generate(PROMPTS, GREEDY, use_tqdm=False)[0].outputs)


def test_outputs_carry_vllms_offline_attributes(llm):
    out = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0]
    for name in ("metrics", "lora_request", "encoder_prompt", "encoder_prompt_token_ids", "num_cache_creation_tokens",
                 "prompt_token_id_logprobs", "kv_transfer_params", "ec_transfer_params"):
        assert getattr(out, name) is None, name
    for name in ("lora_request", "routed_experts", "sampling_mask", "spec_decode_metrics"):
        assert getattr(out.outputs[0], name) is None, name
    assert "metrics" not in {f.name for f in dataclasses.fields(out)}  # class attributes, not per-output fields


# ---------------------------------------------------------------- LLM keywords
def test_generate_chat_and_beam_search_take_vllms_keywords_where_they_ask_for_nothing(llm):
    plain = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    for options in (dict(lora_request=None, priority=None, tokenization_kwargs=None, mm_processor_kwargs=None),
                    dict(lora_request=[None, None], priority=[0, 0], tokenization_kwargs={}, mm_processor_kwargs={}),
                    dict(priority=0)):
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, **options)) == plain, options
    chat = tokens(llm.chat(MESSAGES[:1], GREEDY, use_tqdm=False))
    # vLLM's positional order: sampling_params, use_tqdm, lora_request, priority, chat_template, content format
    assert tokens(llm.chat(MESSAGES[:1], GREEDY, False, None, 0, None, "string", tokenization_kwargs=None)) == chat
    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    beams = beam_tokens(llm.beam_search(PROMPTS, params))
    # vLLM's positional order (lora_request, use_tqdm); concurrency_limit=1: one prompt at a time, the same beams
    assert beam_tokens(llm.beam_search(PROMPTS, params, None, False, concurrency_limit=1)) == beams
    assert len(beams) == 4
    assert_engine_idle(llm.llm_engine)


@pytest.mark.parametrize("method, options, named", [
    ("generate", dict(lora_request=object()), "prompt 0: lora_request=.*LoRA is not enabled.*enable_lora=True"),
    ("generate", dict(priority=1), "prompt 0: priority=1 needs scheduling_policy='priority'"),
    ("generate", dict(priority=[0, 2]), "prompt 1: priority=2 needs scheduling_policy='priority'"),
    ("generate", dict(priority=[0]), "2 prompts but 1 priorities"),
    ("generate", dict(priority=[0, 1.5]), "prompt 1: priority must be an int, got 1.5"),
    ("generate", dict(tokenization_kwargs={"truncation": True}), "tokenization_kwargs=.*tokenize them yourself"),
    ("generate", dict(mm_processor_kwargs={"size": 4}), "mm_processor_kwargs=.*multimodal"),
    ("chat", dict(chat_template_content_format="openai"), "chat_template_content_format='openai'.*'string'"),
    ("chat", dict(lora_request=object()), "lora_request=.*LoRA is not enabled"),
    ("beam_search", dict(lora_request=object()), "LLM.beam_search: .*lora_request=.*LoRA is not enabled"),
    ("beam_search", dict(concurrency_limit=0), "concurrency_limit=.... must be None or an int >= 1, got 0"),
])
def test_vllm_keywords_asking_for_what_is_not_built_are_refused_by_name(llm, method, options, named):
    args = {"generate": (PROMPTS, GREEDY), "chat": (MESSAGES[:1], GREEDY),
            "beam_search": (PROMPTS, BeamSearchParams(beam_width=2, max_tokens=2))}[method]
    with pytest.raises(ValueError, match=named):
        getattr(llm, method)(*args, **options)
    assert_engine_idle(llm.llm_engine)


def test_continue_final_message_needs_add_generation_prompt_false_as_in_vllm(llm):
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt are not compatible"):
        llm.chat(MESSAGES, GREEDY, continue_final_message=True)
    continued = llm.chat(MESSAGES, GREEDY, use_tqdm=False, continue_final_message=True, add_generation_prompt=False)
    assert continued[0].prompt == "<user>Hi there\n<assistant>Well, the"
    assert_engine_idle(llm.llm_engine)


# ---------------------------------------------------------------- SamplingParams
def test_replace_takes_either_name_of_the_length_fields():
    params = SamplingParams(max_tokens=3, min_tokens=1, temperature=0)
    for changes, want in ((dict(max_new_tokens=9), (9, 1)), (dict(max_tokens=9), (9, 1)),
                          (dict(min_new_tokens=2), (3, 2)), (dict(min_tokens=2), (3, 2)),
                          (dict(max_tokens=None), (None, 1)), (dict(temperature=0.5), (3, 1))):
        changed = dataclasses.replace(params, **changes)
        assert (changed.max_tokens, changed.min_tokens) == want, changes
    assert (params.max_new_tokens, params.min_new_tokens) == (3, 1)
    assert dataclasses.replace(SamplingParams(max_new_tokens=None), max_tokens=5).max_new_tokens == 5
    with pytest.raises(ValueError, match="max_tokens .vLLM's name. and max_new_tokens say different things"):
        dataclasses.replace(params, max_tokens=9, max_new_tokens=8)  # both changed, to different values
    with pytest.raises(ValueError, match="max_tokens .vLLM's name. and max_new_tokens say different things"):
        SamplingParams(max_tokens=9, max_new_tokens=8)


def test_logit_bias_takes_any_finite_bias_and_minus_1e4_bans_a_token(llm):
    first = tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False))[0][0]
    banned = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={first: -1e4})
    masked = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                            allowed_token_ids=[t for t in range(259) if t != first])
    got = tokens(llm.generate(PROMPTS, banned, use_tqdm=False))
    assert got == tokens(llm.generate(PROMPTS, masked, use_tqdm=False)) and first not in got[0]  # token-exact
    forced = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logit_bias={70: 1e30})
    assert tokens(llm.generate(PROMPTS[:1], forced, use_tqdm=False)) == [[70] * 4]
    for bias in (float("nan"), float("inf"), -float("inf"), 1e31):
        with pytest.raises(ValueError, match=r"^SamplingParams\.logit_bias must map token ids .* finite numbers"):
            SamplingParams(logit_bias={5: bias})
    assert SamplingParams.from_optional(logit_bias={5: -1e4}).logit_bias == {5: -100.0}  # vLLM's clamp there
    assert_engine_idle(llm.llm_engine)


def test_max_logprobs_is_an_engine_option(llm):
    engine = LLMEngine(tiny_model(), byte_tokenizer(), block_size=4, num_blocks=32, max_logprobs=2)
    for name, value in (("logprobs", 3), ("prompt_logprobs", 3), ("logprobs", -1)):
        with pytest.raises(ValueError, match=rf"^SamplingParams\.{name} must be at most the engine's max_logprobs=2 "
                                             rf"\(LLM\(max_logprobs=\.\.\.\)\), got {value}"):
            engine.add_request(PROMPTS[0], SamplingParams(**{name: value}, max_tokens=2))
    out = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=2, logprobs=2, prompt_logprobs=2), use_tqdm=False)
    assert out[0].error is None and all(len(entry) >= 2 for entry in out[0].outputs[0].logprobs)
    whole = LLMEngine(tiny_model(), byte_tokenizer(), block_size=4, num_blocks=32, max_logprobs=-1)
    assert len(whole.generate(PROMPTS[:1], SamplingParams(max_tokens=1, logprobs=-1), use_tqdm=False)[0]
               .outputs[0].logprobs[0]) == 259
    with pytest.raises(ValueError, match="max_logprobs must be None, an int >= 0, or -1"):
        LLMEngine(tiny_model(), byte_tokenizer(), block_size=4, num_blocks=32, max_logprobs=-2)
    with pytest.raises(ValueError, match=r"^prompt 0: SamplingParams\.logprobs must be at most the engine's "
                                         r"max_logprobs=3"):
        llm.chat(MESSAGES[:1], SamplingParams(max_tokens=2, logprobs=4))
    assert_engine_idle(engine)
    assert_engine_idle(whole)


def test_vllms_other_sampling_fields_are_taken_at_their_defaults(llm):
    defaults = {"skip_clone": False, "skip_reading_prefix_cache": None, "flat_logprobs": False,
                "logprob_token_ids": None, "prompt_logprob_token_ids": None, "prompt_logprob_start": None,
                "extra_args": None, "thinking_token_budget": None, "repetition_detection": None, "watermarking": None,
                "routed_experts_prompt_start": 0, "trace_decode_token_ids": None, "output_text_buffer_length": 0}
    assert set(defaults) == set(VLLM_DEFAULT_ONLY)
    vllm_style = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, **defaults)
    assert tokens(llm.generate(PROMPTS, vllm_style, use_tqdm=False)) == tokens(llm.generate(PROMPTS, GREEDY,
                                                                                             use_tqdm=False))
    for kind in RequestOutputKind:  # generate() returns final outputs whatever it says (tests/test_output_kinds.py)
        kinded = dataclasses.replace(GREEDY, output_kind=kind, stream_interval=2)
        assert tokens(llm.generate(PROMPTS, kinded, use_tqdm=False)) == tokens(llm.generate(PROMPTS, GREEDY,
                                                                                             use_tqdm=False))
    assert SamplingParams(prompt_logprobs=1, skip_reading_prefix_cache=True).prompt_logprobs == 1  # vLLM's None
    assert SamplingParams(skip_reading_prefix_cache=False, watermarking=False, prompt_logprob_start=0)
    own = SamplingParams(skip_clone=True, stop=["x"])
    assert own.clone() is own and SamplingParams(stop=["x"]).clone().stop is not SamplingParams(stop=["x"]).stop
    for name, value in (("flat_logprobs", True), ("skip_reading_prefix_cache", True), ("watermarking", True),
                        ("extra_args", {"k": 1}), ("logprob_token_ids", [5]), ("routed_experts_prompt_start", 0.0)):
        with pytest.raises(ValueError, match=rf"^SamplingParams\.{name} can only be .* here: \w.*, got "):
            SamplingParams(**{name: value})
    assert_engine_idle(llm.llm_engine)


# ---------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def served():
    with single_threaded_torch(), serving({"num_blocks": NUM_BLOCKS}) as (server, loop):
        yield server, loop


def test_the_server_refuses_continue_final_message_with_the_default_generation_prompt(served):
    """vLLM's server renders the pair (add_generation_prompt defaults to true) and the template call
    refuses it: a 400. Set to false, the last message is continued."""
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "temperature": 0, "continue_final_message": True}
    for path, body in (("/v1/chat/completions", chat), ("/tokenize", {"messages": MESSAGES,
                                                                       "continue_final_message": True})):
        refused = post_then_all_free(served, path, body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "continue_final_message", path
        assert post_then_all_free(served, path, {**body, "add_generation_prompt": False}).status_code == 200, path

