"""``PagedKVCache``: a transformers ``Cache`` whose K/V live in blocks addressed by block tables.

An enabled model's forward hooks open each forward on the cache (:meth:`PagedKVCache.begin_forward`)
with its 2D padding mask (pad columns are not stored) and one of two routes:

* the reference route (no Triton: CPU): ``update`` stores the new K/V in their blocks and returns
  the K/V a ``DynamicCache`` would return, read from the blocks; the model's own attention
  implementation and masks do the rest, exactly as with ``DynamicCache``;
* the kernel route (Triton): ``update`` stashes the new K/V for the ``"hf_paged"`` attention
  function (the stash/claim channel of :mod:`hf_paged.channel`), which stores them and reads the
  blocks with the kernels, never building dense K/V.

Columns vs tokens: transformers counts *columns* (the padded length, pads included). The cache
reports columns exactly as ``DynamicCache`` would (so masks and positions match stock), but stores
only real tokens; ``_slot_map(group)[row, column]`` holds each column's slot (−1 = pad).

Layer groups (:mod:`hf_paged.layer_groups`): full-attention layers share one block table per row,
the layers of each sliding window another; a sliding group gives back the blocks its window has
left behind, so a sliding layer holds about what ``DynamicSlidingWindowLayer`` holds.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field

import torch
import transformers
from packaging.version import Version
from transformers import PretrainedConfig

from hf_paged import state_layers
from hf_paged.block_manager import HOLE, BlockManager, NoFreeBlocksError
from hf_paged.channel import BLOCK_TABLE_PAD, AttentionMetadata, PagedLayerView, StashingCache
from hf_paged.kinds import MLAAttentionSpec, SharedKVSpec
from hf_paged.layer_groups import GroupedBlockManager, LayerGroup, group_of_layers, layer_groups
from hf_paged.model_info import layer_kinds
from hf_paged.prefix_index import PrefixIndex
from hf_paged.storage import PagedKVStorage

RELEASED_SLOT = 0  # slot-map entry of a column whose block a sliding group does not hold: never read


def new_columns_valid(padding_mask: torch.Tensor | None, q_len: int, columns: int) -> torch.Tensor | None:
    """Which of the ``q_len`` newest of ``columns`` columns are real tokens, from a 2D padding mask
    (None: all of them). A mask shorter than ``columns`` leaves the missing columns masked, as stock."""
    if padding_mask is None:
        return None
    if padding_mask.shape[-1] < columns:
        padding_mask = torch.nn.functional.pad(padding_mask, (0, columns - padding_mask.shape[-1]))
    return padding_mask[:, columns - q_len : columns]


def left_padded_rows(input_ids: torch.Tensor, padding_mask: torch.Tensor | None) -> tuple[list[list[int]], list[int]]:
    """Each row's real token ids and its count of leading pad columns, from a left-padded batch."""
    columns = input_ids.shape[1]
    lengths = [columns] * input_ids.shape[0] if padding_mask is None else padding_mask.sum(1).tolist()
    return [row[columns - n :] for row, n in zip(input_ids.tolist(), lengths)], [columns - n for n in lengths]


@dataclass
class KVPool:
    """Blocks and their K/V, shared by a cache and its forks (each fork has rows of its own), or by
    every ``generate()`` call of a model with a prefix cache (``prefix``: the pool's index of
    cached blocks; such a pool outlives its caches)."""

    blocks: GroupedBlockManager
    storage: PagedKVStorage
    prefix: PrefixIndex | None = None
    seq_ids: itertools.count = field(default_factory=itertools.count)
    users: weakref.WeakSet = field(default_factory=weakref.WeakSet)

    @classmethod
    def for_config(cls, config: PretrainedConfig, block_size: int, num_blocks: int | None,
                   prefix_caching: bool = False) -> KVPool:
        _, specs = layer_kinds(config.get_text_config(decoder=True))
        blocks = GroupedBlockManager(block_size, num_blocks, layer_groups(specs))
        return cls(blocks, PagedKVStorage(block_size), PrefixIndex(blocks) if prefix_caching else None)


# transformers 5.18 on refuses ``crop(n)`` with n > 0 (before, it kept ``n`` columns, deprecated)
STOCK_REFUSES_POSITIVE_CROP = Version(transformers.__version__) >= Version("5.18.0.dev0")


def heads_view(slots: torch.Tensor, start: int, rows: int, length: int) -> torch.Tensor:
    """Slots ``start .. start + rows * length`` of ``[slots, kv_heads, head_dim]`` K or V, row after
    row, as the ``[rows, kv_heads, length, head_dim]`` that attention reads: one view, no copy."""
    slot_stride, head_stride, dim_stride = slots.stride()
    return slots.as_strided((rows, slots.shape[1], length, slots.shape[2]),
                            (length * slot_stride, head_stride, slot_stride, dim_stride),
                            slots.storage_offset() + start * slot_stride)


