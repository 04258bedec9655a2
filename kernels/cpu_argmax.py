"""Greedy picks of float32 logits rows on CPU in C (``cpu_argmax.c``): each row's argmax (its first
maximum, as ``torch.argmax``), or -1 for a row holding a NaN or +inf, or no finite value at all.

Why: a step's greedy rows need their argmax, and every row a check for non-finite values (the
engine fails such a row's request). In torch these are several small ops and a host sync (the
engine's :func:`hf_paged.engine.sampler.scan_rows` path for many rows); for the few rows of a
decode step they cost more in dispatch than in reading, so there both are one C call.

Built into the few-row library by :mod:`cpu_build` (where no compiler works, :func:`try_greedy_rows`
answers None and callers keep torch's ops). The torch reference: ``logits.argmax(-1)``, with the
non-finite rows found by ``~torch.isfinite(logits.amax(-1))``.
"""

from __future__ import annotations

import torch

from . import cpu_build


def try_greedy_rows(logits: torch.Tensor) -> list[int] | None:
    """Per row of ``logits`` (``[rows, vocab]``, float32, contiguous, on the CPU): its argmax, or -1
    where it holds a NaN or +inf or nothing finite. None where the tensor is not of that kind or
    the library is not built (the caller's torch ops take over)."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2 or not logits.is_contiguous():
        return None
    library = cpu_build.rows_library()
    if library is None:
        return None
    rows, vocab = logits.shape
    picks = torch.empty(rows, dtype=torch.int64)
    if rows:
        library.greedy_rows(logits.data_ptr(), picks.data_ptr(), rows, vocab, torch.get_num_threads())
    return picks.tolist()
