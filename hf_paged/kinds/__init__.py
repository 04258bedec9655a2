"""Layer kinds: what each kind of attention layer stores, keeps and reads, one module per kind.

The block manager groups layers by spec (:mod:`hf_paged.layer_groups`); the cache and the engine
ask a spec which blocks a sequence still needs; the ``"hf_paged"`` attention function asks it what
the read needs (a window, a chunk start). Adding a kind is adding a module here and a line in
:data:`LAYER_TYPE_SPECS` (vLLM V1's anchor: ``kv_cache_interface.py``).

Layers transformers' cache holds no K/V for (linear-attention, state-space and convolution
state, MLP-only layers) have no K/V spec (``None``). Their recurrent state is one more kind,
:class:`RecurrentStateSpec` (:mod:`hf_paged.kinds.recurrent`: one state slot per sequence in
the engine; in ``generate()`` transformers' own cache layers, :mod:`hf_paged.state_layers`).
"""

from __future__ import annotations

from collections.abc import Callable

from hf_paged.kinds.base import KVSpec, attention_heads
from hf_paged.kinds.chunked import ChunkedLocalAttentionSpec
from hf_paged.kinds.full import FullAttentionSpec
from hf_paged.kinds.mla import MLAAttentionSpec, is_mla_config
from hf_paged.kinds.recurrent import STATE_LAYER_TYPES, NoKVSpec, RecurrentStateSpec, state_specs
from hf_paged.kinds.shared import SharedKVSpec, kv_sharing_modes
from hf_paged.kinds.sliding import SlidingWindowSpec

__all__ = ["KVSpec", "attention_heads", "FullAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec", "SharedKVSpec",
           "MLAAttentionSpec", "RecurrentStateSpec", "NoKVSpec", "STATE_LAYER_TYPES", "LAYER_TYPE_SPECS", "spec_for_layer_type",
           "layer_specs", "state_specs", "is_mla_config", "kv_sharing_modes"]

#: transformers layer type -> its spec, from ``get_layer_types_and_kwargs``'s per-layer kwargs.
LAYER_TYPE_SPECS: dict[str, Callable[[dict], KVSpec]] = {
    "full_attention": lambda kw: FullAttentionSpec(),
    "sliding_attention": lambda kw: SlidingWindowSpec(kw["sliding_window"]),
    "chunked_attention": lambda kw: ChunkedLocalAttentionSpec(kw["sliding_window"]),  # transformers' chunk size
    "hybrid": lambda kw: FullAttentionSpec(),  # the attention half of a hybrid layer
    "hybrid_sliding": lambda kw: SlidingWindowSpec(kw["sliding_window"]),
}


def spec_for_layer_type(layer_type: str, layer_kwargs: dict) -> KVSpec | None:
    """The spec of a layer of ``layer_type`` (None: no K/V in the cache)."""
    make = LAYER_TYPE_SPECS.get(layer_type)
    return None if make is None else make(layer_kwargs)


def layer_specs(config, layer_types: list[str], layer_kwargs: list[dict]) -> list[KVSpec | None]:
    """Each layer's spec. A layer that reuses another's K/V (``"reuse"`` in :func:`kv_sharing_modes`:
    on transformers >= 5.24 its cache layer is a dummy; transformers 5.17 builds no cache layer
    for it, its ``layer_types`` stop before the sharing layers) reads the last layer before it of
    the same original type that stores (``"store"``), as the model passes ``shared_kv_states``
    along. A config with a KV latent rank (``kv_lora_rank``) has MLA layers (:mod:`hf_paged.kinds.mla`)."""
    specs = [spec_for_layer_type(t, kw) for t, kw in zip(layer_types, layer_kwargs)]
    if is_mla_config(config):  # MLA: full-attention layers that cache a latent and a rotary key
        mla = MLAAttentionSpec(config.kv_lora_rank, config.qk_rope_head_dim)
        specs = [mla if isinstance(spec, FullAttentionSpec) else spec for spec in specs]
    try:
        modes = kv_sharing_modes(config)
    except ValueError as error:
        raise NotImplementedError(str(error)) from None
    specs += [None] * (len(modes) - len(specs))  # transformers 5.17: no cache layer for a sharing layer
    original = getattr(config, "layer_types", None) or layer_types
    for layer, mode in enumerate(modes):
        if mode != "reuse":
            continue
        source = next((s for s in range(layer - 1, -1, -1)
                       if modes[s] == "store" and original[s] == original[layer]), None)
        if source is None or specs[source] is None:
            raise NotImplementedError(f"layer {layer} reuses K/V, but no earlier {original[layer]} layer stores them")
        specs[layer] = SharedKVSpec(source, specs[source])
    return specs
