"""The attention variants of the families people deploy (issue 20), against stock copies of the
same weights (``torch.equal`` on tokens):

* attention sinks (gpt-oss: ``s_aux`` joins the softmax denominator; sliding and full layers);
* MLA latent caches (DeepSeek V3, GLM-4 MoE Lite: the blocks hold the latent and the rotary key);
* chunked local attention (Llama 4 text: chunks counted from each row's first real token, the
  NoPE layers' temperature tuning reading per-token positions);
* KV-sharing layers (Gemma 3n text: the last layers read their source layer's blocks).

Through the flag: left-padded greedy, beam search, seeded sampling. ``LLMEngine``: greedy equal
to per-request stock ``generate()`` under preemption by recompute and by swap, and prefix-cache
hits. Memory: what each kind keeps. Negative controls: each variant's feature removed makes the
engine differ from stock.
"""

from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch
import transformers
from transformers import DynamicCache

import hf_paged
from hf_paged import attention, kinds
from hf_paged.channel import StashingCache
from hf_paged.engine.step_cache import PackedStepCache
from tests.helpers.tiny_models import left_padded, single_threaded_torch
from tests.helpers.variant_models import CHUNK, VARIANTS, build_variant

BLOCK = 4
PROMPTS = [5, 13, 22]  # left-padded; the longest crosses chunks of 8, windows of 6 and blocks of 4
NEW = 8


@pytest.fixture(autouse=True)
def _quiet_and_one_thread():
    with single_threaded_torch(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


_models: dict = {}


def _model_pair(name: str):
    """(a model to enable, a stock copy of the same weights), built once per module."""
    if name not in _models:
        model = build_variant(name)
        _models[name] = (model, copy.deepcopy(model))
    return _models[name]


def _paged_generate(model, **kwargs):
    hf_paged.enable(model, block_size=BLOCK)
    try:
        out = model.generate(**kwargs, cache_implementation="hf_paged", return_dict_in_generate=True)
    finally:
        hf_paged.disable(model)
    cache = out.past_key_values
    assert isinstance(cache, hf_paged.PagedKVCache) and cache.stats()["tokens_stored"] > 0
    return out.sequences, cache


def _prompts(n: int = 6, seed: int = 0, shared: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 96, (shared,), generator=g).tolist()
    return [prefix + torch.randint(3, 96, (int(k),), generator=g).tolist()
            for k in torch.randint(10, 40, (n,), generator=g)]


def _stock_greedy(stock, prompts, new=NEW) -> list[list[int]]:
    return [stock.generate(input_ids=torch.tensor([p]), max_new_tokens=new, do_sample=False)[0, len(p):].tolist()
            for p in prompts]


def _engine_greedy(model, prompts, new=NEW, **options) -> tuple[list[list[int]], hf_paged.LLMEngine]:
    engine = hf_paged.LLMEngine(model, block_size=BLOCK, **options)
    params = hf_paged.SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True)
    outs = engine.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], engine


def _no_leak(engine) -> None:
    engine.kv.check_invariants()
    assert not engine.has_unfinished_requests() and engine.kv.num_used_blocks() == 0, "blocks leaked"


# ------------------------------------------------------------------------------ the kinds
def test_each_variant_has_its_kind_of_layers():
    def specs(name):
        return hf_paged.model_info.layer_kinds(build_variant(name).config)[1]

    assert [type(s) for s in specs("gpt_oss")] == [kinds.SlidingWindowSpec, kinds.FullAttentionSpec]
    assert {type(s) for s in specs("deepseek_v3")} == {kinds.MLAAttentionSpec}
    llama4 = specs("llama4_text")
    assert llama4[:3] == [kinds.ChunkedLocalAttentionSpec(CHUNK)] * 3 and llama4[3] == kinds.FullAttentionSpec()
    gemma3n = specs("gemma3n_text")
    assert gemma3n[2] == kinds.SharedKVSpec(0, gemma3n[0]) and gemma3n[3] == kinds.SharedKVSpec(1, gemma3n[1])


