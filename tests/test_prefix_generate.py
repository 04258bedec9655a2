"""Prefix caching inside generate(): hits, misses and partial hits equal stock, shared prefixes are
computed once, eviction under a budget, snapshots across processes and with the engine."""

from __future__ import annotations

import copy
import gc
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hf_paged
from hf_paged import LLMEngine, SamplingParams, SnapshotError
from hf_paged.bench.prefix_generate import left_padded_batch as batch  # pads with id 0 = PAD
from hf_paged.model_info import cache_kwarg
from hf_paged.prefix_index import PrefixIndex
from tests.helpers.tiny_models import ARCHITECTURES, PAD, VOCAB, build

BS = 8
MODES = {
    "greedy": dict(do_sample=False),
    "beams": dict(num_beams=3, do_sample=False),
    "sampling": dict(do_sample=True, num_return_sequences=2),
}


class Counted:
    """Real (non-pad) tokens at the model's input, per forward: a hook on the input embeddings."""

    def __init__(self, model):
        self.forwards: list[int] = []
        model.get_input_embeddings().register_forward_pre_hook(
            lambda module, args: self.forwards.append(int((args[0] != PAD).sum())))

    def take(self) -> list[int]:
        out, self.forwards = self.forwards, []
        return out


def pair(arch: str, **options):
    stock = build(arch)
    model = hf_paged.enable(copy.deepcopy(stock), block_size=BS, prefix_caching=True, **options)
    return stock, model


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def both(stock, model, rows, mode="greedy", new=6, **extra):
    """(stock sequences, flagged sequences, the flagged call's output) for one seeded call."""
    ids, mask = batch(rows)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, **MODES[mode], **extra)
    torch.manual_seed(0)
    want = stock.generate(**kwargs)
    torch.manual_seed(0)
    got = model.generate(**kwargs, cache_implementation="hf_paged", return_dict_in_generate=True)
    return want, got.sequences, got


def check_books(model) -> None:
    """Every block is free or cached, and the books agree, as soon as the calls' outputs are dropped:
    no garbage collection runs first, so a cache that gave its blocks back only when collected fails."""
    cache = hf_paged.prefix_cache(model)
    cache.check_invariants()
    assert cache.stats()["blocks_used"] == 0, cache.stats()


# ---------------------------------------------------------------------- exactness: hit, miss, partial hit
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_hits_misses_and_partial_hits_equal_stock(arch):
    stock, model = pair(arch, num_blocks=64)  # room for everything: no evictions
    counted = Counted(model)
    prefix, other = tokens(40, 1), tokens(40, 2)
    calls = [  # (rows, expected cached tokens of the call's longest row)
        ([prefix + tokens(5, 3), prefix + tokens(9, 4)], 0),  # miss (the shared prefix is computed once)
        ([prefix + tokens(7, 5), prefix + tokens(3, 6)], 40),  # hit: the whole prefix
        ([prefix[:24] + other[:20], prefix[:24] + tokens(9, 8)], 24),  # partial hit: 3 of the 5 blocks
        ([other + tokens(6, 7)], 0),  # miss
    ]
    for mode in MODES:
        hf_paged.prefix_cache(model).clear()
        for rows, cached in calls:
            want, got, out = both(stock, model, rows, mode)
            assert torch.equal(want, got), (arch, mode, rows)
            first = counted.take()[0 if cached else slice(None)]
            if cached:  # the longest row has no padding: every row starts computing at that column
                width = max(map(len, rows))
                assert first == len(rows) * (width - cached), (arch, mode, first)
                adopted = sum(cached - (width - len(r)) for r in rows)  # a padded row adopts up to that column
                assert out.past_key_values.stats()["prefix_hit_tokens"] == adopted
            del out
        check_books(model)
    assert hf_paged.prefix_cache(model).stats()["hit_tokens"] > 0


