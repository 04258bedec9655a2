"""LLMEngine: equality with per-request generate(), preemption, prefix caching, errors, leaks."""

from __future__ import annotations

import pytest
import torch

from hf_paged import LLMEngine, SamplingParams
from hf_paged.engine.sequence import Status
from tests.helpers.tiny_models import VOCAB, build, run_beside_an_older_request

GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return build("llama")


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    lengths = [1, 2, 300] + torch.randint(1, 300, (30,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def references(model, prompts):
    """Per-request stock generate(), plus its per-step logits for the near-tie rule."""
    refs = []
    for p in prompts:
        out = model.generate(input_ids=torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                             output_logits=True, return_dict_in_generate=True)
        refs.append((out.sequences[0, len(p):].tolist(), [torch.log_softmax(x[0].float(), -1) for x in out.logits]))
    return refs


def _check_no_leak(engine: LLMEngine) -> None:
    engine.kv.check_invariants()
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_used_blocks() == 0, "blocks leaked"


def compare(outputs, references) -> tuple[int, list]:
    """(exact matches, accepted near-ties). A divergence is accepted only when, at the first
    differing step, both tokens are in each other's top-2 with a log-prob gap below 1e-4."""
    exact, ties = 0, []
    for i, (out, (ref_tokens, ref_logprobs)) in enumerate(zip(outputs, references)):
        got = out.outputs[0].token_ids
        if got == ref_tokens:
            exact += 1
            continue
        step = next(j for j, (a, b) in enumerate(zip(got, ref_tokens)) if a != b)
        lp = ref_logprobs[step]
        top2 = torch.topk(lp, 2).indices.tolist()
        gap = abs(float(lp[got[step]] - lp[ref_tokens[step]]))
        assert set(top2) == {got[step], ref_tokens[step]} and gap < 1e-4, (
            f"prompt {i}: engine {got} vs generate {ref_tokens} (step {step}, gap {gap:.2e})")
        ties.append((i, step, gap))
    return exact, ties


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_equals_generate_under_heavy_preemption(model, prompts, references, mode, prefix_caching):
    engine = LLMEngine(model, block_size=8, num_blocks=48, max_num_batched_tokens=96, preemption_mode=mode,
                       enable_prefix_caching=prefix_caching)
    outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
    exact, ties = compare(outputs, references)
    assert exact + len(ties) == len(prompts)
    print(f"{mode}, prefix caching {prefix_caching}: {exact} exact, near-ties accepted: {ties}")
    stats = engine.stats()
    assert stats[f"preemptions_{mode}"] >= 5, stats  # the budget really forced preemption
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)
    _check_no_leak(engine)


def test_greedy_with_an_ample_budget(model, prompts, references):
    engine = LLMEngine(model, block_size=16, num_blocks=2048, max_num_batched_tokens=512)
    exact, ties = compare(engine.generate(prompts, GREEDY, use_tqdm=False), references)
    assert exact + len(ties) == len(prompts) and engine.stats()["preemptions_recompute"] == 0
    _check_no_leak(engine)


def test_prefix_caching_computes_a_shared_prefix_once(model):
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, VOCAB, (256,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, VOCAB, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 40, (16,), generator=g)]
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    results = {}
    for caching in (False, True):
        engine = LLMEngine(model, block_size=16, num_blocks=512, max_num_batched_tokens=4096,
                           enable_prefix_caching=caching)
        outs = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
        results[caching] = (outs, engine.stats())
        _check_no_leak(engine)
    assert results[True][0] == results[False][0]
    computed_off = results[False][1]["computed_prompt_tokens"]
    computed_on = results[True][1]["computed_prompt_tokens"]
    assert computed_off == sum(map(len, prompts))
    assert computed_off - computed_on >= 15 * 256  # every request after the first skipped the prefix
    assert results[True][1]["prefix_cache_hit_tokens"] >= 15 * 256


