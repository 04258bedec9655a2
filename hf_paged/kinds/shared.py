"""KV-sharing layers (Gemma 3n's ``num_kv_shared_layers``): a layer that reuses another layer's K/V.

transformers runs such a layer on what its source layer's ``cache.update`` returned
(``shared_kv_states``) and never calls ``update`` itself. So the paged cache stores nothing for
it: on the reference route the model passes the source's dense K/V along by itself; on the kernel
route and in engine steps the attention read of a sharing layer goes to its source layer's blocks
(the ``"hf_paged"`` attention function recognises the source's K/V by identity). Bytes per
token: none of its own, as stock.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_paged.kinds.base import KVSpec


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
