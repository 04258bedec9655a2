"""The scheduler's one door to KV memory: slots, forks, frees, the prefix cache and swapping.

Like vLLM V1's ``kv_cache_manager``: the scheduler asks in terms of sequences and token counts;
block ids, reference counts and the prefix index stay behind this facade. It only *decides*
(pure Python, no torch): the block copies and swaps it returns are executed later against
storage by the model runner, which is the only part that holds K/V tensors.

Prefix cache keys are chained: the key of a sequence's block ``i`` is
``(hash(key of block i-1), tokens of block i)``, so a block is reused only after the same
prefix, and the tokens themselves are compared (no reliance on a hash alone for the block).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence as Seq

from hf_paged.block_manager import HOLE, BlockManager, NoFreeBlocksError
from hf_paged.engine.sequence import Sequence
from hf_paged.layer_groups import GroupedBlockManager, LayerGroup

BlockPairs = list[tuple[int, int]]  # (source block, destination block)
FULL_ATTENTION = (LayerGroup(None, ()),)  # the layer groups of a model without sliding windows


class KVCacheManager:
    """Blocks of every layer group (:mod:`hf_paged.layer_groups`) for the scheduler's sequences.

    Block moves come back per layer group (a list indexed like ``groups``): a block id means
    nothing outside its group. Sliding groups give back the blocks their window has left behind
    (:meth:`release_out_of_window`).

    Prefix caching with sliding groups: a prefix of ``p`` full blocks is a hit only if every
    group still has what a forward from token ``p * block_size`` reads: all ``p`` blocks in a
    full group, the blocks of the last ``window - 1`` tokens in a sliding group (blocks before
    that are not needed: they enter the sequence's table as holes). Given-back blocks stay in
    their group's prefix index (as evictable) until their memory is reused, so a later request
    with the same prefix can adopt them. Exact by construction: a hit reads only blocks that hold
    the K/V of the same tokens after the same prefix.
    """

    def __init__(self, block_size: int, num_blocks: int | Seq[int] | None, *, enable_prefix_caching: bool = True,
                 swap_space_blocks: int | Seq[int] = 0, groups: Seq[LayerGroup] = FULL_ATTENTION):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = list(groups)
        self._device = GroupedBlockManager(block_size, num_blocks, self.groups,
                                           enable_prefix_caching=enable_prefix_caching)
        self._swap = GroupedBlockManager(block_size, swap_space_blocks, self.groups) if swap_space_blocks else None
        self._keys: dict[int, list[Hashable]] = {}  # seq_id -> keys of its registered full blocks
        self._inflight: dict[Hashable, int] = {}  # key -> seq computing that block right now
        self._parents: dict[Hashable, Hashable | None] = {}  # key -> the key before it (snapshots rebuild the chain)
        self._prefix_queried_tokens = 0
        self._prefix_hit_tokens = 0

    # ------------------------------------------------------------------ facts
    @property
    def _blocks(self) -> list[BlockManager]:
        return self._device.managers

    @property
    def num_blocks(self) -> int:
        """Device blocks of the first layer group's pool now: the full-attention layers' when the
        model has any (the pool a long sequence needs most of; pools grow when no budget was set)."""
        return self._blocks[0].num_blocks

    @property
    def pool_sizes(self) -> tuple[int, ...]:
        """Device blocks of each layer group's pool now."""
        return tuple(m.num_blocks for m in self._blocks)

    @property
    def growable(self) -> bool:
        return self._blocks[0].growable

    def block_table(self, seq: Sequence, group: int = 0) -> list[int]:
        """A layer group's block table of ``seq`` (``HOLE`` where a sliding group gave blocks back)."""
        return self._blocks[group].block_table(seq.seq_id)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def holds(self, seq: Sequence) -> bool:
        return seq.seq_id in self._device

    def stats(self) -> dict:
        """Block counts (device and swap space, summed over layer groups; each group's under
        ``"groups"``) and prefix-cache counters."""
        swap = self._swap.managers if self._swap else []
        groups = [
            {"window": g.window, "blocks_total": m.num_blocks, "blocks_used": m.num_used_blocks,
             "blocks_free": m.num_free_blocks, "blocks_cached": m.num_cached_blocks,
             "blocks_shared": m.num_shared_blocks, "blocks_peak": m.blocks_peak}
            for g, m in zip(self.groups, self._blocks)
        ]
        totals = {key: sum(g[key] for g in groups) for key in groups[0] if key != "window"}
        return {
            "block_size": self.block_size, **totals,
            "swap_blocks_total": sum(m.num_blocks for m in swap), "swap_blocks_used": sum(m.num_used_blocks for m in swap),
            "prefix_queried_tokens": self._prefix_queried_tokens, "prefix_hit_tokens": self._prefix_hit_tokens,
            "groups": groups,
        }

    # ------------------------------------------------------------------ prefix cache
    def _chain(self, token_ids: list[int], start: int, count: int, parent: Hashable | None) -> list[Hashable]:
        keys, bs = [], self.block_size
        for i in range(start, start + count):
            parent = (hash(parent), tuple(token_ids[i * bs : (i + 1) * bs]))
            keys.append(parent)
        return keys

    def _prompt_keys(self, seq: Sequence) -> list[Hashable]:
        """Keys of the full blocks of a sequence's known tokens but the last (which must be computed)."""
        return self._chain(seq.token_ids, 0, (seq.num_tokens - 1) // self.block_size, None)

    def _match(self, keys: list[Hashable]) -> tuple[int, list[list[int]]]:
        """The longest hit (in blocks) that every layer group can serve, and each group's table for it."""
        found = [manager.match_prefix(keys) if not group.is_sliding else None
                 for group, manager in zip(self.groups, self._blocks)]
        hit = min((len(f) for f in found if f is not None), default=len(keys))
        while hit > 0:
            tables = []
            for group, manager, full in zip(self.groups, self._blocks, found):
                if full is not None:
                    tables.append(full[:hit])
                    continue
                first = group.first_needed(hit * self.block_size) // self.block_size
                window = [manager.cached_block(key) for key in keys[first:hit]]
                if None in window:
                    break
                tables.append([HOLE] * first + window)
            else:
                return hit, tables
            hit -= 1
        return 0, [[] for _ in self.groups]

    def allocate_prefix(self, seq: Sequence) -> int:
        """Register ``seq`` with every cached full block of its known tokens (all but the last,
        which must be computed to get logits) that all layer groups can serve. Returns the number
        of tokens found cached."""
        keys: list[Hashable] = []
        hit, tables = 0, [[] for _ in self.groups]
        if self.enable_prefix_caching:
            keys = self._prompt_keys(seq)
            hit, tables = self._match(keys)
            keys = keys[:hit]
        cached = hit * self.block_size
        for manager, table in zip(self._blocks, tables):
            manager.add_sequence(seq.seq_id, table, cached)
        self._keys[seq.seq_id] = keys
        return cached

    def waits_for_inflight(self, seq: Sequence) -> bool:
        """True when the next block ``seq`` would compute is being computed by another sequence:
        admitting it one step later lets it reuse that block instead of computing it again."""
        if not self.enable_prefix_caching:
            return False
        keys = self._prompt_keys(seq)
        done = len(self._keys[seq.seq_id])
        return done < len(keys) and self._inflight.get(keys[done], seq.seq_id) != seq.seq_id

    def mark_inflight(self, seq: Sequence) -> None:
        """The admitted ``seq`` will compute its prompt blocks: others with the same prefix wait."""
        if self.enable_prefix_caching:
            for key in self._prompt_keys(seq)[len(self._keys[seq.seq_id]) :]:
                self._inflight.setdefault(key, seq.seq_id)

    def record_prefix_lookup(self, seq: Sequence) -> None:
        """Count an admitted sequence's known tokens and how many came from the prefix cache."""
        self._prefix_queried_tokens += seq.num_tokens
        self._prefix_hit_tokens += seq.num_computed_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register in the prefix cache the full blocks that ``seq`` has now computed (in every
        layer group that still holds them)."""
        if not self.enable_prefix_caching:
            return
        keys = self._keys[seq.seq_id]
        full = seq.num_computed_tokens // self.block_size
        if full > len(keys):
            new = self._chain(seq.token_ids, len(keys), full - len(keys), keys[-1] if keys else None)
            parent = keys[-1] if keys else None
            for i, key in enumerate(new, start=len(keys)):
                self._parents.setdefault(key, parent)
                parent = key
                for manager in self._blocks:
                    if i >= manager.num_released(seq.seq_id):
                        manager.register_block(seq.seq_id, i, key)
                if self._inflight.get(key) == seq.seq_id:
                    del self._inflight[key]
            keys.extend(new)
            if len(self._parents) > 2 * sum(self.pool_sizes) + 1024:
                self._prune_parents()

    def _prune_parents(self) -> None:
        """Forget chain links nothing needs: keys no group caches any more and that are no
        cached key's ancestor (keeps the map proportional to the pools, not to all history)."""
        keep: dict[Hashable, Hashable | None] = {}
        for manager in self._blocks:
            for key in manager.cached_blocks():
                while key is not None and key not in keep and key in self._parents:
                    keep[key] = self._parents[key]
                    key = keep[key]
        self._parents = keep

    def export_prefix_cache(self) -> tuple[list[tuple[tuple[int, ...], int]], list[list[tuple[int, int]]]]:
        """What a snapshot holds: the chain, as ``(tokens, index of the parent entry or -1)`` with
        parents first, and per layer group ``(chain entry, block)`` for each cached block. Keys are
        not saved (they contain Python hashes, which differ between processes): a loader rebuilds
        them from the tokens with its own hash."""
        cached = [manager.cached_blocks() for manager in self._blocks]
        index: dict[Hashable, int] = {}
        chain: list[tuple[tuple[int, ...], int]] = []

        def add(key) -> int | None:
            if key in index:
                return index[key]
            if key not in self._parents:
                return None
            parent = self._parents[key]
            parent_index = -1 if parent is None else add(parent)
            if parent_index is None:
                return None
            index[key] = len(chain)
            chain.append((tuple(key[1]), parent_index))
            return index[key]

        groups = []
        for blocks in cached:
            entries = [(add(key), block) for key, block in blocks.items()]
            groups.append([(i, block) for i, block in entries if i is not None])
        return chain, groups

    def import_prefix_cache(self, chain: list[tuple[tuple[int, ...], int]],
                            groups: list[list[int]]) -> list[list[tuple[int, int]]]:
        """Take blocks for a snapshot's cached blocks (``groups[g]``: chain entries) that are not
        cached yet, register them under keys rebuilt from the chain, and park them as evictable.
        Returns per group ``(position in groups[g], block)``: where storage must copy each one's
        K/V. Stops in a group whose fixed budget has no free block left."""
        keys: list[Hashable] = []
        for tokens, parent in chain:
            keys.append((hash(keys[parent] if parent >= 0 else None), tuple(tokens)))
            self._parents.setdefault(keys[-1], keys[parent] if parent >= 0 else None)
        placed = []
        for manager, entries in zip(self._blocks, groups):
            todo = [(pos, keys[i]) for pos, i in enumerate(entries) if manager.cached_block(keys[i]) is None]
            room = len(todo) if manager.growable else min(len(todo), manager.num_free_blocks)
            todo = todo[:room]
            blocks = manager.allocate_blocks(len(todo)) if todo else []
            for (_, key), block in zip(todo, blocks):
                manager.cache_block(block, key)
            manager.release_blocks(blocks)
            placed.append([(pos, block) for (pos, _), block in zip(todo, blocks)])
        return placed

    # ------------------------------------------------------------------ slots
    def release_out_of_window(self, work: list[tuple[Sequence, int]]) -> None:
        """Before the sequences compute their next tokens: sliding groups give back the blocks
        those tokens (and all later ones) can no longer read."""
        if self._device.has_sliding:
            for seq, _ in work:
                self._device.release_out_of_window(seq.seq_id, seq.num_computed_tokens)

    def can_append(self, work: list[tuple[Sequence, int]], reserve: int = 0) -> bool:
        requests = [(seq.seq_id, n) for seq, n in work]
        return all(manager.can_append(requests, reserve) for manager in self._blocks)

    def append(self, work: list[tuple[Sequence, int]]) -> list[BlockPairs]:
        """Slots for ``n`` more tokens of each sequence. Returns, per layer group, the
        copy-on-write copies that must run before the tokens are written."""
        return [copies for _, copies in self._device.append_many([(seq.seq_id, n) for seq, n in work])]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        self._device.fork(parent.seq_id, child.seq_id)
        self._keys[child.seq_id] = list(self._keys.get(parent.seq_id, []))

    def free(self, seq: Sequence) -> None:
        """Give back a sequence's blocks, wherever they are (device or swap space)."""
        self._keys.pop(seq.seq_id, None)
        for key in [k for k, owner in self._inflight.items() if owner == seq.seq_id]:
            del self._inflight[key]
        if seq.seq_id in self._device:
            self._device.free(seq.seq_id)
        elif self._swap is not None and seq.seq_id in self._swap:
            self._swap.free(seq.seq_id)

    # ------------------------------------------------------------------ swapping
    @staticmethod
    def _distinct(manager: BlockManager, seqs: list[Sequence]) -> list[int]:
        return list(dict.fromkeys(b for s in seqs for b in manager.block_table(s.seq_id) if b != HOLE))

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        if self._swap is None:
            return False
        return all(len(self._distinct(src, seqs)) <= dst.num_free_blocks
                   for src, dst in zip(self._blocks, self._swap.managers))

    def swap_out(self, seqs: list[Sequence]) -> list[BlockPairs]:
        """Move the sequences' blocks to the CPU pool (shared blocks once) and free them here.
        Returns, per layer group, the (device block, CPU block) copies to run before the device
        blocks are reused."""
        return [self._move(seqs, src, dst) for src, dst in zip(self._blocks, self._swap.managers)]

    def can_swap_in(self, seqs: list[Sequence], reserve: int = 0) -> bool:
        return all(dst.growable or len(self._distinct(src, seqs)) + reserve <= dst.num_free_blocks
                   for src, dst in zip(self._swap.managers, self._blocks))

    def swap_in(self, seqs: list[Sequence]) -> list[BlockPairs]:
        """The reverse of :meth:`swap_out`: returns the (CPU block, device block) copies per group."""
        return [self._move(seqs, src, dst) for src, dst in zip(self._swap.managers, self._blocks)]

    @classmethod
    def _move(cls, seqs: list[Sequence], src: BlockManager, dst: BlockManager) -> BlockPairs:
        tables = {s.seq_id: src.block_table(s.seq_id) for s in seqs}
        distinct = cls._distinct(src, seqs)
        if len(distinct) > dst.num_free_blocks and not dst.growable:
            raise NoFreeBlocksError(len(distinct), dst.num_free_blocks, dst.num_blocks)
        new = dst.allocate_blocks(len(distinct))
        mapping = dict(zip(distinct, new))
        for s in seqs:
            table = [HOLE if b == HOLE else mapping[b] for b in tables[s.seq_id]]
            dst.add_sequence(s.seq_id, table, src.seq_len(s.seq_id))
            src.free(s.seq_id)
        dst.release_blocks(new)  # the sequences hold them now
        return list(mapping.items())

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        self._device.check_invariants()
        if self._swap is not None:
            self._swap.check_invariants()

    def num_used_blocks(self) -> int:
        return self._device.num_used_blocks + (self._swap.num_used_blocks if self._swap else 0)
