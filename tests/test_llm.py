"""``hf_paged.LLM``, vLLM's offline entry point: a saved checkpoint loaded and served by one engine,
greedy tokens equal to stock ``generate()``; ``chat`` through the tokenizer's template."""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged import LLM, SamplingParams
from hf_paged.demo import byte_tokenizer, demo_model

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPTS = ["def add(a, b):", "Return the list of"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("checkpoint")
    model = demo_model(trained=False, seed=3)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path, model


def _stock_greedy(model, tokenizer, prompt: str) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
    return out[0, ids.shape[1]:].tolist()


def test_a_saved_checkpoint_gives_stock_generates_greedy_tokens(saved):
    path, model = saved
    llm = LLM(str(path), block_size=4)
    assert llm.get_tokenizer() is llm.llm_engine.tokenizer and next(llm.llm_engine.model.parameters()).dtype == torch.float32
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    want = [_stock_greedy(model, byte_tokenizer(), p) for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in outs] == want
    assert [o.prompt for o in outs] == PROMPTS
    other = LLM(demo_model(trained=False, seed=4), byte_tokenizer(), block_size=4)  # negative control
    assert [o.outputs[0].token_ids for o in other.generate(PROMPTS, GREEDY, use_tqdm=False)] != want
    assert llm.llm_engine.kv.stats()["blocks_used"] == 0


def test_chat_runs_the_template_once_and_keeps_its_text(saved):
    path, _ = saved
    llm = LLM(path, dtype="float32")
    tokenizer = llm.get_tokenizer()
    conversations = [[{"role": "user", "content": "Hello"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]]
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in conversations]
    ids = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    want = [o.outputs[0].token_ids for o in llm.generate(ids, GREEDY, use_tqdm=False)]
    outs = llm.chat(conversations, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want and [o.prompt for o in outs] == texts
    assert [o.prompt_token_ids for o in outs] == ids  # the template's BOS, not a second one
    one = llm.chat(conversations[0], GREEDY, use_tqdm=False)  # a single conversation
    assert len(one) == 1 and one[0].outputs[0].token_ids == want[0]


def test_the_demo_model_by_default_and_clear_refusals(tmp_path):
    llm = LLM()
    assert llm.llm_engine.model.hf_paged_demo == "trained"
    assert llm.generate("Return the", GREEDY, use_tqdm=False)[0].outputs[0].text
    with pytest.raises(ValueError, match="not a directory with a saved model"):
        LLM(str(tmp_path / "nothing-here"))
    with pytest.raises(TypeError, match="checkpoint directory, a PreTrainedModel or None"):
        LLM(123)
    with pytest.raises(ValueError, match="not a torch dtype"):
        LLM(dtype="float99")
    assert hf_paged.LLM is LLM


def test_beam_search_is_generates_beam_search_in_vllms_shape(saved):
    path, model = saved
    llm = LLM(str(path), block_size=4)
    tokenizer = llm.get_tokenizer()
    params = hf_paged.BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True, length_penalty=0.5)
    outs = llm.beam_search([PROMPTS[0], {"prompt": PROMPTS[1]}], params)
    assert len(outs) == 2
    for prompt, out in zip(PROMPTS, outs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        stock = model.generate(ids, max_new_tokens=8, num_beams=3, num_return_sequences=3, do_sample=False,
                               eos_token_id=None, length_penalty=0.5, output_scores=True,
                               return_dict_in_generate=True)
        assert [s.tokens for s in out.sequences] == stock.sequences.tolist()  # the prompt, then the beam
        assert [s.text for s in out.sequences] == tokenizer.batch_decode(stock.sequences, skip_special_tokens=True)
        unpenalised = (stock.sequences_scores * 8 ** 0.5).tolist()  # the score is sum / generated_len ** 0.5
        assert [s.cum_logprob for s in out.sequences] == pytest.approx(unpenalised, rel=1e-5)
        assert {s.finish_reason for s in out.sequences} == {"length"} and len({tuple(s.tokens) for s in out.sequences}) == 3
    other = LLM(demo_model(trained=False, seed=4), byte_tokenizer(), block_size=4)  # negative control
    assert [s.tokens for s in other.beam_search(PROMPTS[:1], params)[0].sequences] != [s.tokens for s in outs[0].sequences]
    with pytest.raises(ValueError, match="BeamSearchParams.beam_width must be an int >= 1"):
        llm.beam_search(PROMPTS, hf_paged.BeamSearchParams(beam_width=0, max_tokens=4))
    with pytest.raises(ValueError, match="prompt 1:"):
        llm.beam_search([PROMPTS[0], [10**6]], params)
    assert llm.llm_engine.kv.stats()["blocks_used"] == 0


def test_a_seed_makes_unseeded_samples_repeat(saved):
    path, _ = saved
    sampled = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)

    def draw(seed):
        return LLM(str(path), block_size=4, seed=seed).generate(PROMPTS, sampled, use_tqdm=False)

    first, again, other = draw(7), draw(7), draw(8)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    assert [o.outputs[0].token_ids for o in first] != [o.outputs[0].token_ids for o in other]  # the seed matters
    with pytest.raises(ValueError, match="seed"):
        LLM(str(path), seed="7")