def test_negative_control_the_equality_check_sees_a_wrong_adoption(monkeypatch):
    """Keys that forget the tokens (every block after the same parent collides): a hit adopts
    another prompt's blocks, and the comparison with stock catches it."""
    stock, model = pair("llama")
    monkeypatch.setattr(PrefixIndex, "keys_of", _keys_without_tokens)
    both(stock, model, [tokens(40, 1) + tokens(4, 2)])
    want, got = both(stock, model, [tokens(40, 9) + tokens(4, 2)])[:2]
    assert not torch.equal(want, got)


def _keys_without_tokens(self, token_ids, count, start=0, parent=None, root=None):
    keys = []
    parent = root if start == 0 and parent is None else parent
    for _ in range(start, start + count):
        parent = (hash(parent), len(keys))
        keys.append(parent)
    return keys


class _Colliding(tuple):
    """A key whose hash is the same for every key: only the comparison of tokens tells keys apart."""

    def __hash__(self):
        return 7


def test_forced_hash_collisions_never_adopt_blocks_of_other_tokens(monkeypatch):
    stock, model = pair("llama")
    original = PrefixIndex.keys_of
    monkeypatch.setattr(PrefixIndex, "keys_of", lambda self, *a, **k: [_Colliding(key) for key in original(self, *a, **k)])
    counted = Counted(model)
    for seed in (1, 9, 1):  # the third call hits the first one's blocks, the second one hits nothing
        want, got = both(stock, model, [tokens(40, seed) + tokens(4, 2)])[:2]
        assert torch.equal(want, got)
    assert counted.forwards[0:1] == [44] and counted.forwards[6:7] == [44] and counted.forwards[12:13] == [4]
    check_books(model)


# ---------------------------------------------------------------------- one batch: shared prefix computed once
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_rows_of_one_batch_compute_their_shared_prefix_once(arch):
    """The shared 48 tokens are computed once, in a forward of their own. Then every row computes
    from the first column after them in the unpadded row: with equal lengths only the suffixes;
    left padding makes a shorter row recompute as many prefix tokens as it has pads (the forward's
    columns are the same for all rows)."""
    stock, model = pair(arch)
    counted = Counted(model)
    prefix = tokens(48, 1)
    equal = [prefix + tokens(5, 10 + n) for n in range(4)]
    padded = [prefix + tokens(n, 10 + n) for n in (3, 11, 6, 8)]
    width = max(map(len, padded))
    for mode in MODES:
        for rows, main in ((equal, 4 * 5), (padded, 4 * (width - 48))):
            hf_paged.prefix_cache(model).clear()
            want, got, out = both(stock, model, rows, mode)
            assert torch.equal(want, got), mode
            prefill = counted.take()[:2]
            assert prefill == [48, main], (mode, prefill)
            del out
    check_books(model)


def test_a_prefix_shared_by_too_few_tokens_is_not_computed_apart():
    """The extra forward must save more than it costs: two rows sharing one block next to a long
    unshared row gain nothing (the long row starts at column 0 anyway)."""
    stock, model = pair("llama")
    counted = Counted(model)
    shared = tokens(8, 1)
    rows = [shared + tokens(30, 2), shared + tokens(3, 3), tokens(40, 4)]
    want, got = both(stock, model, rows)[:2]
    assert torch.equal(want, got)
    assert counted.take()[0] == sum(map(len, rows))  # one prefill forward, everything computed


