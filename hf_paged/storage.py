"""Paged KV storage: one K and one V pool per layer, ``[num_blocks, block_size, num_kv_heads, head_dim]``.

Storage decides nothing: the block manager says which slots to write and which blocks to copy,
storage executes it in batches (one write per layer per step, one copy launch per step).

Each layer's pool is created lazily from that layer's first key states, on their device and in
their dtype. So a model split across devices (accelerate ``device_map``) keeps each layer's cache
next to the layer, and a tensor-parallel rank stores only the heads it holds.
"""

from __future__ import annotations

import torch

from hf_paged import kernels


class PagedKVStorage:
    """Per-layer K/V block pools that follow the block manager's capacity."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.key_pools: dict[int, torch.Tensor] = {}
        self.value_pools: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ facts
    @property
    def layers(self) -> list[int]:
        return sorted(self.key_pools)

    def bytes_per_block(self) -> int:
        """Bytes one block takes across all layers (K and V)."""
        return sum(2 * k[0].numel() * k.element_size() for k in self.key_pools.values())

    def bytes_per_token(self) -> int:
        return self.bytes_per_block() // self.block_size

    def num_blocks(self, layer_idx: int) -> int:
        return self.key_pools[layer_idx].shape[0]

    # ------------------------------------------------------------------ allocation
    def ensure_layer(self, layer_idx: int, like: torch.Tensor, num_blocks: int) -> None:
        """Create (or grow) the pools of a layer. ``like`` is ``[..., num_kv_heads, head_dim]``."""
        pool = self.key_pools.get(layer_idx)
        if pool is None:
            shape = (num_blocks, self.block_size, like.shape[-2], like.shape[-1])
            self.key_pools[layer_idx] = torch.zeros(shape, dtype=like.dtype, device=like.device)
            self.value_pools[layer_idx] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        elif pool.shape[0] < num_blocks:
            self._grow_layer(layer_idx, num_blocks)

    def _grow_layer(self, layer_idx: int, num_blocks: int) -> None:
        for pools in (self.key_pools, self.value_pools):
            old = pools[layer_idx]
            new = old.new_zeros((num_blocks, *old.shape[1:]))
            new[: old.shape[0]].copy_(old)
            pools[layer_idx] = new

    def grow(self, num_blocks: int) -> None:
        """Grow every existing layer to at least ``num_blocks`` blocks."""
        for layer_idx, pool in self.key_pools.items():
            if pool.shape[0] < num_blocks:
                self._grow_layer(layer_idx, num_blocks)

    # ------------------------------------------------------------------ execution
    def write(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` to their slots (−1 = skip)."""
        k_pool, v_pool = self.key_pools[layer_idx], self.value_pools[layer_idx]
        kernels.reshape_and_cache(
            key.to(k_pool.dtype), value.to(v_pool.dtype), k_pool, v_pool, slot_mapping.to(k_pool.device)
        )

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``src → dst`` in every layer: one launch per device."""
        if not pairs or not self.key_pools:
            return
        by_device: dict[tuple, list[int]] = {}
        for layer_idx, pool in self.key_pools.items():
            by_device.setdefault((pool.device, pool.dtype, tuple(pool.shape)), []).append(layer_idx)
        for (device, _, _), layer_ids in by_device.items():
            mapping = torch.tensor(pairs, dtype=torch.int64, device=device)
            kernels.copy_blocks(
                [self.key_pools[i] for i in layer_ids], [self.value_pools[i] for i in layer_ids], mapping
            )

    def gather(self, layer_idx: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``slots`` (any shape, −1 gives zeros): ``[*slots.shape, num_kv_heads, head_dim]``."""
        k_pool, v_pool = self.key_pools[layer_idx], self.value_pools[layer_idx]
        slots = slots.to(k_pool.device)
        flat = slots.clamp(min=0).reshape(-1)
        keys = k_pool.view(-1, *k_pool.shape[2:]).index_select(0, flat)
        values = v_pool.view(-1, *v_pool.shape[2:]).index_select(0, flat)
        invalid = (slots.reshape(-1) < 0)[:, None, None]
        keys = keys.masked_fill(invalid, 0).view(*slots.shape, *k_pool.shape[2:])
        values = values.masked_fill(invalid, 0).view(*slots.shape, *v_pool.shape[2:])
        return keys, values

    def clear(self) -> None:
        self.key_pools.clear()
        self.value_pools.clear()
