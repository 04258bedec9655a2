"""Sliding-window layer groups: blocks out of the window go back, outputs stay stock's.

The equality suites (test_equality.py, test_dropin.py) already run the sliding models (Mistral,
Qwen2 with sliding layers, Gemma2, Gemma3) past their windows, where blocks are given back; this
file checks the memory bounds, that given-back blocks are never read (poisoned with NaN, on the
reference route, the kernel route and in the kernels themselves), and the block-manager rules.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers

import hf_paged
from hf_paged import kernels
from hf_paged.bench.kv_bytes import dynamic_cache_bytes
from hf_paged.block_manager import HOLE, BlockManager, BlockManagerError, NoFreeBlocksError
from hf_paged.kinds import FullAttentionSpec, SlidingWindowSpec
from hf_paged.layer_groups import GroupedBlockManager, LayerGroup, layer_groups
from tests.helpers.tiny_models import build, left_padded

# ---------------------------------------------------------------------- block manager


def test_release_before_leaves_holes_and_keeps_numbering():
    bm = BlockManager(4, 16)
    bm.add_sequence("a")
    bm.append_slots("a", 14)  # blocks 0..3, the last one half full
    assert bm.release_before("a", 9) == 2  # tokens 0..7 are in blocks 0 and 1
    assert bm.block_table("a")[:2] == [HOLE, HOLE] and bm.num_used_blocks == 2
    assert bm.slot("a", 8) == bm.block_table("a")[2] * 4
    with pytest.raises(IndexError, match="released"):
        bm.slot("a", 7)
    assert bm.release_before("a", 9) == 0  # idempotent
    bm.fork("a", "b")  # holes are copied, not referenced
    bm.check_invariants()
    slots, copies = bm.append_slots("b", 3)  # copy on write of the shared half-full block
    assert len(copies) == 1 and len(slots) == 3
    bm.free("a")
    bm.free("b")
    bm.check_invariants()
    assert bm.num_used_blocks == 0


def test_truncate_cannot_reach_into_released_blocks():
    bm = BlockManager(4, 16)
    bm.add_sequence("a")
    bm.append_slots("a", 12)
    bm.release_before("a", 8)
    with pytest.raises(BlockManagerError, match="released"):
        bm.truncate("a", 6)
    bm.truncate("a", 10)  # within the held blocks
    bm.truncate("a", 0)  # everything: allowed
    assert bm.block_table("a") == [] and bm.num_released("a") == 0
    bm.append_slots("a", 5)
    bm.check_invariants()
    bm.free("a")
    assert bm.num_used_blocks == 0


def test_layer_groups_full_first_then_windows():
    full, w4, w8 = FullAttentionSpec(), SlidingWindowSpec(4), SlidingWindowSpec(8)
    groups = layer_groups([w4, full, w4, w8, full, None])  # None: a layer without K/V joins no group
    assert groups == [LayerGroup(full, (1, 4)), LayerGroup(w4, (0, 2)), LayerGroup(w8, (3,))]
    assert groups[1].first_needed(10) == 7 and groups[0].first_needed(10) == 0


def test_grouped_append_is_all_or_nothing_across_groups():
    blocks = GroupedBlockManager(4, 3, [LayerGroup(FullAttentionSpec(), (0,)), LayerGroup(SlidingWindowSpec(4), (1,))])
    blocks.add_sequence("a")
    blocks.append_many([("a", 8)])
    blocks.release_out_of_window("a", 8, [False, False])  # the sliding group keeps tokens 5.. only
    assert [m.num_used_blocks for m in blocks.managers] == [2, 1]
    with pytest.raises(NoFreeBlocksError):
        blocks.append_many([("a", 8)])  # the full group has 1 block left, needs 2
    assert [m.num_used_blocks for m in blocks.managers] == [2, 1]  # nothing changed in either group
    blocks.check_invariants()
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        blocks.truncate("a", 3)
    blocks.free("a")
    assert blocks.num_used_blocks == 0


# ---------------------------------------------------------------------- memory against stock


def _long_context_pair(config):
    torch.manual_seed(0)
    stock = transformers.AutoModelForCausalLM.from_config(config).eval()
    paged = copy.deepcopy(stock)
    hf_paged.enable(paged)
    return stock, paged


def _decode_peak(model):
    """Most blocks any layer group held per row after a decode step's forward (hook on the model)."""
    peaks: dict[int, int] = {}

    def hook(module, args, kwargs, output):
        cache = output.past_key_values
        if isinstance(cache, hf_paged.PagedKVCache) and cache.get_seq_length() and kwargs["input_ids"].shape[1] == 1:
            for g, manager in enumerate(cache.managers):
                per_row = max(len([b for b in manager.block_table(s) if b != HOLE]) for s in cache._rows)
                peaks[g] = max(peaks.get(g, 0), per_row)

    return peaks, model.register_forward_hook(hook, with_kwargs=True)


