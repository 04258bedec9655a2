"""The C prefill read on CPU (``hf_paged.kernels.cpu_prefill``, issue 22): float32 attention of each
sequence's new tokens (whole prompts and chunks after a past) straight over the block pools.
Against the torch reference on scattered tables (windows, sinks, grouped heads, head dims the
vectors split differently, odd block sizes, one and two threads), token-exact against stock
generate() in the engine (plain, sliding-window and sink models; chunked prompts and cached
prefixes), its refusals, and negative controls that show each comparison can fail."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from hf_paged import LLMEngine, SamplingParams
from hf_paged.kernels import cpu_build, cpu_prefill
from hf_paged.kernels.reference import paged_attention_prefill_ref
from tests.helpers.tiny_models import build
from tests.helpers.variant_models import build_variant


def _built_or_skip(kv_heads, group, head_dim, block_size):
    if cpu_build.library((kv_heads, group, head_dim, block_size)) is None:
        pytest.skip(f"no C compiler works here: {cpu_build.failure()}")


# (context, new tokens): a lone token, a whole prompt over several blocks, a chunk after a past that
# starts inside a block, a long chunk after a past, one new token after a long past
SEQUENCES = [(1, 1), (70, 70), (33, 5), (130, 64), (17, 1)]


def _case(kv_heads, group, head_dim, block_size, seed=0):
    """Pools of random K/V, scattered block tables padded with -1 past each sequence's blocks,
    queries packed sequence after sequence, and sink logits."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([n for n, _ in SEQUENCES], dtype=torch.int32)
    width = -(-int(lens.max()) // block_size) + 2
    num_blocks = len(SEQUENCES) * width + 7
    k_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[: len(SEQUENCES) * width].view(len(SEQUENCES), width).int()
    for i, n in enumerate(lens.tolist()):
        tables[i, -(-n // block_size):] = -1  # never read
    cu = torch.tensor([0, *itertools.accumulate(new for _, new in SEQUENCES)], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), kv_heads * group, head_dim, generator=g)
    sinks = torch.randn(kv_heads * group, generator=g) * 2
    return q, k_pool, v_pool, tables, cu, lens, sinks


@pytest.mark.parametrize("kv_heads,group,head_dim,block_size",
                         [(2, 4, 32, 16), (4, 1, 8, 16), (1, 3, 12, 5), (2, 2, 64, 32), (3, 5, 20, 7)])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 5}, {"sinks": True}, {"sliding_window": 40, "sinks": True}],
                         ids=["causal", "window", "sinks", "window+sinks"])
def test_the_read_equals_the_reference_on_scattered_blocks(kv_heads, group, head_dim, block_size, options, threads,
                                                           c_target):
    _built_or_skip(kv_heads, group, head_dim, block_size)
    q, k_pool, v_pool, tables, cu, lens, sinks = _case(kv_heads, group, head_dim, block_size)
    kwargs = {**options, "sinks": sinks} if options.get("sinks") else options
    ref = paged_attention_prefill_ref(q, k_pool, v_pool, tables.clamp(min=0), cu, lens, 0.3, **kwargs)
    for n in (1, 2):
        threads(n)
        out = cpu_prefill.paged_prefill_cpu(q, k_pool, v_pool, tables, cu, lens, 0.3, **kwargs)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # negative control: the chunk of sequence 2 placed one position later (a key more) changes its rows
    bumped = lens.clone()
    bumped[2] += 1
    wrong = cpu_prefill.paged_prefill_cpu(q, k_pool, v_pool, tables, cu, bumped, 0.3, **kwargs)
    rows = slice(int(cu[2]), int(cu[3]))
    assert not torch.allclose(wrong[rows], ref[rows], rtol=1e-5, atol=1e-5)


