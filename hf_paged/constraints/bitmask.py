"""Applying a filled token bitmask to logits, fast on CPU.

xgrammar's CPU kernel, like ``Tensor.masked_fill_`` in torch's CPU build, writes ``-inf``
element by element at a few nanoseconds each: about 75 us per row at a 22k-token vocabulary,
2.4 ms for 32 rows, more than the rest of the constraint's work. Unpacking the bits with numpy and
adding ``log(bit)`` (0 where a token is allowed, ``-inf`` where not) is exact (``x + 0 == x``) and
vectorized: about 4x faster there. On an accelerator, xgrammar's own kernel runs.
"""

from __future__ import annotations

import numpy as np
import torch


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set ``logits[row, token]`` to ``-inf`` for every token whose bit is 0 in ``bitmask[row]``
    (in place; ``bitmask`` is xgrammar's int32 ``[rows, ceil(vocab / 32)]`` on the CPU)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        from hf_paged.constraints.compiler import xgrammar

        xgrammar().apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
        return
    every_row = rows == list(range(len(logits)))
    packed = bitmask[: len(rows)] if every_row else bitmask[rows]
    bits = np.unpackbits(packed.numpy().view(np.uint8), axis=-1, count=logits.shape[-1], bitorder="little")
    with np.errstate(divide="ignore"):
        additive = torch.from_numpy(np.log(bits, dtype=np.float32))
    if every_row:
        logits.add_(additive)
    else:
        logits.index_add_(0, torch.tensor(rows, dtype=torch.long), additive)
