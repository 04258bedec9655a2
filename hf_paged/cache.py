"""``PagedKVCache``: a transformers ``Cache`` whose K/V live in blocks addressed by block tables.

It talks to the model through the stash/claim channel of :mod:`hf_paged.channel`: ``update``
stashes the new K/V, the ``"hf_paged"`` attention function claims them, asks this cache to
:meth:`~PagedKVCache.commit` them (the padding mask it receives says which new columns are pads:
those are not stored), then reads K/V through the block tables.

Columns vs tokens: transformers counts *columns* (the padded length, pads included). The cache
reports columns exactly as ``DynamicCache`` would (so masks and positions match stock), but stores
only real tokens; ``_token_index[row, column]`` maps each column to the row's token (−1 = pad).
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig

from hf_paged.block_manager import BlockManager
from hf_paged.channel import BLOCK_TABLE_PAD, AttentionMetadata, StashingCache
from hf_paged.model_info import layer_structure
from hf_paged.storage import PagedKVStorage


@dataclass
class _Pool:
    """Blocks and their K/V, shared by a cache and its forks (each fork has rows of its own)."""

    manager: BlockManager
    storage: PagedKVStorage
    seq_ids: itertools.count = field(default_factory=itertools.count)
    users: weakref.WeakSet = field(default_factory=weakref.WeakSet)


class PagedKVCache(StashingCache):
    """A KV cache in fixed-size blocks with per-sequence block tables (vLLM's PagedAttention).

    Each batch row is one sequence of the block manager. Blocks are allocated as tokens arrive,
    shared between rows by reference count (``reorder_cache`` for beam search and
    ``batch_repeat_interleave`` for shared prompts are block-table forks) and copied only when a
    row writes into a shared, partially filled block.

    Args:
        config: the model config (its layer structure decides sliding-window layers).
        block_size: tokens per block.
        num_blocks: a fixed budget of blocks (``NoFreeBlocksError`` when exceeded), or ``None`` to
            grow on demand.

    Use it with a model prepared by :func:`hf_paged.enable`::

        cache = PagedKVCache(model.config, block_size=16)
        model.generate(**inputs, past_key_values=cache)
        cache.stats()

    ``copy.deepcopy(cache)`` and :meth:`fork` give a cache that shares every block (copy on write):
    a prompt cache can be reused for many requests at the cost of their new tokens only.
    """

    def __init__(self, config: PretrainedConfig, block_size: int = 16, num_blocks: int | None = None):
        if not isinstance(config, PretrainedConfig):
            raise TypeError(f"PagedKVCache needs the model config, got {type(config).__name__}")
        config = config.get_text_config(decoder=True)
        self.layer_types, self.sliding_windows = layer_structure(config)
        super().__init__(self.sliding_windows)
        self.config = config
        self.block_size = block_size
        self._join(_Pool(BlockManager(block_size, num_blocks), PagedKVStorage(block_size)))
        self._rows: list[int] = []  # block-manager sequence id of each batch row
        self._columns = 0  # columns with allocated slots (all layers reach it within a forward)
        self._layer_columns = [0] * len(self.layers)
        self._token_index = torch.empty(0, 0, dtype=torch.long)  # [rows, columns], -1 for pads
        self._has_holes = False  # a pad column after a real one: kernels need contiguous tokens
        self.prompt_copies = 1  # set by generate(): rows of the first forward are this many copies

    def _join(self, pool: _Pool) -> None:
        self._pool, self.manager, self.storage = pool, pool.manager, pool.storage
        pool.users.add(self)

    def fork(self) -> PagedKVCache:
        """A cache with the same rows, sharing every block (copy on write): both continue on their own."""
        self.check_no_pending()
        clone = object.__new__(type(self))
        StashingCache.__init__(clone, self.sliding_windows)
        clone.layer_types, clone.sliding_windows = self.layer_types, self.sliding_windows
        clone.config, clone.block_size = self.config, self.block_size
        clone._join(self._pool)
        clone._rows = []
        for seq_id in self._rows:
            clone._rows.append(clone._fresh_seq_id())
            self.manager.fork(seq_id, clone._rows[-1])
        clone._columns, clone._layer_columns = self._columns, list(self._layer_columns)
        clone._token_index, clone._has_holes = self._token_index.clone(), self._has_holes
        clone.prompt_copies = 1
        return clone

    def __deepcopy__(self, memo) -> PagedKVCache:
        return self.fork()

    def __del__(self) -> None:
        # A fork may outlive this cache in the same pool: this cache's rows go back with it.
        try:
            for seq_id in self._rows:
                if seq_id in self.manager:
                    self.manager.free(seq_id)
        except Exception:  # noqa: BLE001 - never raise from a finalizer (e.g. at interpreter exit)
            pass

    # ------------------------------------------------------------------ transformers API
    @property
    def batch_size(self) -> int:
        return len(self._rows) if self._rows else -1

    def get_seq_length(self, layer_idx: int = 0) -> int:
        self.check_no_pending()
        return self._layer_columns[layer_idx] if layer_idx < len(self._layer_columns) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """Same sizes as ``DynamicCache``: masks, and so outputs, match stock transformers."""
        past = self.get_seq_length(layer_idx)
        window = self.sliding_windows[layer_idx]
        if window is None:
            return past + query_length, 0
        kv_offset = max(past - window + 1, 0)
        kv_length = (window - 1 if past >= window else past) + query_length
        return kv_length, kv_offset

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i continues row ``beam_idx[i]``: a block-table fork, no K/V copied."""
        self._reindex_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes ``repeats`` rows sharing its blocks (a prompt for its beams or samples)."""
        self._reindex_rows([i for i in range(len(self._rows)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._reindex_rows(torch.as_tensor(indices).tolist())

    def crop(self, tokens_to_remove: int) -> None:
        """Drop columns at the end: ``crop(-n)`` removes ``n``; ``crop(n)`` with n > 0 keeps ``n``."""
        self.check_no_pending()
        tokens_to_remove = int(tokens_to_remove)  # transformers 5.17 passes a 0-d tensor
        keep = self._columns + tokens_to_remove if tokens_to_remove < 0 else min(tokens_to_remove, self._columns)
        if tokens_to_remove == 0 or keep == self._columns:
            return
        keep = max(keep, 0)
        for row, seq_id in enumerate(self._rows):
            kept_tokens = int((self._token_index[row, :keep] >= 0).sum())
            self.manager.truncate(seq_id, kept_tokens)
        self._token_index = self._token_index[:, :keep]
        self._columns = keep
        self._layer_columns = [keep] * len(self._layer_columns)
        self.set_metadata(None)

    def reset(self) -> None:
        """Free every block of this cache's rows and forget them (the pools stay allocated for reuse)."""
        for seq_id in self._rows:
            self.manager.free(seq_id)
        self._rows = []
        self._columns = 0
        self._layer_columns = [0] * len(self._layer_columns)
        self._token_index = torch.empty(0, 0, dtype=torch.long)
        self._has_holes = False
        self.prompt_copies = 1
        self.drop_pending()
        self.set_metadata(None)

    def release(self) -> None:
        """Return all blocks and drop the pools unless a fork still uses them (the cache can be
        reused afterwards)."""
        self.reset()
        if all(user is self for user in self._pool.users):
            self.storage.clear()

    # ------------------------------------------------------------------ writing (attention side)
    def commit(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, new_valid: torch.Tensor | None) -> None:
        """Store a layer's new K/V ``[rows, kv_heads, q, head_dim]``; pad columns (``new_valid`` False) are skipped."""
        rows, _, q_len, _ = key.shape
        if self._layer_columns[layer_idx] == self._columns:  # first layer of this forward: allocate
            self._allocate(rows, q_len, new_valid)
        elif self._layer_columns[layer_idx] + q_len != self._columns:
            raise RuntimeError(f"PagedKVCache: layer {layer_idx} is out of step with the other layers")
        self.storage.ensure_layer(layer_idx, key.transpose(1, 2), self.manager.num_blocks)
        slots = self.metadata_on(key.device).slot_mapping
        self.storage.write(
            layer_idx,
            key.transpose(1, 2).reshape(rows * q_len, *key.shape[1:2], key.shape[-1]),
            value.transpose(1, 2).reshape(rows * q_len, *value.shape[1:2], value.shape[-1]),
            slots.reshape(-1),
        )
        self._layer_columns[layer_idx] = self._columns

    def _allocate(self, rows: int, q_len: int, new_valid: torch.Tensor | None) -> None:
        if not self._rows:
            self._rows = [self._new_seq() for _ in range(rows)]
            self._token_index = torch.empty(rows, self._columns, dtype=torch.long)
        elif rows != len(self._rows):
            raise ValueError(f"PagedKVCache holds {len(self._rows)} rows but the batch has {rows}")
        valid = torch.ones(rows, q_len, dtype=torch.bool) if new_valid is None else new_valid.to("cpu", torch.bool)
        counts = valid.sum(1).tolist()
        lengths = torch.tensor([self.manager.seq_len(s) for s in self._rows], dtype=torch.long)
        _, copies = self.manager.append_many(list(zip(self._rows, counts)))
        self.storage.grow(self.manager.num_blocks)
        self.storage.copy_blocks(copies)
        seen = (lengths > 0)[:, None] | valid.cummax(1).values
        self._has_holes = self._has_holes or bool((seen & ~valid).any())
        new_index = torch.where(valid, lengths[:, None] + valid.long().cumsum(1) - 1, -1)
        self._token_index = torch.cat([self._token_index, new_index], 1)
        self._columns += q_len
        tables = self.block_tables()
        all_slots = self._slots_of(self._token_index, tables)
        new_counts = torch.tensor(counts, dtype=torch.int32)
        self.set_metadata(AttentionMetadata(
            slot_mapping=all_slots[:, -q_len:],
            block_tables=tables,
            context_lens=lengths.to(torch.int32) + new_counts,
            cu_seqlens_q=torch.nn.functional.pad(new_counts.cumsum(0, dtype=torch.int32), (1, 0)),
            column_slots=all_slots,
            new_valid=valid,
        ))

    def _slots_of(self, token_index: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        bs = self.block_size
        safe = token_index.clamp(min=0)
        blocks = tables.long().gather(1, (safe // bs).clamp(max=max(tables.shape[1] - 1, 0)))
        return torch.where(token_index >= 0, blocks * bs + safe % bs, -1)

    def _fresh_seq_id(self) -> int:
        return next(self._pool.seq_ids)

    def _new_seq(self) -> int:
        seq_id = self._fresh_seq_id()
        self.manager.add_sequence(seq_id)
        return seq_id

    def _reindex_rows(self, sources: list[int]) -> None:
        """Row i of the new batch continues old row ``sources[i]``: fork, then free the old rows."""
        self.check_no_pending()
        if not self._rows:  # nothing stored yet (e.g. a fresh cache): nothing to share
            return
        if any(not 0 <= s < len(self._rows) for s in sources):
            raise IndexError(f"row index out of range for a cache of {len(self._rows)} rows: {sources}")
        new_rows = []
        for src in sources:
            seq_id = self._fresh_seq_id()
            self.manager.fork(self._rows[src], seq_id)
            new_rows.append(seq_id)
        for seq_id in self._rows:
            self.manager.free(seq_id)
        self._rows = new_rows
        self._token_index = self._token_index[sources]
        self.set_metadata(None)

    def layer_states(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """K/V of one layer as ``DynamicCache`` holds them, ``[rows, kv_heads, columns, head_dim]``
        (a sliding layer: its last ``window - 1`` columns); pad columns read as zeros (stock keeps
        whatever the model computed there, which no mask lets through). A copy: ``layers[i].keys``."""
        self.check_no_pending()
        if layer_idx not in self.storage.key_pools or not self._rows:
            return None, None
        columns = self._layer_columns[layer_idx]
        window = self.sliding_windows[layer_idx]
        first = 0 if window is None else max(columns - (window - 1), 0)
        slots = self._slots_of(self._token_index[:, first:columns], self.block_tables())
        keys, values = self.storage.gather(layer_idx, slots)
        return keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()

    # ------------------------------------------------------------------ reading (attention side)
    def block_tables(self) -> torch.Tensor:
        """int32 ``[rows, max_blocks]`` block tables (``BLOCK_TABLE_PAD`` past each row's blocks)."""
        tables = [self.manager.block_table(s) for s in self._rows]
        width = max((len(t) for t in tables), default=0)
        padded = [t + [BLOCK_TABLE_PAD] * (width - len(t)) for t in tables]
        return torch.tensor(padded, dtype=torch.int32).reshape(len(tables), width)

    def kv_window(self, layer_idx: int, q_len: int) -> tuple[int, int]:
        """(kv_offset, kv_length) of the columns a layer's attention covers, after committing ``q_len`` columns.

        The same window ``get_mask_sizes`` announced before the forward (sliding layers see the
        last ``window - 1`` past columns plus the new ones, as ``DynamicSlidingWindowLayer``).
        """
        past = self._layer_columns[layer_idx] - q_len
        window = self.sliding_windows[layer_idx]
        if window is None:
            return 0, past + q_len
        offset = max(past - window + 1, 0)
        return offset, self._layer_columns[layer_idx] - offset

    def dense_kv(self, layer_idx: int, q_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V ``[rows, kv_heads, kv_length, head_dim]`` as DynamicCache holds them (pads zero): a
        transposed view of the gather (attention functions read strides; copying it contiguous
        changed no bit of the logits and cost a second copy per layer).

        This is the reference read path (CPU): same values, same mask, same attention function as
        stock transformers, hence identical outputs (tests/test_equality.py checks the logits bit for bit).
        """
        offset, length = self.kv_window(layer_idx, q_len)
        device = self.storage.key_pools[layer_idx].device
        slots = self.metadata_on(device).column_slots[:, offset : offset + length]
        keys, values = self.storage.gather(layer_idx, slots)
        return keys.transpose(1, 2), values.transpose(1, 2)

    @property
    def kernels_applicable(self) -> bool:
        """Kernels assume each row's tokens are contiguous (left padding only) and non-empty."""
        return not self._has_holes and self.metadata is not None and int(self.metadata.context_lens.min()) > 0

    # ------------------------------------------------------------------ accounting
    def stats(self) -> dict[str, float | int]:
        """Memory accounting of the cache (the paper's utilization and sharing numbers)."""
        bs, manager = self.block_size, self.manager
        filled: dict[int, int] = {}
        logical = 0
        for seq_id in self._rows:
            length = manager.seq_len(seq_id)
            logical += length
            for i, block in enumerate(manager.block_table(seq_id)):
                filled[block] = max(filled.get(block, 0), min(bs, length - i * bs))
        used = manager.num_used_blocks
        tokens_stored = sum(filled.values())
        per_block = self.storage.bytes_per_block()
        per_token_layer = {
            i: 2 * k.shape[2] * k.shape[3] * k.element_size() for i, k in self.storage.key_pools.items()
        }
        contiguous = 0
        for i, per_token in per_token_layer.items():
            window = self.sliding_windows[i]
            held = self._columns if window is None else min(self._columns, window - 1)
            contiguous += len(self._rows) * held * per_token
        return {
            "block_size": bs,
            "blocks_total": manager.num_blocks,
            "blocks_used": used,
            "blocks_free": manager.num_free_blocks,
            "blocks_shared": manager.num_shared_blocks,
            "blocks_peak": manager.blocks_peak,
            "num_sequences": len(self._rows),
            "tokens_stored": tokens_stored,
            "tokens_logical": logical,
            "slots_allocated": used * bs,
            "utilization": tokens_stored / (used * bs) if used else 1.0,
            "bytes_used": used * per_block,
            "bytes_allocated": manager.num_blocks * per_block if self.storage.key_pools else 0,
            "bytes_contiguous_equivalent": contiguous,
        }

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"PagedKVCache(rows={s['num_sequences']}, block_size={s['block_size']}, "
            f"blocks_used={s['blocks_used']}/{s['blocks_total']}, utilization={s['utilization']:.3f})"
        )