def test_sharing_layers_and_their_sources_are_the_ones_the_model_uses():
    """Which layers share and whose K/V they read: transformers >= 5.24 marks them in the config
    (``kv_sharing_modes``); 5.17 has no marks and builds no cache layer for a sharing layer, and
    hf_paged derives them from ``num_kv_shared_layers`` and ``layer_types`` as 5.17's modeling code
    does. Seven layers, the last three sharing: each reads the last earlier layer of its type."""
    types_ = ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention",
                                                                                          "sliding_attention"]
    config = transformers.Gemma3nTextConfig(**{
        **build_variant("gemma3n_text").config.to_dict(), "num_hidden_layers": 7, "num_kv_shared_layers": 3,
        "layer_types": types_, "intermediate_size": [96] * 7, "activation_sparsity_pattern": [0.0] * 7})
    torch.manual_seed(0)
    model = transformers.Gemma3nForCausalLM(config).float().eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    attention = [layer.self_attn for layer in model.model.layers]
    specs = hf_paged.model_info.layer_kinds(config)[1]
    assert [isinstance(s, kinds.SharedKVSpec) for s in specs] == [a.is_kv_shared_layer for a in attention]
    assert [s.source for s in specs[4:]] == [3, 2, 3] and specs[5] == kinds.SharedKVSpec(2, kinds.FullAttentionSpec())
    for a, spec in zip(attention, specs):  # transformers 5.17 names the source layer
        if getattr(a, "kv_shared_layer_index", None) is not None:
            assert a.kv_shared_layer_index == spec.source
    modes = kinds.kv_sharing_modes(config)
    assert [m == "store" for m in modes] == [a.store_full_length_kv for a in attention]
    plain = types.SimpleNamespace(num_hidden_layers=7, num_kv_shared_layers=3, layer_types=types_)
    assert kinds.kv_sharing_modes(plain) == modes  # the derivation equals transformers' marks where it has them
    # as many cache layers as DynamicCache (5.17: none for the sharing layers), and stock's tokens
    assert len(hf_paged.PagedKVCache(config).layers) == len(DynamicCache(config=config).layers)
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    want = copy.deepcopy(model).generate(**kwargs)
    assert torch.equal(_paged_generate(model, **kwargs)[0], want)
    assert len(set(want[:, -NEW:].flatten().tolist())) > 4, "degenerate output: the comparison says little"


# ------------------------------------------------------------------------------ generate()
@pytest.mark.parametrize("name", VARIANTS)
def test_generate_through_the_flag_equals_stock(name):
    """Left-padded greedy, beam search with 3 beams, and seeded sampling of 3 per prompt."""
    model, stock = _model_pair(name)
    ids, mask = left_padded(PROMPTS)
    runs = [dict(do_sample=False), dict(do_sample=False, num_beams=3),
            dict(do_sample=True, top_k=20, num_return_sequences=3)]
    for options in runs:
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, **options)
        torch.manual_seed(7)
        want = stock.generate(**kwargs)
        torch.manual_seed(7)
        got, cache = _paged_generate(model, **kwargs)
        assert torch.equal(got, want), f"{name} {options}: differs from stock"
    assert len(set(want[:, -NEW:].flatten().tolist())) > 4, "degenerate output: the comparison says little"


@pytest.mark.parametrize("name", ["deepseek_v3", "gemma3n_text", "llama4_text"])
def test_cache_holds_what_dynamic_cache_holds(name):
    """MLA layers store a latent and a rotary key, sharing layers store nothing, a chunked layer
    its last chunk - 1 tokens: within a block per row (and group) of what DynamicCache holds."""
    model, stock = _model_pair(name)
    ids, mask = left_padded(PROMPTS)
    out = stock.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                         return_dict_in_generate=True)
    dynamic = sum(t.numel() * t.element_size() for layer in out.past_key_values.layers
                  for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)
    _, cache = _paged_generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert len(cache.layers) == len(out.past_key_values.layers)  # transformers 5.17: none for sharing layers
    stats = cache.stats()
    assert stats["bytes_contiguous_equivalent"] == dynamic
    slack = sum(len(PROMPTS) * BLOCK * sum(cache.storage.layer_bytes_per_token(i) for i in g["layers"]
                                           if i in cache.storage.key_pools) for g in stats["groups"])
    assert stats["bytes_used"] <= dynamic + slack, (stats["bytes_used"], dynamic)
    per_token = hf_paged.model_info.kv_bytes_per_token(model.config, torch.float32)
    assert per_token == sum(cache.storage.layer_bytes_per_token(i) for i in cache.storage.key_pools)
    if name == "gemma3n_text":
        assert sorted(cache.storage.key_pools) == [0, 1]  # the sharing layers 2 and 3 own no pools
    if name == "deepseek_v3":
        config = model.config
        assert cache.storage.layer_bytes_per_token(0) == (config.kv_lora_rank + config.qk_rope_head_dim) * 4


