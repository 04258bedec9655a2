"""vLLM's ``prompt_logprobs`` and ``num_cached_tokens`` in ``LLMEngine`` (tiny float32 Llama).

Prompt log-probs are compared with a stock forward of the same prompt (``model(ids).logits``,
float32 ``log_softmax``): entry ``i`` holds prompt token ``i`` (its log-prob given tokens ``< i``,
its rank) and the ``k`` most likely tokens, as vLLM builds the dict. Log-probs agree within
``ATOL`` = 1e-4, not bit for bit: the engine's paged attention and its oneDNN LM head sum in
another order than the stock forward, and on these prompts a stock float32 forward itself is up to
3.3e-5 off a float64 one; the engine's own error against float64 is checked to be no larger than
twice stock float32's. Ids, ranks and the order of the top tokens are compared exactly (the
prompts are fixed; none has a near-tie that the rounding flips).

Also: a batch with and without the option (those without unchanged, bit for bit), chunked prefill
(bit-identical to one prefill here), prefix caching (a request with prompt log-probs reads no
cached block but fills the cache; ``num_cached_tokens``), preemption by recompute (each prompt
token scored once), ``n > 1`` (one list), pickling, streaming, bad values, a model with recurrent
layers (one batch row per sequence), and negative controls.
Every test ends with all KV blocks free.
"""

from __future__ import annotations

import copy
import pickle
import pickletools

import pytest
import torch

from hf_paged import LLM, LLMEngine, SamplingParams
from hf_paged.demo import byte_tokenizer, demo_model
from hf_paged.engine.sequence import Request
from tests.helpers.tiny_models import VOCAB, build

ATOL = 1e-4
SAME_ATOL = 5e-5  # the same prompt's log-probs from two engine runs (other chunks, other batches; chunks of at
# most 16 rows multiply in C, longer ones through sgemm: other summation orders, ~1e-5 apart)
LENGTHS = (1, 2, 9, 40, 130)


@pytest.fixture(scope="module")
def model():
    return build("llama")


