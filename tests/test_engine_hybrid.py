"""Hybrid and state-space models in ``LLMEngine`` (issue 21): recurrent state in slots beside the blocks.

Qwen3.5 text, Qwen3-Next, Falcon-H1, Granite 4 hybrid, LFM2, Jamba and a pure Mamba2, tiny
models from transformers' own config classes. Against per-request stock ``generate()`` of the
same weights (``torch.equal`` on tokens): greedy under preemption by recompute and by swap, with
requests arriving mid-run, with chunked prefill forced (in float64, where the recurrent kernels'
rounding depends on where a chunk starts), seeded ``n=2`` sampling and beam search. Every test
ends with every slot and block free. Negative controls: a fork that shares its parent's slot and
a chunked prefill that restarts the state each make the engine differ.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import hf_paged
from hf_paged import kinds, state_layers
from hf_paged.engine.kv_cache_manager import KVCacheManager
from hf_paged.state_slots import StateSlotManager
from tests.helpers.hybrid_models import HYBRIDS, build_hybrid
from tests.helpers.tiny_models import build, run_beside_an_older_request, single_threaded_torch

pytestmark = pytest.mark.skipif(not state_layers.STATE_API, reason="transformers lacks the state-layer cache API")

BLOCK = 4
NEW = 8


@pytest.fixture(autouse=True)
def _quiet_and_one_thread():
    with single_threaded_torch(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


_models: dict = {}


def _model(name: str, dtype: torch.dtype = torch.float32):
    if (name, dtype) not in _models:
        _models[(name, dtype)] = build_hybrid(name, dtype)
    return _models[(name, dtype)]


def _prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (int(k),), generator=g).tolist() for k in torch.randint(10, 40, (n,), generator=g)]


def _stock_greedy(model, prompts, new=NEW) -> list[list[int]]:
    return [model.generate(input_ids=torch.tensor([p]), max_new_tokens=new, do_sample=False)[0, len(p):].tolist()
            for p in prompts]


GREEDY = hf_paged.SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)


def _engine_greedy(model, prompts, **options) -> tuple[list[list[int]], hf_paged.LLMEngine]:
    engine = hf_paged.LLMEngine(model, block_size=BLOCK, **options)
    outs = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert not [o.error for o in outs if o.error]
    return [o.outputs[0].token_ids for o in outs], engine


def _all_free(engine) -> None:
    engine.kv.check_invariants()
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_used_blocks() == 0 and engine.kv.num_used_state_slots() == 0, "blocks or state slots leaked"


def _force_one_preemption(engine, monkeypatch) -> None:
    """A pure state-space model never runs out of blocks: from the 12th check on, refuse appends
    until the scheduler has preempted once."""
    real, calls = engine.kv.can_append, {"n": 0}

    def can_append(work, reserve=0):
        calls["n"] += 1
        refuse = calls["n"] >= 12 and not sum(engine.scheduler.preemptions.values())
        return False if refuse else real(work, reserve)

    monkeypatch.setattr(engine.kv, "can_append", can_append)


# ------------------------------------------------------------------------------ kinds and slots
def test_recurrent_layers_are_a_kind_with_one_slot_per_sequence():
    specs = hf_paged.model_info.state_kinds(_model("qwen3_5_text").config)
    assert [type(s) for s in specs] == [kinds.RecurrentStateSpec, type(None), kinds.RecurrentStateSpec]
    assert specs[0].continues_chunks and not hf_paged.model_info.state_kinds(_model("jamba").config)[0].continues_chunks
    engine = hf_paged.LLMEngine(_model("qwen3_5_text"), block_size=BLOCK, max_num_seqs=5)
    stats = engine.stats()
    assert stats["state_slots_total"] == 5 and stats["state_slots_free"] == 5 and stats["state_bytes_per_slot"] > 0
    assert stats["prefix_caching"] is False and "recurrent" in engine.prefix_caching_note


def test_slot_manager_settles_forks_after_frees_and_copies_at_once():
    slots = StateSlotManager(4)
    a, b = slots.allocate("a"), slots.allocate("b")
    for parent, child in (("b", "b1"), ("a", "a1"), ("a", "a2")):  # a beam step: fork every new beam, then free
        slots.fork(parent, child)
    slots.free("a"), slots.free("b")
    copies = slots.settle()
    assert sorted(src for src, _ in copies) == sorted([b, a, a]) and slots.num_used == 3
    assert {dst for _, dst in copies} & {a, b}, "freed parents' slots are reused by their children"
    slots.check_invariants()
    with pytest.raises(RuntimeError, match="state slots"):
        for s in ("x", "y"):
            slots.allocate(s)


def test_a_byte_budget_pays_for_state_slots_first():
    model = _model("qwen3_5_text")
    probe = hf_paged.LLMEngine(model, block_size=BLOCK)
    per_slot = probe.stats()["state_bytes_per_slot"]
    per_block = hf_paged.model_info.kv_bytes_per_token(model.config, model.dtype) * BLOCK
    engine = hf_paged.LLMEngine(model, block_size=BLOCK, max_num_seqs=64, kv_cache_bytes=10 * (per_slot + per_block))
    stats = engine.stats()
    assert stats["state_slots_total"] == 10 and stats["blocks_total"] == 10, stats
    with pytest.raises(ValueError, match="recurrent state"):
        hf_paged.LLMEngine(model, block_size=BLOCK, kv_cache_bytes=per_slot // 2)


# ------------------------------------------------------------------------------ greedy equals stock
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("name", HYBRIDS)
def test_engine_greedy_equals_stock_under_preemption(name, mode, monkeypatch):
    model = _model(name)
    prompts = _prompts()
    engine = hf_paged.LLMEngine(model, block_size=BLOCK, num_blocks=24, max_num_batched_tokens=16,
                                preemption_mode=mode)
    if not engine.kv.stats()["groups"]:  # a pure state-space model: no blocks to run out of
        _force_one_preemption(engine, monkeypatch)
    outs = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert engine.stats()[f"preemptions_{mode}"] >= 1, "the run was not preempted"
    assert [o.outputs[0].token_ids for o in outs] == _stock_greedy(model, prompts)
    _all_free(engine)


@pytest.mark.parametrize("name", HYBRIDS)
def test_requests_arriving_mid_run_equal_stock(name):
    model = _model(name)
    prompts = _prompts(5, seed=1)
    engine = hf_paged.LLMEngine(model, block_size=BLOCK, max_num_batched_tokens=32)
    done, pending = {}, list(enumerate(prompts))
    ids = {}
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 3 == 0:  # one more request every third step
            i, prompt = pending.pop(0)
            ids[engine.add_request(prompt, GREEDY)] = i
        done.update({ids[o.request_id]: o.outputs[0].token_ids for o in engine.step() if o.finished})
        steps += 1
    assert [done[i] for i in range(len(prompts))] == _stock_greedy(model, prompts)
    _all_free(engine)


@pytest.mark.parametrize("name", HYBRIDS)
def test_chunked_prefill_continues_the_state_in_float64(name):
    """A token budget of 8 splits every prompt; each chunk starts from the state the last one left
    (Jamba's Mamba-v1 mixers cannot: its prompts stay whole, over the budget)."""
    model = _model(name, torch.float64)
    prompts = _prompts(4, seed=2)
    got, engine = _engine_greedy(model, prompts, max_num_batched_tokens=8)
    assert got == _stock_greedy(model, prompts)
    _all_free(engine)


@pytest.mark.parametrize("name", HYBRIDS)
def test_seeded_sampling_n2_is_reproducible_and_frees_everything(name):
    model = _model(name)
    params = hf_paged.SamplingParams(max_new_tokens=6, n=2, temperature=1.0, seed=11, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = hf_paged.LLMEngine(model, block_size=BLOCK, max_num_batched_tokens=16)
        outs = engine.generate(_prompts(3, seed=4), params, use_tqdm=False)
        assert all(len(o.outputs) == 2 for o in outs) and not [o.error for o in outs if o.error]
        runs.append([[c.token_ids for c in o.outputs] for o in outs])
        _all_free(engine)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("name", HYBRIDS)
def test_engine_beam_search_equals_transformers(name):
    model = _model(name)
    prompts = _prompts(2, seed=8)
    engine = hf_paged.LLMEngine(model, block_size=BLOCK, max_num_batched_tokens=16)
    params = hf_paged.SamplingParams(max_new_tokens=6, num_beams=3, n=2, ignore_eos=True)
    outputs = engine.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        ref = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=6, num_beams=3, num_return_sequences=2,
                             do_sample=False)
        assert [c.token_ids for c in out.outputs] == [row[len(prompt):].tolist() for row in ref]
    _all_free(engine)


SHARING = [n for n in HYBRIDS if n not in ("jamba", "mamba2")]  # K/V blocks, and prefills that continue a state


@pytest.mark.parametrize("params, num_blocks", [
    (hf_paged.SamplingParams(max_new_tokens=20, n=4, temperature=1.0, seed=3, ignore_eos=True), 32),
    (hf_paged.SamplingParams(max_new_tokens=12, num_beams=4, n=4, ignore_eos=True), 20)], ids=["samples", "beams"])
@pytest.mark.parametrize("name", SHARING)
def test_sequences_recomputed_after_preemption_share_their_prompt_and_state_again(name, params, num_blocks):
    """4 sequences on a 40-token prompt fit ``num_blocks`` blocks of 4 sharing the prompt's (10 + their
    own), not recomputed apart (4 x 13 or more). Preempted by an older request and recomputed, the first
    computes the common part alone and the others fork from it, its blocks shared and its state
    copied into theirs: one preemption and the tokens of an unpreempted run (before, beams were
    refused as too large for the cache, and samples were preempted 13 times, until enough of
    them had finished for the rest to fit apart)."""
    model = _model(name)
    g = torch.Generator().manual_seed(1)
    older, prompt = (torch.randint(3, 96, (n,), generator=g).tolist() for n in (16, 40))

    def run(num_blocks):
        engine = hf_paged.LLMEngine(model, block_size=BLOCK, num_blocks=num_blocks, max_num_batched_tokens=64)
        result = run_beside_an_older_request(
            engine, older, hf_paged.SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True), prompt, params)
        _all_free(engine)
        return result

    _, ample, _ = run(200)
    error, tight, preemptions = run(num_blocks)
    assert preemptions == 1 and error is None and tight == ample


