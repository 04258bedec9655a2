"""KV-sharing layers (Gemma 3n's ``num_kv_shared_layers``): a layer that reuses another layer's K/V.

transformers runs such a layer on what its source layer's ``cache.update`` returned
(``shared_kv_states``) and never calls ``update`` itself. So the paged cache stores nothing for
it: on the reference route the model passes the source's dense K/V along by itself; on the kernel
route and in engine steps the attention read of a sharing layer goes to its source layer's blocks
(the ``"hf_paged"`` attention function recognises the source's K/V by identity). Bytes per
token: none of its own, as stock.

Which layers share, and whose K/V they read (:func:`kv_sharing_modes`): transformers >= 5.24 marks
them in the config (``kv_sharing_modes``); transformers 5.17 has no such property, and its modeling
code (``Gemma3nTextAttention.__init__``, Gemma 4's likewise) derives the same layers from
``num_kv_shared_layers`` and ``layer_types``, which is what this module then does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hf_paged.kinds.base import KVSpec, config_attr


@dataclass(frozen=True)
class SharedKVSpec(KVSpec):
    """A layer reading layer ``source``'s blocks, with ``source_spec``'s span and read."""

    source: int
    source_spec: KVSpec
    kind = "shared"
    stores = False

    @property
    def window(self) -> int | None:
        return self.source_spec.window

    def read_options(self) -> dict:
        return self.source_spec.read_options()

    def bytes_per_token(self, layer_config, dtype_bytes: int) -> int:
        return 0  # its source layer holds the K/V

    def describe(self) -> str:
        return f"shared(layer {self.source})"


def kv_sharing_modes(config: Any) -> list[str | None]:
    """Per layer of ``config``: ``"reuse"`` (attends with an earlier layer's K/V, stores none),
    ``"store"`` (the last layer of its type before the sharing ones: the layer they read), or None.
    Empty where no layer shares.

    The config's own ``kv_sharing_modes`` where transformers marks them (>= 5.24). Otherwise, as
    transformers 5.17's modeling code decides: the last ``num_kv_shared_layers`` layers reuse
    (none when that would be every layer), and the last earlier layer of each type stores.
    ``ValueError`` when a sharing layer's type has no earlier layer (transformers cannot build it either).
    """
    modes = config_attr(config, "kv_sharing_modes")
    if modes is not None:
        return list(modes)
    shared = config_attr(config, "num_kv_shared_layers") or 0
    if shared <= 0:
        return []
    num_layers = config.num_hidden_layers
    first_shared = num_layers - shared
    if first_shared <= 0:  # as 5.17's Gemma 3n: ``layer_idx >= first_kv_shared_layer_idx > 0``
        return []
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None or len(layer_types) != num_layers:
        raise ValueError(f"{shared} layers share K/V, but the config has no layer_types to tell whose")
    modes = [None] * first_shared + ["reuse"] * shared
    earlier = list(layer_types[:first_shared])
    for layer_type in set(layer_types):
        if layer_type not in earlier:
            raise ValueError(f"{layer_type} layers share K/V, but no layer before the sharing ones is one")
        modes[first_shared - 1 - earlier[::-1].index(layer_type)] = "store"
    return modes
