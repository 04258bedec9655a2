"""PagedKVCache and the adapter: memory, sharing, direct use, fallbacks, options and errors."""

from __future__ import annotations

import copy
import gc
import mmap
import os
import weakref

import pytest
import torch
import transformers
from transformers import DynamicCache

import hf_paged
from hf_paged import NoFreeBlocksError, PagedKVCache
from hf_paged.model_info import cache_kwarg
from hf_paged import storage as storage_module
from hf_paged.storage import PagedKVStorage, zero_pages
from tests.helpers.tiny_models import UNSUPPORTED, build, left_padded

STAT_KEYS = {
    "block_size", "blocks_total", "blocks_used", "blocks_shared", "tokens_stored", "slots_allocated",
    "utilization", "bytes_used", "bytes_contiguous_equivalent", "blocks_peak",
}


@pytest.fixture(scope="module")
def llama():
    return build("llama")


@pytest.fixture
def paged(llama):
    model = hf_paged.enable(llama, block_size=16)
    yield model
    hf_paged.disable(model)


def _cache(out) -> PagedKVCache:
    return getattr(out, "cache", None) or out.past_key_values


def _release(cache: PagedKVCache) -> None:
    cache.manager.check_invariants()
    cache.reset()
    assert cache.manager.num_used_blocks == 0


# ---------------------------------------------------------------------------- memory
def test_beam_search_uses_at_most_half_of_contiguous_memory(paged):
    ids, mask = left_padded([128])
    out = paged.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=64, min_new_tokens=64, num_beams=4, do_sample=False,
        cache_implementation="hf_paged", return_dict_in_generate=True,
    )
    assert out.sequences.shape[1] == 128 + 64
    cache = _cache(out)
    stats = cache.stats()
    assert STAT_KEYS <= set(stats)
    # DynamicCache would hold 4 beams x 191 columns (the last token is never fed back).
    per_token = cache.storage.bytes_per_token()
    assert stats["bytes_contiguous_equivalent"] == 4 * 191 * per_token
    assert stats["bytes_used"] <= 0.5 * stats["bytes_contiguous_equivalent"]
    assert stats["blocks_peak"] * 16 * per_token <= 0.5 * stats["bytes_contiguous_equivalent"]
    assert stats["blocks_shared"] > 0
    _release(cache)


def test_parallel_sampling_stores_the_prompt_once(paged):
    prompt, n, new, bs = 100, 4, 10, 16
    ids, mask = left_padded([prompt])
    torch.manual_seed(0)
    out = paged.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=True,
        num_return_sequences=n, cache_implementation="hf_paged", return_dict_in_generate=True,
    )
    cache = _cache(out)
    tables = cache.block_tables().tolist()
    full_prompt_blocks = (prompt - 1) // bs  # the shared prefill covers all but the last prompt token
    assert all(t[:full_prompt_blocks] == tables[0][:full_prompt_blocks] for t in tables)
    assert all(cache.manager.ref_count(b) == n for b in tables[0][:full_prompt_blocks])
    stats = cache.stats()
    # Physically stored: the prompt's full blocks once; per sample its copy of the partial
    # block, its own last prompt token and the generated tokens fed back (new - 1).
    assert stats["tokens_stored"] == full_prompt_blocks * bs + n * ((prompt - 1) % bs + 1 + new - 1)
    assert stats["tokens_logical"] == n * (prompt + new - 1)
    _release(cache)


def test_shared_prompt_prefill_computes_each_prompt_once(paged, monkeypatch):
    """The prompt tokens go through the model once per distinct prompt, not once per copy."""
    seen = []
    original = PagedKVCache.commit

    def spy(self, layer_idx, key, value, new_valid):
        if layer_idx == 0:
            seen.append(key.shape[0] * key.shape[2])
        return original(self, layer_idx, key, value, new_valid)

    monkeypatch.setattr(PagedKVCache, "commit", spy)
    ids, mask = left_padded([50, 30])
    paged.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, num_beams=3, num_return_sequences=3,
                   do_sample=False, cache_implementation="hf_paged")
    assert seen[0] == 2 * 50  # two distinct prompts, each once (not once per copy)
    assert seen[1] == 6 * 1  # then the first new token of each of the 2 x 3 copies