# ------------------------------------------------------------------------------ limits and refusals
def test_running_sequences_never_exceed_the_state_slots():
    model = _model("qwen3_5_text")
    engine = hf_paged.LLMEngine(model, block_size=BLOCK, num_state_slots=3, max_num_batched_tokens=64)
    params = hf_paged.SamplingParams(max_new_tokens=6, n=2, temperature=1.0, seed=1, ignore_eos=True)
    for prompt in _prompts(4, seed=5):
        engine.add_request(prompt, params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.stats()["state_slots_used"])
    assert peak <= 3 and engine.kv.stats()["state_slots_peak"] == peak >= 2
    too_wide = engine.generate([[5, 6, 7]], hf_paged.SamplingParams(max_new_tokens=2, n=4), use_tqdm=False)[0]
    assert too_wide.error and "state slots" in too_wide.error
    _all_free(engine)


def test_prefix_caching_is_refused_with_the_reason():
    model = _model("qwen3_5_text")
    with pytest.raises(ValueError, match="enable_prefix_caching=True.*recurrent layers"):
        hf_paged.LLMEngine(model, block_size=BLOCK, enable_prefix_caching=True)
    engine = hf_paged.LLMEngine(model, block_size=BLOCK)  # the default turns it off, and says so
    assert not engine.kv.enable_prefix_caching and engine.prefix_caching_note
    shared = _prompts(1, seed=6)[0] * 2
    engine.generate([shared, shared], GREEDY, use_tqdm=False)
    assert engine.stats()["prefix_cache_hit_tokens"] == 0
    with pytest.raises(ValueError, match="num_state_slots is for models with recurrent layers"):
        hf_paged.LLMEngine(build("llama"), num_state_slots=4)


