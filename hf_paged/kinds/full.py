"""Full causal attention: every token is kept and read."""

from __future__ import annotations

from dataclasses import dataclass

from hf_paged.kinds.base import KVSpec


@dataclass(frozen=True)
class FullAttentionSpec(KVSpec):
    """A layer that attends to the whole sequence (transformers' ``"full_attention"``)."""

    kind = "full"