def test_utilization_of_a_mixed_batch_of_32(paged):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(120, 300, (32,), generator=g).tolist()
    ids, mask = left_padded(lengths)
    out = paged.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                         cache_implementation="hf_paged", return_dict_in_generate=True)
    stats = _cache(out).stats()
    assert stats["tokens_stored"] == sum(lengths) + 32 * 7  # pads are not stored
    assert stats["utilization"] >= 0.95
    assert stats["bytes_used"] < stats["bytes_contiguous_equivalent"]
    _release(_cache(out))


# ---------------------------------------------------------------------------- direct use
@pytest.mark.parametrize("name", ["past_key_values", "cache"])
def test_cache_passed_directly(paged, name):
    if name == "cache" and cache_kwarg(paged) != "cache":
        pytest.skip("this transformers' generate takes the cache as past_key_values only (as stock does)")
    ids, mask = left_padded([7, 23, 18])
    hf_paged.disable(paged)
    stock = paged.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, num_beams=3, do_sample=False)
    hf_paged.enable(paged)
    cache = PagedKVCache(paged.config, block_size=8)
    out = paged.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, num_beams=3, do_sample=False,
                         **{name: cache})
    assert torch.equal(stock, out)
    assert cache.stats()["tokens_stored"] > 0 and cache.stats()["block_size"] == 8
    _release(cache)


def test_reorder_cache_moves_references_and_copies_nothing(paged, monkeypatch):
    ids, mask = left_padded([20, 9])
    cache = PagedKVCache(paged.config, block_size=4)
    paged(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    copies = []
    monkeypatch.setattr(PagedKVStorage, "copy_blocks", lambda self, pairs: copies.append(pairs))
    before = [cache.manager.block_table(s) for s in cache._rows]
    cache.reorder_cache(torch.tensor([1, 1]))
    after = [cache.manager.block_table(s) for s in cache._rows]
    assert after[0] == after[1] == before[1]
    assert all(cache.manager.ref_count(b) == 2 for b in before[1])
    assert all(cache.manager.ref_count(b) == 0 for b in before[0])  # row 0's blocks were freed
    assert copies == []
    _release(cache)


def _decode_reads(paged, monkeypatch, lengths, **options):
    """Generate on the reference route, recording the K each decode-step layer read returned."""
    reads = []
    original = PagedKVCache.dense_kv

    def recording(self, layer, q_len):
        keys, values = original(self, layer, q_len)
        if q_len == 1:
            reads.append(keys)
        return keys, values

    monkeypatch.setattr(PagedKVCache, "dense_kv", recording)
    ids, mask = left_padded(lengths)
    hf_paged.disable(paged)
    stock = paged.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, **options)
    hf_paged.enable(paged, block_size=16)
    out = paged.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12,
                         cache_implementation="hf_paged", return_dict_in_generate=True, **options)
    assert torch.equal(stock, out.sequences)
    return _cache(out), reads


def test_a_single_row_is_read_in_place_head_by_head(paged, monkeypatch):
    cache, reads = _decode_reads(paged, monkeypatch, [40], do_sample=False)
    assert cache.storage.heads_major and len(reads) == 11 * paged.config.num_hidden_layers
    pool = cache.storage.key_pools[0]
    assert pool.stride(2) > pool.stride(0)  # memory [heads, slots, head_dim]
    pools = {p.untyped_storage().data_ptr() for p in cache.storage.key_pools.values()}
    for keys in reads:  # a view of the pool, each head's keys one after another (DynamicCache's layout)
        assert keys.untyped_storage().data_ptr() in pools
        assert keys.stride(-2) == keys.shape[-1] and keys.stride(-1) == 1
    _release(cache)


def test_a_batch_reads_into_one_buffer_for_every_layer_and_step(paged, monkeypatch):
    cache, reads = _decode_reads(paged, monkeypatch, [40, 17, 29], do_sample=False)
    assert not cache.storage.heads_major  # gathering many rows is faster from the block layout
    buffers = [keys.untyped_storage().data_ptr() for keys in reads]
    layers = paged.config.num_hidden_layers
    assert len(set(buffers[:layers])) == 1  # every layer of a step reads into the same buffer
    assert len(set(buffers)) == 2  # and so does every step: it grew (doubling) once in 11 steps
    _release(cache)
    beams, _ = _decode_reads(paged, monkeypatch, [40], num_beams=2, do_sample=False)
    assert not beams.storage.heads_major  # one prompt row, but its beams are two
    _release(beams)