@dataclass
class _ForwardPlan:
    """What one forward stores and reads, worked out once for all its layers."""

    q_len: int
    new_valid: torch.Tensor | None  # [rows, q_len]: which new columns are real (None: all)
    write_slots: list[torch.Tensor]  # per layer group: slots of the real new tokens, row by row
    write_rows: torch.Tensor | None  # their positions among the rows * q_len new K/V (None: all)
    new_columns: list[torch.Tensor]  # per layer group: [rows, q_len] slots of the new columns (-1: pad)
    lengths: list[int]  # tokens each row had stored before this forward
    counts: list[int]  # real tokens each row stores in this forward
    new_kv: tuple | None = None  # (layer, key, value, flat K, flat V) of the layer being computed
    reads: dict = field(default_factory=dict)  # what the layers' reads and writes share, built once

    def on(self, device: torch.device, name: str, group: int = 0) -> torch.Tensor:
        """``write_slots`` (of a layer group) or ``write_rows`` on ``device`` (layers may sit on
        different devices)."""
        key = (name, group, device)
        if key not in self.reads:
            value = getattr(self, name)
            self.reads[key] = (value[group] if isinstance(value, list) else value).to(device)
        return self.reads[key]


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
        pool: blocks and K/V to live in instead of a pool of its own (a model's prefix cache:
            :mod:`hf_paged.prefix_cache`); ``block_size`` and ``num_blocks`` are then the pool's.

    Use it with a model prepared by :func:`hf_paged.enable`::

        cache = PagedKVCache(model.config, block_size=16)
        model.generate(**inputs, past_key_values=cache)
        cache.stats()

    ``copy.deepcopy(cache)`` and :meth:`fork` give a cache that shares every block (copy on write):
    a prompt cache can be reused for many requests at the cost of their new tokens only.
    """

    def __init__(self, config: PretrainedConfig, block_size: int = 16, num_blocks: int | None = None,
                 pool: KVPool | None = None):
        if not isinstance(config, PretrainedConfig):
            raise TypeError(f"PagedKVCache needs the model config, got {type(config).__name__}")
        config = config.get_text_config(decoder=True)
        self.layer_types, self.specs = layer_kinds(config)
        self.sliding_windows = [None if spec is None else spec.window for spec in self.specs]
        super().__init__(self._cache_layer_windows())
        state_layers.build_state_layers(self, config, self.layer_types, self.sliding_windows)  # hybrid models
        self.config = config
        self.block_size = block_size
        self.groups: list[LayerGroup] = layer_groups(self.specs)
        self._group_of = group_of_layers(self.groups, self.specs)  # layer -> index of the group it reads
        self._kv_sources = {spec.source for spec in self.specs if isinstance(spec, SharedKVSpec)}  # read by later layers
        if pool is None:
            pool = KVPool(GroupedBlockManager(block_size, num_blocks, self.groups), PagedKVStorage(block_size))
        elif pool.blocks.block_size != block_size or pool.blocks.groups != self.groups:
            raise ValueError("PagedKVCache: the pool was made for another block size or layer structure")
        self._join(pool)
        self._tokens: dict[int, list[int]] = {}  # with a prefix index: each row's stored tokens
        self._prefix_queried = self._prefix_hit = 0  # this cache's own prefix lookups
        self.shares_prefixes = True  # with a prefix index: the first forward may first compute what rows share
        self._rows: list[int] = []  # block-manager sequence id of each batch row (the same in every group)
        self._columns = 0  # columns with allocated slots (all layers reach it within a forward)
        self._layer_columns = [0] * len(self.layers)
        self._slot_bufs = self._empty_slot_bufs()  # per group [rows, capacity]; see _slot_map
        self._has_holes = False  # a pad column after a real one: kernels need contiguous tokens
        self._plan: _ForwardPlan | None = None  # the forward in progress
        self._read_bufs: dict = {}  # see _read_buffers
        self._runs: list[int | None] = [None] * len(self.groups)  # per group: one row whose slots follow each other
        self._forward: tuple | None = None  # (padding mask, kernels?, token ids) of the forward running now
        self.prompt_copies = 1  # set by generate(): rows of the first forward are this many copies
        self.stock_layout = False  # set by generate() for models only the reference route serves (see begin_forward)
        # Set by generate() for attention that multiplies K/V as given (eager): K/V are returned
        # contiguous, as DynamicCache's torch.cat makes them (matmul rounds by layout; SDPA does not).
        self.contiguous_kv = False

    def _cache_layer_windows(self) -> list[int | None]:
        """The windows of ``self.layers``: one per layer type transformers gives, as ``DynamicCache``
        has (transformers 5.17 builds none for KV-sharing layers; ``specs`` still covers every layer)."""
        return self.sliding_windows[:len(self.layer_types)]

    def _join(self, pool: KVPool) -> None:
        self._pool, self.blocks, self.storage = pool, pool.blocks, pool.storage
        self.prefix = pool.prefix
        pool.users.add(self)

    @property
    def pool(self) -> KVPool:
        """The blocks and K/V this cache lives in (shared with its forks, or a model's prefix cache)."""
        return self._pool

    @property
    def managers(self) -> list[BlockManager]:
        """One block manager per layer group (``groups``), in the same order."""
        return self.blocks.managers

    @property
    def manager(self) -> BlockManager:
        """The first layer group's block manager (the full-attention layers when there are any)."""
        return self.blocks.managers[0]

    def _empty_slot_bufs(self) -> list[torch.Tensor]:
        return [torch.empty(0, 0, dtype=torch.long) for _ in self.groups]

    def fork(self) -> PagedKVCache:
        """A cache with the same rows, sharing every block (copy on write): both continue on their own."""
        self.check_no_pending()
        clone = object.__new__(type(self))
        StashingCache.__init__(clone, self._cache_layer_windows())
        clone.layer_types, clone.specs, clone.sliding_windows = self.layer_types, self.specs, self.sliding_windows
        clone.config, clone.block_size = self.config, self.block_size
        clone.groups, clone._group_of, clone._kv_sources = self.groups, self._group_of, self._kv_sources
        clone._join(self._pool)
        state_layers.copy_state_layers(self, clone)
        clone._rows, clone._tokens = [], {}
        clone._prefix_queried = clone._prefix_hit = 0
        clone.shares_prefixes = True
        for seq_id in self._rows:
            clone._rows.append(clone._fresh_seq_id())
            self._fork_seq(seq_id, clone._rows[-1], clone)
        clone._columns, clone._layer_columns = self._columns, list(self._layer_columns)
        clone._slot_bufs = [buf.clone() for buf in self._slot_bufs]
        clone._has_holes, clone._plan, clone._runs = self._has_holes, None, [None] * len(self.groups)
        clone._forward, clone._read_bufs = None, {}
        clone.prompt_copies, clone.stock_layout, clone.contiguous_kv = 1, self.stock_layout, self.contiguous_kv
        return clone

    def __deepcopy__(self, memo) -> PagedKVCache:
        return self.fork()

    def __del__(self) -> None:
        # A fork may outlive this cache in the same pool: this cache's rows go back with it.
        try:
            for seq_id in self._rows:
                if seq_id in self.blocks:
                    self._free_seq(seq_id)
        except Exception:  # noqa: BLE001 - never raise from a finalizer (e.g. at interpreter exit)
            pass

    # ------------------------------------------------------------------ transformers API
    @property
    def batch_size(self) -> int:
        return len(self._rows) if self._rows else -1

    def get_seq_length(self, layer_idx: int = 0) -> int:
        self.check_no_pending()
        layer_idx = state_layers.attention_layer_index(self.layers, layer_idx)
        return self._layer_columns[layer_idx] if layer_idx < len(self._layer_columns) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """Same sizes as ``DynamicCache``: masks, and so outputs, match stock transformers."""
        layer_idx = state_layers.attention_layer_index(self.layers, layer_idx)
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
        state_layers.reorder_states(self.layers, beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes ``repeats`` rows sharing its blocks (a prompt for its beams or samples)."""
        self._reindex_rows([i for i in range(len(self._rows)) for _ in range(repeats)])
        state_layers.repeat_states(self.layers, repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._reindex_rows(torch.as_tensor(indices).tolist())
        state_layers.select_states(self.layers, indices)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop columns at the end: ``crop(-n)`` removes ``n``; ``crop(n)`` with n > 0 keeps ``n``
        where the installed transformers still does that (before 5.18). Refused as ``DynamicCache``
        refuses: a positive value where it does, and any crop of a sliding layer that has reached
        its window unless it records its past (``activate_past_recording``), then a positive one."""
        self.check_no_pending()
        tokens_to_remove = int(tokens_to_remove)  # transformers 5.17 passes a 0-d tensor
        self._refuse_crop_as_stock(tokens_to_remove)
        state_layers.crop_states(self.layers, tokens_to_remove)  # first: one that refuses leaves all as it was
        keep = self._columns + tokens_to_remove if tokens_to_remove < 0 else min(tokens_to_remove, self._columns)
        if tokens_to_remove == 0 or keep == self._columns:
            return
        keep = max(keep, 0)
        kept = [int((self._slot_map(0)[row, :keep] >= 0).sum()) for row in range(len(self._rows))]
        for seq_id, kept_tokens in zip(self._rows, kept):
            self.blocks.truncate(seq_id, kept_tokens)
            # as DynamicSlidingWindowLayer.crop: back to the window, recording or not
            self.blocks.release_out_of_window(seq_id, kept_tokens)
            if seq_id in self._tokens:
                del self._tokens[seq_id][kept_tokens:]
                self.prefix.truncate(seq_id, kept_tokens)
        self._plan = None
        self._columns = keep
        self._layer_columns = [keep] * len(self._layer_columns)
        self.set_metadata(None)

    def _refuse_crop_as_stock(self, tokens_to_remove: int) -> None:
        """Raise what ``DynamicCache.crop`` would raise, checking the layers in its order."""
        for layer in self.layers:
            if not isinstance(layer, PagedLayerView):
                continue  # a recurrent layer: its own crop refuses (state_layers.crop_states)
            if layer.is_sliding and self._columns >= layer.sliding_window:
                if not layer.record_past:
                    raise RuntimeError(f"crop: layer {layer.layer_idx} has reached its sliding window and keeps no "
                                       "past; call activate_past_recording() before crop to roll it back")
                if tokens_to_remove > 0:
                    raise RuntimeError(f"crop: layer {layer.layer_idx} has reached its sliding window; only a "
                                       "negative count of tokens to remove can crop it")
            elif tokens_to_remove > 0 and STOCK_REFUSES_POSITIVE_CROP:
                raise ValueError(f"crop({tokens_to_remove}): a positive value is not supported by this transformers; "
                                 "pass the negative count of tokens to remove")

    def reset(self) -> None:
        """Free every block of this cache's rows and forget them (the pools stay allocated for reuse)."""
        for seq_id in self._rows:
            self._free_seq(seq_id)
        self._rows = []
        state_layers.reset_states(self.layers)
        self._columns = 0
        self._layer_columns = [0] * len(self._layer_columns)
        self._slot_bufs = self._empty_slot_bufs()
        self._has_holes = False
        self._plan, self._runs = None, [None] * len(self.groups)
        self._read_bufs = {}
        self.prompt_copies = 1
        self.drop_pending()
        self.set_metadata(None)

    def release(self) -> None:
        """Return all blocks and drop the pools unless a fork still uses them (the cache can be
        reused afterwards)."""
        self.reset()
        if self.prefix is None and all(user is self for user in self._pool.users):
            self.storage.clear()

    # ------------------------------------------------------------------ one forward
    def begin_forward(self, padding_mask: torch.Tensor | None, kernels: bool, input_ids: torch.Tensor | None = None) -> None:
        """A paged forward starts: its 2D padding mask ``[rows, columns]`` (None: no padding),
        whether the Triton kernels read this forward (else ``update`` returns dense K/V), and its
        token ids (a prefix cache indexes the blocks by them; None: rows stop being indexed).

        With ``stock_layout`` (a model whose attention hf_paged cannot see: inline, its own mask,
        K/V changed after ``update``) pad columns are stored too and reads are contiguous, so
        ``update`` returns exactly what ``DynamicCache`` returns even to a model that attends to
        pads or reshapes K/V with ``view``."""
        if self.stock_layout:
            padding_mask = None
        self._forward = (padding_mask if padding_mask is not None and padding_mask.dim() == 2 else None, kernels,
                         input_ids if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 else None)

    def end_forward(self, completed: bool = True) -> None:
        """The forward is over: with a prefix cache, a completed one's new full blocks are indexed
        (every layer has written them)."""
        self._forward = None
        self.forget_claims()
        if completed and self.prefix is not None:
            for seq_id in self._rows:
                tokens = self._tokens.get(seq_id)
                if tokens is not None:
                    self.prefix.register(seq_id, tokens, len(tokens))

    # ------------------------------------------------------------------ prefix cache
    def adopt_prefix(self, input_ids: torch.Tensor, padding_mask: torch.Tensor | None, max_skip: int | None = None) -> int:
        """Before the first forward, with a prefix cache: each row adopts the cached blocks of its
        prompt's longest cached prefix, so that the forward computes only the columns after them.

        ``input_ids`` is the left-padded ``[rows, columns]`` batch. The forward's columns are
        shared by all rows, so it can start only at a column every row has cached up to: ``C =
        min(pad + hit)`` over rows. A row adopts its first ``C - pad`` tokens (the block holding
        the last of them is copied before the row writes into it, as a cached block never changes).
        Every row computes at least its last token (its logits are needed), and the forward keeps
        at least ``columns - max_skip`` columns. Returns ``C``, the columns the forward can skip (0:
        nothing was adopted).
        """
        if self.prefix is None or self._rows:
            return 0
        rows, columns = input_ids.shape
        tokens, pads = left_padded_rows(input_ids, padding_mask)
        bs = self.block_size
        hits = [self.prefix.longest_hit(t, (len(t) - 1) // bs) for t in tokens]
        skip = min([pad + len(keys) * bs for pad, keys in zip(pads, hits)] + [columns if max_skip is None else max_skip])
        tables = self._tables_for(hits, pads, skip)
        while tables is None:  # a sliding group misses a block a shorter start reads: start at a lower block boundary
            skip = max(pad + (skip - pad - 1) // bs * bs for pad in pads if skip > pad)
            tables = self._tables_for(hits, pads, skip)
        queried, adopted = sum(len(t) for t in tokens), sum(max(skip - pad, 0) for pad in pads)
        self._prefix_queried, self._prefix_hit = self._prefix_queried + queried, self._prefix_hit + adopted
        self.prefix.record(queried, adopted)
        self._rows = []
        self._slot_bufs = [torch.full((rows, skip), -1, dtype=torch.long) for _ in self.groups]
        for r, (keys, pad, row_tables) in enumerate(zip(hits, pads, tables)):
            seq_id, length = self._fresh_seq_id(), max(skip - pad, 0)
            self.prefix.adopt(seq_id, keys, length, row_tables)
            self._rows.append(seq_id)
            self._tokens[seq_id] = tokens[r][:length]
            for g, table in enumerate(row_tables):
                slots = [RELEASED_SLOT if table[p // bs] == HOLE else table[p // bs] * bs + p % bs for p in range(length)]
                self._slot_bufs[g][r, pad:skip] = torch.tensor(slots, dtype=torch.long)
        self._columns = skip
        self._layer_columns = [skip] * len(self._layer_columns)
        return skip

    def _tables_for(self, hits: list[list], pads: list[int], skip: int) -> list[list[list[int]]] | None:
        tables = []
        for keys, pad in zip(hits, pads):
            row = self.prefix.tables_for(keys, max(skip - pad, 0))
            if row is None:
                return None
            tables.append(row)
        return tables

    def _fork_seq(self, parent: int, child: int, into: PagedKVCache) -> None:
        """``child`` (a row of ``into``: this cache or a fork of it) shares every block of ``parent``."""
        self.blocks.fork(parent, child)
        if parent in self._tokens:
            into._tokens[child] = list(self._tokens[parent])
            self.prefix.fork(parent, child)

    def _free_seq(self, seq_id: int) -> None:
        self.blocks.free(seq_id)
        if self._tokens.pop(seq_id, None) is not None:
            self.prefix.forget(seq_id)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """The reference route: store this layer's new K/V and return its K/V as ``DynamicCache``
        would. The kernel route: stash them for the ``"hf_paged"`` attention function."""
        forward = self._forward
        if forward is None:
            raise RuntimeError(
                "PagedKVCache: a forward used this cache without hf_paged's forward hooks; call "
                "hf_paged.enable(model) (and call the model, not model.forward)."
            )
        if forward[1]:
            return super().update(key_states, value_states, layer_idx)
        q_len = key_states.shape[2]
        new_valid = None
        if self.allocates(layer_idx):
            new_valid = new_columns_valid(forward[0], q_len, self._columns + q_len)
        self.commit(layer_idx, key_states, value_states, new_valid)
        keys, values = self.dense_kv(layer_idx, q_len)
        if self.stock_layout or self.contiguous_kv:
            return keys.contiguous(), values.contiguous()
        return keys, values

    def allocates(self, layer_idx: int) -> bool:
        """Whether ``layer_idx`` is the first layer of a forward: the one that allocates (and the
        only one whose ``commit`` reads ``new_valid``)."""
        return self._layer_columns[layer_idx] == self._columns

    def commit(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, new_valid: torch.Tensor | None) -> None:
        """Store a layer's new K/V ``[rows, kv_heads, q, head_dim]``; pad columns (``new_valid`` False) are skipped.

        The first layer of a forward allocates the slots of all its layers (``new_valid`` is read there only).
        """
        rows, kv_heads, q_len, head_dim = key.shape
        columns = self._layer_columns[layer_idx]
        if columns == self._columns:
            self._allocate(rows, q_len, new_valid)
        elif columns + q_len != self._columns:
            raise RuntimeError(f"PagedKVCache: layer {layer_idx} is out of step with the other layers")
        plan = self._plan
        if q_len == 1:  # a decode step: [rows, kv_heads, head_dim] views, no reshape
            new_k, new_v = key.select(2, 0), value.select(2, 0)
        else:
            new_k = key.transpose(1, 2).reshape(rows * q_len, kv_heads, head_dim)
            new_v = value.transpose(1, 2).reshape(rows * q_len, value.shape[1], value.shape[3])  # MLA: another width
        plan.new_kv = (layer_idx, key, value, new_k, new_v)  # what this layer's read may use as they are
        group = self._group_of[layer_idx]
        self.storage.ensure_layer(layer_idx, new_k, self.managers[group].num_blocks, new_v)
        if plan.write_rows is not None:  # pads are not stored
            rows_index = plan.on(new_k.device, "write_rows")
            new_k, new_v = new_k.index_select(0, rows_index), new_v.index_select(0, rows_index)
        self.storage.write(layer_idx, new_k, new_v, plan.on(new_k.device, "write_slots", group))
        self._layer_columns[layer_idx] = self._columns

    def _allocate(self, rows: int, q_len: int, new_valid: torch.Tensor | None) -> None:
        """Slots for this forward's real tokens in every layer group, and the plan its layers share.
        Sliding groups first give back the blocks this forward can no longer read. The bookkeeping
        is proportional to the new tokens; the slot maps grow by their columns."""
        if not self._rows:
            if not self.storage.key_pools and self.prefix is None:  # one row for good: see PagedKVStorage.new_pool
                self.storage.heads_major = rows == 1 and self.prompt_copies == 1 and not self._forward[1]
            self._rows = [self._new_seq() for _ in range(rows)]
            self._slot_bufs = [torch.full((rows, self._columns), -1, dtype=torch.long) for _ in self.groups]
        elif rows != len(self._rows):
            raise ValueError(f"PagedKVCache holds {len(self._rows)} rows but the batch has {rows}")
        valid = None if new_valid is None else new_valid.to("cpu", torch.bool)
        if valid is not None and bool(valid.all()):
            valid = None
        counts = [q_len] * rows if valid is None else valid.sum(1).tolist()
        if self._tokens:
            self._track_tokens(valid)
        lengths = [self.blocks.seq_len(s) for s in self._rows]
        if self.blocks.has_sliding:
            recording = [self._recording(group) for group in self.groups]
            for seq_id, length in zip(self._rows, lengths):
                self.blocks.release_out_of_window(seq_id, length, recording)
        try:
            allocated = self.blocks.append_many(list(zip(self._rows, counts)))
        except NoFreeBlocksError as err:
            raise self._held_elsewhere(err) from None
        write_slots, new_columns = [], []
        write_rows = None if valid is None else valid.reshape(-1).nonzero().squeeze(1)
        for g, (group, manager, (new_slots, copies)) in enumerate(zip(self.groups, self.managers, allocated)):
            self.storage.grow(manager.num_blocks, group.layers)
            if copies:
                self.storage.copy_blocks(copies, group.layers)
                self._move_copied_slots(g, copies, new_slots)
            flat = [slot for row in new_slots for slot in row]
            self._track_run(g, flat, valid is None and not copies, lengths)
            write_slots.append(torch.tensor(flat, dtype=torch.long))
            if valid is None:
                new_columns.append(write_slots[-1].view(rows, q_len))
            else:
                columns = torch.full((rows, q_len), -1, dtype=torch.long)
                columns[valid] = write_slots[-1]
                new_columns.append(columns)
        if valid is not None:
            seen = torch.tensor(lengths)[:, None].gt(0) | valid.cummax(1).values
            self._has_holes = self._has_holes or bool((seen & ~valid).any())
        self._append_columns(new_columns)
        self._plan = _ForwardPlan(q_len, valid, write_slots, write_rows, new_columns, lengths, counts)
        self.set_metadata(None)

    def _track_tokens(self, valid: torch.Tensor | None) -> None:
        """With a prefix cache: each row's new real tokens join its token list (a forward without
        token ids, e.g. from embeddings, ends the indexing of its rows)."""
        input_ids = self._forward[2] if self._forward else None
        if input_ids is None or input_ids.shape[0] != len(self._rows):
            for seq_id in self._rows:
                if self._tokens.pop(seq_id, None) is not None:
                    self.prefix.forget(seq_id)
            return
        ids = input_ids.tolist()
        keep = None if valid is None else valid.tolist()
        for r, seq_id in enumerate(self._rows):
            if seq_id in self._tokens:
                new = ids[r] if keep is None else [t for t, k in zip(ids[r], keep[r]) if k]
                self._tokens[seq_id].extend(new)

    def _held_elsewhere(self, err: NoFreeBlocksError) -> NoFreeBlocksError:
        """``err``, saying so when other live caches of a shared pool (a model's prefix cache) hold
        blocks: each kept ``generate()`` output (its cache) or a traceback that references one does."""
        holders = [user for user in self._pool.users if user is not self and user._rows]
        if not holders:
            return err
        return NoFreeBlocksError(err.needed, err.free, err.total, f"; {len(holders)} other live cache(s) of this "
                                 "model's pool hold blocks (outputs of earlier calls, kept or referenced by a "
                                 "traceback): dropping them frees their blocks")

    def _recording(self, group: LayerGroup) -> bool:
        """Whether transformers asked the group's layers to keep their past (``activate_past_recording``)."""
        return any(getattr(self.layers[i], "record_past", False) for i in group.layers)

    def _track_run(self, group: int, flat: list[int], no_pads: bool, lengths: list[int]) -> None:
        """Whether the single row's slots (in a layer group) still follow each other (its K/V are
        then read in place)."""
        if len(self._rows) != 1 or not no_pads or not flat or any(b != a + 1 for a, b in zip(flat, flat[1:])):
            self._runs[group] = None
        elif self._columns == 0:
            self._runs[group] = flat[0]
        elif self._runs[group] is not None and flat[0] != self._runs[group] + lengths[0]:
            self._runs[group] = None

    def _slot_map(self, group: int) -> torch.Tensor:
        """A layer group's ``[rows, columns]``: the slot of each column's token, -1 for pads (a view
        of a buffer that grows by doubling, so a step appends its columns without copying the
        others). A sliding group's columns before its window keep slots that were given back:
        never read."""
        return self._slot_bufs[group][:, : self._columns]

    def _append_columns(self, new_columns: list[torch.Tensor]) -> None:
        end = self._columns + new_columns[0].shape[1]
        for g, columns in enumerate(new_columns):
            buf = self._slot_bufs[g]
            if end > buf.shape[1]:
                grown = torch.full((len(self._rows), max(end, 2 * buf.shape[1])), -1, dtype=torch.long)
                grown[:, : self._columns] = buf[:, : self._columns]
                buf = self._slot_bufs[g] = grown
            buf[:, self._columns : end] = columns
        self._columns = end

    def _move_copied_slots(self, group: int, copies: list[tuple[int, int]], new_slots: list[list[int]]) -> None:
        """Copy on write moved a row's partly filled last block: its tokens there have new slots."""
        bs, slot_map = self.block_size, self._slot_map(group)
        row_of_block = {row[0] // bs: r for r, row in enumerate(new_slots) if row}
        for src, dst in copies:
            r = row_of_block[dst]  # the row's first new token went into the copy
            moved = slot_map[r] // bs == src
            slot_map[r] = torch.where(moved, slot_map[r] + (dst - src) * bs, slot_map[r])

    def _fresh_seq_id(self) -> int:
        return next(self._pool.seq_ids)

    def _new_seq(self) -> int:
        seq_id = self._fresh_seq_id()
        self.blocks.add_sequence(seq_id)
        if self.prefix is not None:
            self._tokens[seq_id] = []
        return seq_id

    def _reindex_rows(self, sources: list[int]) -> None:
        """Row i of the new batch continues old row ``sources[i]``. The first row to continue an old
        row takes its sequence over (no block changes hands); further ones fork it; old rows nobody
        continues are freed. A beam-search step so touches only the beams that were duplicated or
        dropped, not every block of every beam."""
        self.check_no_pending()
        if not self._rows:  # nothing stored yet (e.g. a fresh cache): nothing to share
            return
        if any(not 0 <= s < len(self._rows) for s in sources):
            raise IndexError(f"row index out of range for a cache of {len(self._rows)} rows: {sources}")
        taken, new_rows = set(), []
        for src in sources:
            if src in taken:
                new_rows.append(self._fresh_seq_id())
                self._fork_seq(self._rows[src], new_rows[-1], self)
            else:
                taken.add(src)
                new_rows.append(self._rows[src])
        for row, seq_id in enumerate(self._rows):
            if row not in taken:
                self._free_seq(seq_id)
        self._rows = new_rows
        self._slot_bufs = [buf[sources] for buf in self._slot_bufs]
        self._plan, self._runs = None, [None] * len(self.groups)
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
        keys, values = self.storage.gather(layer_idx, self._slot_map(self._group_of[layer_idx])[:, first:columns])
        return keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()

    # ------------------------------------------------------------------ reading (attention side)
    def block_tables(self, group: int = 0) -> torch.Tensor:
        """int32 ``[rows, max_blocks]`` block tables of a layer group (``BLOCK_TABLE_PAD`` past each
        row's blocks, and where a sliding group gave blocks back: the kernels never read those)."""
        tables = [self.managers[group].block_table(s) for s in self._rows]
        width = max((len(t) for t in tables), default=0)
        padded = [[BLOCK_TABLE_PAD if b == HOLE else b for b in t] + [BLOCK_TABLE_PAD] * (width - len(t))
                  for t in tables]
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
        """K/V ``[rows, kv_heads, kv_length, head_dim]`` with the values DynamicCache holds: the
        reference read path (CPU). Same values, same mask, same attention function as stock
        transformers, hence identical outputs (tests/test_equality.py checks the logits bit for bit).

        Attention functions read strides, so the result is a transposed view (a contiguous copy
        changed no bit and cost a second copy per layer). A single row whose blocks follow each
        other is read in place, with no gather. Past pad columns hold other tokens' K/V: masked,
        they add exactly zero. This forward's pad columns hold what the model computed for them,
        as in stock, because a pad query attends to them (its output is a hidden state users see).
        A forward with nothing cached before it reads the model's own tensors (what DynamicCache
        returns then).
        """
        offset, length = self.kv_window(layer_idx, q_len)
        plan, rows = self._plan, len(self._rows)
        if length == q_len and plan.new_kv[0] == layer_idx:
            return plan.new_kv[1], plan.new_kv[2]
        k_rows, v_rows = self.storage.slot_rows(layer_idx)
        group = self._group_of[layer_idx]
        run = self._runs[group]
        if run is not None:
            return heads_view(k_rows, run + offset, 1, length), heads_view(v_rows, run + offset, 1, length)
        if torch.is_grad_enabled() or layer_idx in self._kv_sources:  # results kept: fresh tensors
            index = self._gather_index(group, offset, length, k_rows.device)
            keys, values = k_rows.index_select(0, index), v_rows.index_select(0, index)
            k_view, v_view = heads_view(keys, 0, rows, length), heads_view(values, 0, rows, length)
        else:
            index, keys, values, k_view, v_view = self._shared_read(group, offset, length, k_rows, v_rows)
            torch.index_select(k_rows, 0, index, out=keys)
            torch.index_select(v_rows, 0, index, out=values)
        if plan.new_valid is not None and plan.new_kv[0] == layer_idx:
            new_k, new_v = plan.new_kv[3:]
            keys.view(rows, length, *k_rows.shape[1:])[:, -q_len:] = new_k.view(rows, q_len, *new_k.shape[1:])
            values.view(rows, length, *v_rows.shape[1:])[:, -q_len:] = new_v.view(rows, q_len, *new_v.shape[1:])
        return k_view, v_view

    def _gather_index(self, group: int, offset: int, length: int, device: torch.device) -> torch.Tensor:
        """The slots of columns ``offset .. offset + length`` of every row, row after row (pads read
        slot 0: masked), worked out once per layer group and forward."""
        key = (group, offset, length, device)
        index = self._plan.reads.get(key)
        if index is None:
            index = self._slot_map(group)[:, offset : offset + length].clamp(min=0).reshape(-1).to(device)
            self._plan.reads[key] = index
        return index

    def _shared_read(self, group: int, offset: int, length: int, k_rows: torch.Tensor, v_rows: torch.Tensor) -> tuple:
        """(index, K and V buffers ``[rows * length, kv_heads, head_dim]``, their ``[rows, kv_heads,
        length, head_dim]`` views) of a read that layers of this forward share: each layer's
        attention is done with its K/V before the next layer gathers into the same buffers
        (without autograd; a KV-sharing source's are its own, later layers attend with them).
        Worked out once per forward for each window and pool shape: a decode step's layers then
        only gather."""
        key = ("read", group, offset, length, k_rows.device, k_rows.dtype, k_rows.shape[1:], v_rows.shape[1:])
        read = self._plan.reads.get(key)
        if read is None:
            index = self._gather_index(group, offset, length, k_rows.device)
            keys, values = self._read_buffers(index.shape[0], k_rows, v_rows)
            rows = len(self._rows)
            read = self._plan.reads[key] = (index, keys, values, heads_view(keys, 0, rows, length),
                                            heads_view(values, 0, rows, length))
        return read

    def _read_buffers(self, slots: int, k_like: torch.Tensor, v_like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[slots, kv_heads, head_dim]`` buffers shaped like ``k_like``'s and ``v_like``'s rows (an
        MLA layer's differ), cut from ones kept across steps (grown by doubling: a decode step
        allocates nothing to read; they hold about one layer's dense K/V and go with ``reset``)."""
        key = (k_like.device, k_like.dtype, tuple(k_like.shape[1:]), tuple(v_like.shape[1:]))
        buffers = self._read_bufs.get(key)
        if buffers is None or buffers[0].shape[0] < slots:
            capacity = slots if buffers is None else max(slots, 2 * buffers[0].shape[0])
            buffers = self._read_bufs[key] = (k_like.new_empty((capacity, *k_like.shape[1:])),
                                              v_like.new_empty((capacity, *v_like.shape[1:])))
        return buffers[0][:slots], buffers[1][:slots]

    def set_metadata(self, metadata: AttentionMetadata | None) -> None:
        super().set_metadata(metadata)
        self._group_metadata: dict = {}  # (group, device) -> this forward's kernel metadata

    def metadata_for(self, layer_idx: int, device: torch.device) -> AttentionMetadata:
        """The kernels' metadata of this forward for a layer's group, on ``device``: built on first
        use (the CPU reference path never needs block tables), once per group and device."""
        group = self._group_of[layer_idx]
        key = (group, device)
        if key not in self._group_metadata:
            plan = self._plan
            counts = torch.tensor(plan.counts, dtype=torch.int32)
            valid = plan.new_valid if plan.new_valid is not None else torch.ones(len(counts), plan.q_len, dtype=torch.bool)
            self._group_metadata[key] = AttentionMetadata(
                slot_mapping=plan.new_columns[group],
                block_tables=self.block_tables(group),
                context_lens=torch.tensor(plan.lengths, dtype=torch.int32) + counts,
                cu_seqlens_q=torch.nn.functional.pad(counts.cumsum(0, dtype=torch.int32), (1, 0)),
                new_valid=valid,
            ).to(device)
        return self._group_metadata[key]

    @property
    def kernel_route_problem(self) -> str | None:
        """Why this cache's forwards take the reference route even where the kernels could read
        (None: they may take the kernel route)."""
        if any(isinstance(spec, MLAAttentionSpec) for spec in self.specs):
            return ("MLA layers: the model expands the cached latent into K/V after update, and the kernels do not "
                    "attend in latent space; generate() reads MLA models on the reference route on every device")
        return None

    @property
    def kernels_applicable(self) -> bool:
        """Kernels assume each row's tokens are contiguous (left padding only) and non-empty."""
        plan = self._plan
        return (not self._has_holes and plan is not None
                and min(n + c for n, c in zip(plan.lengths, plan.counts)) > 0)

    # ------------------------------------------------------------------ accounting
    def stats(self) -> dict:
        """Memory accounting of the cache (the paper's utilization and sharing numbers), summed over
        layer groups, with each group's own numbers under ``"groups"``. ``bytes_contiguous_equivalent``
        is what ``DynamicCache`` holds for the same rows (a sliding layer: its last ``window - 1``
        columns)."""
        groups = [self._group_stats(g) for g in range(len(self.groups))]
        used = sum(g["blocks_used"] for g in groups)
        tokens_stored = sum(g["tokens_stored"] for g in groups)
        slots = sum(g["slots_allocated"] for g in groups)
        return {
            "block_size": self.block_size,
            "blocks_total": sum(g["blocks_total"] for g in groups),
            "blocks_used": used,
            "blocks_free": sum(g["blocks_free"] for g in groups),
            "blocks_shared": sum(g["blocks_shared"] for g in groups),
            "blocks_peak": sum(g["blocks_peak"] for g in groups),
            "num_sequences": len(self._rows),
            "tokens_stored": tokens_stored,
            "tokens_logical": groups[0]["tokens_logical"],
            "slots_allocated": slots,
            "utilization": tokens_stored / slots if slots else 1.0,
            "bytes_used": sum(g["bytes_used"] for g in groups),
            "bytes_allocated": sum(g["bytes_allocated"] for g in groups),
            "bytes_contiguous_equivalent": sum(g["bytes_contiguous_equivalent"] for g in groups),
            "prefix_queried_tokens": self._prefix_queried,
            "prefix_hit_tokens": self._prefix_hit,
            "groups": groups,
        }

    def _group_stats(self, g: int) -> dict:
        group, manager, bs = self.groups[g], self.managers[g], self.block_size
        filled: dict[int, int] = {}
        logical = 0
        for seq_id in self._rows:
            length = manager.seq_len(seq_id)
            logical += length
            for i, block in enumerate(manager.block_table(seq_id)):
                if block != HOLE:
                    filled[block] = max(filled.get(block, 0), min(bs, length - i * bs))
        used = manager.num_used_blocks
        per_token = {i: self.storage.layer_bytes_per_token(i) for i in self.storage.key_pools if i in group.layers}
        per_block = bs * sum(per_token.values())
        held = self._columns if group.window is None else min(self._columns, group.window - 1)
        return {
            "kind": group.spec.describe(),
            "window": group.window,
            "layers": list(group.layers),
            "blocks_total": manager.num_blocks,
            "blocks_used": used,
            "blocks_free": manager.num_free_blocks,
            "blocks_shared": manager.num_shared_blocks,
            "blocks_peak": manager.blocks_peak,
            "tokens_stored": sum(filled.values()),
            "tokens_logical": logical,
            "slots_allocated": used * bs,
            "bytes_used": used * per_block,
            "bytes_allocated": manager.num_blocks * per_block,
            "bytes_contiguous_equivalent": len(self._rows) * held * sum(per_token.values()),
        }

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"PagedKVCache(rows={s['num_sequences']}, block_size={s['block_size']}, "
            f"blocks_used={s['blocks_used']}/{s['blocks_total']}, utilization={s['utilization']:.3f})"
        )