def test_a_chunked_group_holds_at_most_one_chunk_and_two_partial_blocks():
    """Three chunks of context: the chunked group keeps its current chunk, not the sequence."""
    model, _ = _model_pair("llama4_text")
    ids = torch.randint(3, 96, (1, 3 * CHUNK + 3))
    _, cache = _paged_generate(model, input_ids=ids, max_new_tokens=2, do_sample=False)
    chunked = next(g for g in cache.stats()["groups"] if g["layers"] == [0, 1, 2])
    full = next(g for g in cache.stats()["groups"] if g["layers"] == [3])
    assert chunked["blocks_used"] <= CHUNK // BLOCK + 2 < full["blocks_used"], (chunked, full)


# ------------------------------------------------------------------------------ the engine
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("name", VARIANTS)
def test_engine_greedy_equals_stock_under_preemption(name, mode):
    model, stock = _model_pair(name)
    prompts = _prompts()
    got, engine = _engine_greedy(model, prompts, num_blocks=24, max_num_batched_tokens=16, preemption_mode=mode)
    assert engine.stats()[f"preemptions_{mode}"] >= 1, "the budget did not force preemption"
    assert got == _stock_greedy(stock, prompts)
    _no_leak(engine)


@pytest.mark.parametrize("name", VARIANTS)
def test_engine_prefix_cache_hits_equal_stock(name):
    model, stock = _model_pair(name)
    first, second = _prompts(2, seed=3, shared=24)
    engine = hf_paged.LLMEngine(model, block_size=BLOCK, num_blocks=128, max_num_batched_tokens=16)
    params = hf_paged.SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
    engine.generate([first], params, use_tqdm=False)
    second_out = engine.generate([second], params, use_tqdm=False)[0].outputs[0].token_ids
    assert engine.stats()["prefix_cache_hit_tokens"] >= 16
    assert second_out == _stock_greedy(stock, [second])[0]
    _no_leak(engine)


@pytest.mark.parametrize("name", VARIANTS)
def test_engine_beam_search_equals_transformers(name):
    model, stock = _model_pair(name)
    prompts = _prompts(2, seed=8)
    engine = hf_paged.LLMEngine(model, block_size=BLOCK, num_blocks=256, max_num_batched_tokens=16)
    params = hf_paged.SamplingParams(max_new_tokens=6, num_beams=3, n=2, ignore_eos=True)
    outputs = engine.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        ref = stock.generate(input_ids=torch.tensor([prompt]), max_new_tokens=6, num_beams=3, num_return_sequences=2,
                             do_sample=False)
        assert [c.token_ids for c in out.outputs] == [row[len(prompt):].tolist() for row in ref]
    _no_leak(engine)


def test_llama4_temperature_tuning_reads_each_token_position_in_the_engine():
    """floor_scale 2: the NoPE layer's query scale changes every other position, so a packed step
    must give each token its own position (a past of 0 for all was silently wrong)."""
    model = build_variant("llama4_text", floor_scale=2)
    stock = copy.deepcopy(model)
    prompts = _prompts(4, seed=5)
    want = _stock_greedy(stock, prompts)
    got, engine = _engine_greedy(model, prompts, max_num_batched_tokens=16)
    assert got == want
    with pytest.MonkeyPatch.context() as patch:  # negative control: the past every layer saw before
        patch.setattr(PackedStepCache, "get_seq_length", lambda self, layer_idx=0: 0)
        assert _engine_greedy(model, prompts, max_num_batched_tokens=16)[0] != want


