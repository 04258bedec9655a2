"""Keeping UTF-8-encoded surrogates out of constrained outputs.

xgrammar 0.2.8 matches text as UTF-8 bytes and lets a character class (``[^a]``, ``.``, a JSON
string's characters) take the three-byte encodings of U+D800..U+DFFF (``ED A0..BF xx``), which
are not valid UTF-8. The engine's text decodes each such byte to U+FFFD, so the output would no
longer read as what the grammar matched (a 6-character string becoming 8, a pattern no longer
matching). :class:`SurrogateGuard` clears those tokens from a filled bitmask: always the tokens
holding such a sequence inside them, and, after a token that ends with the lead byte ``ED``, the
tokens that start with a continuation byte ``A0..BF``.
"""

from __future__ import annotations

import torch

_LEAD, _LOW, _HIGH = 0xED, 0xA0, 0xBF


class SurrogateGuard:
    """Built once per vocabulary from xgrammar's decoded tokens (``TokenizerInfo.decoded_vocab``)."""

    def __init__(self, decoded_vocab: list[bytes], bitmask_width: int):
        inside, starts = [], []
        self.ends_with_lead: frozenset[int] = frozenset(
            i for i, token in enumerate(decoded_vocab) if token and token[-1] == _LEAD)
        for i, token in enumerate(decoded_vocab):
            if any(a == _LEAD and _LOW <= b <= _HIGH for a, b in zip(token, token[1:])):
                inside.append(i)
            if token and _LOW <= token[0] <= _HIGH:
                starts.append(i)
        self.always = _cleared(inside, bitmask_width) if inside else None
        self.after_lead = _cleared(inside + starts, bitmask_width)

    def apply(self, bitmask: torch.Tensor, rows: list[int], last_tokens: list[int | None]) -> None:
        """Clear the surrogate tokens from the filled ``bitmask`` rows (``last_tokens``: each row's
        last output token, None before the first)."""
        if self.always is not None:
            bitmask[rows] &= self.always
        for row, token in zip(rows, last_tokens):
            if token in self.ends_with_lead:
                bitmask[row] &= self.after_lead


def _cleared(token_ids: list[int], width: int) -> torch.Tensor:
    """An int32 bitmask row with every bit set except those of ``token_ids``."""
    bits = torch.ones(width * 32, dtype=torch.bool)
    bits[torch.tensor(token_ids, dtype=torch.long)] = False
    weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    packed = (bits.view(width, 32).to(torch.int64) * weights).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
