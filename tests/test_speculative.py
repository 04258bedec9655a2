"""Speculative decoding by n-gram lookup (``LLMEngine(speculative_config=...)``): every token is the
one decoding without drafts gives (stock ``generate()``'s for greedy requests; seeded samples and
their log-probs bit for bit), whatever the drafts, the sampling options, windows, the prefix cache
or preemption; the blocks of rejected draft tokens go back."""

from __future__ import annotations

import dataclasses
import random
import re

import httpx
import pytest
import torch

from hf_paged import LLMEngine, SamplingParams
from hf_paged.demo import demo_model
from hf_paged.engine.output_processor import OutputProcessor
from hf_paged.engine.speculative import NgramProposer, SpeculativeConfig
from tests.helpers.hybrid_models import build_hybrid
from tests.helpers.tiny_models import VOCAB, assert_engine_idle, build, build_narrow_llama

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def llama():
    """Its greedy outputs rarely repeat: most drafts are rejected."""
    return build("llama")


@pytest.fixture(scope="module")
def looping():
    """A tiny demo-architecture model whose greedy outputs fall into loops: most drafts are taken."""
    return demo_model(seed=0, num_hidden_layers=2, hidden_size=64, intermediate_size=128, vocab_size=VOCAB)


def repetitive_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a short random phrase (what n-gram drafts feed on), then a few random tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        phrase = torch.randint(3, VOCAB, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        prompts.append((phrase * 40)[: 4 + 5 * i] + torch.randint(3, VOCAB, (3,), generator=g).tolist())
    return prompts


def run(model, prompts, params, **engine_kwargs):
    """Outputs of a fresh engine, and its stats; every block is free after."""
    engine = LLMEngine(model, **engine_kwargs)
    outputs = engine.generate(prompts, params, use_tqdm=False)
    assert all(out.error is None for out in outputs), [out.error for out in outputs]
    assert_engine_idle(engine)
    return outputs, engine.stats()


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outputs]


def stock_greedy(model, prompts, max_new_tokens: int) -> list[list[list[int]]]:
    return [[model.generate(input_ids=torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                            eos_token_id=None)[0, len(p):].tolist()] for p in prompts]


@pytest.mark.parametrize("name", ["looping", "llama"])
def test_greedy_tokens_equal_stock_generate(name, request):
    model = request.getfixturevalue(name)
    prompts = repetitive_prompts(10)
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    plain, plain_stats = run(model, prompts, params, block_size=4)
    drafted, stats = run(model, prompts, params, block_size=4, speculative_config=NGRAM)
    assert tokens(drafted) == stock_greedy(model, prompts, 40) == tokens(plain)
    assert plain_stats["spec_draft_tokens"] == 0
    assert stats["generated_tokens"] == plain_stats["generated_tokens"] == 400
    drafts, taken = stats["spec_draft_tokens"], stats["spec_accepted_tokens"]
    if name == "looping":  # runs of taken drafts: far fewer steps
        assert taken > 0.8 * drafts and stats["steps"] < plain_stats["steps"] / 2
    else:
        assert drafts > 20 * taken > 0


@pytest.mark.parametrize("name", ["looping", "llama"])
def test_negative_control_rows_after_a_rejected_draft_token_give_other_tokens(name, request, monkeypatch):
    """The suite can fail: taking the next row's token although the draft token before it was not the
    one chosen (its row saw a context that never happened) changes the outputs."""
    model = request.getfixturevalue(name)
    prompts = repetitive_prompts(10)
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    monkeypatch.setattr(OutputProcessor, "_took", staticmethod(lambda seq, draft_token: seq.finish_reason is None))
    drafted, _ = run(model, prompts, params, block_size=4, speculative_config=NGRAM)
    assert tokens(drafted) != stock_greedy(model, prompts, 40)


SAMPLED = [
    SamplingParams(max_new_tokens=30, temperature=0.9, top_p=0.9, seed=5, n=2, logprobs=3),
    SamplingParams(max_new_tokens=30, temperature=1.0, top_k=8, seed=11),
    SamplingParams(max_new_tokens=25, temperature=0, repetition_penalty=1.3, presence_penalty=0.5),
    SamplingParams(max_new_tokens=25, temperature=0.7, frequency_penalty=0.8, seed=3, logprobs=0),
    SamplingParams(max_new_tokens=20, temperature=0, min_tokens=6, stop_token_ids=[5, 17, 40, 61]),
    SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True),
    SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True),
    SamplingParams(max_new_tokens=20, temperature=0, logit_bias={7: 3.0, 9: -100.0}, allowed_token_ids=None),
    SamplingParams(max_new_tokens=20, temperature=0.8, seed=9, min_p=0.05, allowed_token_ids=list(range(3, 60))),
]