def test_mistral_window_64_at_2048_tokens_holds_about_what_stock_holds():
    config = transformers.MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                        sliding_window=64, initializer_range=0.1, pad_token_id=0)
    stock, paged = _long_context_pair(config)
    ids, mask = left_padded([2000, 1990])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=48, min_new_tokens=48, do_sample=False,
                  return_dict_in_generate=True, pad_token_id=0)
    want = stock.generate(**kwargs)
    peaks, handle = _decode_peak(paged)
    got = paged.generate(**kwargs, cache_implementation="hf_paged")
    handle.remove()
    assert torch.equal(got.sequences, want.sequences)
    cache, block_size, window = got.past_key_values, 16, 64
    bound = math.ceil((window + block_size) / block_size) + 1
    assert 0 < peaks[0] <= bound, peaks
    stats = cache.stats()
    assert len(stats["groups"]) == 1 and stats["groups"][0]["window"] == window
    ratio = stats["bytes_used"] / dynamic_cache_bytes(want.past_key_values)
    assert ratio <= 1.6, ratio
    assert stats["bytes_contiguous_equivalent"] == dynamic_cache_bytes(want.past_key_values)
    cache.release()
    assert cache.blocks.num_used_blocks == 0


def test_gemma3_five_to_one_window_512_at_2048_tokens_within_5_percent_of_stock():
    config = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, sliding_window=512,
        layer_types=["sliding_attention"] * 5 + ["full_attention"], query_pre_attn_scalar=16,
        initializer_range=0.02, pad_token_id=0)
    stock, paged = _long_context_pair(config)
    ids, mask = left_padded([2000], seed=1)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=48, min_new_tokens=48, do_sample=False,
                  return_dict_in_generate=True, pad_token_id=0)
    want = stock.generate(**kwargs)
    got = paged.generate(**kwargs, cache_implementation="hf_paged")
    assert torch.equal(got.sequences, want.sequences)
    stats = got.past_key_values.stats()
    assert [g["window"] for g in stats["groups"]] == [None, 512]
    ratio = stats["bytes_used"] / dynamic_cache_bytes(want.past_key_values)
    assert ratio <= 1.05, ratio
    got.past_key_values.release()


def test_sliding_group_gives_back_blocks_in_beam_search():
    stock = build("mistral")  # window 12
    paged = copy.deepcopy(stock)
    hf_paged.enable(paged, block_size=4)
    ids, mask = left_padded([30, 22])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, num_beams=4,
                  num_return_sequences=2, do_sample=False, return_dict_in_generate=True, output_scores=True)
    want = stock.generate(**kwargs)
    got = paged.generate(**kwargs, cache_implementation="hf_paged")
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.scores, want.scores))
    cache = got.past_key_values
    per_row = [len([b for b in cache.manager.block_table(s) if b != HOLE]) for s in cache._rows]
    assert max(per_row) <= math.ceil((12 + 4) / 4) + 1 and cache.manager.num_released(cache._rows[0]) > 0
    cache.release()
    assert cache.blocks.num_used_blocks == 0


# ---------------------------------------------------------------------- given-back blocks are never read


def _poison_free_blocks(model, also_live: list | None = None):
    """After every forward, fill each sliding group's free blocks with NaN (``also_live``: poison,
    once, the newest block of row 0 instead: the control)."""

    def hook(module, args, output):
        cache = output.past_key_values
        if not isinstance(cache, hf_paged.PagedKVCache):
            return
        for group, manager in zip(cache.groups, cache.managers):
            if not group.is_sliding:
                continue
            if also_live is not None:
                if also_live and cache.get_seq_length() > 30:
                    also_live.pop()
                    blocks = [manager.block_table(cache._rows[0])[-2]]
                else:
                    continue
            else:
                blocks = [b for b in range(manager.num_blocks) if manager.ref_count(b) == 0]
            for layer in group.layers:
                if layer in cache.storage.key_pools and blocks:
                    cache.storage.key_pools[layer][blocks] = float("nan")
                    cache.storage.value_pools[layer][blocks] = float("nan")

    return model.register_forward_hook(hook)


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
@pytest.mark.parametrize("block_size", [1, 4])
def test_given_back_blocks_are_never_read(arch, block_size):
    stock = build(arch)
    paged = copy.deepcopy(stock)
    hf_paged.enable(paged, block_size=block_size)
    ids, mask = left_padded([34, 21, 28])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    want = stock.generate(**kwargs)
    handle = _poison_free_blocks(paged)
    got = paged.generate(**kwargs, cache_implementation="hf_paged")
    handle.remove()
    assert torch.equal(got, want)


