"""Sliding-window attention: a query sees its last ``sliding_window`` tokens."""

from __future__ import annotations

from dataclasses import dataclass

from hf_paged.kinds.base import KVSpec


@dataclass(frozen=True)
class SlidingWindowSpec(KVSpec):
    """transformers' ``"sliding_attention"``: the group keeps the last ``sliding_window - 1``
    tokens before a forward (what ``DynamicSlidingWindowLayer`` keeps) and gives back the rest."""

    sliding_window: int
    kind = "sliding"

    @property
    def window(self) -> int:
        return self.sliding_window

    def read_options(self) -> dict:
        return {"sliding_window": self.sliding_window}

    def describe(self) -> str:
        return f"sliding({self.sliding_window})"