def test_crop_for_assisted_decoding(paged, monkeypatch):
    crops = []
    original = PagedKVCache.crop
    monkeypatch.setattr(PagedKVCache, "crop", lambda self, n: (crops.append(n), original(self, n))[1])
    assistant = build("llama", seed=1)
    ids, mask = left_padded([30])
    hf_paged.disable(paged)
    stock = paged.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                           assistant_model=assistant)
    hf_paged.enable(paged, block_size=4)
    out = paged.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                         assistant_model=assistant, cache_implementation="hf_paged", return_dict_in_generate=True)
    assert torch.equal(stock, out.sequences)
    assert any(n < 0 for n in crops), "assisted decoding never rejected a draft token"
    cache = _cache(out)
    assert cache.stats()["tokens_stored"] == cache.get_seq_length()
    _release(cache)


def test_crop_truncates_blocks(paged):
    ids, mask = left_padded([10, 4])
    cache = PagedKVCache(paged.config, block_size=4)
    paged(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    assert [cache.manager.seq_len(s) for s in cache._rows] == [10, 4]
    cache.crop(-7)  # 3 columns left: row 1 had pads there
    assert cache.get_seq_length() == 3
    assert [cache.manager.seq_len(s) for s in cache._rows] == [3, 0]
    assert cache.manager.num_used_blocks == 1
    _release(cache)


# ---------------------------------------------------------------------------- fallbacks
def test_enabled_model_still_runs_plain_forward_and_training(llama):
    reference = build("llama")
    ids, mask = left_padded([12, 20])
    hf_paged.enable(llama)
    try:
        for model in (llama, reference):
            model.train()
            model.zero_grad()
            out = model(input_ids=ids, attention_mask=mask, labels=ids)
            out.loss.backward()
            model.eval()
        assert llama.config._attn_implementation == "sdpa"  # paged-ness belongs to paged forwards only
        assert torch.equal(llama(input_ids=ids, attention_mask=mask).logits,
                           reference(input_ids=ids, attention_mask=mask).logits)
        for (name, p), q in zip(llama.named_parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad), name
        stock = reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        for kwargs in ({}, {"past_key_values": DynamicCache(config=llama.config)}):
            assert torch.equal(llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8,
                                              do_sample=False, **kwargs), stock)
    finally:
        hf_paged.disable(llama)
        llama.zero_grad(set_to_none=True)


def test_enable_again_changes_options_and_disable_restores(llama):
    ids, mask = left_padded([20])
    for block_size in (8, 32):
        hf_paged.enable(llama, block_size=block_size, num_blocks=64)
        out = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                             cache_implementation="hf_paged", return_dict_in_generate=True)
        stats = _cache(out).stats()
        assert stats["block_size"] == block_size and stats["blocks_total"] == 64
    hf_paged.disable(llama)
    assert llama.config._attn_implementation == "sdpa" and "generate" not in llama.__dict__


def test_pools_follow_the_layer_dtype(llama):
    model = build("llama").to(torch.float64)
    hf_paged.enable(model)
    ids, mask = left_padded([9])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                         cache_implementation="hf_paged", return_dict_in_generate=True)
    pools = _cache(out).storage.key_pools
    assert len(pools) == model.config.num_hidden_layers
    assert all(p.dtype == torch.float64 and p.shape[1:] == (16, 2, 16) for p in pools.values())


