"""The engine's fast paths (issue 22): the two-pass argmax (its chunk maxima shared with the
non-finite check), plain greedy and forked sampled tokens appended with a one-line undo,
log-probabilities only when asked for, the LM head through oneDNN in engine forwards only (on a
prepacked copy), and glibc's malloc thresholds set for a CPU engine's process."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from hf_paged import LLMEngine, SamplingParams
from hf_paged.engine import cpu_linear, host_malloc, output_processor, sampler
from hf_paged.engine.structured import StructuredOutputManager
from hf_paged.kernels import cpu_gemv
from tests.helpers.tiny_models import VOCAB, build


@pytest.fixture(scope="module")
def model():
    return build("llama")


PROMPTS = [[5, 6, 7, 8, 9], list(range(3, 40)), [11] * 20]


@pytest.mark.parametrize("vocab", [32000, 32001, 259, 256, 200, 50])
def test_argmax_rows_equals_torch_argmax_with_ties_and_tails(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(40, vocab, generator=g)
    logits[1] = 1.0  # every column ties: the first wins
    logits[2, vocab - 1] = 99.0  # the maximum in the last (partial) chunk
    logits[3, 5] = logits[3, vocab - 2] = 99.0  # a tie across chunks
    logits[4] = float("-inf")
    logits[4, vocab // 2] = 0.0
    logits[5] = torch.randint(0, 3, (vocab,), generator=g).float()  # many ties in many chunks
    assert torch.equal(sampler.argmax_rows(logits), logits.argmax(-1))


def test_argmax_rows_negative_control_the_last_maximum_is_not_the_first():
    logits = torch.zeros(1, 1000)
    logits[0, 10] = logits[0, 900] = 1.0
    assert int(sampler.argmax_rows(logits)) == 10
    assert int(logits.flip(-1).argmax(-1)) != 989, "a wrong tie rule would have been caught above"


@pytest.mark.parametrize("vocab", [32000, 32001, 1000])
def test_nonfinite_rows_read_from_the_chunk_maxima_find_what_a_full_read_finds(vocab):
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(1))
    logits[1, 7] = float("nan")
    logits[2, vocab - 1] = float("inf")  # in the last (partial) chunk
    logits[4] = float("-inf")
    maxima = sampler.chunk_maxima(logits)
    assert maxima is not None and maxima.shape == (6, -(-vocab // sampler.ARGMAX_CHUNK))
    assert sampler.nonfinite_rows(logits, maxima) == sampler.nonfinite_rows(logits) == [1, 2, 4]
    assert torch.equal(sampler.argmax_rows(logits[[0, 3, 5]], maxima[[0, 3, 5]]), logits[[0, 3, 5]].argmax(-1))
    logits[5, 0] = float("nan")  # negative control: maxima taken before the change miss it
    assert sampler.nonfinite_rows(logits, maxima) != sampler.nonfinite_rows(logits)


GREEDY8 = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)


class Interrupt(BaseException):
    """Raised inside a step's processing (like a KeyboardInterrupt)."""


def _tokens_after_an_abandoned_third_step(model, monkeypatch, params: SamplingParams, last: SamplingParams,
                                          undo: bool) -> list[list[int]]:
    """``PROMPTS`` with ``params`` and one more prompt with ``last``, in one engine whose third step
    raises ``Interrupt`` (the caller has injected it): every request then fails, with nothing left
    held; returns the first three's tokens. ``undo`` False: the quiet lane's undo does nothing."""
    if not undo:
        monkeypatch.setattr(output_processor._Appended, "restore", lambda self, request: None)
    engine = LLMEngine(model, block_size=4)
    for prompt, p in zip(PROMPTS + [[40, 41, 42]], [params] * 3 + [last]):
        engine.add_request(prompt, p)
    for _ in range(2):
        engine.step()
    with pytest.raises(Interrupt):
        engine.step()
    failed = sorted(engine.step(), key=lambda out: int(out.request_id))
    assert [out.error_kind for out in failed] == ["fault"] * 4
    assert not engine.has_unfinished_requests() and engine.kv.num_used_blocks() == 0
    return [out.outputs[0].token_ids for out in failed[:3]]