def test_reset_prefix_cache_after_the_weights_change():
    """Cached blocks hold the old weights' keys and values: without a reset the same prompts read
    them (tokens differ from stock's with the new weights: the negative control); after it they
    equal stock's. A reset while a request is unfinished changes nothing and says so."""
    model = build("llama")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (70, 49, 90)]
    engine = LLMEngine(model, block_size=16, num_blocks=64)

    def tokens():
        return [list(o.outputs[0].token_ids) for o in engine.generate(prompts, GREEDY, use_tqdm=False)]

    def stock():
        return [model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None)[0, len(p):]
                .tolist() for p in prompts]

    assert tokens() == stock() and engine.stats()["blocks_cached"] > 0
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.weight.mul_(-2.0)
    assert tokens() != stock()  # stale cached prefixes
    engine.add_request(prompts[0], GREEDY, request_id="busy")
    assert engine.reset_prefix_cache() is False and engine.stats()["blocks_cached"] > 0
    engine.abort("busy")
    assert engine.reset_prefix_cache() is True and engine.stats()["blocks_cached"] == 0
    assert tokens() == stock()
    _check_no_leak(engine)


def test_parallel_sampling_is_seeded_and_shares_the_prompt(model, prompts):
    params = SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, top_k=20, n=3, seed=7)
    alone = LLMEngine(model, num_blocks=256).generate([prompts[5]], params, use_tqdm=False)[0]
    crowd = LLMEngine(model, num_blocks=256).generate(prompts[:8], [params] * 8, use_tqdm=False)[5]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in crowd.outputs]
    assert len(alone.outputs) == 3 and len({tuple(c.token_ids) for c in alone.outputs}) > 1
    engine = LLMEngine(model, num_blocks=256, block_size=16)
    engine.add_request(prompts[2], SamplingParams(max_new_tokens=4, n=4, seed=1))
    engine.step()  # the prefill, then the fork into 4 samples
    req = next(iter(engine.requests.values()))
    tables = [engine.kv.block_table(s) for s in req.seqs]
    full = (len(prompts[2])) // 16
    assert len(tables) == 4 and all(t[:full] == tables[0][:full] for t in tables)
    while engine.has_unfinished_requests():
        engine.step()
    _check_no_leak(engine)


def test_abort_mid_prefill_and_mid_decode_frees_everything(model, prompts):
    engine = LLMEngine(model, block_size=8, num_blocks=128, max_num_batched_tokens=32)
    long_id = engine.add_request(prompts[2], GREEDY)  # 300 tokens: prefill takes many 32-token chunks
    short_id = engine.add_request(prompts[0], GREEDY)
    engine.step()
    assert engine.requests[long_id].seqs[0].num_computed_tokens < 300  # still prefilling
    engine.abort(long_id)
    for _ in range(3):
        engine.step()
    assert engine.requests[short_id].status is Status.RUNNING and engine.requests[short_id].forked
    engine.abort(short_id)
    _check_no_leak(engine)


@pytest.mark.parametrize("bad, match", [
    ([], "empty prompt"),
    ([5, VOCAB + 3], "outside the vocabulary"),
    ([-1, 4], "outside the vocabulary"),
    (list(range(3, 90)) * 7, "positions"),  # 609 tokens, the model has 512 positions
])
def test_bad_requests_fail_alone(model, prompts, references, bad, match):
    engine = LLMEngine(model, block_size=8, num_blocks=64)
    outputs = engine.generate([prompts[0], bad, prompts[1]], GREEDY, use_tqdm=False)
    assert outputs[1].error is not None and pytest.approx(0) == len(outputs[1].outputs)
    import re
    assert re.search(match, outputs[1].error), outputs[1].error
    assert outputs[0].outputs[0].token_ids == references[0][0]
    assert outputs[2].outputs[0].token_ids == references[1][0]
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request([], GREEDY)
    _check_no_leak(engine)


