"""The paged text-generation pipeline returns what the stock pipeline returns (greedy, float32)."""

from __future__ import annotations

import pytest
import torch
import transformers

import hf_paged
from hf_paged.demo import byte_tokenizer, demo_model

SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, initializer_range=0.3)


@pytest.fixture(scope="module")
def pipes():
    tok = byte_tokenizer()
    stock = transformers.pipeline("text-generation", model=demo_model(**SMALL), tokenizer=tok)
    paged = hf_paged.pipeline("text-generation", model=demo_model(**SMALL), tokenizer=tok, num_blocks=256,
                              block_size=8)
    return stock, paged


@pytest.mark.parametrize("inputs, kwargs", [
    ("Hello", dict(max_new_tokens=10, do_sample=False)),
    (["Hi", "Once upon a time", "x"], dict(max_new_tokens=8, do_sample=False)),
    ([{"role": "user", "content": "hey there"}], dict(max_new_tokens=6, do_sample=False)),
    ([[{"role": "user", "content": "a"}], [{"role": "user", "content": "bcd"}]], dict(max_new_tokens=5, do_sample=False)),
    ("Beam me up", dict(max_new_tokens=6, num_beams=3, num_return_sequences=2, do_sample=False)),
    ("new text only", dict(max_new_tokens=5, do_sample=False, return_full_text=False)),
    (["", "x"], dict(max_new_tokens=6, do_sample=False, return_tensors=True)),  # generate() starts "" from BOS
    ("", dict(max_new_tokens=6, do_sample=False)),
])
def test_paged_pipeline_matches_the_stock_pipeline(pipes, inputs, kwargs):
    stock, paged = pipes
    assert paged(inputs, **kwargs) == stock(inputs, **kwargs)
    paged.engine.kv.check_invariants()
    assert paged.engine.kv.num_used_blocks() == 0


def test_registered_task_and_sampling(pipes):
    stock, paged = pipes
    registered = transformers.pipeline("paged-text-generation", model=paged.model, tokenizer=paged.tokenizer)
    assert isinstance(registered, hf_paged.PagedTextGenerationPipeline)
    assert registered("Hello", max_new_tokens=7, do_sample=False) == stock("Hello", max_new_tokens=7, do_sample=False)
    sampled = paged("Hello", max_new_tokens=7, do_sample=True, temperature=0.9, top_p=0.9, num_return_sequences=3)
    assert len(sampled) == 3 and all(r["generated_text"].startswith("Hello") for r in sampled)
    with pytest.raises(ValueError, match="text-generation"):
        hf_paged.pipeline("summarization", model=paged.model, tokenizer=paged.tokenizer)


BYTE = byte_tokenizer()
PROMPTS = ["The quick brown fox", "Once upon a time there"]


def _byte(char: str) -> int:
    return BYTE.convert_tokens_to_ids(BYTE.tokenize(char))[0]


@pytest.fixture(scope="module")
def generated(pipes):
    """Stock's greedy continuations of PROMPTS (ids): the stop tokens and strings below are taken
    from them, so that each stop really ends an output early."""
    stock, _ = pipes
    greedy = stock(PROMPTS, max_new_tokens=30, do_sample=False, return_tensors=True)
    beam = stock(PROMPTS[0], max_new_tokens=12, num_beams=3, do_sample=False, return_tensors=True)
    return [out[0]["generated_token_ids"][len(BYTE(p)["input_ids"]):] for p, out in zip(PROMPTS, greedy)] + [
        beam[0]["generated_token_ids"][len(BYTE(PROMPTS[0])["input_ids"]):]]  # [greedy 0, greedy 1, best beam 0]


CASES = {
    "stop_strings": lambda g: dict(max_new_tokens=30, stop_strings=[BYTE.decode(g[0][6:8])], tokenizer=BYTE),
    "stop_sequence": lambda g: dict(max_new_tokens=30, stop_sequence=BYTE.decode(g[1][4:5])),
    "eos_token_id": lambda g: dict(max_new_tokens=30, eos_token_id=g[0][5]),
    "eos_token_ids": lambda g: dict(max_new_tokens=30, eos_token_id=[g[0][9], g[1][3]], return_tensors=True),
    "max_length": lambda g: dict(max_length=25),  # counts the prompt, as in generate()
    "max_length_below_prompt": lambda g: dict(max_length=4),
    "min_new_tokens": lambda g: dict(max_new_tokens=12, min_new_tokens=8, eos_token_id=g[0][5]),
    "generation_config": lambda g: dict(generation_config=transformers.GenerationConfig(max_new_tokens=5)),
    "beams_eos": lambda g: dict(max_new_tokens=12, num_beams=3, num_return_sequences=3, eos_token_id=g[2][4],
                                return_tensors=True),
    "beams_repetition_penalty": lambda g: dict(max_new_tokens=12, num_beams=2, repetition_penalty=1.5),
    "batch_size": lambda g: dict(max_new_tokens=8, batch_size=2),
}