@pytest.mark.parametrize("undo", [True, False], ids=["undone", "negative-control-not-undone"])
def test_plain_greedy_tokens_of_an_abandoned_step_are_undone(model, monkeypatch, undo):
    """Plain greedy rows take their tokens before the sampled rows are processed; when processing
    then raises, the step is rolled back: the failed outputs hold only the earlier steps' tokens."""
    clean = LLMEngine(model, block_size=4).generate(PROMPTS, GREEDY8, use_tqdm=False)
    sampled = SamplingParams(max_new_tokens=8, temperature=0.8, seed=3, ignore_eos=True)
    sample = sampler.sample

    def interrupted(logits, rows, *args):
        if any(row.params is sampled and row.num_generated == 2 for row in rows):  # every plain request has two
            raise Interrupt()
        return sample(logits, rows, *args)

    monkeypatch.setattr(sampler, "sample", interrupted)
    got = _tokens_after_an_abandoned_third_step(model, monkeypatch, GREEDY8, sampled, undo)
    assert (got == [out.outputs[0].token_ids[:2] for out in clean]) == undo


@pytest.mark.parametrize("undo", [True, False], ids=["undone", "negative-control-not-undone"])
@pytest.mark.parametrize("lane", ["greedy", "sampled"])
def test_quietly_appended_tokens_of_an_abandoned_step_are_undone(model, monkeypatch, lane, undo):
    """Rows of one sequence that nothing can fail (plain greedy rows, and sampled rows once their
    request has forked) take their tokens with a one-line undo; when a later request's share of
    the step raises, the step is rolled back and theirs are taken back too."""
    params = GREEDY8 if lane == "greedy" else SamplingParams(max_new_tokens=8, temperature=0.8, seed=3, ignore_eos=True)
    clean = LLMEngine(model, block_size=4).generate(PROMPTS, params, use_tqdm=False)
    scored = SamplingParams(max_new_tokens=8, temperature=0, logprobs=1, ignore_eos=True)  # the guarded path
    advance = output_processor.OutputProcessor._advance

    def interrupted(self, request, *args):
        if request.params is scored and request.seqs[0].num_output_tokens == 2:
            raise Interrupt()
        return advance(self, request, *args)

    monkeypatch.setattr(output_processor.OutputProcessor, "_advance", interrupted)
    got = _tokens_after_an_abandoned_third_step(model, monkeypatch, params, scored, undo)
    assert (got == [out.outputs[0].token_ids[:2] for out in clean]) == undo


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_a_quietly_appended_token_is_taken_back_when_its_request_fails_later_in_the_step(model, monkeypatch,
                                                                                        temperature):
    """A request with a logit bias takes the quiet lane (its row biased in place) and its matcher
    step comes after the tokens: failing it there takes its token back; the others go on."""
    plain = SamplingParams(max_new_tokens=8, temperature=temperature, seed=5, ignore_eos=True)
    biased = SamplingParams(max_new_tokens=8, temperature=temperature, seed=5, ignore_eos=True, logit_bias={5: 0.0})
    clean = LLMEngine(model, block_size=4).generate(PROMPTS, plain, use_tqdm=False)
    advance, calls = StructuredOutputManager.advance, [0]

    def failing(self, changed, forks, fail):
        calls[0] += 1
        if calls[0] == 4:
            fail(next(r for r in changed if r.structured is not None), "injected matcher fault")
        return advance(self, changed, forks, fail)

    monkeypatch.setattr(StructuredOutputManager, "advance", failing)
    engine = LLMEngine(model, block_size=4)
    outs = engine.generate(PROMPTS, [plain, biased, plain], use_tqdm=False)
    assert outs[1].error_kind == "fault" and "injected matcher fault" in outs[1].error
    assert outs[1].outputs[0].token_ids == clean[1].outputs[0].token_ids[:3]  # not the failed step's fourth
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2])] == [o.outputs[0].token_ids for o in (clean[0], clean[2])]
    assert engine.kv.num_used_blocks() == 0