@pytest.mark.parametrize("field, value", [
    ("temperature", -1.0), ("top_p", 0.0), ("top_k", -5), ("n", 0), ("max_new_tokens", 0),
    ("repetition_penalty", 0.0), ("min_p", 2.0), ("num_beams", 0), ("logprobs", -2), ("early_stopping", "sometimes"),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_a_request_larger_than_the_cache_fails_while_others_finish(model, prompts):
    engine = LLMEngine(model, block_size=8, num_blocks=12, max_num_batched_tokens=64)
    params = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True)  # grows past 96 slots
    outputs = engine.generate([prompts[0], [5] * 40], [GREEDY, params], use_tqdm=False)
    assert outputs[0].error is None and outputs[0].finished
    assert outputs[1].error and "KV blocks" in outputs[1].error
    _check_no_leak(engine)


def test_stream_yields_deltas_that_add_up(model, prompts, references):
    engine = LLMEngine(model, num_blocks=128)
    deltas = list(engine.stream(prompts[3], GREEDY))
    assert sum(len(d["token_ids"]) for d in deltas) == 12 and deltas[-1]["finished"]
    assert [t for d in deltas for t in d["token_ids"]] == references[3][0]
    _check_no_leak(engine)


def test_streamed_text_adds_up_to_the_final_text_and_others_lose_nothing():
    """``stream()``'s text deltas: a character split over byte tokens goes out whole, nothing of a
    stop string goes out (both once did), and they join to the final text. A request added with
    add_request meanwhile is stepped too, and its output comes with the next step() (it was lost)."""
    from hf_paged.constraints import StructuredOutputsParams
    from hf_paged.demo import byte_tokenizer, demo_model

    engine = LLMEngine(demo_model(), byte_tokenizer(), num_blocks=64)  # trained: it writes whole characters
    unicode = SamplingParams(max_new_tokens=20, temperature=0, structured_outputs=StructuredOutputsParams(
        choice=["héllo 日本 x"]))
    free = engine.generate(["Hi"], SamplingParams(max_new_tokens=12, temperature=0), use_tqdm=False)[0].outputs[0]
    stop = SamplingParams(max_new_tokens=12, temperature=0, stop=[free.text[3:9]])
    for params in (unicode, stop):
        final = engine.generate(["Hi"], params, use_tqdm=False)[0].outputs[0].text
        other = engine.add_request([5, 6, 7], GREEDY)
        deltas = [d["text"] for d in engine.stream("Hi", params)]
        assert "".join(deltas) == final and "\ufffd" not in "".join(deltas)
        assert final in ("héllo 日本 x", free.text[:3])
        later = {o.request_id: o for o in engine.step() if o.finished}
        while engine.has_unfinished_requests():
            later.update((o.request_id, o) for o in engine.step() if o.finished)
        assert len(later[other].outputs[0].token_ids) == 12
    _check_no_leak(engine)


def test_stop_token_ids_logprobs_and_stats(model, prompts, references):
    ref = references[4][0]
    engine = LLMEngine(model, num_blocks=128)
    out = engine.generate([prompts[4]], SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=[ref[3]],
                                                      logprobs=2), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.token_ids == ref[: ref.index(ref[3]) + 1] and completion.finish_reason == "stop"
    assert len(completion.logprobs) == len(completion.token_ids) and len(completion.logprobs[0]) >= 2
    assert completion.cumulative_logprob == pytest.approx(sum(lp[t] for lp, t in zip(completion.logprobs,
                                                                                          completion.token_ids)))
    stats = engine.stats()
    for key in ("running", "waiting", "swapped", "blocks_used", "blocks_free", "blocks_cached", "prefix_cache_hit_rate",
                "preemptions_recompute", "preemptions_swap", "tokens_per_second"):
        assert key in stats
    _check_no_leak(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_soak(model, mode):
    """500 requests of random lengths and widths, some aborted, on a tiny budget (HF_PAGED_SOAK=N
    changes the size; the full size takes ~5 s per mode here)."""
    import os
    import random

    rng = random.Random(0)
    total = int(os.environ.get("HF_PAGED_SOAK", "500"))
    engine = LLMEngine(model, block_size=8, num_blocks=40, max_num_batched_tokens=64, max_num_seqs=16,
                       preemption_mode=mode)
    expected = {}
    for i in range(total):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 60))]
        max_new_tokens, n, temperature = rng.randrange(1, 12), rng.choice([1, 1, 2, 3]), rng.choice([0, 0.7])
        params = SamplingParams(max_new_tokens=max_new_tokens, n=n if temperature else 1, seed=i,
                                temperature=temperature)  # greedy takes n=1 only
        expected[engine.add_request(prompt, params)] = params
    finished, aborted = {}, set()
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        if steps % 7 == 0 and engine.requests:
            victim = rng.choice(sorted(engine.requests))
            engine.abort(victim)
            aborted.add(victim)
        engine.kv.check_invariants()
    for rid, params in expected.items():
        if rid in aborted:
            continue
        out = finished[rid]
        assert len(out.outputs) == params.n
        assert all(1 <= len(c.token_ids) <= params.max_new_tokens for c in out.outputs)
    assert engine.stats()[f"preemptions_{mode}"] > 0
    _check_no_leak(engine)


