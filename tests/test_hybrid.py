"""Hybrid models (linear attention / Mamba / conv layers beside attention) in flagged generate().

Each model is a tiny random one built from a config; the flagged copy is a deepcopy of the stock
one, so both have the same weights. Outputs must be identical (``torch.equal``, float32, CPU):
sequences and scores, greedy on a left-padded batch, seeded sampling with three samples per
prompt, beam search with four beams, at blocks of 16 and of 1 token. The cache's batch operations
are checked against a ``DynamicCache`` of the same model, a negative control shows the comparison
catches a state that beam search did not reorder. (The engine serves them: tests/test_engine_hybrid.py.)
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionLayer

import hf_paged
from hf_paged import state_layers
from hf_paged.state_layers import PagedHybridLayer
from tests.helpers.tiny_models import left_padded, single_threaded_torch, transformers_at_least

pytestmark = pytest.mark.skipif(not state_layers.STATE_API,
                                reason=f"transformers {transformers.__version__} lacks the state-layer cache API")

VOCAB = 128
_COMMON = dict(vocab_size=VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=2, initializer_range=0.1,
               hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=8,
               mamba_d_conv=4, mamba_expand=1)
_GATED_DELTA = dict(layer_types=["linear_attention", "full_attention", "linear_attention"], linear_num_value_heads=4,
                    linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
CONFIGS = {
    "qwen3_5_text": lambda: transformers.Qwen3_5TextConfig(
        **_COMMON, **_GATED_DELTA, intermediate_size=96, num_hidden_layers=3, head_dim=16),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        **_COMMON, **_GATED_DELTA, intermediate_size=96, num_hidden_layers=3, head_dim=16, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, decoder_sparse_step=1),
    "falcon_h1": lambda: transformers.FalconH1Config(  # every layer is both: Mamba2 and attention in parallel
        **_COMMON, **_MAMBA2, intermediate_size=96, num_hidden_layers=2, head_dim=16, mamba_d_ssm=64),
    "lfm2": lambda: transformers.Lfm2Config(  # short convolutions: conv state, no recurrent state
        **_COMMON, intermediate_size=96, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
        conv_L_cache=3),
    "bamba": lambda: transformers.BambaConfig(
        **_COMMON, **_MAMBA2, intermediate_size=96, num_hidden_layers=3, attn_layer_indices=[1]),
}
MODELS = list(CONFIGS)
PROMPTS = [5, 11, 17]  # left-padded; crosses blocks of 16
NEW_TOKENS = 10
MODES = {
    "greedy": dict(do_sample=False),
    "sample3": dict(do_sample=True, num_return_sequences=3),
    "beam4": dict(do_sample=False, num_beams=4),
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_threaded_torch(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def build(name: str, seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.float32).eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    return model


@pytest.fixture(scope="module")
def pairs():
    """(stock, enabled) per model: the enabled one is a deepcopy of the stock one, made before enable()."""
    made = {}
    for name in MODELS:
        stock = build(name)
        made[name] = (stock, hf_paged.enable(copy.deepcopy(stock)))
    return made


def _generate(model, paged: bool, **options):
    ids, mask = left_padded(PROMPTS)
    torch.manual_seed(0)
    extra = dict(cache_implementation="hf_paged") if paged else {}
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, output_scores=True,
                          return_dict_in_generate=True, **options, **extra)


def _manager_of(out):
    """The block manager of ``out``'s paged cache, which held blocks and state layers."""
    cache = out.past_key_values
    assert isinstance(cache, hf_paged.PagedKVCache) and cache.stats()["tokens_stored"] > 0
    assert state_layers.has_state_layers(cache)
    return cache.manager


def _all_blocks_free(manager) -> None:
    """Once the output (and with it the cache) is dropped, every block is back: at once, not at the
    next garbage collection."""
    assert manager.num_used_blocks == 0 and manager.sequences == []


# ---------------------------------------------------------------------- generate() equals stock
@pytest.mark.parametrize("block_size", [16, 1])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", MODELS)
def test_flagged_generate_equals_stock(pairs, name, mode, block_size):
    stock, paged = pairs[name]
    hf_paged.enable(paged, block_size=block_size)
    expected = _generate(stock, paged=False, **MODES[mode])
    assert isinstance(expected.past_key_values, DynamicCache)
    got = _generate(paged, paged=True, **MODES[mode])
    new = expected.sequences[:, -NEW_TOKENS:]
    assert len(set(new.flatten().tolist())) >= 6, "degenerate output: the comparison would mean little"
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.scores) == len(expected.scores)
    assert all(torch.equal(a, b) for a, b in zip(got.scores, expected.scores))
    manager = _manager_of(got)
    del got
    _all_blocks_free(manager)


