"""Shared by the tests of the few-row C kernels (tests/test_cpu_gemv.py, tests/test_cpu_argmax.py): three
prompts whose decode steps have a few rows, and their greedy tokens from stock generate() and from an engine."""

from __future__ import annotations

import torch

from hf_paged import SamplingParams

PROMPTS = [list(range(3, 3 + n)) for n in (21, 5, 13)]


def stock_greedy(stock, new: int = 10) -> list[list[int]]:
    return [stock.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False)[0, len(p):].tolist()
            for p in PROMPTS]


def engine_greedy(engine, new: int = 10) -> list[list[int]]:
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=new, temperature=0), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]
