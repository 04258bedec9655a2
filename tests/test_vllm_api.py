"""vLLM's offline API where hf_paged's used to differ silently: ``max_tokens=None``, ``seed=-1``,
positional ``SamplingParams``, greedy ``n > 1``, prompt dicts, ``add_request``'s argument order,
``abort_request`` and the other vLLM names, ``generate(sampling_params=...)``, vLLM-only fields."""

from __future__ import annotations

import pytest

from hf_paged import LLMEngine, SamplingParams
from hf_paged.demo import byte_tokenizer, demo_model

POSITIONS = 40
PROMPT = [5, 17, 33, 8, 61]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return demo_model(seed=0, num_hidden_layers=1, hidden_size=32, intermediate_size=64, initializer_range=0.3,
                      max_position_embeddings=POSITIONS)


@pytest.fixture
def engine(model):
    return LLMEngine(model, byte_tokenizer(), block_size=4, num_blocks=128)


def test_max_tokens_none_runs_to_the_models_positions(engine):
    unlimited = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    assert unlimited.max_tokens is None and SamplingParams(max_new_tokens=None).max_new_tokens is None
    outs = engine.generate([PROMPT, PROMPT[:2]], unlimited, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [POSITIONS - 5, POSITIONS - 2]
    assert {o.outputs[0].finish_reason for o in outs} == {"length"} and unlimited.max_new_tokens is None
    beams = engine.generate([PROMPT], SamplingParams(max_tokens=None, num_beams=2, ignore_eos=True), use_tqdm=False)
    assert len(beams[0].outputs[0].token_ids) == POSITIONS - 5
    default = engine.generate([PROMPT], SamplingParams(temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(default[0].outputs[0].token_ids) == 16  # not passed: vLLM's default
    with pytest.raises(ValueError, match="max_tokens .* and max_new_tokens say different things"):
        SamplingParams(max_tokens=None, max_new_tokens=8)
    engine.intake.max_positions = None  # a model whose config gives no length: nothing to fill up to
    with pytest.raises(ValueError, match=r"^SamplingParams\.max_new_tokens=None .* pass a number"):
        engine.add_request(PROMPT, unlimited)


def test_seed_minus_one_is_unseeded_as_in_vllm():
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2


def test_sampling_params_take_keywords_only():
    with pytest.raises(TypeError, match="keyword arguments only"):
        SamplingParams(2)  # vLLM: n=2; hf_paged read it as max_new_tokens=2
    assert SamplingParams(n=2).n == 2


def test_greedy_with_n_above_one_is_refused():
    """n identical copies before; vLLM and transformers (num_return_sequences) refuse it."""
    with pytest.raises(ValueError, match=r"^SamplingParams\.n must be 1 with greedy decoding \(temperature=0\)"):
        SamplingParams(temperature=0, n=2)
    assert SamplingParams(temperature=0, n=2, num_beams=2).n == 2  # beam search returns n distinct beams
    assert SamplingParams(temperature=0.5, n=2).n == 2


def test_vllm_prompt_dicts(engine):
    plain = engine.generate([PROMPT, "Hi"], GREEDY, use_tqdm=False)
    one = engine.generate({"prompt_token_ids": PROMPT}, GREEDY, use_tqdm=False)  # a single dict: KeyError: 0 before
    assert len(one) == 1 and one[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    outs = engine.generate([{"prompt_token_ids": PROMPT, "prompt": "text"}, {"prompt": "Hi"}], GREEDY, use_tqdm=False)
    assert [o.error for o in outs] == [None, None]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert [o.prompt for o in outs] == ["text", "Hi"] and outs[1].prompt_token_ids == plain[1].prompt_token_ids
    rid = engine.add_request({"prompt": "Hi"}, GREEDY)
    assert engine.requests[rid].prompt_token_ids == plain[1].prompt_token_ids
    engine.abort(rid)
    for key in ("multi_modal_data", "cache_salt"):
        with pytest.raises(ValueError, match=rf"prompt dict key\(s\) \['{key}'\] are not supported"):
            engine.add_request({"prompt": "Hi", key: {"image": 1} if key == "multi_modal_data" else "s"}, GREEDY)
    bad = engine.generate([{"prompt_token_ids": PROMPT, "cache_salt": "s"}], GREEDY, use_tqdm=False)[0]
    assert "cache_salt" in bad.error and bad.prompt_token_ids == PROMPT
    assert not engine.requests


def test_add_request_in_vllms_order_says_the_order(engine):
    with pytest.raises(ValueError, match=r"takes \(prompt, params, request_id=None\), not vLLM's \(request_id, "):
        engine.add_request("req-1", "Hi", GREEDY)
    assert engine.add_request("Hi", GREEDY, request_id="req-1") == "req-1"
    engine.abort("req-1")


def test_abort_takes_one_id_or_several_and_vllms_names(engine):
    ids = [engine.add_request(PROMPT, GREEDY) for _ in range(3)]
    assert engine.get_num_unfinished_requests() == 3 and engine.get_tokenizer() is engine.tokenizer
    engine.abort([ids[0]])
    engine.abort_request(ids[1])
    engine.abort_request(iter([ids[2], "unknown"]))
    assert engine.get_num_unfinished_requests() == 0 and not engine.has_unfinished_requests()
    assert engine.kv.num_used_blocks() == 0


def test_generate_takes_vllms_sampling_params_keyword(engine):
    out = engine.generate([PROMPT], sampling_params=GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
    with pytest.raises(TypeError, match="both params and sampling_params"):
        engine.generate([PROMPT], GREEDY, sampling_params=GREEDY, use_tqdm=False)


@pytest.mark.parametrize("name, value", [("truncate_prompt_tokens", 8), ("best_of", 2)])
def test_vllm_only_fields_say_what_to_do(name, value):
    with pytest.raises(TypeError, match=rf"^SamplingParams has no parameter '{name}': \w"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("name, value", [("flat_logprobs", True), ("extra_args", {"x": 1}),
                                         ("thinking_token_budget", 8)])
def test_vllm_fields_at_other_values_say_what_to_do(name, value):
    """Taken at vLLM's default (tests/test_offline_api_parity.py); another value names the field and why."""
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{name} can only be .* here: \w.*, got "):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("name", ["include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens"])
def test_vllms_text_options_are_taken_as_bools(name):
    """Once refused as vLLM-only names; tests/test_output_text_options.py checks what they do."""
    flipped = not getattr(SamplingParams(), name)
    assert getattr(SamplingParams(**{name: flipped}), name) is flipped
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{name} must be a bool, got 1$"):
        SamplingParams(**{name: 1})