@pytest.mark.parametrize("params", SAMPLED, ids=lambda p: f"n{p.n}-t{p.temperature}-max{p.max_new_tokens}")
def test_every_token_and_log_prob_equals_decoding_without_drafts(llama, params):
    """Seeded samples draw the same numbers in the same order: tokens, finish and stop reasons are
    equal, log-probs equal but for the last bits (a row's matrix products round by the shape of the
    step it ran in, drafts or not, as between any two batches)."""
    prompts = repetitive_prompts(6, seed=1)
    plain, _ = run(llama, prompts, params, block_size=4)
    drafted, stats = run(llama, prompts, params, block_size=4, speculative_config=NGRAM)
    assert tokens(drafted) == tokens(plain)
    for a, b in zip(plain, drafted):
        for x, y in zip(a.outputs, b.outputs):
            assert (x.finish_reason, x.stop_reason) == (y.finish_reason, y.stop_reason)
            assert (x.cumulative_logprob is None) == (y.cumulative_logprob is None)
            if x.cumulative_logprob is not None:
                assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-4)
            for row_x, row_y in zip(x.logprobs or [], y.logprobs or [], strict=True):
                assert row_x.keys() == row_y.keys()
                assert [float(row_x[t]) for t in row_x] == pytest.approx([float(row_y[t]) for t in row_x], abs=1e-4)
    if params.max_new_tokens > 1:
        assert stats["spec_draft_tokens"] > 0


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_windows_prefix_cache_and_preemption(arch):
    """Sliding windows (blocks given back behind them), prefix hits of repeated prompts, and a pool
    small enough to preempt (recompute, then swap): tokens as without drafts, books kept, nothing
    leaked."""
    model = build(arch)
    prompts = repetitive_prompts(8, seed=2)
    prompts += [list(p) for p in prompts[:3]]  # prefix hits
    params = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    for mode in ("recompute", "swap"):
        kwargs = dict(block_size=2, num_blocks=48, max_num_batched_tokens=24, preemption_mode=mode,
                      enable_prefix_caching=True)
        plain, _ = run(model, prompts, params, **kwargs)
        drafted, stats = run(model, prompts, params, **kwargs, speculative_config=NGRAM)
        assert tokens(drafted) == tokens(plain)
        assert stats["spec_accepted_tokens"] > 0
        assert stats[f"preemptions_{mode}"] > 0


def test_any_draft_gives_the_same_tokens(llama, monkeypatch):
    """Random drafts of random lengths (mostly wrong), stepped one at a time with the books checked
    after every step: the outputs are those of decoding without drafts."""
    rng = random.Random(0)

    def random_draft(self, request, seq, budget):
        limit = min(budget, self.limit(request, seq), rng.randint(0, 6))
        if rng.random() < 0.3 and limit > 0:  # now and then a right guess: the decoded continuation
            return tuple(expected[request.request_id][seq.index][seq.num_output_tokens:][:limit])
        return tuple(rng.randrange(VOCAB) for _ in range(max(limit, 0)))

    prompts = repetitive_prompts(8, seed=3)
    params = [SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_new_tokens=24, temperature=0.8, seed=4, n=2, ignore_eos=True)] * 4
    plain, _ = run(llama, prompts, params, block_size=4)
    expected = {str(i): [c.token_ids for c in out.outputs] for i, out in enumerate(plain)}
    monkeypatch.setattr(NgramProposer, "propose", random_draft)
    engine = LLMEngine(llama, block_size=4, num_blocks=80, speculative_config=dict(NGRAM, num_speculative_tokens=6))
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(prompt, p, request_id=str(i))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = [c.token_ids for c in out.outputs]
        engine.kv.check_invariants()
        for request in engine.scheduler.running:  # no block held past the tokens that stood
            for seq in filter(engine.kv.holds, request.live_seqs):
                assert len(engine.kv.block_table(seq)) == engine.kv.blocks_for(seq.num_computed_tokens)
    assert finished == expected
    assert engine.stats()["spec_draft_tokens"] > engine.stats()["spec_accepted_tokens"] > 0
    assert_engine_idle(engine)