def test_negative_control_poisoning_a_held_block_changes_the_output():
    stock = build("mistral")
    paged = copy.deepcopy(stock)
    hf_paged.enable(paged, block_size=4)
    ids, mask = left_padded([34, 21, 28])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    want = stock.generate(**kwargs)
    handle = _poison_free_blocks(paged, also_live=[True])
    got = paged.generate(**kwargs, cache_implementation="hf_paged")
    handle.remove()
    assert not torch.equal(got, want)


def test_kernel_route_reads_through_group_tables_with_holes():
    """The Triton kernels (interpreter on CPU) on a Gemma3-like model: full and sliding groups,
    given-back blocks poisoned with NaN; outputs equal stock's."""
    stock = build("gemma3")  # sliding, full, sliding; window 7
    paged = copy.deepcopy(stock)
    hf_paged.enable(paged, block_size=4)
    ids, mask = left_padded([18, 11])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                  return_dict_in_generate=True)
    want = stock.generate(**kwargs)
    handle = _poison_free_blocks(paged)
    kernels.set_backend("triton")
    try:
        got = paged.generate(**kwargs, cache_implementation="hf_paged")
    finally:
        kernels.set_backend("auto")
        handle.remove()
    assert torch.equal(got.sequences, want.sequences)
    cache = got.past_key_values
    assert cache.managers[1].num_released(cache._rows[0]) > 0  # the sliding group really gave blocks back
    cache.release()


# ---------------------------------------------------------------------- the kernels on holed tables


