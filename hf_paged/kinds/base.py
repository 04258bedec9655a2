"""The base of every layer kind: what a layer stores per token, which blocks it keeps, what its read needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


def config_attr(config, name: str):
    """``config.name``, or None where it is unset or the config refuses to read it (heterogeneous
    configs refuse global reads of per-layer values)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - whatever the config raises, the value is not there to read
        return None


def attention_heads(layer_config) -> tuple[int, int, int]:
    """``(query heads, K/V heads, head size)`` of an attention layer's config (K/V heads default to
    the query heads, the head size to hidden size / heads)."""
    heads = layer_config.num_attention_heads
    kv_heads = getattr(layer_config, "num_key_value_heads", None) or heads
    return heads, kv_heads, getattr(layer_config, "head_dim", None) or layer_config.hidden_size // heads


@dataclass(frozen=True)
class KVSpec:
    """One kind of attention layer, as the paged cache sees it (vLLM V1's ``KVCacheSpec``).

    ``window``: how many tokens of the past the layer's blocks keep, as transformers'
    ``DynamicCache`` keeps them (None: all). A layer group with a window gives back every block
    that falls wholly before it. Layers of one spec share a block table per sequence.
    """

    kind: ClassVar[str] = "full"
    stores: ClassVar[bool] = True  # False: the layer stores nothing and reads another layer's blocks

    @property
    def window(self) -> int | None:
        return None

    @property
    def gives_back(self) -> bool:
        """Whether the group releases blocks as the sequence moves on."""
        return self.window is not None

    def first_needed(self, next_position: int) -> int:
        """The earliest token position that a forward whose first new token sits at
        ``next_position`` reads (what the group must still hold)."""
        return 0 if self.window is None else max(next_position - self.window + 1, 0)

    def read_options(self) -> dict:
        """The keywords of the paged attention read (``hf_paged.kernels``) for this kind."""
        return {}

    def blocks_per_sequence(self, block_size: int) -> int | None:
        """Most blocks one sequence of this kind holds at once (None: unbounded, grows with it)."""
        if self.window is None:
            return None
        return -(-(self.window - 1) // block_size) + 2  # the window's blocks and a partial one at each end

    def bytes_per_token(self, layer_config, dtype_bytes: int) -> int:
        """Bytes one token of this layer takes in its blocks (K and V), from the layer's config."""
        _, kv_heads, head_dim = attention_heads(layer_config)
        return 2 * kv_heads * head_dim * dtype_bytes

    def describe(self) -> str:
        return self.kind
