"""Multi-head latent attention (DeepSeek V2/V3, Kimi K2, GLM-4 MoE Lite, MiniCPM3...).

transformers caches what MLA compresses: through ``cache.update(kv_nope, k_rot, layer)`` it
stores the latent (``[batch, 1, seq, kv_lora_rank]``) as "keys" and the shared rotary key
(``[batch, 1, seq, qk_rope_head_dim]``) as "values", then expands what ``update`` returned into
per-head K/V with ``kv_b_proj``. So the blocks hold one head of two widths, and a token costs
``(kv_lora_rank + qk_rope_head_dim) × dtype`` bytes per layer, as in ``DynamicCache``.

Reads: ``update`` must return each sequence's whole cached latent (the model expands it). In
``generate()`` that is the reference route's dense per-row latent (on every device: the kernels
attend over K/V of one width, not over a latent). In an engine step, ``update`` writes the new
latents and returns the step's sequences' cached latents packed one after another (varlen); the
``"hf_paged"`` attention function then attends per sequence over what the model expanded. Cost:
per layer and step, a gather of every running sequence's latent context and its expansion by
``kv_b_proj`` (what stock ``generate()`` pays too); attending in latent space (absorbing the
up-projection into the query, as FlashMLA does) would avoid the expansion and is not built.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_paged.kinds.base import KVSpec, config_attr


@dataclass(frozen=True)
class MLAAttentionSpec(KVSpec):
    """A full-attention MLA layer: keys are the latent, values the rotary key, one head each."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    kind = "mla"

    def bytes_per_token(self, layer_config, dtype_bytes: int) -> int:
        return (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes  # one latent, one rotary key

    def describe(self) -> str:
        return f"mla({self.kv_lora_rank}+{self.qk_rope_head_dim})"


def is_mla_config(config) -> bool:
    """Whether ``config`` (a text config) describes MLA layers (a KV latent rank)."""
    return config_attr(config, "kv_lora_rank") is not None and config_attr(config, "qk_rope_head_dim") is not None