@pytest.mark.parametrize("case", CASES)
def test_the_generate_options_of_a_call_are_honored_as_stock_honors_them(pipes, generated, case):
    stock, paged = pipes
    kwargs = dict(do_sample=False, **CASES[case](generated))
    try:
        expected = stock(PROMPTS, **kwargs)
    except ValueError as refusal:  # a prompt (truncated) at max_length: newer transformers refuse it
        assert case == "max_length_below_prompt" and "max_length" in str(refusal)
        with pytest.raises(ValueError, match="max_length=4 leaves no room"):
            paged(PROMPTS, **kwargs)
    else:
        assert paged(PROMPTS, **kwargs) == expected
    assert paged.engine.kv.num_used_blocks() == 0


def test_the_stops_above_end_stocks_outputs_early(pipes, generated):
    """The control for the cases above: each stop changes stock's output."""
    stock, _ = pipes
    for case in ("stop_strings", "stop_sequence", "eos_token_id", "eos_token_ids", "min_new_tokens", "beams_eos"):
        kwargs = dict(do_sample=False, **CASES[case](generated))
        kwargs.pop("eos_token_id", None), kwargs.pop("stop_strings", None), kwargs.pop("stop_sequence", None)
        unstopped = stock(PROMPTS, **kwargs)
        assert stock(PROMPTS, do_sample=False, **CASES[case](generated)) != unstopped, case


def test_options_given_at_construction_and_the_pipelines_defaults_are_honored():
    tok = byte_tokenizer()
    model = demo_model(**SMALL)
    stock = transformers.pipeline("text-generation", model=demo_model(**SMALL), tokenizer=tok, max_new_tokens=6,
                                  do_sample=False)
    paged = hf_paged.pipeline("text-generation", model=model, tokenizer=tok, num_blocks=256, max_new_tokens=6,
                              do_sample=False)
    assert paged("Hello there") == stock("Hello there")
    assert len(paged("Hello there", return_tensors=True)[0]["generated_token_ids"]) == len("Hello there") + 6
    seen: list = []  # no options at all: stock's defaults (256 new tokens, sampled at temperature 0.7)
    bare = hf_paged.pipeline("text-generation", model=model, tokenizer=tok, num_blocks=256)
    generate = bare.engine.generate
    bare.engine.generate = lambda prompts, params, **kw: seen.append(params) or generate(prompts, params, **kw)
    bare("Hi", eos_token_id=_byte("H"))
    (params,), = seen
    assert (params.max_new_tokens, params.temperature, params.top_k) == (256, 0.7, 50)


def test_a_streamer_gets_the_tokens_as_stock_hands_them_over(pipes):
    stock, paged = pipes
    class Tokens(transformers.TextStreamer):  # what a streamer is handed, call by call
        def __init__(self):
            self.calls: list = []

        def put(self, value):
            self.calls.append(value.tolist())

        def end(self):
            self.calls.append("end")

    seen = []
    for pipe in (stock, paged):
        streamer = Tokens()
        seen.append((pipe("Streaming is", max_new_tokens=10, do_sample=False, streamer=streamer), streamer.calls))
    assert seen[0] == seen[1] and len(seen[0][1]) == 1 + 10 + 1  # the prompt, each new token, the end
    streamer = transformers.TextIteratorStreamer(paged.tokenizer, skip_prompt=True, timeout=60)
    result = paged("Streaming is", max_new_tokens=10, do_sample=False, streamer=streamer)
    assert "Streaming is" + "".join(streamer) == result[0]["generated_text"]
    with pytest.raises(ValueError, match="streamer needs one sequence"):
        paged("x", max_new_tokens=3, num_beams=2, do_sample=False, streamer=transformers.TextStreamer(paged.tokenizer))


@pytest.mark.parametrize("kwargs, named", [
    (dict(no_repeat_ngram_size=2), "no_repeat_ngram_size"),
    (dict(bad_words_ids=[[5]]), "bad_words_ids"),
    (dict(typical_p=0.5, do_sample=True), "typical_p"),
    (dict(logits_processor=transformers.LogitsProcessorList()), "logits_processor"),
    (dict(num_beams=2, stop_strings=["x"]), "stop does not apply to beam search"),
    (dict(return_dict_in_generate=True, output_scores=True), "output_scores"),  # stock returns them
    (dict(do_sample=True, num_beams=2), "beam sampling"),
    (dict(do_sample=True, temperature=0.0), "temperature=0.0 with do_sample=True"),
])
def test_options_the_engine_cannot_honor_are_refused_by_name(pipes, kwargs, named):
    _, paged = pipes
    with pytest.raises(ValueError, match=named):
        paged("Hello", **{"do_sample": False, **kwargs})
    assert paged.engine.kv.num_used_blocks() == 0


def test_sampling_is_repeatable_under_torch_manual_seed(pipes):
    _, paged = pipes
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(paged(["Hello", "Hi"], max_new_tokens=12, do_sample=True, temperature=1.5))
    assert runs[0] == runs[1] and runs[0] != runs[2]
    torch.manual_seed(0)
    assert paged(["Hello", "Hi"], max_new_tokens=12, do_sample=True, temperature=None) != runs[0]  # 1.0, as stock
