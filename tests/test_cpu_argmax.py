"""The C greedy picks (``hf_paged.kernels.cpu_argmax``): each row's first maximum as ``torch.argmax``
finds it and the non-finite rows as the torch check finds them, on rows built to trip them (ties
across and inside chunks, signed zeros, NaNs of either sign, infinities, rows of -inf), in both
builds; the engine's step scan (``sampler.RowScan``) answering the same through C and through
torch; decode steps picking their greedy tokens in C with stock generate()'s tokens; and negative
controls."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from hf_paged import LLMEngine
from hf_paged.engine import sampler
from hf_paged.kernels import cpu_argmax
from tests.helpers.few_rows import engine_greedy, stock_greedy
from tests.helpers.tiny_models import build


def _tricky_rows(vocab: int, seed: int = 0) -> torch.Tensor:
    """Rows that trip a wrong max, tie rule, zero rule or non-finite check (``vocab`` >= 9; the tie
    across the C scan's chunks of 64 where the rows are long enough)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(18, vocab, generator=g)
    rows[1] = rows[1].round()  # many ties
    rows[2] = 1.0  # every entry ties: the first wins
    rows[3, 5] = rows[3, vocab - 2] = 99.0  # a tie far apart
    rows[4, min(63, vocab - 2)] = rows[4, min(64, vocab - 1)] = 99.0  # a tie across the C scan's chunks of 64
    rows[5, vocab - 1] = 99.0  # the max in the last, partial chunk
    rows[6] = -float("inf")  # nothing finite
    rows[7] = -float("inf")
    rows[7, vocab - 3] = -3.0  # one finite value among -inf
    rows[8, 2] = float("nan")
    rows[9, vocab // 2] = float("inf")
    rows[10, vocab - 1] = -float("nan")  # a NaN with the sign bit set
    rows[11] = -5.0
    rows[11, 3], rows[11, 1] = 0.0, -0.0  # a zero max: +0.0 and -0.0 tie, the first wins
    rows[12] = -5.0
    rows[12, 6] = -0.0  # the max is -0.0
    rows[13] = -rows[13].abs()  # every value negative
    rows[14, 4] = torch.finfo(torch.float32).max
    rows[15] = torch.randn(vocab, generator=g) * 1e-40  # denormals
    rows[16, 0] = -float("inf")  # -inf is allowed among finite values
    rows[17, 7] = float("nan")
    rows[17, 8] = float("inf")
    return rows


@pytest.mark.parametrize("vocab", [32000, 32003, 1000, 129, 64, 9])
def test_picks_are_torch_argmax_and_bad_rows_the_torch_check(rows_built, vocab):
    rows = _tricky_rows(vocab)
    picks = cpu_argmax.try_greedy_rows(rows)
    bad = sampler.nonfinite_rows(rows)
    assert bad == [6, 8, 9, 10, 17]
    assert [i for i, pick in enumerate(picks) if pick < 0] == bad
    expected = rows.argmax(-1).tolist()
    good = [i for i in range(len(rows)) if i not in bad]
    assert [picks[i] for i in good] == [expected[i] for i in good]
    first_maxima = picks[2] == 0 and picks[11] == 1 and picks[12] == 6 and picks[4] == min(63, vocab - 2)
    assert first_maxima, "the first maximum wins"


def test_picks_do_not_depend_on_the_rows_beside_them_nor_the_threads(rows_built):
    rows = _tricky_rows(4099, seed=1)
    together = cpu_argmax.try_greedy_rows(rows)
    assert [cpu_argmax.try_greedy_rows(row[None])[0] for row in rows] == together
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert cpu_argmax.try_greedy_rows(rows) == together
    finally:
        torch.set_num_threads(threads)


def test_what_it_does_not_take_is_left_to_torch(rows_built):
    rows = torch.randn(4, 100)
    assert cpu_argmax.try_greedy_rows(rows.t()) is None  # not contiguous
    assert cpu_argmax.try_greedy_rows(rows.double()) is None
    assert cpu_argmax.try_greedy_rows(rows.half()) is None
    assert cpu_argmax.try_greedy_rows(rows[0]) is None  # one dimension
    assert cpu_argmax.try_greedy_rows(rows[:0]) == []


@pytest.mark.parametrize("vocab", [32000, 1000])
def test_the_step_scan_answers_the_same_through_c_and_through_torch(rows_built, monkeypatch, vocab):
    rows = _tricky_rows(vocab, seed=2)
    through_c = sampler.RowScan(rows)
    assert through_c._picks is not None
    monkeypatch.setattr(cpu_argmax, "try_greedy_rows", lambda logits: None)
    through_torch = sampler.RowScan(rows)
    assert through_torch._picks is None
    assert through_c.bad == through_torch.bad == [6, 8, 9, 10, 17]
    good = [i for i in range(len(rows)) if i not in through_c.bad]
    assert through_c.argmax(good) == through_torch.argmax(good) == rows[good].argmax(-1).tolist()
    assert through_c.argmax(good[::-1]) == through_torch.argmax(good[::-1])  # any order of rows
    assert sampler.RowScan(None).bad == []


def test_negative_control_a_last_maximum_rule_is_caught():
    """The comparisons above can fail: a pick that takes the last of tied maxima differs from
    torch's on the tie rows, and a check that reads a row without its last entry misses a NaN."""
    rows = _tricky_rows(1000)
    last = (rows.shape[1] - 1 - rows.flip(-1).argmax(-1)).tolist()
    assert last[2] != rows[2].argmax().item() and last[3] != rows[3].argmax().item()
    rows[5, -1] = math.nan
    assert 5 not in sampler.nonfinite_rows(rows[:, :-1].contiguous()) and 5 in sampler.nonfinite_rows(rows)


def test_engine_steps_pick_their_greedy_tokens_in_c_with_stock_tokens(rows_built, monkeypatch):
    model = build("llama")
    stock = stock_greedy(copy.deepcopy(model))
    answered, real = [], cpu_argmax.try_greedy_rows

    def counted(logits):
        picks = real(logits)
        answered.append(picks is not None)
        return picks

    monkeypatch.setattr(cpu_argmax, "try_greedy_rows", counted)
    engine = LLMEngine(model, block_size=4)
    assert engine_greedy(engine) == stock
    assert len(answered) >= 10 and all(answered), "a step's picks did not come from C"
    assert engine.stats()["blocks_free"] == engine.stats()["blocks_total"]


def test_negative_control_picks_off_by_one_change_tokens(rows_built, monkeypatch):
    """What the engine test above compares can fail: picks one token off do not give stock tokens."""
    model = build("llama")
    stock = stock_greedy(copy.deepcopy(model))
    real = cpu_argmax.try_greedy_rows
    monkeypatch.setattr(cpu_argmax, "try_greedy_rows", lambda logits: [p + 1 if p >= 0 else p for p in real(logits)])
    assert engine_greedy(LLMEngine(model, block_size=4)) != stock