def test_negative_control_a_state_not_reordered_for_beams_changes_the_output(pairs, monkeypatch):
    """If beam search reordered only the K/V blocks and left the recurrent/conv states in place,
    the tokens would differ from stock: the equality above does check the states."""
    for name in ("qwen3_5_text", "bamba", "lfm2"):
        stock, paged = pairs[name]
        hf_paged.enable(paged, block_size=16)
        expected = _generate(stock, paged=False, **MODES["beam4"]).sequences
        with monkeypatch.context() as patch:
            patch.setattr(state_layers, "reorder_states", lambda layers, index: None)
            broken = _generate(paged, paged=True, **MODES["beam4"])
        assert not torch.equal(broken.sequences, expected), name
        assert torch.equal(_generate(paged, paged=True, **MODES["beam4"]).sequences, expected)  # unpatched: equal


# ---------------------------------------------------------------------- the cache's layers
@pytest.mark.parametrize("name", MODELS)
def test_the_cache_holds_states_in_transformers_own_layers(name):
    config = CONFIGS[name]()
    cache, stock = hf_paged.PagedKVCache(config), DynamicCache(config=config)
    for mine, theirs in zip(cache.layers, stock.layers, strict=True):
        if isinstance(theirs, LinearAttentionLayer) and not isinstance(mine, PagedHybridLayer):
            assert type(mine) is type(theirs)  # the very class DynamicCache builds
        elif isinstance(mine, PagedHybridLayer):
            assert isinstance(mine, LinearAttentionLayer)  # state half: transformers' class
    assert cache.is_linear == stock.is_linear and cache.is_sliding == stock.is_sliding
    assert cache.is_dummy == stock.is_dummy


