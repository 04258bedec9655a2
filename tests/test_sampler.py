"""The engine's batched sampler: draws follow each row's distribution exactly (zero-probability
tokens never drawn), a row's tokens do not depend on the rest of the batch, the top-p candidate
path keeps what a full sort keeps, and a row with nothing left to sample fails its request alone."""

from __future__ import annotations

import math

import pytest
import torch

from hf_paged import LLMEngine, SamplingParams
from hf_paged.engine import sampler
from tests.helpers.tiny_models import build


def spec(width: int = 1, seed: int | None = None, **params) -> sampler.RowSpec:
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return sampler.RowSpec(SamplingParams(**{"temperature": 1.0, **params}), [1, 2], 1, width, generator)


def chi_square(tokens: list[int], probs: torch.Tensor) -> tuple[float, int]:
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    seen = expected > 0
    return float(((counts[seen] - expected[seen]) ** 2 / expected[seen]).sum()), int(seen.sum()) - 1


@pytest.mark.parametrize("vocab", [1000, 259, 100])  # whole chunks and a short last one, a single short chunk
def test_draws_follow_the_distribution_and_never_pick_a_masked_token(vocab):
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(vocab)) * 1.5
    logits[0, 3: vocab // 3] = float("-inf")  # whole chunks and parts of chunks at probability 0
    probs = logits.softmax(-1)[0]
    draws = 100_000
    tokens = sampler.sample(logits, [spec(width=draws, seed=0)], [])[0]
    assert not any(3 <= t < vocab // 3 for t in tokens)
    chi2, dof = chi_square(tokens, probs)
    assert chi2 < dof + 5 * math.sqrt(2 * dof), (chi2, dof)
    # negative control: the same statistic rejects the draws against a slightly different distribution
    skewed = probs.clone()
    skewed[probs > 0] = skewed[probs > 0].roll(1)
    assert chi_square(tokens, skewed)[0] > dof + 5 * math.sqrt(2 * dof)


def test_extreme_draws_land_on_possible_tokens():
    probs = torch.tensor([[0.0, 0.0, 0.25, 0.0, 0.75, 0.0, 0.0] + [0.0] * 300])
    owner = torch.zeros(3, dtype=torch.long)
    draws = torch.tensor([0.0, 0.25, math.nextafter(1.0, 0.0)], dtype=torch.float64)
    assert sampler.inverse_cdf(probs, owner, lambda: draws).tolist() == [2, 4, 4]


def test_a_rows_tokens_do_not_depend_on_the_batch():
    vocab = 3000
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(1)) * 4
    options = [dict(), dict(top_k=20), dict(top_p=0.9), dict(min_p=0.1), dict(top_k=40, top_p=0.8, temperature=0.7),
               dict(temperature=0)]
    alone = [sampler.sample(logits[i: i + 1], [spec(width=3, seed=i, **options[i])], [])[0] for i in range(6)]
    together = sampler.sample(logits, [spec(width=3, seed=i, **options[i]) for i in range(6)], [])
    assert together == alone
    assert len({tuple(t) for t in alone[:5]}) == 5 and alone[5] == [int(logits[5].argmax())] * 3
    # negative control: the seeds are what makes them agree
    assert sampler.sample(logits, [spec(width=3, seed=i + 10, **options[i]) for i in range(6)], [])[:5] != alone[:5]


def test_unseeded_rows_draw_from_torchs_global_generator():
    logits = torch.zeros(2, 500)
    torch.manual_seed(5)
    first = sampler.sample(logits, [spec(width=4), spec(width=4)], [])
    torch.manual_seed(5)
    assert sampler.sample(logits, [spec(width=4), spec(width=4)], []) == first
    assert first[0] != first[1]


@pytest.mark.parametrize("candidates", [1, 8, 4096])
def test_top_p_keeps_what_a_full_sort_keeps(monkeypatch, candidates):
    """Rows whose cut falls among the candidates and rows sorted whole give one answer."""
    g = torch.Generator().manual_seed(2)
    logits = torch.cat([torch.randn(4, 2000, generator=g) * 8, torch.randn(4, 2000, generator=g) * 0.3])
    rows = [spec(top_p=p) for p in (0.5, 0.9, 0.99, 0.3) * 2]
    reference = []
    for row, x in zip(rows, logits):
        ordered, order = torch.sort(x.softmax(-1), descending=True)
        drop = ordered.cumsum(-1) - ordered > row.params.top_p
        reference.append(torch.zeros_like(drop).scatter(0, order, drop))
    monkeypatch.setattr(sampler, "TOP_P_CANDIDATES", candidates)
    kept = sampler.process(logits, rows, []) > float("-inf")
    assert torch.equal(kept, ~torch.stack(reference))
    assert kept.sum(-1).min() >= 1 and kept[:4].sum(-1).max() < 100 < kept[4:].sum(-1).min()


def test_top_k_with_a_different_k_per_row():
    logits = torch.randn(3, 700, generator=torch.Generator().manual_seed(3))
    kept = sampler.process(logits, [spec(top_k=k) for k in (1, 5, 600)], []) > float("-inf")
    assert kept.sum(-1).tolist() == [1, 5, 600]
    for row, k in zip(range(3), (1, 5, 600)):
        assert set(kept[row].nonzero()[:, 0].tolist()) == set(logits[row].topk(k).indices.tolist())


def test_a_row_with_nothing_left_to_sample_fails_its_request_alone(monkeypatch):
    model = build("llama")
    victim = SamplingParams(max_new_tokens=6, temperature=1.0, seed=4, ignore_eos=True)
    others = [SamplingParams(max_new_tokens=6, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2)]
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    clean = LLMEngine(model, block_size=4).generate(prompts[:2], others, use_tqdm=False)
    process = sampler.process

    def masked(logits, rows, *args):
        out = process(logits, rows, *args)
        for i, row in enumerate(rows):
            if row.params is victim and row.num_generated == 2:
                out[i] = float("-inf")  # every token masked, as a grammar that allows nothing would
        return out

    monkeypatch.setattr(sampler, "process", masked)
    engine = LLMEngine(model, block_size=4)
    outs = engine.generate(prompts, [*others, victim], use_tqdm=False)
    assert outs[2].error_kind == "fault" and "nothing left to sample" in outs[2].error
    assert len(outs[2].outputs[0].token_ids) == 2
    assert [o.outputs[0].token_ids for o in outs[:2]] == [o.outputs[0].token_ids for o in clean]
    assert engine.kv.num_used_blocks() == 0