def _prompts(lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _stock(model, prompt: list[int]) -> torch.Tensor:
    """Float32 log-probs of a stock forward: row ``i`` is the distribution of token ``i + 1``."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)


def _expected_entry(row: torch.Tensor, token: int, k: int) -> dict[int, tuple[float, int]]:
    """vLLM's entry from a stock row: the prompt token (rank: tokens at least as likely), then the
    top ``k`` with ranks 1..k (a prompt token among them takes its entry there)."""
    entry = {token: (float(row[token]), int((row >= row[token]).sum()))}
    top = torch.topk(row, k)
    entry.update((t, (v, r)) for t, v, r in zip(top.indices.tolist(), top.values.tolist(), range(1, k + 1)))
    return entry


def check_prompt_logprobs(got, prompt: list[int], stock: torch.Tensor, k: int) -> float:
    """Assert ``got`` (an output's prompt_logprobs) is vLLM's list for ``prompt`` against the stock
    log-probs; returns the largest log-prob difference."""
    assert isinstance(got, list) and len(got) == len(prompt) and got[0] is None
    worst = 0.0
    for i in range(1, len(prompt)):
        want = _expected_entry(stock[i - 1], prompt[i], k)
        assert list(got[i]) == list(want), f"position {i}: ids {list(got[i])} != {list(want)}"
        assert [v.rank for v in got[i].values()] == [r for _, r in want.values()], f"position {i}: ranks"
        worst = max(worst, max(abs(v.logprob - w) for v, (w, _) in zip(got[i].values(), want.values())))
    assert worst <= ATOL, worst
    return worst


def _table(prompt_logprobs) -> list:
    """An output's prompt log-probs as plain data (ids, values, ranks), for exact comparisons."""
    return [None if e is None else [(t, float(v), v.rank) for t, v in e.items()] for e in prompt_logprobs]


def assert_same_lists(got, want, atol: float = SAME_ATOL) -> None:
    """Two runs' prompt log-probs: the same ids and ranks in the same order, log-probs within
    ``atol`` (a prompt computed in other chunks or beside other sequences is summed in another
    order: a few ulps, no more)."""
    assert len(got) == len(want) and got[0] is want[0] is None
    for i, (a, b) in enumerate(zip(got[1:], want[1:]), start=1):
        assert [(t, v.rank) for t, v in a.items()] == [(t, v.rank) for t, v in b.items()], f"position {i}"
        assert max(abs(v - w) for v, w in zip(a.values(), b.values())) <= atol, f"position {i}"


def _check_no_leak(engine: LLMEngine) -> None:
    engine.kv.check_invariants()
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_used_blocks() == 0, "blocks leaked"


def _stock_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("compile", [None, False])
def test_prompt_logprobs_equal_a_stock_forward(model, compile):
    prompts = _prompts(LENGTHS)
    engine = LLMEngine(model, block_size=8, num_blocks=128, compile=compile)
    params = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=k) for k in (3, 0, 5, 3, 2)]
    outs = engine.generate(prompts, params, use_tqdm=False)
    model64 = copy.deepcopy(model).double()
    engine_err = stock_err = 0.0
    for prompt, p, out in zip(prompts, params, outs):
        assert out.error is None and out.num_cached_tokens == 0
        stock = _stock(model, prompt)
        check_prompt_logprobs(out.prompt_logprobs, prompt, stock, p.prompt_logprobs)
        assert out.outputs[0].token_ids == _stock_greedy(model, prompt, 4)  # its tokens stay stock's
        if len(prompt) > 1:  # as accurate as a stock float32 forward, against float64
            with torch.no_grad():
                exact = torch.log_softmax(model64(torch.tensor([prompt])).logits[0], -1)
            rows, tokens = torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])
            got = torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))],
                               dtype=torch.float64)
            engine_err = max(engine_err, float((got - exact[rows, tokens]).abs().max()))
            stock_err = max(stock_err, float((stock[rows, tokens].double() - exact[rows, tokens]).abs().max()))
    assert all(len(e) == 1 for e in outs[1].prompt_logprobs[1:])  # prompt_logprobs=0: the prompt token alone
    assert engine_err <= 2 * stock_err + 1e-6, (engine_err, stock_err)
    _check_no_leak(engine)


def test_a_mixed_batch_leaves_the_others_unchanged(model):
    """Requests without the option: ``prompt_logprobs`` None, tokens and their sampled log-probs
    bit-identical to the same batch where nobody asked for prompt log-probs."""
    prompts = _prompts((23, 5, 61, 2, 37, 14), seed=1)
    ks = (2, None, 0, None, 4, None)
    asked = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=k) for k in ks]
    plain = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)] * len(prompts)
    engine = LLMEngine(model, block_size=8, num_blocks=128, max_num_batched_tokens=64, compile=False)
    mixed = engine.generate(prompts, asked, use_tqdm=False)
    _check_no_leak(engine)
    alone = LLMEngine(model, block_size=8, num_blocks=128, max_num_batched_tokens=64,
                      compile=False).generate(prompts, plain, use_tqdm=False)
    for prompt, k, got, base in zip(prompts, ks, mixed, alone):
        assert base.prompt_logprobs is None
        assert got.outputs[0].token_ids == base.outputs[0].token_ids
        assert _table(got.outputs[0].logprobs) == _table(base.outputs[0].logprobs)
        if k is None:
            assert got.prompt_logprobs is None
        else:
            check_prompt_logprobs(got.prompt_logprobs, prompt, _stock(model, prompt), k)