def test_log_probabilities_only_when_asked_for(model):
    engine = LLMEngine(model, block_size=4)
    plain, sampled, scored, beams = engine.generate(PROMPTS[:1] * 4, [
        SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True),
        SamplingParams(max_new_tokens=5, temperature=0.8, seed=1, ignore_eos=True),
        SamplingParams(max_new_tokens=5, temperature=0, logprobs=2, ignore_eos=True),
        SamplingParams(max_new_tokens=5, num_beams=2, temperature=0, ignore_eos=True),
    ], use_tqdm=False)
    assert plain.outputs[0].cumulative_logprob is None and sampled.outputs[0].cumulative_logprob is None
    lp = scored.outputs[0]
    assert lp.cumulative_logprob == pytest.approx(sum(d[t] for d, t in zip(lp.logprobs, lp.token_ids)))
    assert beams.outputs[0].cumulative_logprob is not None  # the beam score
    assert plain.outputs[0].token_ids == lp.token_ids
    assert engine.kv.num_used_blocks() == 0


@pytest.mark.parametrize("few_rows", [True, False])
def test_onednn_lm_head_runs_in_engine_steps_only(model, monkeypatch, few_rows):
    """Inside an engine forward the float32 LM head is oneDNN's, and the layers' linears (oneDNN off,
    as in this suite) are routed to the few-row C products (:func:`cpu_linear.few_row_layers`), or
    with ``HF_PAGED_FEW_ROW_LAYERS=0`` stay sgemm; afterwards the model is stock again, bit for bit
    (generate()'s scores equal a stock copy's)."""
    if not cpu_linear.available() or not cpu_gemv.ready():
        pytest.skip("this torch has no oneDNN linear, or the C products are not built here")
    monkeypatch.setenv(cpu_linear.FEW_ROW_LAYERS_ENV, "1" if few_rows else "0")
    stock = copy.deepcopy(model)
    head = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda m, args: seen.setdefault(m, set()).add("forward" in m.__dict__))
             for m in linears]
    try:
        engine = LLMEngine(model, block_size=4)
        outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True),
                               use_tqdm=False)
    finally:
        for hook in hooks:
            hook.remove()
    assert seen.get(head) == {True}, "engine forwards did not switch the LM head to oneDNN"
    assert len(seen) == len(linears) and all(seen[m] == {few_rows} for m in linears if m is not head), \
        "a layer's linear was routed otherwise"
    assert engine.runner.onednn_layers is False and len(engine.runner.layer_linears) == (len(linears) - 1) * few_rows
    assert not any("forward" in m.__dict__ for m in linears), "a linear stayed switched after the step"
    ids = torch.tensor([PROMPTS[1]])
    kwargs = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    ours, theirs = model.generate(ids, **kwargs), stock.generate(ids, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(ours.scores, theirs.scores))
    assert [o.outputs[0].token_ids for o in outs] == [
        stock.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False)[0, len(p):].tolist() for p in PROMPTS]


def test_negative_control_onednn_changes_bits_so_a_leftover_switch_would_be_seen():
    if not cpu_linear.available():
        pytest.skip("this torch has no oneDNN linear")
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(256, VOCAB * 8, bias=False)
    x = torch.randn(64, 256, generator=g)
    with cpu_linear.onednn_linears([layer]):
        switched = layer(x)
    assert not torch.equal(switched, layer(x)), "oneDNN gave sgemm's bits: the test above could not see a leftover"
    torch.testing.assert_close(switched, layer(x))


def test_lm_head_runs_on_its_prepacked_copy_in_engine_steps(model, monkeypatch):
    """By default the engine packs a small float32 LM head once and every step's head uses it;
    tokens stay those of stock generate()."""
    if not cpu_linear.available():
        pytest.skip("this torch has no oneDNN linear")
    packs = []
    real_get = cpu_linear.PrepackedWeight.get
    monkeypatch.setattr(cpu_linear.PrepackedWeight, "get", lambda self: packs.append(self.module) or real_get(self))
    engine = LLMEngine(model, block_size=4)
    tokens = _greedy(engine)
    assert packs and all(m is model.get_output_embeddings() for m in packs)
    assert tokens == _stock_greedy(model)
    assert not LLMEngine(model, block_size=4, prepack_lm_head=False).runner._prepacked