def _holed_case(window, block_size=4, ctx=(23, 17), seed=0):
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = 4, 2, 16
    num_blocks = 24
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1  # block 0 is the poisoned "freed" block
    width = max(-(-c // block_size) for c in ctx)
    tables = perm[: len(ctx) * width].view(len(ctx), width).to(torch.int32)
    return k_cache, v_cache, tables, torch.tensor(ctx, dtype=torch.int32), heads, dim, g


def _hole_out(tables, ctx, first_needed, block_size, hole):
    holed = tables.clone()
    for row, c in enumerate(ctx.tolist()):
        holed[row, : first_needed(c) // block_size] = hole
    return holed


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kernels_never_read_blocks_before_the_window(backend):
    window, bs = 6, 4
    k_cache, v_cache, tables, ctx, heads, dim, g = _holed_case(window, bs)
    k_poisoned, v_poisoned = k_cache.clone(), v_cache.clone()
    k_poisoned[0], v_poisoned[0] = float("nan"), float("nan")
    scale = dim**-0.5
    # decode: one query at position ctx - 1 sees keys > ctx - 1 - window
    q = torch.randn(len(ctx), heads, dim, generator=g)
    want = kernels.paged_attention_decode(q, k_cache, v_cache, tables, ctx, scale, sliding_window=window,
                                          backend=backend)
    for hole in (HOLE, 0):  # an entry never filled in, and one pointing at a NaN block
        holed = _hole_out(tables, ctx, lambda c: c - window, bs, hole)
        got = kernels.paged_attention_decode(q, k_poisoned, v_poisoned, holed, ctx, scale, sliding_window=window,
                                             backend=backend)
        assert torch.equal(got, want), hole
    # prefill: the last n_q tokens of each sequence; the first of them reads back to pos - window + 1
    n_q = torch.tensor([5, 3], dtype=torch.int32)
    cu = torch.nn.functional.pad(n_q.cumsum(0, dtype=torch.int32), (1, 0))
    q = torch.randn(int(n_q.sum()), heads, dim, generator=g)
    want = kernels.paged_attention_prefill(q, k_cache, v_cache, tables, cu, ctx, scale, sliding_window=window,
                                           backend=backend)
    queries = dict(zip(ctx.tolist(), n_q.tolist()))
    for hole in (HOLE, 0):
        holed = _hole_out(tables, ctx, lambda c: c - queries[c] - window + 1, bs, hole)
        got = kernels.paged_attention_prefill(q, k_poisoned, v_poisoned, holed, cu, ctx, scale,
                                              sliding_window=window, backend=backend)
        assert torch.equal(got, want), hole
    # the control: a wider window reaches the NaN block, and the output shows it
    holed = _hole_out(tables, ctx, lambda c: c - window, bs, 0)
    got = kernels.paged_attention_decode(q[: len(ctx)], k_poisoned, v_poisoned, holed, ctx, scale,
                                         sliding_window=window + 2 * bs, backend=backend)
    assert torch.isnan(got).any()


# ---------------------------------------------------------------------- rollback (assisted decoding)


def test_crop_into_given_back_blocks_is_refused_unless_recording():
    model = build("mistral")  # window 12
    hf_paged.enable(model, block_size=4)
    ids, mask = left_padded([30])
    cache = hf_paged.PagedKVCache(model.config, block_size=4)
    model(input_ids=ids[:, :20], attention_mask=mask[:, :20], past_key_values=cache)
    model(input_ids=ids[:, 20:], attention_mask=mask, past_key_values=cache)  # gives back tokens < 9
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        cache.crop(-15)
    cache.reset()
    cache.activate_past_recording()
    model(input_ids=ids[:, :20], attention_mask=mask[:, :20], past_key_values=cache)
    model(input_ids=ids[:, 20:], attention_mask=mask, past_key_values=cache)
    cache.crop(-15)  # everything was kept: back to 15 tokens, then the window again
    assert cache.get_seq_length() == 15 and cache.manager.num_released(cache._rows[0]) == 1
    cache.reset()
    assert cache.blocks.num_used_blocks == 0


def test_assisted_decoding_with_an_enabled_sliding_assistant_equals_stock():
    stock = build("mistral")
    assistant_stock = build("mistral", seed=3)
    paged, assistant = copy.deepcopy(stock), copy.deepcopy(assistant_stock)
    hf_paged.enable(paged, block_size=4)
    hf_paged.enable(assistant, block_size=4)
    ids, mask = left_padded([26])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    plain = stock.generate(**kwargs)  # greedy assisted decoding gives the target's own greedy tokens
    got = paged.generate(**kwargs, assistant_model=assistant, cache_implementation="hf_paged")
    assert torch.equal(got, plain)
    try:
        want = stock.generate(**kwargs, assistant_model=assistant_stock)
    except RuntimeError:  # transformers 5.17 crops its sliding layers wrongly here (a size mismatch in SDPA);
        return  # the paged cache keeps every block it may crop back to, so it gives the right tokens
    assert torch.equal(got, want)


# ---------------------------------------------------------------------- the engine


def _engine_prompts(n: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 96, (shared,), generator=g).tolist()
    lengths = torch.randint(14, 70, (n,), generator=g).tolist()
    return [prefix + torch.randint(3, 96, (k,), generator=g).tolist() for k in lengths]


def _references(model, prompts, new_tokens):
    refs = []
    for p in prompts:
        out = model.generate(input_ids=torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                             output_logits=True, return_dict_in_generate=True)
        refs.append((out.sequences[0, len(p):].tolist(), [torch.log_softmax(x[0].float(), -1) for x in out.logits]))
    return refs


def _run_engine(engine, prompts, params):
    """Step the engine to the end; returns the outputs in prompt order and, per step, each layer
    group's blocks in use next to the blocks the same sequences would hold without giving any back."""
    ids = [engine.add_request(p, params) for p in prompts]
    done, trace = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        held = sum(engine.kv.blocks_for(s.num_computed_tokens) for r in engine.scheduler.running for s in r.live_seqs)
        trace.append(([g["blocks_used"] for g in engine.kv.stats()["groups"]], held))
    return [done[i] for i in ids], trace


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_engine_on_sliding_models_equals_generate_and_gives_blocks_back(arch, mode):
    from tests.test_engine import _check_no_leak, compare

    model = build(arch)
    prompts = _engine_prompts(10)
    refs = _references(model, prompts, 10)
    engine = hf_paged.LLMEngine(model, block_size=4, num_blocks=40, max_num_batched_tokens=48, preemption_mode=mode)
    params = hf_paged.SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    outputs, trace = _run_engine(engine, prompts, params)
    exact, ties = compare(outputs, refs)
    assert exact + len(ties) == len(prompts)
    assert engine.stats()[f"preemptions_{mode}"] >= 1
    sliding = [g for g, group in enumerate(engine.kv.groups) if group.is_sliding]
    assert sliding and any(used[sliding[0]] < held for used, held in trace), "no block was given back"
    _check_no_leak(engine)


def test_engine_prefix_cache_hits_through_sliding_groups():
    """A second request behind the same 40-token prefix adopts the full group's blocks and the
    sliding group's window blocks (the rest of its table are holes), and still equals generate()."""
    from tests.test_engine import _check_no_leak, compare

    model = build("gemma3")  # window 7
    first, second = _engine_prompts(2, seed=4, shared=40)
    engine = hf_paged.LLMEngine(model, block_size=4, num_blocks=256, max_num_batched_tokens=16)
    params = hf_paged.SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    engine.generate([first], params, use_tqdm=False)
    request_id = engine.add_request(second, params)
    engine.step()
    seq = engine.requests[request_id].seqs[0]
    sliding = next(g for g, group in enumerate(engine.kv.groups) if group.is_sliding)
    table = engine.kv.block_table(seq, sliding)
    hit = engine.kv.stats()["prefix_hit_tokens"]
    assert hit >= 36 and table[0] == HOLE and table[(hit - 1) // 4] != HOLE
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    exact, ties = compare(outputs, _references(model, [second], 6))
    assert exact + len(ties) == 1
    _check_no_leak(engine)


def test_split_budget_caps_sliding_groups_and_gives_the_rest_to_full_layers():
    from hf_paged.layer_groups import split_budget

    assert split_budget(1000, [10, 10], [None, None]) == [50, 50]
    assert split_budget(1000, [10, 10], [None, 20]) == [80, 20]  # the sliding group can use 20 at most
    assert split_budget(1000, [10, 10], [None, 90]) == [50, 50]  # a cap above the share changes nothing
    assert split_budget(1000, [10, 50], [12, 12]) == [16, 16]  # all sliding: no caps


def test_engine_budget_from_bytes_sizes_sliding_pools_by_what_they_can_hold():
    model = build("gemma3")  # 2 sliding layers (window 7) and 1 full
    per_layer = hf_paged.model_info.kv_bytes_per_token(model.config, torch.float32, [0]) * 4
    budget = 3 * per_layer * 400  # 400 blocks per layer if split evenly
    engine = hf_paged.LLMEngine(model, block_size=4, kv_cache_bytes=budget, max_num_seqs=4, max_num_batched_tokens=16)
    full, sliding = engine.kv.pool_sizes
    assert sliding == 4 * (2 + 2) + 4 and full == (budget - 2 * sliding * per_layer) // per_layer
    assert full > 400 and full * per_layer + 2 * sliding * per_layer <= budget
    prompts = _engine_prompts(6, seed=2)
    from tests.test_engine import _check_no_leak, compare

    params = hf_paged.SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    exact, ties = compare(engine.generate(prompts, params, use_tqdm=False), _references(model, prompts, 8))
    assert exact + len(ties) == len(prompts)
    _check_no_leak(engine)


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_engine_beam_search_through_sliding_groups_equals_transformers(arch):
    from tests.test_engine import _check_no_leak

    model = build(arch)
    prompts = _engine_prompts(3, seed=5)
    engine = hf_paged.LLMEngine(model, block_size=4, num_blocks=512, max_num_batched_tokens=32)
    params = hf_paged.SamplingParams(max_new_tokens=12, num_beams=4, n=2, ignore_eos=True)
    outputs = engine.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        ref = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=12, num_beams=4, num_return_sequences=2,
                             do_sample=False, eos_token_id=None)
        assert [c.token_ids for c in out.outputs] == [row[len(prompt):].tolist() for row in ref]
    _check_no_leak(engine)


def test_a_model_whose_layers_all_slide_serves_prompts_longer_than_its_pool():
    """Mistral's layers all slide (window 12): computing 8 tokens a step, a sequence holds at most
    the window's blocks and a chunk's (6 of 4 tokens), so a pool of 6 serves prompts of 40-60
    tokens and 20 more, one at a time, as stock generates them; the server is told no length
    bound comes from the cache. With 5 blocks the prompts are refused as exceeding the cache.
    (Before, every prompt longer than the pool was refused, 6 blocks or 600 tokens of window.)"""
    from hf_paged.serve.engine_process import EngineFacts
    from tests.test_engine import _check_no_leak, compare

    model = build("mistral")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (40, 50, 60)]
    params = hf_paged.SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
    engine = hf_paged.LLMEngine(model, block_size=4, num_blocks=6, max_num_batched_tokens=8)
    exact, ties = compare(engine.generate(prompts, params, use_tqdm=False), _references(model, prompts, 20))
    assert exact + len(ties) == len(prompts) and EngineFacts.of(engine).kv_tokens is None
    _check_no_leak(engine)
    small = hf_paged.LLMEngine(model, block_size=4, num_blocks=5, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="exceeds the whole KV cache"):
        small.add_request(prompts[0], params)
    assert EngineFacts.of(small).kv_tokens == 20
    mixed = hf_paged.LLMEngine(build("gemma3"), block_size=4, num_blocks=6, max_num_batched_tokens=8)
    assert EngineFacts.of(mixed).kv_tokens == 24  # a full group: every token's block
