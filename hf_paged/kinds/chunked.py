"""Chunked local attention (Llama 4): a query sees the tokens of its own chunk up to itself.

Chunks are ``attention_chunk_size`` tokens long and counted from a sequence's first real token
(``masking_utils`` offsets them by the left padding; the paged cache stores real tokens only, so
a token's position in its blocks is its position in the chunk grid). The group keeps what
transformers' ``DynamicCache`` keeps for such a layer (a ``DynamicSlidingWindowLayer`` of the
chunk size: the last ``chunk - 1`` tokens), so at any time it holds at most one chunk and two
partial blocks; the blocks of finished chunks go back. The read's lower bound is the start of
the query's chunk (``chunk_size`` of the kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_paged.kinds.base import KVSpec


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(KVSpec):
    """transformers' ``"chunked_attention"`` layers (``attention_chunk_size``)."""

    chunk_size: int
    kind = "chunked"

    @property
    def window(self) -> int:
        return self.chunk_size

    def read_options(self) -> dict:
        return {"chunk_size": self.chunk_size}

    def describe(self) -> str:
        return f"chunked({self.chunk_size})"