@pytest.mark.parametrize("num_beams, n, length_penalty, early_stopping", [
    (2, 1, 1.0, False), (4, 2, 1.0, False), (4, 4, 2.0, True), (3, 2, 0.0, "never"), (6, 3, -1.0, False),
])
def test_beam_search_equals_transformers(model, num_beams, n, length_penalty, early_stopping):
    g = torch.Generator().manual_seed(num_beams)
    prompts = [torch.randint(3, VOCAB, (int(k),), generator=g).tolist() for k in (5, 23, 40)]
    # EOS = the third token of the first prompt's best beam, so that hypotheses really end early
    free_run = model.generate(input_ids=torch.tensor([prompts[0]]), max_new_tokens=10, num_beams=num_beams,
                              do_sample=False, eos_token_id=None)
    eos = int(free_run[0, len(prompts[0]) + 2])
    model.generation_config.eos_token_id = eos
    try:
        engine = LLMEngine(model, block_size=8, num_blocks=256)
        params = SamplingParams(max_new_tokens=10, num_beams=num_beams, n=n, length_penalty=length_penalty,
                                early_stopping=early_stopping)
        outputs = engine.generate(prompts, params, use_tqdm=False)
        if n > 1:  # among several returned hypotheses, early-ended ones are really exercised
            assert any(c.token_ids[-1] == eos for out in outputs for c in out.outputs), "no hypothesis ended with EOS"
        for prompt, out in zip(prompts, outputs):
            ref = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=10, num_beams=num_beams,
                                 num_return_sequences=n, length_penalty=length_penalty, early_stopping=early_stopping,
                                 do_sample=False, return_dict_in_generate=True, output_scores=True, eos_token_id=eos)
            assert len(out.outputs) == n
            for row, completion in enumerate(out.outputs):
                expected = ref.sequences[row, len(prompt):].tolist()
                if eos in expected:
                    expected = expected[: expected.index(eos) + 1]
                assert completion.token_ids == expected
                assert completion.cumulative_logprob == pytest.approx(float(ref.sequences_scores[row]), rel=1e-5,
                                                                      abs=5e-5)
        _check_no_leak(engine)
    finally:
        model.generation_config.eos_token_id = 1


def test_beam_search_shares_blocks_between_beams(model):
    engine = LLMEngine(model, block_size=8, num_blocks=256)
    engine.add_request(list(range(3, 60)), SamplingParams(max_new_tokens=12, num_beams=4, n=2))
    shared_seen = 0
    while engine.has_unfinished_requests():
        engine.step()
        shared_seen = max(shared_seen, engine.kv.stats()["blocks_shared"])
    assert shared_seen >= 7  # the 57-token prompt's 7 full blocks are shared by all beams
    _check_no_leak(engine)