# ---------------------------------------------------------------------- budget: LRU eviction, no leaks
def test_lru_eviction_under_a_fixed_budget_keeps_recent_prefixes_and_held_blocks():
    stock, model = pair("llama", num_blocks=24)
    counted = Counted(model)
    a, b, c = (tokens(40, s) for s in (1, 2, 3))  # 5 blocks each
    for prefix in (a, b):
        both(stock, model, [prefix + tokens(3, 4)])
    held = both(stock, model, [c + tokens(3, 5)])[2]  # keeps its blocks (7) while the next calls run
    stats = hf_paged.prefix_cache(model).stats()
    assert stats["cached_blocks"] >= 15 and stats["evictions"] == 0, stats
    counted.take()
    want, got = both(stock, model, [tokens(40, 6) + tokens(50, 7)])[:2]  # needs 12 blocks + 2 while 7 are held
    assert torch.equal(want, got)
    assert hf_paged.prefix_cache(model).stats()["evictions"] > 0
    counted.take()
    for prefix, expected in ((b, 3), (a, 43)):  # a (oldest) was evicted, b was not
        want, got = both(stock, model, [prefix + tokens(3, 4)])[:2]
        assert torch.equal(want, got)
        assert counted.take()[0] == expected, prefix is a
    # the held cache's blocks were never evicted: continuing from it equals stock continuing
    ids = held.sequences
    cont = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                          **{cache_kwarg(model): held.past_key_values})
    assert torch.equal(cont, stock.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                            do_sample=False))
    del held
    check_books(model)


def test_a_call_never_fails_for_blocks_eviction_can_free():
    stock, model = pair("llama", num_blocks=12)
    for seed in range(6):  # each call needs 8 of the 12 blocks; earlier calls' blocks are all cached
        want, got = both(stock, model, [tokens(50, seed) + tokens(5, 99)], new=8)[:2]
        assert torch.equal(want, got)
    check_books(model)
    assert hf_paged.prefix_cache(model).stats()["evictions"] >= 20


def test_stats_clear_and_options():
    stock, model = pair("llama")
    rows = [tokens(40, 1) + tokens(3, 2)]
    both(stock, model, rows)
    both(stock, model, rows)
    stats = hf_paged.prefix_cache(model).stats()
    assert stats["queried_tokens"] == 86 and stats["hit_tokens"] == 40 and stats["cached_blocks"] >= 5
    assert hf_paged.prefix_cache(model).clear() >= 5
    assert hf_paged.prefix_cache(model).stats()["cached_blocks"] == 0
    counted = Counted(model)
    both(stock, model, rows)
    assert counted.forwards[0] == 43  # cleared: computed again
    hf_paged.enable(model, block_size=BS)  # prefix caching off
    with pytest.raises(ValueError, match="prefix_caching=True"):
        hf_paged.prefix_cache(model)
    with pytest.raises(ValueError, match="prefix_caching"):
        hf_paged.enable(model, prefix_caching="yes")


def _scale_weights(model, factor: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(factor)  # in place, as an optimizer step


@pytest.mark.parametrize("change", ["load_state_dict", "in place", "to float64", "deepcopy, then in place"])
def test_cached_k_v_of_other_weights_are_never_reused(change):
    """Once the weights change the cached K/V are stale: the next call starts an empty pool (it once
    adopted them and gave other tokens from the first one; after ``.to(float64)`` it crashed)."""
    stock, model = pair("llama", num_blocks=64)
    rows = [tokens(40, 1) + tokens(5, 2)]
    both(stock, model, rows)
    if change == "load_state_dict":
        new_weights = build("llama", seed=7).state_dict()
        stock.load_state_dict(new_weights)
        model.load_state_dict(new_weights)
    elif change == "in place":
        _scale_weights(stock, 1.5)
        _scale_weights(model, 1.5)
    elif change == "to float64":
        stock.to(torch.float64)
        model.to(torch.float64)
    else:
        model = copy.deepcopy(model)
        _scale_weights(stock, 1.5)
        _scale_weights(model, 1.5)
    counted = Counted(model)
    want, got, out = both(stock, model, rows)
    assert torch.equal(want, got) and out.past_key_values.stats()["prefix_hit_tokens"] == 0
    assert counted.take()[0] == 45  # computed whole
    del out
    want, got, out = both(stock, model, rows)  # the new weights' K/V are cached as usual
    assert torch.equal(want, got) and out.past_key_values.stats()["prefix_hit_tokens"] == 40
    del out
    check_books(model)


def test_running_out_because_kept_outputs_hold_blocks_says_so():
    """Every call of a prefix-caching model shares one pool: outputs kept with their caches hold
    blocks, and the error names that (it read as if the budget were simply too small)."""
    stock, model = pair("llama", num_blocks=16)
    kept = []
    with pytest.raises(hf_paged.NoFreeBlocksError, match=r"other live cache\(s\) of this model's pool hold blocks"):
        for seed in range(20):
            kept.append(both(stock, model, [tokens(30, seed)])[2])
    assert len(kept) >= 3
    kept.clear()
    gc.collect()
    want, got, out = both(stock, model, [tokens(30, 99)])  # the same call fits once they are gone
    assert torch.equal(want, got)
    del out
    check_books(model)


def test_outputs_that_cover_every_position_compute_every_position():
    stock, model = pair("llama")
    rows = [tokens(40, 1) + tokens(3, 2)]
    both(stock, model, rows)
    ids, mask = batch(rows)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, output_hidden_states=True,
                  return_dict_in_generate=True)
    want = stock.generate(**kwargs)
    got = model.generate(**kwargs, cache_implementation="hf_paged")
    assert torch.equal(want.sequences, got.sequences)
    assert [h.shape for h in got.hidden_states[0]] == [h.shape for h in want.hidden_states[0]]
    assert all(torch.equal(x, y) for x, y in zip(want.hidden_states[0], got.hidden_states[0]))