def resident_mib() -> float:
    """This process's resident memory (skips the test where /proc/self/statm cannot tell)."""
    if not os.path.exists("/proc/self/statm"):
        pytest.skip("no /proc/self/statm to read resident memory from")
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.parametrize("heads_major", [False, True], ids=["block-major", "heads-major"])
def test_cpu_pools_are_zero_and_cost_memory_only_where_written(heads_major):
    """A CPU pool reads as zeros, takes writes, grows keeping its blocks, and allocating a 256 MiB
    pool makes almost none of it resident (negative control: writing a fresh pool of that size
    makes it all resident, so the measure sees it; ``torch.zeros`` is no control: in a process
    whose allocator kept freed memory it may take pages already resident)."""
    storage = PagedKVStorage(block_size=16)
    storage.heads_major = heads_major
    before = resident_mib()
    storage.ensure_layer(0, torch.empty(1, 4, 64), num_blocks=16384)  # 16,384 blocks x 16 x 4 x 64 floats = 256 MiB
    allocated = resident_mib() - before
    k_pool = storage.key_pools[0]
    assert k_pool.shape == (16384, 16, 4, 64) and k_pool.nbytes == 256 << 20
    assert allocated < 32, f"allocating two 256 MiB pools made {allocated:.0f} MiB resident"
    before = resident_mib()
    written = zero_pages((16384, 16, 4, 64), torch.float32).fill_(0.0)
    assert resident_mib() - before > 200, "writing a fresh 256 MiB pool left it unresident: the check could not fail"
    del written
    key, value = torch.randn(3, 4, 64), torch.randn(3, 4, 64)
    storage.write(0, key, value, torch.tensor([0, 17, 262143]))
    k_rows, v_rows = storage.slot_rows(0)
    assert torch.equal(k_rows[[0, 17, 262143]], key) and torch.equal(v_rows[[0, 17, 262143]], value)
    assert not k_rows[1:17].any() and not v_rows[18:262143].any()
    storage.grow(16400)
    k_rows, v_rows = storage.slot_rows(0)
    assert storage.num_blocks(0) == 16400 and torch.equal(k_rows[[0, 17, 262143]], key)
    assert not k_rows[262144:].any() and not v_rows[262144:].any()



@pytest.mark.parametrize("reserve", [True, False], ids=["reserved", "negative-control-no-room"])
def test_a_growing_cpu_pool_grows_in_place_copying_nothing(reserve, monkeypatch):
    """A CPU pool reserves address space to grow into: growing it keeps its memory (the same data
    pointer, nothing more made resident though 64 MiB of it were written), its blocks, and zeros
    past them; a deep copy of the storage has pools of its own, copies of the pools, not of the room
    they reserved, with room of their own. Negative control: no room (``RESERVE_BYTES`` 0): the
    pool grows by copying, which these checks see (a new pointer, the written blocks resident
    twice), keeping its blocks."""
    if not reserve:
        monkeypatch.setattr(storage_module, "RESERVE_BYTES", 0)
    storage = PagedKVStorage(block_size=16)
    storage.ensure_layer(0, torch.empty(1, 4, 64), num_blocks=8192)  # 8,192 blocks x 16 x 4 x 64 floats = 128 MiB
    if reserve and storage.key_pools[0].untyped_storage().nbytes() == storage.key_pools[0].nbytes:
        pytest.skip("this system refuses address-space reservations (strict overcommit or an address-space limit)")
    written = torch.arange(4096 * 16)  # the first 64 MiB of each pool
    storage.write(0, torch.ones(len(written), 4, 64), torch.full((len(written), 4, 64), 2.0), written)
    pointers, before = [storage.key_pools[0].data_ptr(), storage.value_pools[0].data_ptr()], resident_mib()
    storage.grow(16384)
    grown = resident_mib() - before
    k_pool, v_pool = storage.key_pools[0], storage.value_pools[0]
    assert k_pool.shape == v_pool.shape == (16384, 16, 4, 64)
    assert bool((k_pool[:4096] == 1).all()) and bool((v_pool[:4096] == 2).all())
    assert not k_pool[4096:].any() and not v_pool[4096:].any()
    if reserve:
        assert [k_pool.data_ptr(), v_pool.data_ptr()] == pointers, "the pools moved"
        assert grown < 16, f"growing made {grown:.0f} MiB resident"
    else:
        assert k_pool.data_ptr() not in pointers and grown > 100, f"a copying growth made only {grown:.0f} MiB resident"
    before = resident_mib()
    clone = copy.deepcopy(storage)  # copies the pools (2 x 256 MiB), not the room they reserved (GiBs each)
    assert resident_mib() - before < 640 and clone.key_pools[0].data_ptr() != k_pool.data_ptr()
    assert torch.equal(clone.value_pools[0], v_pool)
    clone_pointer = clone.key_pools[0].data_ptr()
    clone.grow(20000)
    assert clone.num_blocks(0) == 20000 and storage.num_blocks(0) == 16384
    assert (clone.key_pools[0].data_ptr() == clone_pointer) == reserve