def test_a_prompt_longer_than_the_kv_budget_is_refused(model, prompts, references):
    engine = LLMEngine(model, block_size=8, num_blocks=16)  # 128 slots
    outputs = engine.generate([prompts[2], prompts[0]], GREEDY, use_tqdm=False)  # 300 tokens, then 1
    assert "exceeds the whole KV cache" in outputs[0].error
    assert outputs[1].outputs[0].token_ids == references[0][0]
    _check_no_leak(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_request_that_outgrows_the_whole_pool_is_refused_while_others_wait(model, prompts, mode):
    """A 79-token prompt fits 20 blocks of 4 but its 8 new tokens do not: it is refused and the
    other request served. Both modes refuse it as soon as it cannot grow, though another request
    waits: swapped out it was once kept for good, admitting nothing behind it, stepping forever;
    recomputed it came back first and needed the same blocks again."""
    engine = LLMEngine(model, block_size=4, num_blocks=20, preemption_mode=mode)
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    small = prompts[3][:10]
    alone = engine.generate([small], params, use_tqdm=False)[0].outputs[0].token_ids
    ids = [engine.add_request(p, params) for p in ([5] * 79, small)]
    outputs = {}
    for _ in range(200):
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests(), engine.stats()
    assert "needs more KV blocks than the cache has" in outputs[ids[0]].error
    assert outputs[ids[1]].outputs[0].token_ids == alone
    _check_no_leak(engine)


def test_seeded_samples_are_the_same_when_preempted_by_recompute(model):
    """Each sample of a seeded n > 1 request draws from its own generator after the first token: a
    recompute re-prefills the siblings in other chunks, and with one shared generator they once
    took its numbers in another order (these four cases changed tokens)."""
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=2, seed=7, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    cases = []
    for _ in range(12):  # prompt sets drawn as when these cases were found
        lengths = torch.randint(1, 40, (3,), generator=g).tolist()
        cases.append([torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths])

    def run(chosen, **options):
        engine = LLMEngine(model, block_size=4, **options)
        outputs = engine.generate(chosen, params, use_tqdm=False)
        _check_no_leak(engine)
        return [[c.token_ids for c in o.outputs] for o in outputs], engine.stats()["preemptions_recompute"]

    for case, num_blocks in [(8, 24), (9, 16), (10, 20), (11, 16)]:
        ample, _ = run(cases[case], num_blocks=300)
        tight, preemptions = run(cases[case], num_blocks=num_blocks, max_num_batched_tokens=24)
        assert preemptions > 0 and tight == ample, case
        assert all(a != b for a, b in ample)  # two samples, not one twice


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=12, temperature=1.0, n=4, seed=3, ignore_eos=True),
                                    SamplingParams(max_new_tokens=12, num_beams=4, n=2, ignore_eos=True)],
                         ids=["4 samples", "4 beams"])
def test_sequences_recomputed_after_preemption_share_their_prompt_again(model, params, prefix_caching):
    """A request of 4 sequences on a 60-token prompt fits 30 blocks of 4 while they share the
    prompt's blocks (15 + their own), not recomputed apart (4 x 19). Preempted by an older request
    and recomputed, its first sequence computes the common part alone and the others fork from it:
    it finishes with the tokens of an unpreempted run (it was once refused as too large for the
    cache, the prefix cache's blocks evicted or not)."""
    g = torch.Generator().manual_seed(1)
    older, prompt = (torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (20, 60))

    def run(num_blocks):
        engine = LLMEngine(model, block_size=4, num_blocks=num_blocks, enable_prefix_caching=prefix_caching)
        result = run_beside_an_older_request(
            engine, older, SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True), prompt, params)
        _check_no_leak(engine)
        return result

    _, ample, _ = run(300)
    error, tight, preemptions = run(30)
    assert preemptions > 0 and error is None and tight == ample


def test_the_first_of_n_seeded_samples_is_the_single_sample(model, prompts):
    """Sample i of a seeded request draws from its own generator from the first token on, sample 0
    from the seed's own (vLLM: seed + i): the first of n samples is the n=1 draw, and n=2's samples
    are the first two of n=3's — alone or batched with other requests (before, a seeded n > 1
    request drew its first tokens from one generator, so no sample equalled the n=1 draw)."""
    def samples(n, batch, seed=7):
        engine = LLMEngine(model, num_blocks=300)
        params = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.95, n=n, seed=seed, ignore_eos=True)
        outputs = engine.generate(batch, params, use_tqdm=False)
        _check_no_leak(engine)
        return [[c.token_ids for c in o.outputs] for o in outputs]

    batch = prompts[3:7]
    one, two, three = samples(1, batch), samples(2, batch), samples(3, batch)
    alone = [samples(3, [p])[0] for p in batch[:2]]
    for i in range(len(batch)):
        assert three[i][0] == two[i][0] == one[i][0]
        assert three[i][1] == two[i][1] != three[i][0]
        assert len({tuple(t) for t in three[i]}) == 3
    assert alone == three[:2]
    assert samples(1, batch, seed=8) != one  # the seed matters