def test_no_drafts_above_the_batch_size_limit(llama):
    prompts = repetitive_prompts(6, seed=4)
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    config = dict(NGRAM, disable_by_batch_size=5)
    _, crowded = run(llama, prompts, params, speculative_config=config)
    assert crowded["spec_draft_tokens"] == 0
    _, few = run(llama, prompts[:5], params, speculative_config=config)
    assert few["spec_draft_tokens"] > 0


def test_ngram_proposals():
    config = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3,
                                   "prompt_lookup_min": 2})
    proposer = NgramProposer(config, max_positions=None)

    class Req:
        params = SamplingParams(max_new_tokens=100)

    from hf_paged.engine.sequence import Sequence

    seq = Sequence([1, 2, 3, 4, 5, 9, 9, 2, 3, 4], num_prompt_tokens=10)
    assert proposer.propose(Req, seq, budget=8) == (5, 9, 9, 2, 3)  # after the last "2 3 4"
    assert proposer.propose(Req, seq, budget=2) == (5, 9)
    seq.token_ids += [7, 7]
    assert proposer.propose(Req, seq, budget=8) == ()  # "4 7 7" / "7 7" never came before
    seq.token_ids += [7]
    assert proposer.propose(Req, seq, budget=8) == (7, 7, 7, 7, 7)  # a repeat shorter than the draft repeats
    short = Sequence([6, 1, 2, 6, 1], num_prompt_tokens=5)
    assert proposer.propose(Req, short, budget=8) == (2, 6, 1, 2, 6)
    Req.params = SamplingParams(max_new_tokens=3)
    assert proposer.propose(Req, short, budget=8) == (2, 6)  # its last token is the step's own
    assert NgramProposer(config, max_positions=7).propose(Req, Sequence([6, 1, 2, 6, 1], 5), budget=8) == (2,)


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle' is not supported"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an int >= 1"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min=4"),
    ({"num_speculative_tokens": 2, "model": "draft"}, "unsupported keys ['model']"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size must be"),
    ("ngram", "must be a dict"),
])
def test_bad_configs_are_refused_naming_what_is_wrong(llama, config, message):
    with pytest.raises(ValueError, match=rf"speculative_config.*{message}".replace("[", r"\[").replace("]", r"\]")):
        LLMEngine(llama, speculative_config=config)


def test_vllm_defaults_of_the_lookup_window():
    assert SpeculativeConfig.of({"num_speculative_tokens": 3}) == SpeculativeConfig(3, 5, 5)
    assert SpeculativeConfig.of({"num_speculative_tokens": 3, "prompt_lookup_max": 4}) == SpeculativeConfig(3, 4, 4)
    assert SpeculativeConfig.of({"num_speculative_tokens": 3, "prompt_lookup_min": 2}) == SpeculativeConfig(3, 2, 2)


def test_models_with_recurrent_layers_are_refused():
    with pytest.raises(ValueError, match="recurrent layers, whose state cannot be rolled back"):
        LLMEngine(build_hybrid("lfm2"), speculative_config=NGRAM)


def test_served_requests_with_drafts_answer_as_the_engine_without_them():
    """``hf-paged serve --speculative-config``'s engine over real HTTP with the openai client: streamed
    and whole completions and a chat answer with the tokens of an engine without drafts."""
    import openai

    from hf_paged.demo import byte_tokenizer
    from tests.helpers.serving import serving, single_threaded_torch, tiny_model, wait_idle

    looping = {"initializer_range": 0.05}  # its greedy answers loop: drafts are taken
    prompts = ["The cat sat on the mat. The cat sat on", "abcabcabcab", "1, 2, 3, 1, 2, 3, 1"]
    with single_threaded_torch(), serving({"num_blocks": 256, "speculative_config": NGRAM}, looping) as (server, loop):
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            whole = [client.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0,
                                               extra_body={"return_token_ids": True}) for p in prompts]
            streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
                model="tiny", prompt=prompts[0], max_tokens=24, temperature=0, stream=True))
            chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompts[1]}],
                                                  max_tokens=24, temperature=0, extra_body={"return_token_ids": True})
        stats = wait_idle(loop)
        metrics = httpx.get(server.url + "/metrics").text
    tokenizer = byte_tokenizer()
    engine = LLMEngine(tiny_model(**looping), tokenizer, num_blocks=256)
    expected = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    assert [c.choices[0].token_ids for c in whole] == [out.outputs[0].token_ids for out in expected]
    assert [c.choices[0].text for c in whole] == [out.outputs[0].text for out in expected]
    assert streamed == expected[0].outputs[0].text
    answer = engine.generate([{"prompt_token_ids": chat.prompt_token_ids}],
                             SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0].outputs[0]
    assert (chat.choices[0].token_ids, chat.choices[0].message.content) == (answer.token_ids, answer.text)
    assert stats["spec_accepted_tokens"] > 20
    for name, key in (("drafts", "spec_drafts"), ("draft_tokens", "spec_draft_tokens"),
                      ("accepted_tokens", "spec_accepted_tokens")):  # vLLM's series
        assert re.search(rf'^vllm:spec_decode_num_{name}_total{{model_name="[^"]*"}} {stats[key]}$', metrics, re.M)


