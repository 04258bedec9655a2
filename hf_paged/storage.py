"""Paged KV storage: one K and one V pool per layer, ``[num_blocks, block_size, num_kv_heads, head_dim]``.

Storage decides nothing: the block manager says which slots to write and which blocks to copy,
storage executes it in batches (one write per layer per step, one copy launch per step).

Each layer's pool is created lazily from that layer's first key states, on their device and in
their dtype. So a model split across devices (accelerate ``device_map``) keeps each layer's cache
next to the layer, and a tensor-parallel rank stores only the heads it holds.
"""

from __future__ import annotations

import copy
import math
import mmap
import os
import sys
from collections.abc import Iterable

import torch

from hf_paged import kernels


RESERVE_BYTES = 1 << 36  # the most address space a growable CPU pool reserves to grow in place (64 GiB)
# Python < 3.13 does not name it (0x4000 is Linux's value; elsewhere address space is not committed anyway)
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def zero_pages(shape: tuple[int, ...], dtype: torch.dtype, reserve_rows: int = 0) -> torch.Tensor:
    """A zeroed CPU tensor on fresh anonymous memory (``mmap``): the kernel maps its pages to zeros
    and faults each in at its first write, so a pool costs time and resident memory for the blocks
    written, not for its size (``torch.zeros`` writes every page: a 2 GiB pool took 0.7 s of the
    first step, and all of it stayed resident). The tensor holds the mapping; it goes with the tensor.

    With ``reserve_rows`` above ``shape[0]``, the mapping has room for that many rows: address
    space only (``MAP_NORESERVE``: nothing is committed until written), into which
    :func:`grown_in_place` extends the tensor without copying it. Where the system refuses the
    reservation (strict overcommit, an address-space limit), the mapping is the size asked."""
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    room = count // shape[0] * reserve_rows if reserve_rows > shape[0] else count
    memory = None
    if room > count and hasattr(mmap, "MAP_ANONYMOUS"):  # POSIX
        try:
            memory = mmap.mmap(-1, room * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        except (OSError, OverflowError, ValueError):
            memory = None
    if memory is None:
        room = count
        memory = mmap.mmap(-1, count * dtype.itemsize)
    return torch.frombuffer(memory, dtype=dtype, count=room)[:count].view(shape)


def room_rows(pool: torch.Tensor) -> int:
    """The rows ``pool`` (contiguous, rows along dim 0) can take over its own memory: more than it
    has where it lies on a :func:`zero_pages` reservation, 0 where it is not laid out to grow."""
    if not pool.shape[0] or not pool.is_contiguous() or pool.storage_offset():
        return 0
    return pool.untyped_storage().nbytes() // pool[:1].nbytes


def grown_in_place(pool: torch.Tensor, rows: int) -> torch.Tensor | None:
    """``pool`` extended to ``rows`` rows over the same memory, where it has that room
    (:func:`room_rows`; the rows past the old ones were never written, so they read as zeros);
    None where it has not."""
    if rows > room_rows(pool):
        return None
    return pool.as_strided((rows, *pool.shape[1:]), pool.stride())


def _reserve_bytes() -> int:
    """The address space a growable pool reserves: ``RESERVE_BYTES``, the machine's physical memory
    (a pool never needs more) or a sixteenth of the process's address-space limit where one is set
    (``ulimit -v``: reservations leave room for the rest), whichever is least."""
    try:
        memory = min(RESERVE_BYTES, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        memory = RESERVE_BYTES
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    except (ImportError, OSError, ValueError, AttributeError):  # no resource module (Windows)
        return memory
    return memory if limit == resource.RLIM_INFINITY else min(memory, limit // 16)


class PagedKVStorage:
    """Per-layer K/V block pools that follow the block manager's capacity."""

    def __init__(self, block_size: int, device: torch.device | str | None = None, pin_memory: bool = False):
        """``device``: where pools live (default: each layer's own device); ``pin_memory`` for a CPU
        swap pool that a GPU copies to and from asynchronously."""
        self.block_size = block_size
        self.device = None if device is None else torch.device(device)
        self.pin_memory = pin_memory
        self.heads_major = False  # lay new pools out head by head: see new_pool
        self.key_pools: dict[int, torch.Tensor] = {}
        self.value_pools: dict[int, torch.Tensor] = {}
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> pools viewed as slot rows

    def __deepcopy__(self, memo: dict) -> PagedKVStorage:
        """A copy with pools of its own holding these pools' blocks (tensors' own deep copy would
        copy every byte a pool reserved to grow into: :func:`zero_pages`)."""
        clone = copy.copy(self)
        memo[id(self)] = clone
        clone._rows = {}
        clone.key_pools, clone.value_pools = {}, {}
        for pools, copies in ((self.key_pools, clone.key_pools), (self.value_pools, clone.value_pools)):
            for layer_idx, pool in pools.items():
                room = room_rows(pool)
                copies[layer_idx] = (zero_pages(tuple(pool.shape), pool.dtype, room).copy_(pool)
                                     if room > pool.shape[0] else copy.deepcopy(pool, memo))
        return clone

    # ------------------------------------------------------------------ facts
    @property
    def layers(self) -> list[int]:
        return sorted(self.key_pools)

    def bytes_per_block(self) -> int:
        """Bytes one block takes across all layers (K and V)."""
        return sum(self.layer_bytes_per_token(i) for i in self.key_pools) * self.block_size

    def layer_bytes_per_token(self, layer_idx: int) -> int:
        """Bytes one token takes in a layer's pools (K and V, which may differ in width)."""
        k, v = self.key_pools[layer_idx], self.value_pools[layer_idx]
        return (k[0, 0].numel() * k.element_size()) + (v[0, 0].numel() * v.element_size())

    def bytes_per_token(self) -> int:
        return self.bytes_per_block() // self.block_size

    def num_blocks(self, layer_idx: int) -> int:
        return self.key_pools[layer_idx].shape[0]

    def slot_rows(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's K and V pools as ``[num_slots, num_kv_heads, head_dim]`` views (one row a slot)."""
        rows = self._rows.get(layer_idx)
        if rows is None:
            k_pool, v_pool = self.key_pools[layer_idx], self.value_pools[layer_idx]
            rows = self._rows[layer_idx] = (k_pool.view(-1, *k_pool.shape[2:]), v_pool.view(-1, *v_pool.shape[2:]))
        return rows

    # ------------------------------------------------------------------ allocation
    def ensure_layer(self, layer_idx: int, like: torch.Tensor, num_blocks: int,
                     value_like: torch.Tensor | None = None) -> None:
        """Create (or grow) the pools of a layer. ``like`` is ``[..., num_kv_heads, head_dim]`` (its
        keys; ``value_like`` its values where they have another width: an MLA layer's latent and
        rotary key, :mod:`hf_paged.kinds.mla`)."""
        pool = self.key_pools.get(layer_idx)
        if pool is None:
            device = self.device or like.device
            self._rows.pop(layer_idx, None)
            for pools, shaped in ((self.key_pools, like), (self.value_pools, like if value_like is None else value_like)):
                pools[layer_idx] = self.new_pool(num_blocks, shaped.shape[-2], shaped.shape[-1], like.dtype, device)
        elif pool.shape[0] < num_blocks:
            self._grow_layer(layer_idx, num_blocks)

    def new_pool(self, num_blocks: int, heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        """A zeroed ``[num_blocks, block_size, heads, head_dim]`` pool. With ``heads_major`` its memory
        is ``[heads, slots, head_dim]`` (same shape, other strides): one sequence's consecutive slots
        then read as ``DynamicCache``'s layout, each head's keys contiguous, which CPU attention
        reads faster; gathering many sequences is faster from the block layout, so generate()
        chooses this for single-row caches only. Unpinned CPU pools are :func:`zero_pages`, those
        in the block layout with room to grow in place (up to ``RESERVE_BYTES``, the machine's
        memory or 1/16 of an address-space limit, whichever is least): growing a pool then copies
        nothing, nor holds old and new at once."""
        pin = self.pin_memory and device.type == "cpu" and torch.cuda.is_available()
        shape = (heads, num_blocks, self.block_size, head_dim) if self.heads_major else (
            num_blocks, self.block_size, heads, head_dim)
        if device.type == "cpu" and not pin:
            block_bytes = self.block_size * heads * head_dim * dtype.itemsize
            reserve = 0 if self.heads_major else _reserve_bytes() // block_bytes
            memory = zero_pages(shape, dtype, reserve)
        else:
            memory = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
        return memory.permute(1, 2, 0, 3) if self.heads_major else memory

    def _grow_layer(self, layer_idx: int, num_blocks: int) -> None:
        self._rows.pop(layer_idx, None)
        for pools in (self.key_pools, self.value_pools):
            old = pools[layer_idx]
            new = grown_in_place(old, num_blocks)  # None unless it lies on a reservation (CPU)
            if new is None:
                new = self.new_pool(num_blocks, old.shape[2], old.shape[3], old.dtype, old.device)
                new[: old.shape[0]].copy_(old)
            pools[layer_idx] = new

    def grow(self, num_blocks: int, layers: Iterable[int] | None = None) -> None:
        """Grow every existing layer (or those of ``layers``) to at least ``num_blocks`` blocks."""
        for layer_idx in self._existing(layers):
            if self.key_pools[layer_idx].shape[0] < num_blocks:
                self._grow_layer(layer_idx, num_blocks)

    def _existing(self, layers: Iterable[int] | None) -> list[int]:
        return list(self.key_pools) if layers is None else [i for i in layers if i in self.key_pools]

    # ------------------------------------------------------------------ execution
    def write(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` to their slots.

        Every slot must be a real one (callers leave pads out; a negative slot raises on the torch
        path). Off the Triton path the write is one ``index_copy_`` per pool: it runs once per layer
        per forward, so the reference kernel's checks are skipped."""
        k_rows, v_rows = self.slot_rows(layer_idx)
        if slot_mapping.device != k_rows.device:
            slot_mapping = slot_mapping.to(k_rows.device)
        if key.dtype != k_rows.dtype:
            key, value = key.to(k_rows.dtype), value.to(v_rows.dtype)
        if kernels.use_triton(k_rows) and k_rows.shape[1:] == v_rows.shape[1:]:  # MLA's two widths: index_copy_
            kernels.reshape_and_cache(key, value, self.key_pools[layer_idx], self.value_pools[layer_idx], slot_mapping)
            return
        k_rows.index_copy_(0, slot_mapping, key)
        v_rows.index_copy_(0, slot_mapping, value)

    def copy_blocks(self, pairs: list[tuple[int, int]], layers: Iterable[int] | None = None) -> None:
        """Copy whole blocks ``src → dst`` in every layer (or those of ``layers``, a layer group's
        block ids mean nothing in another group's pools): one launch per device."""
        if not pairs or not self.key_pools:
            return
        by_shape: dict[tuple, list[torch.Tensor]] = {}  # one launch per device, dtype and pool shape
        for layer_idx in self._existing(layers):
            for pool in (self.key_pools[layer_idx], self.value_pools[layer_idx]):
                by_shape.setdefault((pool.device, pool.dtype, tuple(pool.shape), pool.stride()), []).append(pool)
        for (device, *_), pools in by_shape.items():
            kernels.copy_blocks(pools, [], torch.tensor(pairs, dtype=torch.int64, device=device))

    def gather(self, layer_idx: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``slots`` (any shape, −1 gives zeros): ``[*slots.shape, num_kv_heads, head_dim]``."""
        k_pool, v_pool = self.key_pools[layer_idx], self.value_pools[layer_idx]
        slots = slots.to(k_pool.device)
        flat = slots.clamp(min=0).reshape(-1)
        k_rows, v_rows = self.slot_rows(layer_idx)
        keys, values = k_rows.index_select(0, flat), v_rows.index_select(0, flat)
        invalid = (slots.reshape(-1) < 0).nonzero().squeeze(1)
        if invalid.numel():  # zero only the padding rows (a full masked_fill costs as much as the gather)
            keys.index_fill_(0, invalid, 0)
            values.index_fill_(0, invalid, 0)
        return keys.view(*slots.shape, *k_pool.shape[2:]), values.view(*slots.shape, *v_pool.shape[2:])

    def transfer(self, dst: PagedKVStorage, pairs: list[tuple[int, int]], dst_num_blocks: int,
                 layers: Iterable[int] | None = None) -> None:
        """Copy blocks ``src (here) → dst (there)`` for every layer (or those of ``layers``): swap
        out / swap in."""
        if not pairs:
            return
        src_ids = torch.tensor([s for s, _ in pairs], dtype=torch.long)
        dst_ids = torch.tensor([d for _, d in pairs], dtype=torch.long)
        for layer_idx in self._existing(layers):
            k_pool = self.key_pools[layer_idx]
            dst.ensure_layer(layer_idx, k_pool[0], dst_num_blocks, self.value_pools[layer_idx][0])
            for src_pools, dst_pools in ((self.key_pools, dst.key_pools), (self.value_pools, dst.value_pools)):
                src_pool, dst_pool = src_pools[layer_idx], dst_pools[layer_idx]
                moved = src_pool.index_select(0, src_ids.to(src_pool.device))
                dst_pool.index_copy_(0, dst_ids.to(dst_pool.device), moved.to(dst_pool.device, non_blocking=True))

    def clear(self) -> None:
        self.key_pools.clear()
        self.value_pools.clear()
        self._rows.clear()
