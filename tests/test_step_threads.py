"""Small engine steps run on one thread (hf_paged.engine.step_threads): which steps, that the
setting ends with the step, the LM head on every thread inside them, compiled graphs for both
thread counts, and tokens equal to stock generate()."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_paged import LLMEngine, SamplingParams
from hf_paged.engine import cpu_linear, step_threads
from hf_paged.engine.step_threads import SERIAL_STEP_MAX_MACS, SerialSmallSteps
from hf_paged.kernels import cpu_gemv
from tests.helpers.tiny_models import build

pytestmark = pytest.mark.skipif(not step_threads.available(), reason="this torch's thread counts cannot be set per thread")

PROMPTS = [list(range(3, 40)), [5, 6, 7], [9] * 20, list(range(50, 62))]


def test_one_thread_holds_inside_the_block_only(threads):
    threads(2)
    assert step_threads.current_threads() == (2, 2)
    with step_threads.one_thread():
        assert step_threads.current_threads() == (1, 1)
        assert torch.get_num_threads() == 1  # what torch's own ops and the C reads split by
        with step_threads.one_thread():
            assert step_threads.current_threads() == (1, 1)
        assert step_threads.current_threads() == (1, 1)  # the inner block gives back the outer one's setting
    assert step_threads.current_threads() == (2, 2) and torch.get_num_threads() == 2


def test_default_follows_the_openmp_wait_policy_and_the_thread_count(monkeypatch, threads):
    model = build("llama")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    threads(2)
    assert SerialSmallSteps.of(model) is None  # active waits: split steps are faster
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    serial = SerialSmallSteps.of(model)
    largest = max(m.in_features * m.out_features for m in model.model.modules() if isinstance(m, torch.nn.Linear))
    assert serial is not None and serial.max_tokens == SERIAL_STEP_MAX_MACS // largest
    assert step_threads.largest_gemm_macs_per_token(model) == largest  # the body's linears, not the LM head
    assert SerialSmallSteps.of(model, True) is not None and SerialSmallSteps.of(model, False) is None
    threads(1)
    assert SerialSmallSteps.of(model) is None and SerialSmallSteps.of(model, True) is None  # nothing to split
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    threads(2)
    assert SerialSmallSteps.of(model) is None


def _engine_run(model, serial: bool | None, max_tokens: int = 8, compile: bool = False, heads: list | None = None,
                head_threads: int | None = None):
    """Greedy tokens of PROMPTS and, per forward, (tokens in the step, (OpenMP, MKL) threads inside
    it): seen by the first MLP (eager steps) or by the paged attention the compiled body calls out to.
    ``heads`` gets the same pair as seen inside the LM head's oneDNN or C call, per forward."""
    engine = LLMEngine(model, block_size=8, max_num_batched_tokens=64, serial_small_steps=serial, compile=compile)
    engine.graphs_after_build = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    if engine.runner.serial_steps is not None:
        engine.runner.serial_steps.max_tokens = max_tokens
        if head_threads is not None:
            engine.runner.serial_steps.head_threads = head_threads
    seen = []
    if compile:  # the compiled body's forward (its decode steps attend in C, from a plan: no attend call)
        forward = engine.runner.compiled.forward

        def watched(input_ids=None, position_ids=None, inputs_embeds=None, **kwargs):
            seen.append(((input_ids if input_ids is not None else inputs_embeds).shape[1],
                         step_threads.current_threads()))
            return forward(input_ids=input_ids, position_ids=position_ids, inputs_embeds=inputs_embeds, **kwargs)

        engine.runner.compiled.forward = watched
        undo = lambda: delattr(engine.runner.compiled, "forward")  # noqa: E731
    else:
        undo = model.model.layers[0].mlp.register_forward_pre_hook(
            lambda module, args: seen.append((args[0].shape[-2], step_threads.current_threads()))).remove
    head_op, few_rows = torch.ops.mkldnn._linear_pointwise, cpu_gemv.try_linear_rows

    def watched_head(*args):
        if heads is not None:
            heads.append((seen[-1][0], step_threads.current_threads()))
        return head_op(*args)

    def watched_few_rows(x, weight, bias=None):  # the head's products of a few rows run in C
        out = few_rows(x, weight, bias)
        if heads is not None and weight is model.lm_head.weight and out is not None:
            heads.append((seen[-1][0], step_threads.current_threads()))
        return out

    torch.ops.mkldnn._linear_pointwise, cpu_gemv.try_linear_rows = watched_head, watched_few_rows
    try:
        outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0), use_tqdm=False)
    finally:
        undo()
        torch.ops.mkldnn._linear_pointwise, cpu_gemv.try_linear_rows = head_op, few_rows
    assert engine.kv.num_used_blocks() == 0
    return [o.outputs[0].token_ids for o in outs], seen, engine


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_small_steps_run_on_one_thread_and_tokens_equal_stock_generate(threads, compile):
    threads(2)
    model = build("llama")
    stock = [copy.deepcopy(model).generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
             for p in PROMPTS]
    heads = []
    tokens, seen, engine = _engine_run(model, serial=True, compile=compile, heads=heads)
    assert engine.stats()["compiled"] == compile
    assert engine.stats()["serial_step_max_tokens"] == 8
    assert tokens == stock
    small = [t for n, t in seen if n <= 8]
    large = [t for n, t in seen if n > 8]
    assert small and large, "the run needs steps on both sides of the limit"
    assert set(small) == {(1, 1)} and set(large) == {(2, 2)}
    if cpu_linear.available():  # the LM head keeps both threads in every step (one oneDNN region)
        assert len(heads) == len(seen) and {t for _, t in heads} == {(2, 2)}
    assert step_threads.current_threads() == (2, 2)  # nothing stays set after the steps
    if compile:  # warmed up at both thread counts as the engine was built: nothing compiles while serving
        assert engine.runner.compiled.calls == 4 + len(seen)
        assert engine.graphs_after_build == torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_negative_control_without_the_setting_every_step_splits(threads):
    threads(2)
    heads = []
    tokens, seen, engine = _engine_run(build("llama"), serial=False, heads=heads)
    assert engine.stats()["serial_step_max_tokens"] == 0
    assert {t for _, t in seen} == {(2, 2)}
    assert {t for _, t in heads} == ({(2, 2)} if cpu_linear.available() else set())


def test_negative_control_the_lm_head_of_a_one_thread_step_on_one_thread(threads):
    """Without the LM head's exception (``head_threads`` 1) the watcher sees it on one thread."""
    if not cpu_linear.available():
        pytest.skip("no oneDNN linear in this torch")
    threads(2)
    heads = []
    _engine_run(build("llama"), serial=True, heads=heads, head_threads=1)
    assert {t for n, t in heads if n <= 8} == {(1, 1)} and {t for n, t in heads if n > 8} == {(2, 2)}