def test_prepacked_lm_head_follows_the_size_limit_and_the_option(model, monkeypatch):
    if not cpu_linear.available():
        pytest.skip("this torch has no oneDNN linear")
    head = model.get_output_embeddings()
    assert cpu_linear.prepacked_lm_head(model).module is head
    assert cpu_linear.prepacked_lm_head(model, False) is None
    monkeypatch.setattr(cpu_linear, "PREPACK_LM_HEAD_MAX_BYTES", head.weight.nbytes - 1)
    assert cpu_linear.prepacked_lm_head(model) is None, "a head over the limit was packed by default"
    assert cpu_linear.prepacked_lm_head(model, True).module is head
    assert cpu_linear.prepacked_lm_head(copy.deepcopy(model).to(torch.bfloat16), True) is None


def test_prepacked_weight_is_packed_again_when_the_weight_changes():
    """A changed or replaced weight is never run from a stale packed copy (negative control: the
    old copy gives other numbers)."""
    if not cpu_linear.available():
        pytest.skip("this torch has no oneDNN linear")
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(64, 300, bias=True)
    x = torch.randn(48, 64, generator=g)
    packed = cpu_linear.PrepackedWeight(layer)
    with cpu_linear.onednn_linears([layer], prepacked=(packed,)):
        before = layer(x)
    torch.testing.assert_close(before, torch.nn.functional.linear(x, layer.weight, layer.bias))
    stale = packed.get()
    with torch.no_grad():
        layer.weight.mul_(2)
    with cpu_linear.onednn_linears([layer], prepacked=(packed,)):
        changed = layer(x)
    torch.testing.assert_close(changed, torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert packed.get() is not stale
    stale_out = torch.ops.mkldnn._linear_pointwise(x, stale, layer.bias, "none", [], "")
    assert not torch.allclose(stale_out, changed), "the stale copy gives the same numbers: the test could not fail"
    layer.weight = torch.nn.Parameter(torch.randn(300, 64, generator=g))
    with cpu_linear.onednn_linears([layer], prepacked=(packed,)):
        replaced = layer(x)
    torch.testing.assert_close(replaced, torch.nn.functional.linear(x, layer.weight, layer.bias))


def _layer_modules(model) -> set[int]:
    head = model.get_output_embeddings()
    return {id(m) for m in model.get_decoder().modules() if isinstance(m, torch.nn.Linear) and m is not head}


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_onednn_layers_run_every_layer_linear_in_engine_steps_only(model, monkeypatch, compile):
    """``onednn_layers=True``: every layer linear of an engine step goes through oneDNN (eager, or as
    the op inside the compiled body), the tokens are stock generate()'s, and afterwards the model is
    stock again, bit for bit."""
    if not cpu_linear.available():
        pytest.skip("this torch has no oneDNN linear")
    monkeypatch.setattr(cpu_linear, "ONEDNN_MIN_MACS", 0)  # the tiny model's products go to oneDNN too
    monkeypatch.setattr(cpu_linear, "ONEDNN_MIN_ROWS", 1)
    stock = copy.deepcopy(model)
    seen, real = set(), cpu_linear.linear

    def counted(x, weight, bias):
        seen.add(id(weight))
        return real(x, weight, bias)

    monkeypatch.setattr(cpu_linear, "linear", counted)
    engine = LLMEngine(model, block_size=4, onednn_layers=True, compile=compile)
    assert engine.stats()["onednn_layers"] and engine.stats()["compiled"] is compile
    assert {id(m) for m in engine.runner.layer_linears} == _layer_modules(model)
    seen.clear()  # compiling ran the body once on dummy tokens
    tokens = _greedy(engine)
    assert seen == {id(m.weight) for m in engine.runner.layer_linears}, "a layer's linear stayed on sgemm"
    assert not any("forward" in m.__dict__ for m in model.modules()), "a linear stayed switched after the step"
    assert tokens == _stock_greedy(stock)
    ids = torch.tensor([PROMPTS[1]])
    kwargs = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    ours, theirs = model.generate(ids, **kwargs), stock.generate(ids, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(ours.scores, theirs.scores))


def test_negative_control_onednn_layer_products_differ_from_sgemm_in_the_last_bits(monkeypatch):
    """What the test above sees: a product through oneDNN does not give sgemm's bits (so a layer left
    on sgemm, or switched after the step, would show), and one under ``ONEDNN_MIN_MACS`` or of fewer
    than ``ONEDNN_MIN_ROWS`` rows keeps sgemm's exactly."""
    if not cpu_linear.available():
        pytest.skip("this torch has no oneDNN linear")
    g = torch.Generator().manual_seed(0)
    rows = cpu_linear.ONEDNN_MIN_ROWS
    x, weight, bias = torch.randn(1, rows, 256, generator=g), torch.randn(688, 256, generator=g), torch.randn(688)
    sgemm = torch.nn.functional.linear(x, weight, bias)
    onednn = cpu_linear.linear(x, weight, bias)
    assert onednn.shape == sgemm.shape and not torch.equal(onednn, sgemm)
    torch.testing.assert_close(onednn, sgemm, rtol=1e-4, atol=1e-4)
    fewer = x[:, 1:]  # one row fewer
    assert torch.equal(cpu_linear.linear(fewer, weight, bias), torch.nn.functional.linear(fewer, weight, bias))
    monkeypatch.setattr(cpu_linear, "ONEDNN_MIN_MACS", rows * weight.numel() + 1)
    assert torch.equal(cpu_linear.linear(x, weight, bias), sgemm)


def test_onednn_layers_by_default_where_measured_faster(model, monkeypatch):
    """``onednn_layers=None``: on where oneDNN measured at least ``ONEDNN_MIN_SPEEDUP`` x sgemm (the
    note says the measure), off below it or with ``HF_PAGED_ONEDNN_LAYERS=0``; True / False force
    it; half-precision models have none (torch runs them through oneDNN already)."""
    if not cpu_linear.available():
        pytest.skip("this torch has no oneDNN linear")
    layers = _layer_modules(model)
    monkeypatch.delenv(cpu_linear.ONEDNN_LAYERS_ENV, raising=False)
    monkeypatch.setattr(cpu_linear, "onednn_speedup", lambda *shape: 2.0)
    modules, note = cpu_linear.layer_linears(model)
    assert {id(m) for m in modules} == layers and note.startswith("on: oneDNN 2.00x")
    monkeypatch.setattr(cpu_linear, "onednn_speedup", lambda *shape: 1.1)
    modules, note = cpu_linear.layer_linears(model)
    assert modules == () and note.startswith("off: oneDNN 1.10x")
    assert {id(m) for m in cpu_linear.layer_linears(model, True)[0]} == layers
    monkeypatch.setattr(cpu_linear, "onednn_speedup", lambda *shape: 2.0)
    assert cpu_linear.layer_linears(model, False) == ((), "off (onednn_layers=False)")
    monkeypatch.setenv(cpu_linear.ONEDNN_LAYERS_ENV, "0")
    assert cpu_linear.layer_linears(model)[0] == () and cpu_linear.layer_linears(model, True)[0]
    assert cpu_linear.layer_linears(copy.deepcopy(model).to(torch.bfloat16), True)[0] == ()
    assert not LLMEngine(model, block_size=4).stats()["onednn_layers"]


def test_the_speed_measure_leaves_the_global_generator_alone():
    """An engine built after ``torch.manual_seed`` samples as one built without the measure would."""
    if not cpu_linear.available():
        pytest.skip("this torch has no oneDNN linear")
    cpu_linear.onednn_speedup.cache_clear()
    before = torch.get_rng_state()
    assert cpu_linear.onednn_speedup(64, 96, rows=8) > 0
    assert torch.equal(torch.get_rng_state(), before)


def test_onednn_layers_leave_a_replaced_forward_alone():
    """A layer whose forward is already replaced keeps it."""
    layer, other = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    own = layer.forward = lambda x: x
    with cpu_linear.layer_products([layer, other]):
        assert layer.forward is own and "forward" in other.__dict__
    assert layer.forward is own and "forward" not in other.__dict__


def _greedy(engine, prompts=PROMPTS, tokens=4):
    params = SamplingParams(max_new_tokens=tokens, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]


def _stock_greedy(model, prompts=PROMPTS, tokens=4):
    return [model.generate(torch.tensor([p]), max_new_tokens=tokens, do_sample=False)[0, len(p):].tolist()
            for p in prompts]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_layer_products_run_on_packed_copies_in_engine_steps(model, monkeypatch, compile):
    """With the layers on oneDNN, each layer product of a step (decode rows too) runs on its weight's
    packed copy, made once at build (eager steps, and the op inside the compiled body); tokens are
    stock generate()'s; ``prepack_layers=False`` runs the live weights."""
    if not cpu_linear.available():
        pytest.skip("this torch has no oneDNN linear")
    monkeypatch.setattr(cpu_linear, "ONEDNN_MIN_MACS", 0)  # the tiny model's products go to oneDNN too
    monkeypatch.setattr(cpu_linear, "LAYER_GEMV_MAX_ROWS", 0)  # decode rows too (not the C few-row products)
    packed, real_get = [], cpu_linear.PrepackedWeight.get
    monkeypatch.setattr(cpu_linear.PrepackedWeight, "get", lambda self: packed.append(self.module) or real_get(self))
    engine = LLMEngine(model, block_size=4, onednn_layers=True, compile=compile, prepack_lm_head=False)
    assert engine.stats()["prepacked_layers"] and engine.runner.layer_packs_note.startswith("on: packed copies of")
    assert {id(p.module) for p in engine.runner.layer_packs.values()} == _layer_modules(model)
    assert {id(m) for m in packed} == _layer_modules(model), "not every layer weight was packed at build"
    packed.clear()
    assert _greedy(engine) == _stock_greedy(model)
    per_module = {}
    for module in packed:
        per_module[id(module)] = per_module.get(id(module), 0) + 1
    steps = engine.stats()["steps"]
    assert set(per_module) == _layer_modules(model) and min(per_module.values()) >= steps - 1, (
        "a layer product ran on its live weight in some step")
    live = LLMEngine(model, block_size=4, onednn_layers=True, compile=compile, prepack_layers=False,
                     prepack_lm_head=False)
    assert not live.stats()["prepacked_layers"] and live.runner.layer_packs == {}
    packed.clear()
    assert _greedy(live) == _stock_greedy(model) and not packed


def test_negative_control_a_packed_layer_product_does_not_give_sgemms_bits(monkeypatch):
    """What the test above relies on: inside a step with packs (``packed_layers``), a decode-sized
    product of a packed weight runs oneDNN on the copy (other bits than sgemm's, which the same
    product keeps outside the step), and a weight without a copy stays on sgemm."""
    if not cpu_linear.available():
        pytest.skip("this torch has no oneDNN linear")
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(256, 688, bias=True)
    packs, _ = cpu_linear.layer_packs((layer,), True)
    x = torch.randn(1, 32, 256, generator=g)
    sgemm = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert torch.equal(cpu_linear.linear(x, layer.weight, layer.bias), sgemm), "no packs: decode rows keep sgemm"
    with cpu_linear.packed_layers(packs):
        on_copy = cpu_linear.linear(x, layer.weight, layer.bias)
    assert not torch.equal(on_copy, sgemm), "the packed product gave sgemm's bits: a live run could not be told"
    torch.testing.assert_close(on_copy, sgemm, rtol=1e-4, atol=1e-4)
    other = torch.nn.Linear(256, 688)
    with cpu_linear.packed_layers(packs):  # a weight without a copy stays live
        assert torch.equal(cpu_linear.linear(x, other.weight, other.bias),
                           torch.nn.functional.linear(x, other.weight, other.bias))


def test_a_changed_or_replaced_layer_weight_is_never_run_from_a_stale_copy(model, monkeypatch):
    """Weights changed in place after the engine was built are packed again; a replaced weight runs
    live; either way the engine's tokens are stock generate()'s of the new weights (eager and
    compiled), and a stale copy would have given other tokens (negative control). Prefix caching is
    off: cached blocks would hold the old weights' K/V (``reset_prefix_cache`` is for that)."""
    if not cpu_linear.available():
        pytest.skip("this torch has no oneDNN linear")
    monkeypatch.setattr(cpu_linear, "ONEDNN_MIN_MACS", 0)
    for compile in (False, True):
        ours = copy.deepcopy(model)
        engine = LLMEngine(ours, block_size=4, onednn_layers=True, compile=compile, enable_prefix_caching=False)
        before = _greedy(engine, tokens=6)
        stale = {ptr: pack.get() for ptr, pack in engine.runner.layer_packs.items()}
        layers = [m for m in ours.get_decoder().modules() if id(m) in _layer_modules(ours)]
        with torch.no_grad():
            for module in layers:
                module.weight.mul_(-1.5)
        changed = _greedy(engine, tokens=6)
        assert changed == _stock_greedy(ours, tokens=6) and changed != before
        assert all(pack.get() is not stale[ptr] for ptr, pack in engine.runner.layer_packs.items())
        replaced = layers[0]
        replaced.weight = torch.nn.Parameter(torch.randn_like(replaced.weight) * 0.3)
        assert _greedy(engine, tokens=6) == _stock_greedy(ours, tokens=6)
        engine.close()


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_onednn_products_run_at_bucketed_row_counts(model, monkeypatch, compile):
    """Every oneDNN product of engine steps (the layers', packed or live, and the LM head's) runs at
    a row count of ``bucketed_rows`` (oneDNN builds a primitive per row count), the padding is cut
    off (tokens are stock generate()'s), and the buckets are what they say."""
    if not cpu_linear.available():
        pytest.skip("this torch has no oneDNN linear")
    assert [cpu_linear.bucketed_rows(n) for n in (0, 1, 8, 9, 256, 257, 1024, 1025, 4000)] == [
        0, 8, 8, 16, 256, 288, 1024, 1088, 4032]
    monkeypatch.setattr(cpu_linear, "ONEDNN_MIN_MACS", 0)
    monkeypatch.setattr(cpu_linear, "ONEDNN_MIN_ROWS", 1)  # live weights' decode products too
    monkeypatch.setattr(cpu_linear, "LAYER_GEMV_MAX_ROWS", 0)  # and decode products on oneDNN, not in C
    monkeypatch.setattr(cpu_linear, "HEAD_GEMV_MAX_ROWS", 0)
    rows_seen, real = [], torch.ops.mkldnn._linear_pointwise

    def counted(x, *args):
        rows_seen.append(x.shape[0])
        return real(x, *args)

    for packed in (True, False):
        engine = LLMEngine(model, block_size=4, onednn_layers=True, prepack_layers=packed, compile=compile)
        with monkeypatch.context() as patch:  # after compiling: inductor looks the op up itself
            patch.setattr(torch.ops.mkldnn, "_linear_pointwise", counted)
            assert _greedy(engine) == _stock_greedy(model)
        assert rows_seen and all(n % 8 == 0 for n in rows_seen), sorted(set(rows_seen))
        assert 8 in rows_seen, "no decode-sized product went through oneDNN: the check saw too little"
        rows_seen.clear()
        engine.close()
    unpadded = torch.randn(13, 64)
    layer = torch.nn.Linear(64, 96)
    with monkeypatch.context() as patch:
        patch.setattr(torch.ops.mkldnn, "_linear_pointwise", counted)
        out = cpu_linear.onednn_product(unpadded[None], layer.weight, layer.bias)
    assert rows_seen == [16] and out.shape == (1, 13, 96)
    torch.testing.assert_close(out[0], layer(unpadded))


def test_layer_packs_follow_the_size_limit_the_option_and_the_environment(model, monkeypatch):
    """``prepack_layers=None`` packs the oneDNN layers' weights up to ``PREPACK_LAYERS_MAX_BYTES``
    (a weight shared by two modules once), unless ``HF_PAGED_PREPACK_LAYERS=0``; True packs whatever
    the size; False, or no oneDNN layers, none; each answer's note says why."""
    if not cpu_linear.available():
        pytest.skip("this torch has no oneDNN linear")
    monkeypatch.delenv(cpu_linear.PREPACK_LAYERS_ENV, raising=False)
    modules = cpu_linear.layer_linears(model, True)[0]
    total = sum(m.weight.nbytes for m in modules)
    packs, note = cpu_linear.layer_packs(modules)
    assert len(packs) == len(modules) and note.startswith("on:")
    assert cpu_linear.layer_packs(modules + modules[:1])[0].keys() == packs.keys()
    monkeypatch.setattr(cpu_linear, "PREPACK_LAYERS_MAX_BYTES", total - 1)
    packs, note = cpu_linear.layer_packs(modules)
    assert packs == {} and note.startswith("off: the layers' weights take")
    assert len(cpu_linear.layer_packs(modules, True)[0]) == len(modules)
    monkeypatch.setattr(cpu_linear, "PREPACK_LAYERS_MAX_BYTES", total)
    assert cpu_linear.layer_packs(modules, False) == ({}, "off (prepack_layers=False)")
    assert cpu_linear.layer_packs((), True) == ({}, "no oneDNN layers to pack")
    monkeypatch.setenv(cpu_linear.PREPACK_LAYERS_ENV, "0")
    assert cpu_linear.layer_packs(modules)[0] == {} and cpu_linear.layer_packs(modules, True)[0]
    engine = LLMEngine(model, block_size=4, onednn_layers=False, prepack_layers=True)
    assert not engine.stats()["prepacked_layers"] and engine.runner.layer_packs_note == "no oneDNN layers to pack"


class _CountingTokenizer:
    """The demo tokenizer, counting decodes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decodes = tokenizer, 0
        self.eos_token_id = tokenizer.eos_token_id

    def decode(self, *args, **kwargs):
        self.decodes += 1
        return self.tokenizer.decode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_unfinished_outputs_are_decoded_by_their_reader_not_by_the_step(model):
    from hf_paged.demo import byte_tokenizer

    counting = _CountingTokenizer(byte_tokenizer())
    engine = LLMEngine(model, counting, block_size=4)
    engine.add_request(PROMPTS[1], SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))
    partial = []
    while engine.has_unfinished_requests():
        partial += [o for o in engine.step() if not o.finished]
    # the final text only (and, once, the prompt's last tokens it is decoded after)
    assert len(partial) == 5 and counting.decodes == 2, "the steps decoded unfinished outputs"
    texts = [o.outputs[0].text for o in partial]
    assert counting.decodes == 7 and texts == [counting.tokenizer.decode(o.outputs[0].token_ids) for o in partial]
    assert [o.outputs[0].text for o in partial] == texts and counting.decodes == 7, "decoded again on a second read"


_FAULT_PROBE = """
import importlib.util, resource, sys, torch
spec = importlib.util.spec_from_file_location("host_malloc", sys.argv[2])  # by path: hf_paged's import costs seconds
host_malloc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(host_malloc)
if sys.argv[1] == "tuned":
    assert host_malloc.tune_malloc()
sizes = [((i * 7919) % 20 + 1) << 18 for i in range(60)]  # float32 buffers of 1-20 MiB, sizes changing
def loop():
    held = []
    for n in sizes:
        held = held[-3:] + [torch.empty(n).fill_(1.0)]
loop()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
loop()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_tuned_malloc_stops_changing_buffer_sizes_from_faulting_pages_in_again():
    """What the engine's ``tune_malloc`` is for: buffers of changing sizes, as a CPU step's, reuse
    freed memory instead of faulting fresh pages in (negative control: the same loop with glibc's
    defaults, in its own process). Pages faulted in by the second loop: with the defaults 4,352 to
    54,432 from run to run, tuned 0 or 256. The tuned probe runs up to three times: once in a full
    suite run (2026-12-07) it faulted 4,352, not seen in 60 runs alone."""
    if not host_malloc.tune_malloc():
        pytest.skip("the C library is not glibc")

    def probe(mode: str) -> int:
        result = subprocess.run([sys.executable, "-c", _FAULT_PROBE, mode, host_malloc.__file__], capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        return int(result.stdout.split()[-1])

    faults = {"default": probe("default"), "tuned": []}
    assert faults["default"] > 1000, f"glibc's defaults did not fault: the check below could not fail ({faults})"
    while len(faults["tuned"]) < 3 and not any(n < 1000 for n in faults["tuned"]):
        faults["tuned"].append(probe("tuned"))
    assert min(faults["tuned"]) < 1000, faults


def test_engine_tunes_malloc_on_cpu_unless_told_not_to(model, monkeypatch):
    calls = []
    monkeypatch.setattr(host_malloc, "tune_malloc", lambda: calls.append(1) or True)
    LLMEngine(model, block_size=4)
    assert calls == [1], "a CPU engine left glibc's malloc thresholds at their defaults"
    LLMEngine(model, block_size=4, tune_malloc=False)
    assert calls == [1], "tune_malloc=False still set them"