def test_the_command_line_takes_vllms_json_form():
    from hf_paged.__main__ import CliError, parser, serving_engine

    config = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'
    engine = serving_engine(parser().parse_args(["serve", "--speculative-config", config, "--num-blocks", "64"]))
    assert engine.speculative_config == SpeculativeConfig(3, 2, 2)
    with pytest.raises(CliError, match="--speculative-config.*not JSON"):
        serving_engine(parser().parse_args(["serve", "--speculative-config", "{ngram}"]))
    with pytest.raises(CliError, match="speculative_config: method 'draft_model' is not supported"):
        serving_engine(parser().parse_args(["serve", "--speculative-config",
                                            '{"method": "draft_model", "num_speculative_tokens": 3}']))


def test_drafts_on_the_triton_kernels(triton_launches, monkeypatch):
    """The GPU route (Triton kernels, interpreted here): drafts are read by the decode kernel, a
    row per token, and the tokens are stock generate()'s."""
    from hf_paged import kernels

    model = build_narrow_llama()
    prompts = [p[:20] for p in repetitive_prompts(3, seed=5)]
    params = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    decode_rows = []
    original = kernels.paged_attention_decode

    def counted(q, *args, **kwargs):
        decode_rows.append(q.shape[0])
        return original(q, *args, **kwargs)

    monkeypatch.setattr(kernels, "paged_attention_decode", counted)
    drafted, stats = run(model, prompts, params, block_size=4, speculative_config=NGRAM)
    assert tokens(drafted) == stock_greedy(model, prompts, 10)
    assert stats["spec_draft_tokens"] > 0 and triton_launches["paged_attention_decode"] > 0
    assert max(decode_rows) > len(prompts)  # a draft's rows among them


def test_drafts_through_the_compiled_step(looping):
    """CPU engines compile their steps by default (the tests run eager): drafts there too."""
    prompts = repetitive_prompts(4, seed=6)
    params = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    drafted, stats = run(looping, prompts, params, block_size=4, speculative_config=NGRAM, compile=True)
    assert stats["compiled"] and stats["spec_accepted_tokens"] > 30
    assert tokens(drafted) == stock_greedy(looping, prompts, 30)


def test_constrained_requests_take_drafts_a_mask_at_a_time():
    """A grammar's mask at each position follows the tokens taken before it (the matcher advances
    every round): JSON-schema and regex outputs, greedy and seeded samples, as without drafts."""
    from hf_paged.constraints import StructuredOutputsParams
    from hf_paged.demo import byte_tokenizer
    from tests.helpers.serving import tiny_model

    model, tokenizer = tiny_model(initializer_range=0.05), byte_tokenizer()
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 12}}, "required": ["a"]}
    requests = []
    for constraint in (StructuredOutputsParams(json=schema), StructuredOutputsParams(regex=r"(ab|abc)+x{0,20}")):
        requests += [SamplingParams(max_tokens=40, temperature=0, structured_outputs=constraint),
                     SamplingParams(max_tokens=40, temperature=1.0, seed=7, n=2, structured_outputs=constraint)]
    prompts = ["abcabcabc"] * len(requests)
    results = []
    for config in (None, NGRAM):
        engine = LLMEngine(model, tokenizer, num_blocks=256, speculative_config=config)
        outputs = engine.generate(prompts, requests, use_tqdm=False)
        assert all(out.error is None for out in outputs)
        assert_engine_idle(engine)
        results.append(([[c.text for c in out.outputs] for out in outputs], tokens(outputs), engine.stats()))
    assert results[1][:2] == results[0][:2]
    assert results[1][2]["spec_accepted_tokens"] > 0


