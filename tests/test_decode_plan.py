"""Compiled decode steps attending in C from a plan (``attention.DecodePlanner``,
``cpu_ops.decode_step_attention``): stock generate()'s tokens, with full and sliding-window layers in
two layer groups, every decode step planned and every layer served; models and steps a plan does
not serve (softcap) left to the Python operator; the operator against the Python path's write and
read on hand-made pools; its refusals; and negative controls."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_paged import LLMEngine, SamplingParams
from hf_paged.kernels import cpu_build, cpu_decode, cpu_ops
from tests.helpers.tiny_models import build

PROMPTS = [list(range(3, 3 + n)) for n in (30, 7, 19)]
NEW = 10


@pytest.fixture
def op():
    found = cpu_ops.decode_step_attention()
    if found is None:
        pytest.skip(f"the C++ operators do not build here: {cpu_build.failure() or cpu_build.ops_failure()}")
    return found


def _stock(model) -> list[list[int]]:
    return [model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
            for p in PROMPTS]


def _tokens(engine) -> list[list[int]]:
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, temperature=0), use_tqdm=False)
    assert engine.kv.num_used_blocks() == 0
    return [list(o.outputs[0].token_ids) for o in outs]


# plain, and two layer groups (full and sliding-window layers); sinks: the operator's test below
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_planned_decode_steps_give_stock_tokens(op, name):
    model = build(name)
    stock = _stock(copy.deepcopy(model))
    engine = LLMEngine(model, block_size=4, compile=True)
    layers, before = model.config.num_hidden_layers, cpu_ops.decode_layers_in_c()
    assert _tokens(engine) == stock
    planned = engine.runner.compiled.planned_steps
    assert planned >= NEW - 1, "the decode steps were not planned"
    assert cpu_ops.decode_layers_in_c() - before == planned * layers


def test_a_model_with_an_attention_softcap_is_not_planned(op):
    model = build("gemma2")
    stock = _stock(copy.deepcopy(model))
    engine = LLMEngine(model, block_size=4, compile=True)
    assert not engine.runner.decode_planner.possible
    assert _tokens(engine) == stock and engine.runner.compiled.planned_steps == 0


def test_negative_control_a_plan_with_a_wrong_window_changes_tokens(op, monkeypatch):
    """What the tests above compare can fail: the same plans with a window of 2 tokens at every layer."""
    model = build("llama")
    stock = _stock(copy.deepcopy(model))
    engine = LLMEngine(model, block_size=4, compile=True)
    planner = engine.runner.decode_planner
    real = planner.plan

    def narrow(step):
        plan = real(step)
        if plan is not None:
            plan.rows[:, 8] = 2
            plan.start(int(step.metadata_for(0, torch.device("cpu")).num_decode))
        return plan

    monkeypatch.setattr(planner, "plan", narrow)
    assert _tokens(engine) != stock


def _pools(g, blocks=6, block_size=4, kv_heads=2, head_dim=8):
    return (torch.randn(blocks, block_size, kv_heads, head_dim, generator=g),
            torch.randn(blocks, block_size, kv_heads, head_dim, generator=g))


def test_the_operator_writes_and_reads_as_the_python_path_does(op):
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, seqs = 4, 2, 8, 2
    k_pool, v_pool = _pools(g)
    tables = torch.tensor([[3, 1, 0], [5, 2, 4]], dtype=torch.int32)
    lens = torch.tensor([10, 7], dtype=torch.int32)
    slots = torch.tensor([1 * 4 + 1, 4 * 4 + 2], dtype=torch.int64)  # each sequence's last token: block 1 / 4
    query = torch.randn(1, seqs, heads, head_dim, generator=g).transpose(1, 2)  # as the model hands them over
    key, value = (torch.randn(1, seqs, kv_heads, head_dim, generator=g).transpose(1, 2) for _ in range(2))
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    k_ref.view(-1, kv_heads, head_dim).index_copy_(0, slots, key[0].transpose(0, 1))
    v_ref.view(-1, kv_heads, head_dim).index_copy_(0, slots, value[0].transpose(0, 1))
    for window, sinks in ((0, None), (5, None), (0, torch.randn(heads, generator=g))):
        expected = cpu_decode.paged_decode_cpu(query[0].transpose(0, 1), k_ref, v_ref, tables, lens, 0.3,
                                               window or None, sinks)
        k_run, v_run = k_pool.clone(), v_pool.clone()
        plan = cpu_ops.DecodePlan(1)
        plan.set_layer(0, k_run, v_run, heads, window)
        plan.set_rows([0], seqs, slots, tables, lens)
        plan.start(seqs)
        try:
            out = op(query, key, value, 0.3, None, None, sinks)
        finally:
            assert plan.end() == 1
        assert torch.equal(k_run, k_ref) and torch.equal(v_run, v_ref)
        assert out.shape == (1, seqs, heads, head_dim) and torch.equal(out[0], expected)
    plan.start(seqs)  # negative control: another scale reads otherwise
    try:
        assert not torch.equal(op(query, key, value, 0.31, None, None, None)[0], expected)
    finally:
        plan.end()


def test_the_operator_refuses_what_its_plan_does_not_fit(op):
    g = torch.Generator().manual_seed(1)
    k_pool, v_pool = _pools(g)
    plan = cpu_ops.DecodePlan(1)
    plan.set_layer(0, k_pool, v_pool, 4, 0)
    tables, lens = torch.tensor([[3, 1]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32)
    query, key, value = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    cases = {"does not fit its plan": (torch.randn(1, 4, 1, 7), torch.tensor([5]), None),
             "outside the pool": (query, torch.tensor([24]), None),
             "has a softcap": (query, torch.tensor([5]), 30.0)}
    for what, (q, slots, softcap) in cases.items():
        plan.set_rows([0], 1, slots, tables, lens)
        plan.start(1)
        try:
            with pytest.raises(RuntimeError, match=what):
                op(q, key, value, 0.3, None, softcap, None)
        finally:
            plan.end()
    with pytest.raises(ValueError, match="not 1 rows"):
        plan.set_rows([0], 1, torch.tensor([5], dtype=torch.int32), tables, lens)
    with pytest.raises(ValueError, match="float32"):
        plan.set_layer(0, k_pool.double(), v_pool.double(), 4, 0)
    with pytest.raises(ValueError, match="does not fit"):
        plan.set_layer(0, k_pool, v_pool, 3, 0)  # 3 query heads over 2 K/V heads