@pytest.mark.parametrize("name", ["qwen3_5_text", "mamba2"])
def test_tensor_parallelism_refuses_recurrent_layers_with_the_reason(name):
    from hf_paged.engine.tensor_parallel import check_kv_heads

    model = build_hybrid(name, torch.float32)  # not the shared instance: tp_size is set on it below
    with pytest.raises(ValueError, match="tensor parallelism is not supported for models with recurrent layers"):
        check_kv_heads(model.config, 2)
    check_kv_heads(model.config, 1)  # one rank: served
    model._tp_size = 2  # as a tp_plan load sets it: the engine refuses before it looks for the ranks
    with pytest.raises(ValueError, match="recurrent layers.*run them on one rank"):
        hf_paged.LLMEngine(model, block_size=BLOCK)
    plain = build("llama")
    plain._tp_size = 2  # an attention-only model passes the check and goes on to look for its ranks
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        hf_paged.LLMEngine(plain, block_size=BLOCK)


def test_a_pure_state_space_model_runs_in_the_engine_and_generate_refuses_it():
    model = _model("mamba2")
    with pytest.raises(NotImplementedError, match="no layer writes a KV cache"):
        hf_paged.enable(model)
    engine = hf_paged.LLMEngine(model, block_size=BLOCK, num_blocks=1)  # no K/V: the block budget bounds nothing
    prompts = _prompts(3, seed=7)
    outs = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _stock_greedy(model, prompts)
    stats = engine.stats()
    assert stats["blocks_total"] == 0 and stats["state_slots_total"] == 256
    _all_free(engine)