def test_request_ids_prompt_types_and_stop_strings_without_a_tokenizer(model):
    """A caller's id "2" is never handed out again while in flight (generate() once refused its own
    prompt for it); numpy integers are token ids, booleans are not; stop strings on an engine
    without a tokenizer are refused (they were ignored)."""
    import numpy as np

    engine = LLMEngine(model, num_blocks=64)
    mine = engine.add_request([5, 6], GREEDY, request_id="2")
    outputs = engine.generate([[7, 8], [9, 10], [11, 12]], GREEDY, use_tqdm=False)
    assert all(o.error is None for o in outputs) and mine not in [o.request_id for o in outputs]
    assert engine.add_request(np.array([5, 6]).tolist(), GREEDY) and engine.add_request(list(np.array([5, 6])), GREEDY)
    for bad, message in [([True, False], "integers, got bool"), ([5.0], "integers, got float")]:
        with pytest.raises(ValueError, match=message):
            engine.add_request(bad, GREEDY)
    with pytest.raises(ValueError, match="SamplingParams.stop .*needs a tokenizer"):
        engine.add_request([5], SamplingParams(stop=["x"]))
    while engine.has_unfinished_requests():
        engine.step()
    _check_no_leak(engine)


def test_vllm_spellings_of_the_length_limits(model, prompts):
    """``max_tokens`` / ``min_tokens`` (what vLLM users write) are max_new_tokens / min_new_tokens."""
    params = SamplingParams(max_tokens=5, min_tokens=5, temperature=0)
    assert (params.max_new_tokens, params.min_new_tokens, params.max_tokens) == (5, 5, 5)
    assert params == SamplingParams(max_new_tokens=5, min_new_tokens=5, temperature=0)
    engine = LLMEngine(model, num_blocks=64)
    assert len(engine.generate([prompts[4]], params, use_tqdm=False)[0].outputs[0].token_ids) == 5
    with pytest.raises(ValueError, match="max_tokens .* and max_new_tokens say different things"):
        SamplingParams(max_tokens=5, max_new_tokens=7)
    with pytest.raises(ValueError, match="SamplingParams.min_tokens must be an int between 0 and max_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
    _check_no_leak(engine)


def test_string_prompts_text_and_stop_strings():
    from hf_paged.demo import byte_tokenizer, demo_model

    model, tok = demo_model(num_hidden_layers=2, hidden_size=64, intermediate_size=128, initializer_range=0.3), \
        byte_tokenizer()
    engine = LLMEngine(model, tok, num_blocks=64)
    free = engine.generate(["Hello there"], SamplingParams(max_new_tokens=12, temperature=0), use_tqdm=False)[0]
    text = free.outputs[0].text
    assert text == tok.decode(free.outputs[0].token_ids, skip_special_tokens=True) and len(text) > 2
    stop = text[2:4]
    out = engine.generate(["Hello there"], SamplingParams(max_new_tokens=12, temperature=0, stop=[stop]),
                          use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop" and stop not in out.outputs[0].text
    assert text.startswith(out.outputs[0].text) and out.prompt == "Hello there"
    at_start = engine.generate(["Hello there"], SamplingParams(max_new_tokens=12, temperature=0, stop=[text[:2]]),
                               use_tqdm=False)[0].outputs[0]  # cut to nothing: "" is the text, not "undecoded"
    assert (at_start.text, at_start.finish_reason) == ("", "stop") and at_start.token_ids == free.outputs[0].token_ids[:2]
    _check_no_leak(engine)


def test_min_new_tokens_holds_back_stop_tokens_and_stop_strings_too():
    """vLLM's min_tokens: nothing ends the output before it, not EOS alone (once a stop token id or
    string ended it at its first token)."""
    from hf_paged.demo import byte_tokenizer, demo_model

    model, tok = demo_model(num_hidden_layers=2, hidden_size=64, intermediate_size=128, initializer_range=0.3), \
        byte_tokenizer()
    engine = LLMEngine(model, tok, num_blocks=64)

    def run(**options):
        params = SamplingParams(max_new_tokens=16, temperature=0, **options)
        return engine.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0]

    free = run()
    first, stop = free.token_ids[0], free.text[:2]
    assert len(run(stop_token_ids=[first]).token_ids) == 1 and run(stop=[stop]).text == ""
    held = run(stop_token_ids=[first], min_new_tokens=6)  # masked for six tokens, then it may end it
    assert len(held.token_ids) >= 6 and first not in held.token_ids[:6]
    cut = run(stop=[stop], min_new_tokens=6)  # greedy: the same tokens, cut where a match ends after 5
    before_min = len(tok.decode(free.token_ids[:5], skip_special_tokens=True))
    assert len(cut.token_ids) >= 6 and cut.token_ids == free.token_ids[:len(cut.token_ids)]
    assert len(cut.text) + len(stop) > before_min and free.text.startswith(cut.text)
    _check_no_leak(engine)


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gemma2", "gemma3", "gpt2", "opt", "qwen3"])
def test_engine_greedy_on_other_architectures(arch):
    """Sliding windows (Mistral, Qwen2, Gemma2/3), softcap (Gemma2), MQA (Qwen3), learned positions."""
    other = build(arch)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=g).tolist() for n in (1, 9, 30, 70)]
    refs = [other.generate(input_ids=torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                           output_logits=True, return_dict_in_generate=True) for p in prompts]
    refs = [(r.sequences[0, len(p):].tolist(), [torch.log_softmax(x[0].float(), -1) for x in r.logits])
            for p, r in zip(prompts, refs)]
    engine = LLMEngine(other, block_size=8, num_blocks=40, max_num_batched_tokens=48)
    exact, ties = compare(engine.generate(prompts, GREEDY, use_tqdm=False), refs)
    assert exact + len(ties) == len(prompts)
    _check_no_leak(engine)


