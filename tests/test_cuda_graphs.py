"""Decode steps from the graphs' static buffers at bucketed batch sizes (``hf_paged.engine.cuda_graphs``).

No GPU here: the graphs are built with ``capture=False`` (same static buffers, buckets, pad rows
and scratch block; the recorded forward runs eagerly instead of replaying) and the Triton kernels
are forced (the interpreter: the route a GPU takes). Greedy tokens must equal per-request stock
``generate()`` while the batch shrinks through the buckets; negative controls show that pad rows
writing outside the scratch block, or stale static rows, change tokens. The Llama has 2 heads over
one K/V head (tiny_models.build_narrow_llama): the interpreter's cost grows with heads."""

from __future__ import annotations

import pytest
import torch

from hf_paged import LLMEngine, SamplingParams
from hf_paged.engine.cuda_graphs import DecodeGraphs
from tests.helpers.tiny_models import build, build_narrow_llama

PROMPTS = [list(range(3, 3 + n)) for n in (21, 9, 3, 14, 6)]
MAX_NEW = [6, 4, 7, 5, 2]  # requests finish at different steps: 5, 4, 3, 2, 1 rows (buckets 8, 4, 4, 2, 1)


def _stock(model):
    return [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[0, len(p):].tolist() for p, n in zip(PROMPTS, MAX_NEW)]


def _engine(model, num_blocks=64, **kwargs):
    engine = LLMEngine(model, block_size=4, num_blocks=num_blocks, max_num_seqs=8, **kwargs)
    engine.runner.graphs = DecodeGraphs(engine.runner, 8, list(engine.kv.pool_sizes), engine.max_positions,
                                        capture=False)
    return engine


def _tokens(engine, params=None):
    params = params or [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in MAX_NEW]
    outs = engine.generate(PROMPTS, params, use_tqdm=False)
    assert engine.kv.num_used_blocks() == 0
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("arch, compile", [("llama", False), ("llama", True), ("gemma2", False)])
def test_decode_steps_from_static_buffers_give_stock_tokens(arch, compile, triton_launches):
    """gemma2: two layer groups (sliding window 9 and full attention), each with its own buffers
    and scratch block; compile: the compiled body at every bucket size."""
    model = build_narrow_llama() if arch == "llama" else build(arch)
    engine = _engine(model, compile=compile)
    graphs = engine.runner.graphs
    assert graphs.buckets == (1, 2, 4, 8) and graphs.width == -(-model.config.max_position_embeddings // 4)
    assert _tokens(engine) == _stock(model)
    assert graphs.replayed >= max(MAX_NEW) - 1  # every pure-decode step (prefills and mixed steps run eager)
    assert triton_launches["paged_attention_decode"] > 0
    pools = engine.runner.storage.key_pools
    assert all(pool.shape[0] == 64 + 1 for pool in pools.values())  # whole from the start, plus the scratch block
    assert engine.stats()["cuda_graphs"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_sequences_come_back_through_the_graphs(mode, triton_launches):
    """10 blocks of 4 tokens cannot hold every sequence to its end: some are preempted (recomputed, or
    swapped out and back into the same pools) and decode from the static buffers again."""
    model = build_narrow_llama()
    engine = _engine(model, num_blocks=10, preemption_mode=mode)
    assert _tokens(engine) == _stock(model)
    assert engine.stats()[f"preemptions_{mode}"] > 0 and engine.runner.graphs.replayed > 0


def test_seeded_sampling_equals_eager_steps(triton_launches):
    model = build_narrow_llama()
    params = [SamplingParams(max_new_tokens=n, temperature=0.8, top_k=20, seed=i, ignore_eos=True)
              for i, n in enumerate(MAX_NEW)]
    graphs = _engine(model)
    assert _tokens(graphs, params) == _tokens(LLMEngine(model, block_size=4, num_blocks=64, max_num_seqs=8), params)
    assert graphs.runner.graphs.replayed > 0


def test_negative_control_pad_rows_writing_into_a_live_block_change_tokens(triton_launches):
    model = build_narrow_llama()
    engine = _engine(model)
    engine.runner.graphs.scratch = [0]  # pad rows write into block 0, which the first request owns
    assert _tokens(engine) != _stock(model)


def test_negative_control_a_bucket_whose_rows_are_not_refilled_changes_tokens(triton_launches, monkeypatch):
    model = build_narrow_llama()
    engine = _engine(model)
    graphs = engine.runner.graphs
    fill = graphs._fill
    filled = set()

    def first_fill_only(bucket, step):  # later steps of a bucket replay the first step's rows
        if step is None or bucket not in filled:
            filled.add(bucket)
            fill(bucket, step)

    monkeypatch.setattr(graphs, "_fill", first_fill_only)
    assert _tokens(engine) != _stock(model)


def test_steps_that_do_not_fit_run_eager():
    """A prefill, a mixed step and more sequences than the largest bucket run the eager forward."""
    model = build_narrow_llama()
    engine = LLMEngine(model, block_size=4, num_blocks=64, max_num_seqs=8)
    engine.runner.graphs = DecodeGraphs(engine.runner, 2, list(engine.kv.pool_sizes), engine.max_positions,
                                        capture=False)
    assert engine.runner.graphs.buckets == (1, 2)
    assert _tokens(engine) == _stock(model)  # up to 5 rows: 3 or more decode eager
    assert 0 < engine.runner.graphs.replayed < max(MAX_NEW) - 1


def test_cuda_graphs_refusals_name_why():
    model = build_narrow_llama()
    with pytest.raises(ValueError, match="cuda_graphs=True needs a KV budget"):
        LLMEngine(model, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs=True: CUDA graphs need a model on a CUDA device"):
        LLMEngine(model, num_blocks=64, cuda_graphs=True)
    assert not LLMEngine(model, num_blocks=64).stats()["cuda_graphs"]