# ------------------------------------------------------------------------------ negative controls
def test_negative_control_a_dropped_sink_term_changes_the_engine():
    model, stock = _model_pair("gpt_oss")
    prompts = _prompts(4, seed=1)
    want = _stock_greedy(stock, prompts)
    read_options = attention._read_options

    def without_sinks(*args):
        options = read_options(*args)
        options.pop("sinks", None)
        return options

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention, "_read_options", without_sinks)
        assert _engine_greedy(model, prompts, max_num_batched_tokens=16)[0] != want
    assert _engine_greedy(model, prompts, max_num_batched_tokens=16)[0] == want


def test_negative_control_an_ignored_chunk_start_changes_the_engine():
    model, stock = _model_pair("llama4_text")
    prompts = _prompts(4, seed=2)
    want = _stock_greedy(stock, prompts)
    with pytest.MonkeyPatch.context() as patch:  # chunked layers read as full ones (nothing given back)
        patch.setattr(kinds.ChunkedLocalAttentionSpec, "read_options", lambda self: {})
        patch.setattr(kinds.ChunkedLocalAttentionSpec, "window", property(lambda self: None))
        assert _engine_greedy(model, prompts, max_num_batched_tokens=16)[0] != want


def test_negative_control_a_sharing_layer_that_does_not_read_its_source_changes_the_engine():
    model, stock = _model_pair("gemma3n_text")
    prompts = _prompts(4, seed=3)
    want = _stock_greedy(stock, prompts)
    with pytest.MonkeyPatch.context() as patch:  # the sharing layers see only this step's new K/V
        patch.setattr(StashingCache, "claimed_layer", lambda self, key, value: None)
        assert _engine_greedy(model, prompts, max_num_batched_tokens=16)[0] != want


def test_tensor_parallelism_refuses_mla_with_the_reason():
    from hf_paged.engine.tensor_parallel import check_kv_heads

    model, _ = _model_pair("deepseek_v3")
    with pytest.raises(ValueError, match="MLA"):
        check_kv_heads(model.config, 2)
    check_kv_heads(model.config, 1)  # one rank: served


# ------------------------------------------------------------------------------ the kernel route
@pytest.mark.parametrize("name", ["gpt_oss", "llama4_text", "gemma3n_text"])
def test_kernel_route_reads_sinks_chunks_and_shared_layers_like_stock(name, triton_launches):
    """generate() on the kernel route: the decode and prefill kernels read the blocks (sinks, chunk
    starts, a sharing layer's source blocks) and the tokens equal stock's."""
    model, stock = _model_pair(name)
    ids, mask = left_padded([5, 13])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    want = stock.generate(**kwargs)
    got, _ = _paged_generate(model, **kwargs)
    assert torch.equal(got, want)
    assert triton_launches["paged_attention_prefill"] > 0 and triton_launches["paged_attention_decode"] > 0


@pytest.mark.parametrize("name", ["gpt_oss", "llama4_text", "gemma3n_text"])
def test_engine_on_the_triton_kernels_equals_stock(name, triton_launches):
    model, stock = _model_pair(name)
    prompts = _prompts(2, seed=6)
    got, engine = _engine_greedy(model, prompts, new=4, max_num_batched_tokens=16)
    assert got == _stock_greedy(stock, prompts, new=4)
    assert triton_launches["paged_attention_prefill"] > 0 and triton_launches["paged_attention_decode"] > 0
    _no_leak(engine)


def test_mla_takes_the_reference_route_even_with_the_kernels_forced(triton_launches):
    model, stock = _model_pair("deepseek_v3")
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    got, cache = _paged_generate(model, **kwargs)
    assert torch.equal(got, stock.generate(**kwargs)) and "MLA" in cache.kernel_route_problem
    assert triton_launches == {"paged_attention_decode": 0, "paged_attention_prefill": 0}