def test_chunked_prefill_equals_one_prefill(model):
    """A prompt prefilled over many steps (a small token budget, beside a decoding request) scores
    every position once; outputs before its last chunk carry ``[None]``, as vLLM's would."""
    long, other = _prompts((61, 7), seed=2)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=3)
    whole = LLMEngine(model, block_size=8, num_blocks=64, compile=False).generate([long], params, use_tqdm=False)[0]
    engine = LLMEngine(model, block_size=8, num_blocks=64, max_num_batched_tokens=8, compile=False)
    engine.add_request(other, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), request_id="other")
    engine.step()
    engine.add_request(long, params, request_id="long")
    progress, seen, final = [], [], None
    while engine.has_unfinished_requests():
        if "long" in engine.requests:
            progress.append(engine.requests["long"].prompt_logprobs.num_rows)
        for out in engine.step():
            if out.request_id == "long":
                seen.append(out.prompt_logprobs)
                final = out if out.finished else final
    assert len({n for n in progress if 0 < n < len(long) - 1}) >= 4  # really chunked
    assert [None] in seen and all(s == [None] or len(s) == len(long) for s in seen)
    check_prompt_logprobs(final.prompt_logprobs, long, _stock(model, long), 3)
    assert_same_lists(final.prompt_logprobs, whole.prompt_logprobs)
    assert final.outputs[0].token_ids == whole.outputs[0].token_ids
    _check_no_leak(engine)


def _shared_prefix_prompts() -> list[list[int]]:
    prefix, *tails = _prompts((48, 9, 13, 11), seed=3)
    return [prefix + tail for tail in tails]


def _run_one_at_a_time(engine: LLMEngine, prompts, params) -> list:
    return [engine.generate([p], q, use_tqdm=False)[0] for p, q in zip(prompts, params)]


def test_prefix_caching_is_not_read_but_filled(model):
    """With a shared 48-token prefix (6 blocks): a second plain request finds it cached
    (``num_cached_tokens`` 48); one with prompt log-probs reads nothing (0), still gets every
    entry, is not counted as a lookup, and its blocks serve a later plain request of its prompt."""
    a, b, c = _shared_prefix_prompts()
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    scored = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=2)
    engine = LLMEngine(model, block_size=8, num_blocks=64, compile=False)
    first, second = _run_one_at_a_time(engine, [a, b], [plain, plain])
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 48)
    queried = engine.stats()["prefix_cache_queried_tokens"]
    with_logprobs = engine.generate([c], scored, use_tqdm=False)[0]
    assert with_logprobs.num_cached_tokens == 0 and engine.stats()["prefix_cache_queried_tokens"] == queried
    fresh = LLMEngine(model, block_size=8, num_blocks=64, enable_prefix_caching=False, compile=False)
    reference = fresh.generate([c], scored, use_tqdm=False)[0]
    check_prompt_logprobs(with_logprobs.prompt_logprobs, c, _stock(model, c), 2)
    assert _table(with_logprobs.prompt_logprobs) == _table(reference.prompt_logprobs)
    again = engine.generate([c], plain, use_tqdm=False)[0]  # c's own blocks, which it cached
    assert again.num_cached_tokens == (len(c) - 1) // 8 * 8 and again.prompt_logprobs is None
    assert again.outputs[0].token_ids == with_logprobs.outputs[0].token_ids
    _check_no_leak(engine)
    off = _run_one_at_a_time(fresh, [a, b], [plain, plain])  # negative control: nothing is cached
    assert [o.num_cached_tokens for o in off] == [0, 0]
    _check_no_leak(fresh)


