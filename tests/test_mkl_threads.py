"""Small engine steps run MKL's GEMMs on one thread (hf_paged.engine.mkl_threads): which steps,
that the setting ends with the step, and that tokens stay those of stock generate()."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_paged import LLMEngine, SamplingParams
from hf_paged.engine import mkl_threads
from hf_paged.engine.mkl_threads import SERIAL_GEMM_MAX_MACS, SerialGemms
from tests.helpers.tiny_models import build

pytestmark = pytest.mark.skipif(not mkl_threads.available(), reason="this torch has no MKL thread-local setting")

PROMPTS = [list(range(3, 40)), [5, 6, 7], [9] * 20, list(range(50, 62))]


def test_one_thread_holds_inside_the_block_only(threads):
    threads(2)
    assert mkl_threads.current_threads() == 2
    with mkl_threads.one_thread():
        assert mkl_threads.current_threads() == 1
        with mkl_threads.one_thread():
            assert mkl_threads.current_threads() == 1
        assert mkl_threads.current_threads() == 1  # the inner block gives back the outer one's setting
    assert mkl_threads.current_threads() == 2


def test_default_follows_the_openmp_wait_policy_and_the_thread_count(monkeypatch, threads):
    model = build("llama")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    threads(2)
    assert SerialGemms.of(model) is None  # active waits: split GEMMs are faster
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    serial = SerialGemms.of(model)
    largest = max(m.in_features * m.out_features for m in model.model.modules() if isinstance(m, torch.nn.Linear))
    assert serial is not None and serial.max_tokens == SERIAL_GEMM_MAX_MACS // largest
    assert mkl_threads.largest_gemm_macs_per_token(model) == largest  # the body's linears, not the LM head
    threads(1)
    assert SerialGemms.of(model) is None  # nothing to split
    assert SerialGemms.of(model, True) is not None and SerialGemms.of(model, False) is None
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    threads(2)
    assert SerialGemms.of(model) is None


def _engine_run(model, serial: bool | None, max_tokens: int = 8, compile: bool = False):
    """Greedy tokens of PROMPTS and, per forward, (tokens in the step, MKL's threads inside it):
    seen by the first MLP (eager steps) or by the paged attention the compiled body calls out to."""
    engine = LLMEngine(model, block_size=8, max_num_batched_tokens=64, serial_small_gemms=serial, compile=compile)
    if engine.runner.serial_gemms is not None:
        engine.runner.serial_gemms.max_tokens = max_tokens
    seen = []
    if compile:
        attend = engine.runner.compiled.attend

        def watched(step, layer, query, *args, **kwargs):
            if layer == 0:
                seen.append((query.shape[-2], mkl_threads.current_threads()))
            return attend(step, layer, query, *args, **kwargs)

        engine.runner.compiled.attend = watched
        undo = lambda: setattr(engine.runner.compiled, "attend", attend)  # noqa: E731
    else:
        undo = model.model.layers[0].mlp.register_forward_pre_hook(
            lambda module, args: seen.append((args[0].shape[-2], mkl_threads.current_threads()))).remove
    try:
        outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0), use_tqdm=False)
    finally:
        undo()
    assert engine.kv.num_used_blocks() == 0
    return [o.outputs[0].token_ids for o in outs], seen, engine


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_small_steps_run_serial_gemms_and_tokens_equal_stock_generate(threads, compile):
    threads(2)
    model = build("llama")
    stock = [copy.deepcopy(model).generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
             for p in PROMPTS]
    tokens, seen, engine = _engine_run(model, serial=True, compile=compile)
    assert engine.stats()["compiled"] == compile
    assert engine.stats()["serial_gemm_max_tokens"] == 8
    assert tokens == stock
    small = [t for n, t in seen if n <= 8]
    large = [t for n, t in seen if n > 8]
    assert small and large, "the run needs steps on both sides of the limit"
    assert set(small) == {1} and set(large) == {2}
    assert mkl_threads.current_threads() == 2  # nothing stays set after the steps


def test_negative_control_without_the_setting_every_step_splits(threads):
    threads(2)
    tokens, seen, engine = _engine_run(build("llama"), serial=False)
    assert engine.stats()["serial_gemm_max_tokens"] == 0
    assert {t for _, t in seen} == {2}
