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


def _unsampled_rows(model, prompt, samples: int = 64) -> list[int]:
    """Prompt tokens whose embedding rows hold none of the values a 64-sample strided fingerprint
    reads (the rows a sampled fingerprint misses)."""
    emb = model.get_input_embeddings().weight
    index = torch.linspace(0, emb.numel() - 1, samples).long()
    sampled = set((index // emb.shape[1]).tolist())
    return [t for t in sorted(set(prompt)) if t not in sampled]


def test_a_snapshot_of_a_model_with_a_few_other_embedding_rows_is_refused(tmp_path):
    """Fine-tuning only a few tokens' embeddings changes the K/V of every prompt holding them: the
    weights fingerprint covers every element, not a sample."""
    model = build("llama")
    path = tmp_path / "prefix.safetensors"
    assert _saved(model, path) >= 8
    prompt = _prompts()[0]
    rows = _unsampled_rows(model, prompt)[:3]
    assert len(rows) == 3
    tuned = build("llama")
    with torch.no_grad():
        tuned.get_input_embeddings().weight[rows] += 0.3 * torch.randn(3, tuned.config.hidden_size,
                                                                   generator=torch.Generator().manual_seed(5))
    assert _reference(tuned, prompt) != _reference(model, prompt)  # the tuned rows matter
    engine = LLMEngine(tuned, block_size=8, num_blocks=128)
    with pytest.raises(SnapshotError, match="weights"):
        engine.load_prefix_cache(path)
    assert engine.kv.stats()["blocks_cached"] == 0
    # negative control: the same weights in another model object load
    assert LLMEngine(build("llama"), block_size=8, num_blocks=128).load_prefix_cache(path) >= 8


def test_a_snapshot_of_an_older_format_is_refused_by_name(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    model = build("llama")
    path = tmp_path / "prefix.safetensors"
    _saved(model, path)
    with safe_open(str(path), framework="pt") as f:
        metadata, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
    old = tmp_path / "v1.safetensors"
    save_file(tensors, str(old), metadata={**metadata, "format": "hf_paged.prefix_cache.v1"})
    with pytest.raises(SnapshotError, match="older hf_paged"):
        LLMEngine(model, block_size=8, num_blocks=128).load_prefix_cache(old)


@pytest.mark.parametrize("when", ["before any request", "after reset_prefix_cache"])
def test_an_empty_engine_prefix_cache_saves_an_empty_snapshot(when, tmp_path):
    model = build("llama")
    engine = LLMEngine(model, block_size=8, num_blocks=128)
    if when != "before any request":
        engine.generate(_prompts()[:1], PARAMS, use_tqdm=False)
        assert engine.reset_prefix_cache()
    path = tmp_path / "empty.safetensors"
    assert engine.save_prefix_cache(path) == 0
    assert path.exists()
    fresh = LLMEngine(model, block_size=8, num_blocks=128)
    assert fresh.load_prefix_cache(path) == 0
    assert fresh.kv.stats()["blocks_cached"] == 0
    # the fresh engine serves as usual
    prompt = _prompts()[1]
    assert fresh.generate([prompt], PARAMS, use_tqdm=False)[0].outputs[0].token_ids == _reference(model, prompt)
    _check_no_leak(fresh)
    # and still refuses an empty snapshot of another model
    with pytest.raises(SnapshotError, match="weights"):
        LLMEngine(build("llama", seed=1), block_size=8).load_prefix_cache(path)


@pytest.mark.parametrize("when", ["before any call", "after clear"])
def test_an_empty_generate_prefix_cache_saves_an_empty_snapshot(when, tmp_path):
    import copy

    import hf_paged

    stock = build("llama")
    model = hf_paged.enable(copy.deepcopy(stock), block_size=8, prefix_caching=True)
    prompt = _prompts()[0]
    if when != "before any call":
        model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=2, do_sample=False,
                       cache_implementation="hf_paged")
        assert hf_paged.prefix_cache(model).clear() > 0
    path = tmp_path / "empty.safetensors"
    assert hf_paged.prefix_cache(model).save(path) == 0
    fresh = hf_paged.enable(copy.deepcopy(stock), block_size=8, prefix_caching=True)
    assert hf_paged.prefix_cache(fresh).load(path) == 0
    assert hf_paged.prefix_cache(fresh).stats()["cached_blocks"] == 0
    out = fresh.generate(input_ids=torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                         cache_implementation="hf_paged")
    assert out[0, len(prompt):].tolist() == _reference(stock, prompt)
    # an engine takes it too
    assert LLMEngine(stock, block_size=8, num_blocks=128).load_prefix_cache(path) == 0


@pytest.mark.parametrize("chunk", [None, 1000])  # 1000 bytes: every tensor hashed in several chunks
def test_the_weights_fingerprint_sees_any_one_element(chunk, monkeypatch):
    from hf_paged import prefix_snapshot

    if chunk:
        monkeypatch.setattr(prefix_snapshot, "_CHUNK", chunk)
    model = build("llama")
    base = prefix_snapshot.weights_fingerprint(model)
    assert prefix_snapshot.weights_fingerprint(build("llama")) == base  # deterministic: same weights, same print
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    for name in ("model.embed_tokens.weight", "model.layers.1.self_attn.k_proj.weight", "model.norm.weight",
                 "model.rotary_emb.inv_freq"):
        flat = tensors[name].data.view(-1)
        for position in (0, flat.numel() // 2 + 1, flat.numel() - 1):
            before = flat[position].item()
            flat[position] = torch.nextafter(flat[position], torch.tensor(float("inf")))  # one ulp
            assert prefix_snapshot.weights_fingerprint(model) != base, (name, position)
            flat[position] = before
    assert prefix_snapshot.weights_fingerprint(model) == base