def test_keys_past_the_last_position_are_never_read(c_target):
    """The unwritten end of a sequence's last block may hold anything (another sequence's old keys,
    or NaN after a failed step): the rows never see it."""
    _built_or_skip(2, 4, 32, 16)
    q, k_pool, v_pool, tables, cu, lens, _ = _case(2, 4, 32, 16)
    ref = cpu_prefill.paged_prefill_cpu(q, k_pool, v_pool, tables, cu, lens, 0.3)
    for i, n in enumerate(lens.tolist()):
        if n % 16:
            k_pool[tables[i, n // 16], n % 16:] = float("nan")
            v_pool[tables[i, n // 16], n % 16:] = float("nan")
    out = cpu_prefill.paged_prefill_cpu(q, k_pool, v_pool, tables, cu, lens, 0.3)
    assert torch.equal(out, ref)
    # negative control: NaN inside a sequence's visible keys does reach its rows
    k_pool[tables[1, 0], 0] = float("nan")
    assert out[int(cu[1]):int(cu[2])].isfinite().all()
    assert cpu_prefill.paged_prefill_cpu(q, k_pool, v_pool, tables, cu, lens, 0.3)[int(cu[1]):int(cu[2])].isnan().any()


def test_tables_and_lengths_outside_the_pool_are_refused_before_anything_is_read():
    _built_or_skip(2, 4, 32, 16)
    q, k_pool, v_pool, tables, cu, lens, _ = _case(2, 4, 32, 16)
    bad = tables.clone()
    bad[3, 2] = k_pool.shape[0]  # sequence 3 (130 tokens) reads its third block
    with pytest.raises(ValueError, match=rf"sequence 3 reads block {k_pool.shape[0]} \(entry 2 of its table\), "
                                         rf"outside the pool of {k_pool.shape[0]} blocks"):
        cpu_prefill.paged_prefill_cpu(q, k_pool, v_pool, bad, cu, lens, 0.3)
    bad[3, 2] = -1
    with pytest.raises(ValueError, match=r"sequence 3 reads block -1 \(entry 2"):
        cpu_prefill.paged_prefill_cpu(q, k_pool, v_pool, bad, cu, lens, 0.3)
    # a window that starts past the bad entry never reads it
    bad[3, 2] = tables[3, 2]
    bad[3, 0] = -1
    out = cpu_prefill.paged_prefill_cpu(q, k_pool, v_pool, bad, cu, lens, 0.3, sliding_window=20)
    ref = paged_attention_prefill_ref(q, k_pool, v_pool, tables.clamp(min=0), cu, lens, 0.3, sliding_window=20)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    longer = lens + torch.tensor([0, 0, 0, 100, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match="sequence 3 has 64 new tokens and context length 230; its table holds 11 blocks"):
        cpu_prefill.paged_prefill_cpu(q, k_pool, v_pool, tables.clamp(min=0), cu, longer, 0.3)
    shorter = lens - torch.tensor([0, 0, 30, 0, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match="sequence 2 has 5 new tokens and context length 3"):
        cpu_prefill.paged_prefill_cpu(q, k_pool, v_pool, tables, cu, shorter, 0.3)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        cpu_prefill.paged_prefill_cpu(q[:-1], k_pool, v_pool, tables, cu, lens, 0.3)
    with pytest.raises(ValueError, match="context_lens"):
        cpu_prefill.paged_prefill_cpu(q, k_pool, v_pool, tables, cu, lens[:2], 0.3)
    with pytest.raises(ValueError, match="does not fit pools of 2 heads of 32"):
        cpu_prefill.paged_prefill_cpu(q[..., :16], k_pool, v_pool, tables, cu, lens, 0.3)
    with pytest.raises(ValueError, match="not float32"):
        cpu_prefill.paged_prefill_cpu(q, k_pool.double(), v_pool.double(), tables, cu, lens, 0.3)


def test_supports_float32_cpu_pools_in_the_block_layout_with_head_dims_of_fours():
    _built_or_skip(2, 4, 32, 16)
    q, k_pool, v_pool, *_ = _case(2, 4, 32, 16)
    assert cpu_prefill.supports(q, k_pool, v_pool)
    assert not cpu_prefill.supports(q.bfloat16(), k_pool.bfloat16(), v_pool.bfloat16())
    heads_major = k_pool.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    assert not cpu_prefill.supports(q, heads_major, heads_major)
    odd = torch.randn(4, 2, 6), torch.randn(3, 16, 1, 6)
    assert not cpu_prefill.supports(odd[0], odd[1], odd[1])
    with pytest.raises(ValueError, match="head dim 6 is not a multiple of 4"):
        cpu_prefill.paged_prefill_cpu(odd[0], odd[1], odd[1], torch.zeros(1, 1, dtype=torch.int32),
                                      torch.tensor([0, 4]), torch.tensor([4]), 0.3)


# ------------------------------------------------------------------------------------ the engine
# a prompt chunked over steps, prompts that share a cached prefix (a chunk after a cached past),
# and one short prompt
SHARED = list(range(5, 45))
PROMPTS = [list(range(3, 73)), SHARED + [7, 8, 9], [4] * 5, SHARED + list(range(60, 90)), [9] * 64]


def _engine_tokens(model, monkeypatch, read: str = "c", new: int = 10):
    engine = LLMEngine(model, block_size=16, max_num_batched_tokens=48, enable_prefix_caching=True)
    engine.runner.prefill_read = read
    calls = []
    original = cpu_prefill.paged_prefill_cpu

    def counted(q, k, v, tables, cu, lens, *args, **kwargs):
        calls.append((cu[1:] - cu[:-1] < lens).any().item())  # whether a chunk came after a past
        return original(q, k, v, tables, cu, lens, *args, **kwargs)

    monkeypatch.setattr(cpu_prefill, "paged_prefill_cpu", counted)
    outs = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=new, temperature=0), use_tqdm=False)
    outs += engine.generate(PROMPTS[2:], SamplingParams(max_new_tokens=new, temperature=0), use_tqdm=False)
    monkeypatch.setattr(cpu_prefill, "paged_prefill_cpu", original)
    assert engine.stats()["prefix_cache_hit_tokens"] >= 32  # the shared prefix's two full blocks
    assert engine.kv.num_used_blocks() == 0
    return [o.outputs[0].token_ids for o in outs], calls


def _stock(stock, new: int = 10):
    return [stock.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False)[0, len(p):].tolist()
            for p in PROMPTS]


def _layout(model) -> tuple[int, int, int, int]:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads, head_dim, 16


@pytest.mark.parametrize("name", ["llama", "mistral", "gpt_oss"])  # plain, a sliding window, sinks and a window
def test_engine_with_the_c_prefill_read_equals_stock_generate(name, monkeypatch, c_target):
    model = build_variant(name) if name == "gpt_oss" else build(name)
    stock = _stock(copy.deepcopy(model))
    _built_or_skip(*_layout(model))
    tokens, calls = _engine_tokens(model, monkeypatch)
    assert any(calls) and not all(calls), "no chunk after a past (or only such chunks) took the C read"
    assert tokens == stock
    by_sdpa, calls = _engine_tokens(model, monkeypatch, read="sdpa")
    assert not calls and by_sdpa == stock


def test_negative_control_a_prefill_read_that_sees_less_changes_tokens(monkeypatch):
    model = build("llama")
    stock = _stock(copy.deepcopy(model))
    _built_or_skip(*_layout(model))
    original = cpu_prefill.paged_prefill_cpu

    def narrow(*args, **kwargs):  # each prompt row sees only its last 8 keys
        return original(*args[:7], sliding_window=8)

    monkeypatch.setattr(cpu_prefill, "paged_prefill_cpu", narrow)
    tokens, calls = _engine_tokens(model, monkeypatch)
    assert calls and tokens != stock