def test_negative_control_a_request_that_reads_the_cache_loses_its_prompt_rows(model, monkeypatch):
    """Were a request with prompt log-probs to take a prefix hit, the positions it skipped would
    have no logits: the same run then fails the check (here the engine refuses the rows' gap)."""
    a, _, c = _shared_prefix_prompts()
    monkeypatch.setattr(Request, "skip_reading_prefix_cache", property(lambda self: False))
    engine = LLMEngine(model, block_size=8, num_blocks=64, compile=False)
    engine.generate([a], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    out = engine.generate([c], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.num_cached_tokens == 48
    with pytest.raises(AssertionError):
        assert out.error is None
        check_prompt_logprobs(out.prompt_logprobs, c, _stock(model, c), 2)
    _check_no_leak(engine)


def test_preemption_by_recompute_scores_each_prompt_token_once(model):
    """A tiny pool: the newest request (prompt log-probs, prefilled in chunks) is preempted and
    recomputed, its recomputed "prompt" then holding generated tokens too; its list equals an
    unpreempted run's, each position scored once, and ``num_cached_tokens`` keeps its first value."""
    prompts = _prompts((30, 30, 45), seed=4)
    params = [SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)] * 2 + [
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, prompt_logprobs=2)]
    roomy = LLMEngine(model, block_size=4, num_blocks=256, max_num_batched_tokens=16, compile=False)
    want = roomy.generate(prompts, params, use_tqdm=False)
    engine = LLMEngine(model, block_size=4, num_blocks=28, max_num_batched_tokens=16, preemption_mode="recompute",
                       compile=False)
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    done, preempted_at = {}, []
    while engine.has_unfinished_requests():
        request = engine.requests.get(ids[2])
        before = request.num_preemptions if request else None
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if request is not None and request.num_preemptions != before:
            preempted_at.append(request.prompt_logprobs.num_rows)
    assert preempted_at and engine.stats()["preemptions_recompute"] >= 1
    assert any(0 < n < len(prompts[2]) - 1 for n in preempted_at)  # in the middle of its prefill
    assert len(prompts[2]) - 1 in preempted_at  # and after it: the recompute covers generated tokens too
    got = [done[i] for i in ids]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    check_prompt_logprobs(got[2].prompt_logprobs, prompts[2], _stock(model, prompts[2]), 2)
    assert_same_lists(got[2].prompt_logprobs, want[2].prompt_logprobs)
    assert [o.prompt_logprobs for o in got[:2]] == [None, None] and got[2].num_cached_tokens == 0
    _check_no_leak(engine)


def test_samples_share_one_list(model):
    """``n`` samples (and beams) have the request's one list: the prompt's, whatever is sampled."""
    prompt = _prompts((33,), seed=5)[0]
    engine = LLMEngine(model, block_size=8, num_blocks=64, compile=False)
    greedy, sampled, beams = engine.generate([prompt] * 3, [
        SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=3),
        SamplingParams(max_tokens=5, temperature=1.0, n=3, seed=0, prompt_logprobs=3),
        SamplingParams(max_tokens=5, num_beams=2, n=2, prompt_logprobs=3)], use_tqdm=False)
    assert len(sampled.outputs) == 3 and len(beams.outputs) == 2
    assert _table(sampled.prompt_logprobs) == _table(greedy.prompt_logprobs) == _table(beams.prompt_logprobs)
    check_prompt_logprobs(greedy.prompt_logprobs, prompt, _stock(model, prompt), 3)
    _check_no_leak(engine)


def test_outputs_pickle_compactly_and_stream_them_once():
    """Through ``LLM.generate`` with a tokenizer: entries decode their tokens (``decoded_token``);
    a pickled output (as the server's engine process sends them) has the same list, from a few
    flat arrays; ``stream()`` gives the list with the request's first delta only."""
    tokenizer = byte_tokenizer()
    llm = LLM(demo_model(trained=False, seed=3), tokenizer, block_size=4, compile=False)
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=4)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    ids = out.prompt_token_ids
    assert out.prompt_logprobs[1][ids[1]].decoded_token == tokenizer.decode([ids[1]])
    assert all(v.decoded_token == tokenizer.decode([t]) for e in out.prompt_logprobs[1:] for t, v in e.items())
    data = pickle.dumps(out)
    back = pickle.loads(data)
    assert type(back.prompt_logprobs).__name__ == "PromptLogprobsList"  # a list, pickled as flat arrays
    assert _table(back.prompt_logprobs) == _table(out.prompt_logprobs) and back.outputs == out.outputs
    assert back.num_cached_tokens == out.num_cached_tokens == 0
    flat, as_objects = pickle.dumps(out.prompt_logprobs), pickle.dumps(list(out.prompt_logprobs))
    assert len(list(pickletools.genops(flat))) < 100 < 2000 < len(list(pickletools.genops(as_objects)))
    assert len(flat) < len(as_objects) / 2, (len(flat), len(as_objects))
    deltas = list(llm.llm_engine.stream(prompt, params))
    assert _table(deltas[0]["prompt_logprobs"]) == _table(out.prompt_logprobs)
    assert all(d["prompt_logprobs"] is None and d["num_cached_tokens"] == 0 for d in deltas[1:]) and len(deltas) > 1
    assert [t for d in deltas for t in d["token_ids"]] == out.outputs[0].token_ids
    _check_no_leak(llm.llm_engine)


