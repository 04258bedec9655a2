"""Prefix-cache snapshots in safetensors: save, load in a fresh engine, hit, refuse what does not fit."""

from __future__ import annotations

import pytest
import torch

from hf_paged import LLMEngine, SamplingParams, SnapshotError
from tests.helpers.tiny_models import VOCAB, build
from tests.test_engine import _check_no_leak

PARAMS = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)


def _prompts(seed: int = 0, shared: int = 64, n: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, VOCAB, (shared,), generator=g).tolist()
    return [prefix + torch.randint(3, VOCAB, (int(k),), generator=g).tolist() for k in (5, 9, 13)[:n]]


def _reference(model, prompt) -> list[int]:
    out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def _saved(model, path, **engine_kwargs) -> int:
    engine = LLMEngine(model, block_size=8, num_blocks=128, **engine_kwargs)
    engine.generate(_prompts()[:1], PARAMS, use_tqdm=False)
    saved = engine.save_prefix_cache(path)
    _check_no_leak(engine)
    return saved


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: a full and a sliding layer group
def test_a_loaded_snapshot_serves_prefix_hits_with_the_same_tokens(arch, tmp_path):
    model = build(arch)
    path = tmp_path / "prefix.safetensors"
    assert _saved(model, path) >= 8  # the 64-token prefix is 8 full blocks
    engine = LLMEngine(model, block_size=8, num_blocks=128)
    assert engine.load_prefix_cache(path) >= 8
    assert engine.load_prefix_cache(path) == 0  # already cached: nothing taken twice
    prompts = _prompts()[1:]
    outputs = engine.generate(prompts, PARAMS, use_tqdm=False)
    stats = engine.stats()
    assert stats["prefix_cache_hit_tokens"] >= 2 * 64 - 8, stats  # each prompt adopted (almost) the whole prefix
    assert stats["computed_prompt_tokens"] <= sum(len(p) for p in prompts) - 2 * 56
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == _reference(model, prompt)
    _check_no_leak(engine)


def test_negative_control_a_fresh_engine_computes_everything(tmp_path):
    engine = LLMEngine(build("llama"), block_size=8, num_blocks=128)
    engine.generate(_prompts()[1:], PARAMS, use_tqdm=False)
    # only the later prompt hits (the blocks the earlier one computed): at most one prefix's worth
    assert engine.stats()["prefix_cache_hit_tokens"] <= 64


def test_snapshots_of_another_model_dtype_or_block_size_are_refused(tmp_path):
    model = build("llama")
    path = tmp_path / "prefix.safetensors"
    _saved(model, path)
    with pytest.raises(SnapshotError, match="weights"):
        LLMEngine(build("llama", seed=1), block_size=8).load_prefix_cache(path)
    with pytest.raises(SnapshotError, match="config"):
        LLMEngine(build("mistral"), block_size=8).load_prefix_cache(path)
    with pytest.raises(SnapshotError, match="block size"):
        LLMEngine(model, block_size=16).load_prefix_cache(path)
    with pytest.raises(SnapshotError, match="dtype"):
        LLMEngine(build("llama").to(torch.float64), block_size=8).load_prefix_cache(path)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_file_is_refused_and_nothing_is_loaded(tmp_path, damage):
    model = build("llama")
    path = tmp_path / "prefix.safetensors"
    _saved(model, path)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 100]
    else:
        data[-50] ^= 0xFF  # a byte of the last tensor's data
    path.write_bytes(bytes(data))
    engine = LLMEngine(model, block_size=8, num_blocks=128)
    with pytest.raises(SnapshotError):
        engine.load_prefix_cache(path)
    assert engine.kv.stats()["blocks_cached"] == 0 and engine.kv.num_used_blocks() == 0


def test_a_fixed_budget_loads_what_fits(tmp_path):
    model = build("llama")
    path = tmp_path / "prefix.safetensors"
    saved = _saved(model, path)
    engine = LLMEngine(model, block_size=8, num_blocks=4)
    assert engine.load_prefix_cache(path) == 4 < saved
    assert engine.kv.stats()["blocks_cached"] == 4
    _check_no_leak(engine)


def test_the_chain_map_stays_proportional_to_the_pool():
    """Many distinct prompts through a small pool: the chain links of evicted blocks are dropped,
    and a snapshot still loads and hits."""
    model = build("llama")
    engine = LLMEngine(model, block_size=8, num_blocks=16)
    g = torch.Generator().manual_seed(3)
    computed = 0
    for _ in range(10):
        prompts = [torch.randint(3, VOCAB, (120,), generator=g).tolist() for _ in range(12)]
        engine.generate(prompts, SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True), use_tqdm=False)
        computed += 12 * (119 // 8)
    assert computed > 1500 and engine.kv.prefix.num_chain_links <= 2 * 16 + 1024 + 15 * 12
    _check_no_leak(engine)