# ---------------------------------------------------------------------- property: random call sequences
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5), st.lists(st.integers(1, 12), min_size=1, max_size=3),
                          st.sampled_from(list(MODES))), min_size=2, max_size=5))
def test_random_call_sequences_keep_the_books_and_equal_stock(calls):
    """Calls drawn from three prefixes (cut at random block counts) and random suffixes, under a
    budget small enough to evict."""
    stock, model = _property_pair()
    hf_paged.prefix_cache(model).clear()
    prefixes = [tokens(40, 100 + i) for i in range(3)]
    for which, cut, suffixes, mode in calls:
        rows = [prefixes[which][: 8 * cut] + tokens(n, 7 * n + which) for n in suffixes]
        want, got = both(stock, model, rows, mode, new=4)[:2]
        assert torch.equal(want, got), (calls, rows, mode)
        check_books(model)


_PAIR: list = []


def _property_pair():
    if not _PAIR:
        _PAIR.extend(pair("mistral", num_blocks=20))  # a sliding group too
    return _PAIR


# ---------------------------------------------------------------------- snapshots
def test_save_then_load_in_a_fresh_process_recomputes_nothing_saved(tmp_path):
    stock, model = pair("llama")
    prefix = tokens(40, 1)
    both(stock, model, [prefix + tokens(3, 2)])
    path = tmp_path / "prefix.safetensors"
    assert hf_paged.prefix_cache(model).save(path) >= 5
    rows = [prefix + tokens(6, 3), prefix + tokens(2, 4)]
    want = both(stock, model, rows)[0]
    script = textwrap.dedent(f"""
        import json, sys, torch, hf_paged
        sys.path.insert(0, {str(_repo())!r})
        from tests.test_prefix_generate import Counted, batch, build
        model = hf_paged.enable(build("llama"), block_size={BS}, prefix_caching=True)
        counted = Counted(model)
        loaded = hf_paged.prefix_cache(model).load({str(path)!r})
        ids, mask = batch({rows!r})
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6,
                             do_sample=False, cache_implementation="hf_paged")
        print(json.dumps({{"loaded": loaded, "sequences": out.tolist(), "first": counted.forwards[0]}}))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got["loaded"] >= 5
    assert got["sequences"] == want.tolist()
    width = max(map(len, rows))
    assert got["first"] == len(rows) * (width - 40)  # from the column after the saved prefix (longest row)


def _repo():
    from pathlib import Path
    return Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_snapshots_cross_between_the_engine_and_generate(arch, tmp_path):
    stock, model = pair(arch)
    prefix = tokens(40, 1)
    rows = [prefix + tokens(5, 2)]
    # generate() -> engine
    both(stock, model, rows)
    path = tmp_path / "from_generate.safetensors"
    assert hf_paged.prefix_cache(model).save(path) >= 5
    engine = LLMEngine(stock, block_size=BS, num_blocks=64)
    assert engine.load_prefix_cache(path) >= 5
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    engine.generate([prefix + tokens(4, 3)], params, use_tqdm=False)
    assert engine.stats()["prefix_cache_hit_tokens"] >= 40
    # engine -> generate()
    engine = LLMEngine(stock, block_size=BS, num_blocks=64)
    engine.generate([tokens(40, 7) + tokens(3, 8)], params, use_tqdm=False)
    path = tmp_path / "from_engine.safetensors"
    assert engine.save_prefix_cache(path) >= 5
    fresh = hf_paged.enable(copy.deepcopy(stock), block_size=BS, prefix_caching=True)
    assert hf_paged.prefix_cache(fresh).load(path) >= 5
    counted = Counted(fresh)
    want, got = both(stock, fresh, [tokens(40, 7) + tokens(6, 9)])[:2]
    assert torch.equal(want, got)
    assert counted.forwards[0] == 6
    check_books(fresh)


def _mutated(path, tmp_path, how: str):
    data = bytearray(path.read_bytes())
    out = tmp_path / f"{how}.safetensors"
    if how == "truncated":
        data = data[: len(data) - 100]
    else:  # damaged header: the JSON header's first bytes
        data[10:14] = b"\xff\xfe\xfd\xfc"
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize("problem", ["config", "dtype", "block size", "truncated", "damaged header"])
def test_refused_snapshots_leave_the_cache_as_it_was(problem, tmp_path):
    stock, model = pair("llama")
    both(stock, model, [tokens(40, 1) + tokens(3, 2)])
    path = tmp_path / "prefix.safetensors"
    hf_paged.prefix_cache(model).save(path)
    other = build("llama")
    if problem == "config":
        other = build("phi3")
    elif problem == "dtype":
        other = build("llama").to(torch.float64)
    if problem in ("truncated", "damaged header"):
        path = _mutated(path, tmp_path, problem.split()[0])
    target = hf_paged.enable(other, block_size=4 if problem == "block size" else BS, prefix_caching=True)
    target_stock = copy.deepcopy(other)
    both(target_stock, target, [tokens(16, 5) + tokens(3, 6)])
    before = hf_paged.prefix_cache(target).stats()
    with pytest.raises(SnapshotError, match={"config": "model config", "dtype": "dtype", "block size": "block size",
                                             "truncated": "snapshot", "damaged header": "snapshot"}[problem]):
        hf_paged.prefix_cache(target).load(path)
    assert hf_paged.prefix_cache(target).stats() == before
    check_books(target)


def test_hybrid_models_refuse_prefix_caching():
    from hf_paged import state_layers

    if not state_layers.STATE_API:
        pytest.skip("this transformers has no state-layer API: hybrids are refused by enable itself")
    from tests.test_hybrid import MODELS, build as build_hybrid

    with pytest.raises(ValueError, match="recurrent"):
        hf_paged.enable(build_hybrid(MODELS[0]), prefix_caching=True)


@pytest.mark.parametrize("assist", ["assistant", "prompt lookup"])
def test_assisted_decoding_with_a_prefix_cache_equals_stock(assist):
    """Assisted decoding crops rejected candidates: the rows' indexed tokens follow the crop."""
    stock, model = pair("llama")
    options = {"assistant_model": build("llama", seed=1)} if assist == "assistant" else {"prompt_lookup_num_tokens": 3}
    prefix = tokens(40, 1)
    for suffix in (2, 3, 2):
        rows = [prefix + tokens(6, suffix)]
        want, got = both(stock, model, rows, new=10, **options)[:2]
        assert torch.equal(want, got), assist
    check_books(model)
    assert hf_paged.prefix_cache(model).stats()["hit_tokens"] >= 40
