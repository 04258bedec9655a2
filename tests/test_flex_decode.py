"""The compiled CPU decode read (``hf_paged.kernels.flex_decode``, issue 22): FlexAttention over the
pools through a block mask, no gathered copy. Against the torch reference on scattered tables,
token-exact against stock generate() in the engine, and a negative control."""

from __future__ import annotations

import pytest
import torch

from hf_paged import LLMEngine, SamplingParams
from hf_paged.kernels import flex_decode
from hf_paged.kernels.reference import paged_attention_decode_ref
from tests.helpers.tiny_models import build


def _compiled_or_skip(kv_heads, group, head_dim, block_size):
    if not flex_decode.ready(kv_heads, group, head_dim, block_size, wait=True):
        pytest.skip(f"inductor cannot compile here: {flex_decode.failure()}")


@pytest.mark.parametrize("kv_heads,group", [(2, 4), (4, 1)])
def test_flex_read_equals_the_reference_on_scattered_blocks(kv_heads, group):
    block_size, head_dim, num_blocks = 32, 16, 64
    _compiled_or_skip(kv_heads, group, head_dim, block_size)
    g = torch.Generator().manual_seed(kv_heads)
    k_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    lens = torch.tensor([1, 32, 33, 100, 7, 64], dtype=torch.int32)  # a lone slot, full and partial last blocks
    width = 4
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * width].view(len(lens), width).int()
    tables[0, 1:] = -1  # padding of short tables is never read
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=g)
    mask = flex_decode.decode_block_mask(tables, lens, num_blocks, block_size, group)
    out = flex_decode.paged_decode_flex(q, k_pool, v_pool, mask, 0.3)
    ref = paged_attention_decode_ref(q, k_pool, v_pool, tables.clamp(min=0), lens, 0.3)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # a mask that lets each sequence see one slot more is wrong for every sequence whose last block has room
    wrong = flex_decode.paged_decode_flex(q, k_pool, v_pool,
                                          flex_decode.decode_block_mask(tables, lens + 1, num_blocks, block_size, group),
                                          0.3)
    assert not torch.allclose(wrong[2], ref[2], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def model():
    return build("llama")


PROMPTS = [list(range(3, 3 + n)) for n in (70, 41, 5, 33)] + [[9] * 64]


def _engine_tokens(model, mode: str, block_size: int = 32):
    engine = LLMEngine(model, block_size=block_size)
    engine.runner.flex_decode = mode
    calls = []
    original = flex_decode.paged_decode_flex

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    flex_decode.paged_decode_flex = counted
    try:
        outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0),
                               use_tqdm=False)
    finally:
        flex_decode.paged_decode_flex = original
    assert engine.kv.num_used_blocks() == 0
    return [o.outputs[0].token_ids for o in outs], len(calls)


def test_engine_with_the_flex_read_equals_stock_generate(model):
    config = model.config
    _compiled_or_skip(config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads,
                      config.hidden_size // config.num_attention_heads, 32)
    tokens, calls = _engine_tokens(model, "always")
    assert calls >= 11 * config.num_hidden_layers, "the decode steps did not take the compiled read"
    stock = [model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
             for p in PROMPTS]
    assert tokens == stock
    never, calls = _engine_tokens(model, "never")
    assert calls == 0 and never == stock


def test_the_background_compile_serves_the_steps_without_compiling_again(model):
    """The read compiled on the background thread is the one engine steps call: a step that compiled
    it again (Dynamo guards on the grad mode; steps run under inference_mode) raises here."""
    config = model.config
    layout = (config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads,
              config.hidden_size // config.num_attention_heads, 64)  # a block size no other test compiles
    flex_decode.ready(*layout)
    flex_decode.wait_for_compiles()
    if not flex_decode.ready(*layout):
        pytest.skip(f"inductor cannot compile here: {flex_decode.failure()}")
    with torch.compiler.set_stance("fail_on_recompile"):
        _, calls = _engine_tokens(model, "always", block_size=64)
    assert calls >= 11 * config.num_hidden_layers


def test_auto_keeps_the_gather_read_for_short_contexts(model):
    _, calls = _engine_tokens(model, "auto")
    assert calls == 0


def test_negative_control_a_mask_one_slot_short_changes_tokens(model, monkeypatch):
    config = model.config
    _compiled_or_skip(config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads,
                      config.hidden_size // config.num_attention_heads, 32)
    original = flex_decode.decode_block_mask
    monkeypatch.setattr(flex_decode, "decode_block_mask",
                        lambda tables, lens, *a, **k: original(tables, (lens - 1).clamp(min=1), *a, **k))
    tokens, _ = _engine_tokens(model, "always")
    stock = [model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
             for p in PROMPTS]
    assert tokens != stock