def _step_inputs(ids, mask, cache_len: int | None):
    """Inputs of a prefill (``cache_len`` None) or of one decode step after ``cache_len`` columns."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    if cache_len is None:
        return dict(input_ids=ids, attention_mask=mask, position_ids=positions)
    return dict(input_ids=ids[:, -1:], attention_mask=mask, position_ids=positions[:, -1:])


def _two_steps(model, cache, edit, ids, mask):
    """Prefill, apply ``edit`` to the cache (it returns the cache to continue and the row order),
    then one decode step: its logits."""
    with torch.no_grad():
        first = model(**_step_inputs(ids, mask, None), cache=cache)
        cache, rows = edit(cache)
        nxt = first.logits[rows, -1].argmax(-1, keepdim=True)
        ids2 = torch.cat([ids[rows], nxt], 1)
        mask2 = torch.cat([mask[rows], torch.ones_like(nxt)], 1)
        return model(**_step_inputs(ids2, mask2, ids.shape[1]), cache=cache).logits


@pytest.mark.parametrize("operation", ["reorder", "select", "repeat", "fork", "deepcopy"])
@pytest.mark.parametrize("name", ["qwen3_5_text", "falcon_h1", "lfm2"])
def test_batch_operations_match_dynamic_cache(pairs, name, operation):
    """Each operation, then one more step: the logits equal those of a DynamicCache that went the
    same way (``DynamicCache`` has no ``batch_repeat_interleave`` for these layers: a reorder with
    each row repeated is what it means)."""
    stock, paged = pairs[name]
    ids, mask = left_padded([4, 9, 7])
    order = torch.tensor([2, 2, 0])
    kept = torch.tensor([0, 2])
    repeated = torch.arange(3).repeat_interleave(2)
    forks = []

    def edit(cache):
        if operation == "reorder":
            cache.reorder_cache(order)
            return cache, order
        if operation == "select":
            (cache.batch_select_indices if isinstance(cache, hf_paged.PagedKVCache) else cache.reorder_cache)(kept)
            return cache, kept
        if operation == "repeat":
            if isinstance(cache, hf_paged.PagedKVCache):
                cache.batch_repeat_interleave(2)
            else:
                cache.reorder_cache(repeated)
            return cache, repeated
        forks.append(cache)  # the original must not see the fork's step
        paged_fork = operation == "fork" and isinstance(cache, hf_paged.PagedKVCache)
        return (cache.fork() if paged_fork else copy.deepcopy(cache)), torch.arange(3)

    expected = _two_steps(stock, DynamicCache(config=stock.config), edit, ids, mask)
    got = _two_steps(paged, hf_paged.PagedKVCache(paged.config, block_size=4), edit, ids, mask)
    assert torch.equal(got, expected)
    if forks:  # the original continues as if the fork had never run
        original, reference = forks[1], forks[0]
        with torch.no_grad():
            nxt = torch.full((3, 1), 5)
            step = _step_inputs(torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1), ids.shape[1])
            assert torch.equal(paged(**step, cache=original).logits, stock(**step, cache=reference).logits)


def test_crop_and_reset_act_on_the_states_as_dynamic_cache(pairs):
    stock, paged = pairs["lfm2"]
    ids, mask = left_padded([4, 9])
    caches = {"stock": DynamicCache(config=stock.config), "paged": hf_paged.PagedKVCache(paged.config, block_size=4)}
    logits = {}
    for key, model in (("stock", stock), ("paged", paged)):
        cache = caches[key]
        with pytest.raises(RuntimeError, match="activate_past_recording"):  # stock's refusal, on an empty cache
            cache.crop(-1)
        cache.activate_past_recording()
        with torch.no_grad():
            model(**_step_inputs(ids, mask, None), cache=cache)
            cache.crop(-2)  # drop the last two columns: K/V and conv states
            assert cache.get_seq_length() == ids.shape[1] - 2
            step = _step_inputs(ids[:, :-1], mask[:, :-1], ids.shape[1] - 2)
            logits[key] = model(**step, cache=cache).logits
    assert torch.equal(logits["paged"], logits["stock"])
    paged_cache = caches["paged"]
    paged_cache.reset()
    conv = [layer for layer in paged_cache.layers if isinstance(layer, LinearAttentionLayer)]
    assert conv and all(not any(layer.has_previous_state.values()) for layer in conv)
    assert paged_cache.manager.num_used_blocks == 0


# ---------------------------------------------------------------------- what stock refuses
def _outcome(model, **kwargs):
    try:
        return model.generate(**kwargs)
    except Exception as error:  # noqa: BLE001 - compared with stock's own error
        return type(error), str(error)


@pytest.mark.parametrize("name", MODELS)
def test_assisted_decoding_is_refused_as_stock_refuses_it_or_matches_stock(pairs, name, monkeypatch):
    stock, paged = pairs[name]
    hf_paged.enable(paged, block_size=4)
    ids, mask = left_padded([9])
    call = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, assistant_model=build(name, 1))
    expected = _outcome(stock, **call)
    crops = []
    original_crop = hf_paged.PagedKVCache.crop
    monkeypatch.setattr(hf_paged.PagedKVCache, "crop", lambda self, n: (crops.append(n), original_crop(self, n))[1])
    got = _outcome(paged, **call, cache_implementation="hf_paged")
    if isinstance(expected, tuple):  # stock refuses stateful models: the same check runs, same error
        assert expected[0] is ValueError and "stateful" in expected[1]
        assert got == expected
    else:  # LFM2 (conv states only: croppable), and since transformers 5.25 the recurrent models that
        # record their states (recurrent_states_to_keep): assisted decoding runs, on the paged cache
        assert name == "lfm2" or transformers_at_least("5.25")
        assert torch.equal(got, expected) and crops


# ---------------------------------------------------------------------- the engine
# ---------------------------------------------------------------------- the kernel route
@pytest.mark.parametrize("name", MODELS)
def test_the_kernel_route_equals_stock(pairs, name):
    """CUDA's route (here the Triton interpreter): attention reads the blocks with the paged kernels,
    the state layers run as on the reference route."""
    stock, paged = pairs[name]
    hf_paged.enable(paged, block_size=4)
    ids, mask = left_padded([5, 11])
    call = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, num_beams=2)
    expected = stock.generate(**call)
    hf_paged.kernels.set_backend("triton")
    try:
        got = paged.generate(**call, cache_implementation="hf_paged")
    finally:
        hf_paged.kernels.set_backend("auto")
    assert torch.equal(got, expected)