def test_decode_groups_split_where_padding_would_cost_more_than_a_call():
    from hf_paged.engine.step_cache import split_by_length

    assert split_by_length([]) == []
    assert split_by_length([300] * 40) == [(0, 40)]  # equal lengths: nothing to save
    groups = split_by_length([900, 880, 100, 90, 80, 70, 60, 50, 40, 30, 20, 10], overhead=1000)
    assert groups[0] == (0, 2) and groups[-1][1] == 12  # the two long ones alone, every row covered once
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))
    assert split_by_length([900, 10], overhead=10_000) == [(0, 2)]  # a small saving is not worth a call


def test_building_an_engine_leaves_generate_untouched():
    """The engine's forwards are paged; the model itself stays stock (its generate, its attention)."""
    import transformers

    model, stock = build("llama"), build("llama")
    ids = torch.tensor([[5, 9, 14, 3, 22]])
    LLMEngine(model, num_blocks=32)
    assert "generate" not in model.__dict__ and type(model).generate is transformers.GenerationMixin.generate
    assert model.config._attn_implementation == "sdpa"  # only the engine's own forwards are paged
    with pytest.raises(ValueError, match="cache_implementation"):  # the flag belongs to hf_paged.enable
        model.generate(input_ids=ids, max_new_tokens=2, cache_implementation="hf_paged")
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=6, do_sample=False),
                       stock.generate(input_ids=ids, max_new_tokens=6, do_sample=False))


def test_streams_read_side_by_side_and_a_generate_inside_one_lose_nothing(model, prompts, references):
    """Each call's step may finish another call's request: its outputs wait for that call (they
    were left for step(), and the other stream ended early without them)."""
    engine = LLMEngine(model, num_blocks=128)
    tokens: dict[int, list[int]] = {0: [], 3: []}
    for a, b in zip(engine.stream(prompts[0], GREEDY), engine.stream(prompts[3], GREEDY)):
        tokens[0] += a["token_ids"]
        tokens[3] += b["token_ids"]
    assert tokens == {0: references[0][0], 3: references[3][0]}
    streamed = []
    for delta in engine.stream(prompts[1], GREEDY):
        streamed += delta["token_ids"]
        if len(streamed) == 1:
            (out,) = engine.generate([prompts[2]], GREEDY, use_tqdm=False)  # steps the stream's request too
            assert out.outputs[0].token_ids == references[2][0]
    assert streamed == references[1][0] and engine.step() == []
    _check_no_leak(engine)