def test_bad_values_are_refused_by_name(model):
    for bad in (-2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="SamplingParams.prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    engine = LLMEngine(model, block_size=8, num_blocks=64, compile=False)
    with pytest.raises(ValueError, match=f"SamplingParams.prompt_logprobs must be at most the vocabulary size {VOCAB}"):
        engine.add_request([5, 6, 7], SamplingParams(prompt_logprobs=VOCAB + 1))
    prompt = _prompts((12,), seed=6)[0]
    too_many, whole = engine.generate([prompt, prompt], [SamplingParams(max_tokens=2, prompt_logprobs=VOCAB + 1),
                                                         SamplingParams(max_tokens=2, prompt_logprobs=VOCAB)],
                                      use_tqdm=False)
    assert too_many.error is not None and "prompt_logprobs" in too_many.error and too_many.prompt_logprobs is None
    assert whole.error is None and all(len(e) == VOCAB for e in whole.prompt_logprobs[1:])  # every token, ranked
    check_prompt_logprobs(whole.prompt_logprobs, prompt, _stock(model, prompt), VOCAB)
    minus_one = engine.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=-1, logprobs=-1),
                                use_tqdm=False)[0]  # vLLM's -1: the whole vocabulary
    assert minus_one.prompt_logprobs == whole.prompt_logprobs
    assert [len(e) for e in minus_one.outputs[0].logprobs] == [VOCAB, VOCAB]
    _check_no_leak(engine)


def test_negative_controls_of_the_comparison(model):
    """The check fails on a list one position off and on another model's log-probs."""
    prompt = _prompts((40,), seed=7)[0]
    engine = LLMEngine(model, block_size=8, num_blocks=64, compile=False)
    out = engine.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    stock = _stock(model, prompt)
    check_prompt_logprobs(out.prompt_logprobs, prompt, stock, 3)
    with pytest.raises(AssertionError):  # rows shifted by one position
        check_prompt_logprobs(out.prompt_logprobs, prompt, torch.cat([stock[1:], stock[:1]]), 3)
    with pytest.raises(AssertionError):  # another model's distribution
        check_prompt_logprobs(out.prompt_logprobs, prompt, _stock(build("llama", seed=1), prompt), 3)
    _check_no_leak(engine)


def test_a_recurrent_model_scores_its_prompt_row_by_row():
    """Models with recurrent layers run each sequence in a batch row of its own; a budget of one
    token makes every chunk after the first a one-token row beside the decoding rows."""
    from tests.helpers.hybrid_models import build_hybrid

    model = build_hybrid("lfm2")
    prompts = _prompts((9, 4), seed=8)
    engine = LLMEngine(model, block_size=8, num_blocks=64, max_num_batched_tokens=1)
    outs = engine.generate(prompts, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        check_prompt_logprobs(out.prompt_logprobs, prompt, _stock(model, prompt), 2)
        assert out.outputs[0].token_ids == _stock_greedy(model, prompt, 3)
    _check_no_leak(engine)
