"""Keeping invalid UTF-8 out of constrained outputs.

xgrammar 0.2.8 matches text as UTF-8 bytes and checks a multi-byte character's lead and
continuation bytes, but not the narrower range some leads allow for the second byte: it lets a
character class (``[^a]``, ``.``, a length-bounded JSON string) take overlong forms (``E0 80..9F
xx``, ``F0 80..8F xx xx``) and encoded surrogates (``ED A0..BF xx``), none of which is valid
UTF-8. The engine's text decodes each such byte to U+FFFD, so the output would no longer read as
what the grammar matched (a 3-character string becoming 6, a pattern no longer matching).
:class:`Utf8Guard` clears those tokens from a filled bitmask: always the tokens holding such a
byte pair inside them, and after a token that ends with one of those lead bytes, the tokens
whose first byte is a continuation byte the lead does not allow.
"""

from __future__ import annotations

import torch

# lead byte -> the range its second byte must be in (RFC 3629); other leads take any of 80..BF
SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def _bad_pair(lead: int, second: int) -> bool:
    low, high = SECOND_BYTE[lead]
    return 0x80 <= second <= 0xBF and not low <= second <= high


class Utf8Guard:
    """Built once per vocabulary from xgrammar's decoded tokens (``TokenizerInfo.decoded_vocab``)."""

    def __init__(self, decoded_vocab: list[bytes], bitmask_width: int):
        inside = [i for i, token in enumerate(decoded_vocab)
                  if any(a in SECOND_BYTE and _bad_pair(a, b) for a, b in zip(token, token[1:]))]
        self.always = _cleared(inside, bitmask_width) if inside else None
        self.lead_of: dict[int, int] = {i: token[-1] for i, token in enumerate(decoded_vocab)
                                        if token and token[-1] in SECOND_BYTE}
        self.after: dict[int, torch.Tensor] = {
            lead: _cleared(inside + [i for i, token in enumerate(decoded_vocab) if token and _bad_pair(lead, token[0])],
                           bitmask_width)
            for lead in SECOND_BYTE}

    def apply(self, bitmask: torch.Tensor, rows: list[int], last_tokens: list[int | None]) -> None:
        """Clear the invalid continuations from the filled ``bitmask`` rows (``last_tokens``: each
        row's last output token, None before the first)."""
        if self.always is not None:
            bitmask[rows] &= self.always
        for row, token in zip(rows, last_tokens):
            lead = self.lead_of.get(token)
            if lead is not None:
                bitmask[row] &= self.after[lead]


def _cleared(token_ids: list[int], width: int) -> torch.Tensor:
    """An int32 bitmask row with every bit set except those of ``token_ids``."""
    bits = torch.ones(width * 32, dtype=torch.bool)
    if token_ids:
        bits[torch.tensor(token_ids, dtype=torch.long)] = False
    weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    packed = (bits.view(width, 32).to(torch.int64) * weights).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