def test_a_pool_the_system_refuses_room_to_is_sized_exactly_and_grows_by_copying(monkeypatch):
    """Where ``mmap`` refuses the reservation (strict overcommit, an address-space limit), a pool
    is the size asked and grows by copying, keeping its blocks."""
    real = mmap.mmap

    def refusing(fileno, length, *args, **kwargs):
        if "flags" in kwargs:
            raise OSError(12, "Cannot allocate memory")
        return real(fileno, length, *args, **kwargs)

    monkeypatch.setattr(mmap, "mmap", refusing)
    storage = PagedKVStorage(block_size=4)
    storage.ensure_layer(0, torch.empty(1, 2, 8), num_blocks=4)
    k_pool = storage.key_pools[0]
    assert k_pool.untyped_storage().nbytes() == k_pool.nbytes
    storage.write(0, torch.ones(1, 2, 8), torch.ones(1, 2, 8), torch.tensor([15]))
    storage.grow(8)
    assert storage.key_pools[0].data_ptr() != k_pool.data_ptr() and storage.slot_rows(0)[0][15].sum() == 16

# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize("arch", list(UNSUPPORTED))
def test_inline_attention_models_page_on_the_reference_route_and_the_engine_refuses_them_by_name(arch):
    model = build(arch, table=UNSUPPORTED)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    ids, mask = left_padded([3, 9])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    want = model.generate(**kwargs)
    hf_paged.enable(model, block_size=4)
    try:
        assert torch.equal(model.generate(**kwargs, cache_implementation="hf_paged"), want)
    finally:
        hf_paged.disable(model)
    with pytest.raises(ValueError, match=f"{type(model).__name__}.*inline"):
        hf_paged.LLMEngine(model, block_size=4)
    with pytest.raises(NotImplementedError, match="BartForCausalLM.*cross-attention"):
        hf_paged.enable(transformers.BartForCausalLM(transformers.BartConfig(
            vocab_size=96, d_model=32, decoder_layers=1, encoder_layers=1, decoder_attention_heads=2,
            encoder_attention_heads=2, decoder_ffn_dim=32, encoder_ffn_dim=32, add_cross_attention=True)))


def test_non_paged_cache_with_the_flag_is_refused(paged):
    ids, mask = left_padded([5])
    with pytest.raises(ValueError, match="DynamicCache"):
        paged.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, cache_implementation="hf_paged",
                       past_key_values=DynamicCache(config=paged.config))


def test_paged_cache_without_enable_is_refused(llama):
    ids, mask = left_padded([5])
    with pytest.raises(RuntimeError, match="hf_paged.enable"):
        llama(input_ids=ids, attention_mask=mask, past_key_values=PagedKVCache(llama.config), use_cache=True)
    with pytest.raises(TypeError, match="config"):
        PagedKVCache(None)


def test_exhausted_budget_raises_and_the_model_keeps_serving(paged):
    hf_paged.enable(paged, block_size=4, num_blocks=6)
    ids, mask = left_padded([16, 7])
    with pytest.raises(NoFreeBlocksError, match="out of KV cache blocks"):
        paged.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, cache_implementation="hf_paged")
    small_ids, small_mask = left_padded([6])
    out = paged.generate(input_ids=small_ids, attention_mask=small_mask, max_new_tokens=4, do_sample=False,
                         cache_implementation="hf_paged", return_dict_in_generate=True)
    hf_paged.disable(paged)
    assert torch.equal(out.sequences, paged.generate(input_ids=small_ids, attention_mask=small_mask,
                                                     max_new_tokens=4, do_sample=False))
    _release(_cache(out))


def test_enable_leaves_no_trace_in_a_saved_config(paged, tmp_path):
    paged.config.save_pretrained(tmp_path)
    text = (tmp_path / "config.json").read_text()
    assert "paged" not in text


def test_flagged_generate_frees_its_blocks_when_the_cache_is_not_returned(paged, monkeypatch):
    created = []
    original = PagedKVCache.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        created.append((weakref.ref(self), weakref.ref(self.storage), self.manager))

    monkeypatch.setattr(PagedKVCache, "__init__", spy)
    ids, mask = left_padded([20, 9])
    gc.disable()  # freed by reference counting the moment generate returns, not by a later collection
    try:
        paged.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, num_beams=2,
                       cache_implementation="hf_paged")
        assert len(created) == 1
        cache, storage, manager = created[0]
        assert cache() is None and storage() is None  # the cache and its K/V pools are gone
    finally:
        gc.enable()
    assert manager.blocks_peak > 0  # it did hold blocks while generating
