"""Half precision in the engine (issue 22): a request's greedy tokens do not depend on its batch.

In bfloat16 and float16 one rounding step flips a greedy token, so the engine must compute each
sequence as stock ``generate()`` computes it alone: prefill attention by SDPA in the model's dtype,
as ``sdpa_attention_forward`` calls it for one prompt (not the float32 reference), and decode
groups without padding (SDPA's rounding depends on how many masked keys pad a row). On a fixed
prompt set, for tiny Llama and Mistral (sliding window) configs, the engine's batched run equals
per-request stock ``generate()`` with ``torch.equal``-strict token lists, also where stock's own
left-padded batch does not. Negative control: the old read paths (padded groups, float32 prefill)
diverge on the same set.
"""

from __future__ import annotations

import pytest
import torch

import hf_paged.attention as attention
import hf_paged.engine.step_cache as step_cache
from hf_paged import LLMEngine, SamplingParams
from tests.helpers.tiny_models import VOCAB, build

NEW = 24
LENGTHS = (5, 17, 33, 60, 9, 41)
SEEDS = (1, 2)  # two prompt sets of six


def _prompts() -> list[list[int]]:
    prompts = []
    for seed in SEEDS:
        g = torch.Generator().manual_seed(seed)
        prompts += [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    return prompts


_cache: dict = {}


def _case(arch: str, dtype: torch.dtype):
    """The model and per-request stock tokens (built once per case)."""
    if (arch, dtype) not in _cache:
        model = build(arch).to(dtype)
        singles = [model.generate(input_ids=torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                                  eos_token_id=None)[0, len(p):].tolist() for p in _prompts()]
        _cache[(arch, dtype)] = model, singles
    return _cache[(arch, dtype)]


def _engine_tokens(model, prompts) -> list[list[int]]:
    engine = LLMEngine(model, block_size=16)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True),
                           use_tqdm=False)
    assert not [o.error for o in outs if o.error]
    assert engine.kv.num_used_blocks() == 0
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_engine_batch_equals_stock_alone_in_half_precision(arch, dtype):
    model, singles = _case(arch, dtype)
    got = _engine_tokens(model, _prompts())
    assert all(len(t) == NEW for t in got)
    assert got == singles, [i for i, (a, b) in enumerate(zip(got, singles)) if a != b]


@pytest.fixture
def old_read_paths(monkeypatch):
    """The read paths before issue 22: decode groups padded to their longest member, prefill by the
    float32 reference."""
    monkeypatch.setattr(step_cache, "equal_runs", step_cache.split_by_length)
    monkeypatch.setattr(attention, "_has_span_options", lambda options: True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_negative_control_padded_groups_and_float32_prefill_diverge(dtype, old_read_paths):
    differing = 0
    for arch in ("llama", "mistral"):
        model, singles = _case(arch, dtype)
        differing += sum(a != b for a, b in zip(_engine_tokens(model, _prompts()), singles))
    assert differing, "the old read paths gave stock's tokens: the test above could not fail"