# ------------------------------------------------------------------------------ negative controls
def test_negative_control_a_fork_that_shares_the_parents_slot_changes_the_output(monkeypatch):
    model = _model("qwen3_5_text")
    prompts = _prompts(2, seed=8)
    params = hf_paged.SamplingParams(max_new_tokens=6, num_beams=3, ignore_eos=True)
    reference = [model.generate(input_ids=torch.tensor([p]), max_new_tokens=6, num_beams=3,
                                do_sample=False)[0, len(p):].tolist() for p in prompts]

    def shared_settle(self):
        copies = []
        for child, source in self._forks.items():
            owner = next(s for s, slot in self._slot_of.items() if slot == source) if source in self._slot_of.values() else None
            if owner is None:  # the parent was freed: take its slot back as it is (no copy)
                self._free.remove(source)
            self._slot_of[child] = source
        self._forks.clear()
        return copies

    monkeypatch.setattr(StateSlotManager, "settle", shared_settle)
    monkeypatch.setattr(StateSlotManager, "check_invariants", lambda self: None)
    monkeypatch.setattr(KVCacheManager, "check_invariants", lambda self: None)
    engine = hf_paged.LLMEngine(model, block_size=BLOCK, max_num_batched_tokens=16)
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] != reference


def test_negative_control_a_chunked_prefill_that_restarts_the_state_changes_the_output(monkeypatch):
    from hf_paged.engine import model_runner

    model = _model("qwen3_5_text", torch.float64)
    prompts = _prompts(4, seed=2)
    real = model_runner.StatePool.layers_for
    monkeypatch.setattr(model_runner.StatePool, "layers_for",
                        lambda self, slots, has_previous: real(self, slots, has_previous and len(slots) > 1))
    got, _ = _engine_greedy(model, prompts, max_num_batched_tokens=8)
    assert got != _stock_greedy(model, prompts)


def test_negative_control_jamba_chunks_split_anyway_change_the_output():
    """Why Jamba's prompts stay whole: its Mamba-v1 mixers restart their scan on every chunk."""
    model = _model("jamba", torch.float64)
    prompts = _prompts(4, seed=2)
    engine = hf_paged.LLMEngine(model, block_size=BLOCK, max_num_batched_tokens=8)
    engine.scheduler.split_prompts = True
    outs = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] != _stock_greedy(model, prompts)