def test_vllms_llm_takes_the_config(looping):
    from hf_paged import LLM

    llm = LLM(looping, speculative_config=NGRAM)
    prompts = repetitive_prompts(3, seed=7)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False)
    assert tokens(outputs) == stock_greedy(looping, prompts, 20)
    assert llm.llm_engine.stats()["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("name", ["gpt_oss", "deepseek_v3", "llama4_text", "gemma3n_text", "gemma3", "gpt2"])
def test_every_attention_kind_takes_drafts(name):
    """Sinks and sliding windows (gpt-oss), latent attention (DeepSeek V3), chunked local attention
    (Llama 4), layers sharing K/V (Gemma 3n), sliding + full groups (Gemma 3), learned positions
    (GPT-2): greedy tokens with drafts are stock generate()'s."""
    from tests.helpers.variant_models import BUILDERS, build_variant

    model = build_variant(name) if name in BUILDERS else build(name)
    vocab = model.config.get_text_config().vocab_size
    prompts = [[t % vocab for t in p] for p in repetitive_prompts(5, seed=8)]
    drafted, stats = run(model, prompts, SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True),
                         block_size=4, speculative_config=NGRAM)
    assert tokens(drafted) == [[model.generate(input_ids=torch.tensor([p]), max_new_tokens=24, do_sample=False,
                                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()]
                               for p in prompts]
    assert stats["spec_accepted_tokens"] > 0


HALF = [(torch.bfloat16, "llama"), (torch.bfloat16, "mistral"), (torch.float16, "llama"), (torch.float16, "mistral")]


def half_precision_runs(dtype: torch.dtype, arch: str):
    """(with drafts, stock generate()) greedy tokens of a half-precision model on a fixed prompt set."""
    model = build(arch).to(dtype)
    prompts = repetitive_prompts(8, seed=9)
    params = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    drafted, stats = run(model, prompts, params, block_size=4, speculative_config=NGRAM)
    assert stats["spec_accepted_tokens"] > 0
    return tokens(drafted), stock_greedy(model, prompts, 30)


@pytest.mark.parametrize("dtype, arch", HALF, ids=lambda v: str(v).removeprefix("torch."))
def test_half_precision_drafts_give_stock_tokens(dtype, arch):
    """Draft rows are read as decode rows (a group of one length each, as a decode step reads a
    row), so their rounding is a decode step's: the tokens are stock generate()'s in bfloat16 and
    float16 too."""
    drafted, stock = half_precision_runs(dtype, arch)
    assert drafted == stock


def test_negative_control_drafts_through_the_prefill_read_round_otherwise(monkeypatch):
    """Read as a chunk after a past (the prefill read), a half-precision draft row rounds otherwise,
    and a near-tie goes the other way: the half-precision tests can fail. Which near-tie flips
    depends on the CPU's half-precision arithmetic (bfloat16 llama did on earlier machines; on an
    AMD EPYC with AVX-512 BF16 only mistral's, in both dtypes), so any of the four flipping shows it."""
    from hf_paged.engine import step_cache

    original = step_cache.step_metadata

    def without_draft_rows(step, group):
        return dataclasses.replace(original(step, group), num_draft_seqs=0, draft_tables=None, draft_lens=None)

    monkeypatch.setattr(step_cache, "step_metadata", without_draft_rows)
    flipped = []
    for dtype, arch in HALF:
        drafted, stock = half_precision_runs(dtype, arch)
        flipped.append(drafted != stock)
    assert any(flipped), dict(zip(HALF, flipped))


def test_deltas_of_steps_that_take_several_tokens_add_up(looping):
    """A step that takes drafts gives a request several tokens at once: vLLM's DELTA outputs and
    stream() deltas carry them all, and join into the final output."""
    from hf_paged import RequestOutputKind

    prompts = repetitive_prompts(3, seed=10)
    engine = LLMEngine(looping, block_size=4, speculative_config=NGRAM)
    final = engine.generate(prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False)
    delta = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, delta, request_id=f"d{i}")
    joined, sizes = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            joined.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            sizes.append(len(out.outputs[0].token_ids))
    assert [joined[f"d{i}"] for i in range(3)] == [out.outputs[0].token_ids for out in final]
    assert max(sizes) > 1  # steps that took drafts
    streamed = [t for delta in engine.stream(prompts[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
                for t in delta["token_ids"]]
    assert streamed == final[0].outputs[0].token_ids
    assert_engine_idle(engine)
