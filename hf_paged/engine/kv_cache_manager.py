"""The scheduler's one door to KV memory: slots, forks, frees, the prefix cache and swapping.

Like vLLM V1's ``kv_cache_manager``: the scheduler asks in terms of sequences and token counts;
block ids, reference counts and the prefix index stay behind this facade. It only *decides*
(pure Python, no torch): the block copies and swaps it returns are executed later against
storage by the model runner, which is the only part that holds K/V tensors.

The prefix cache's index (chained block keys, lookups, registration, snapshots) is
:class:`hf_paged.prefix_index.PrefixIndex`, the same code ``generate()`` uses.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence as Seq

from hf_paged.block_manager import HOLE, BlockManager, NoFreeBlocksError
from hf_paged.engine.sequence import Sequence
from hf_paged.kinds import FullAttentionSpec, NoKVSpec
from hf_paged.layer_groups import GroupedBlockManager, LayerGroup
from hf_paged.prefix_index import PrefixIndex
from hf_paged.state_slots import SlotPairs, StateSlotManager

BlockPairs = list[tuple[int, int]]  # (source block, destination block)
FULL_ATTENTION = (LayerGroup(FullAttentionSpec(), ()),)  # the layer groups of a model without sliding windows
NO_KV = NoKVSpec()


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

    Models with recurrent layers (:mod:`hf_paged.kinds.recurrent`) also give every sequence one
    state slot (``num_state_slots``, :mod:`hf_paged.state_slots`): taken when its blocks are,
    copied at a fork (settled after the step's frees, :meth:`settle_state_forks`), moved with its
    blocks on a swap, freed with them. Such models run without prefix caching.
    """

    def __init__(self, block_size: int, num_blocks: int | Seq[int] | None, *, enable_prefix_caching: bool = True,
                 swap_space_blocks: int | Seq[int] = 0, groups: Seq[LayerGroup] = FULL_ATTENTION,
                 num_state_slots: int = 0, swap_state_slots: int = 0):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching and not num_state_slots
        self.groups = list(groups)
        self._device = GroupedBlockManager(block_size, num_blocks, self.groups,
                                           enable_prefix_caching=self.enable_prefix_caching)
        if swap_state_slots and all(g.spec == NO_KV for g in self.groups):
            swap_space_blocks = None  # no K/V: the swap space's bookkeeping grows as the device's does
        swap_space = swap_space_blocks is None or swap_space_blocks
        self._swap = GroupedBlockManager(block_size, swap_space_blocks, self.groups) if swap_space else None
        self.prefix = PrefixIndex(self._device)
        self._inflight: dict[Hashable, int] = {}  # key -> seq computing that block right now
        self._states = StateSlotManager(num_state_slots) if num_state_slots else None
        self._swap_states = StateSlotManager(swap_state_slots) if num_state_slots and swap_state_slots else None

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

    def _window_blocks(self, group: LayerGroup, chunk: int) -> int | None:
        """Most blocks of a group with a window one sequence holds while it computes ``chunk`` tokens:
        the window's before them and theirs (one more where they start inside a block); None for a
        group without a window (it holds every token's)."""
        return None if group.window is None else self.blocks_for(group.window - 1 + chunk) + 1

    def _most_blocks(self, group: LayerGroup, num_tokens: int, chunk: int | None) -> int:
        """Most blocks of ``group`` one sequence of ``num_tokens`` holds at once, computing at most
        ``chunk`` tokens a step (None: all at once)."""
        cap = self._window_blocks(group, chunk or num_tokens)
        return self.blocks_for(num_tokens) if cap is None else min(self.blocks_for(num_tokens), cap)

    def fits_alone(self, lengths: Seq[int], shared: int = 0, chunk: int | None = None) -> bool:
        """Whether sequences of these lengths (in tokens) fit the pools with nothing else in them:
        a full group holds all their blocks (those of their first ``shared`` tokens once, when
        full), a group with a window only what :meth:`_most_blocks` says. Growing pools fit."""
        if self.growable:
            return True
        once = (len(lengths) - 1) * (shared // self.block_size)
        return all(
            sum(self._most_blocks(group, n, chunk) for n in lengths) - (0 if group.window else once) <= size
            for group, size in zip(self.groups, self.pool_sizes))

    def max_tokens_alone(self, chunk: int | None) -> int | None:
        """The most tokens one sequence can hold alone (None: no bound, the pools grow or every
        group has a window whose blocks, and a chunk's, fit)."""
        if self.growable:
            return None
        bounds = []
        for group, size in zip(self.groups, self.pool_sizes):
            cap = None if chunk is None else self._window_blocks(group, chunk)
            if cap is None or cap > size:  # every token's blocks, or a window and chunk the pool cannot hold
                bounds.append(size * self.block_size)
        return min(bounds) if bounds else None

    def holds(self, seq: Sequence) -> bool:
        return seq.seq_id in self._device

    @property
    def has_states(self) -> bool:
        """Whether sequences hold recurrent-state slots beside their blocks."""
        return self._states is not None

    @property
    def num_state_slots(self) -> int:
        return self._states.num_slots if self._states else 0

    def state_slot(self, seq: Sequence) -> int:
        """The device state slot of a scheduled sequence (-1 for a model without recurrent layers)."""
        return self._states.slot(seq.seq_id) if self._states else -1

    def stats(self) -> dict:
        """Block counts (device and swap space, summed over layer groups; each group's under
        ``"groups"``) and prefix-cache counters."""
        swap = self._swap.managers if self._swap else []
        groups = [
            {"kind": g.spec.describe(), "layers": list(g.layers), "window": g.window, "blocks_total": m.num_blocks, "blocks_used": m.num_used_blocks,
             "blocks_free": m.num_free_blocks, "blocks_cached": m.num_cached_blocks,
             "blocks_shared": m.num_shared_blocks, "blocks_peak": m.blocks_peak}
            for g, m in zip(self.groups, self._blocks)
        ]
        keys = [key for key in groups[0] if key not in ("kind", "layers", "window")]
        groups = [g for g in groups if g["kind"] != NO_KV.describe()]  # a state-only model's bookkeeping
        totals = {key: sum(g[key] for g in groups) for key in keys}
        states, swap_states = self._states, self._swap_states
        return {
            "block_size": self.block_size, **totals,
            "swap_blocks_total": sum(m.num_blocks for m in swap), "swap_blocks_used": sum(m.num_used_blocks for m in swap),
            "prefix_queried_tokens": self.prefix.queried_tokens, "prefix_hit_tokens": self.prefix.hit_tokens,
            "state_slots_total": states.num_slots if states else 0, "state_slots_used": states.num_used if states else 0,
            "state_slots_free": states.num_free if states else 0, "state_slots_peak": states.peak if states else 0,
            "swap_state_slots_used": swap_states.num_used if swap_states else 0,
            "groups": groups,
        }

    # ------------------------------------------------------------------ prefix cache
    def _prompt_keys(self, seq: Sequence) -> list[Hashable]:
        """Keys of the full blocks of a sequence's known tokens but the last (which must be computed)."""
        return self.prefix.keys_of(seq.token_ids, (seq.num_tokens - 1) // self.block_size, root=seq.cache_root)

    def allocate_prefix(self, seq: Sequence, read: bool = True) -> int:
        """Register ``seq`` with every cached full block of its known tokens (all but the last,
        which must be computed to get logits) that all layer groups can serve. Returns the number
        of tokens found cached. ``read=False`` (vLLM's ``skip_reading_prefix_cache``: a request
        that needs every prompt position's logits): no lookup, 0; the blocks it computes are
        still cached for others."""
        if self._states is not None:
            self._states.allocate(seq.seq_id)  # a state cannot be restored from cached blocks: no prefix hits
            self._device.add_sequence(seq.seq_id)
            return 0
        if not self.enable_prefix_caching or not read:
            self._device.add_sequence(seq.seq_id)
            return 0
        keys = self.prefix.longest_hit(seq.token_ids, (seq.num_tokens - 1) // self.block_size, seq.cache_root)
        cached = len(keys) * self.block_size
        self.prefix.adopt(seq.seq_id, keys, cached, self.prefix.tables_for(keys, cached))
        return cached

    def waits_for_inflight(self, seq: Sequence) -> bool:
        """True when the next block ``seq`` would compute is being computed by another sequence:
        admitting it one step later lets it reuse that block instead of computing it again."""
        if not self.enable_prefix_caching:
            return False
        keys = self._prompt_keys(seq)
        done = self.prefix.num_registered(seq.seq_id)
        return done < len(keys) and self._inflight.get(keys[done], seq.seq_id) != seq.seq_id

    def mark_inflight(self, seq: Sequence) -> None:
        """The admitted ``seq`` will compute its prompt blocks: others with the same prefix wait."""
        if self.enable_prefix_caching:
            for key in self._prompt_keys(seq)[self.prefix.num_registered(seq.seq_id) :]:
                self._inflight.setdefault(key, seq.seq_id)

    def record_prefix_lookup(self, seq: Sequence) -> None:
        """Count an admitted sequence's known tokens and how many came from the prefix cache."""
        self.prefix.record(seq.num_tokens, seq.num_computed_tokens)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register in the prefix cache the full blocks that ``seq`` has now computed (in every
        layer group that still holds them)."""
        if self.enable_prefix_caching:
            for key in self.prefix.register(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.cache_root):
                if self._inflight.get(key) == seq.seq_id:
                    del self._inflight[key]

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

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """``seq`` keeps the slots of its first ``num_tokens`` tokens; blocks past them go back
        (speculative decoding: the K/V of draft tokens that were not taken). The blocks kept are
        registered in the prefix cache only by :meth:`cache_full_blocks`, after this."""
        self._device.truncate(seq.seq_id, num_tokens)
        self.prefix.truncate(seq.seq_id, num_tokens)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        self._device.fork(parent.seq_id, child.seq_id)
        self.prefix.fork(parent.seq_id, child.seq_id)
        if self._states is not None:
            self._states.fork(parent.seq_id, child.seq_id)

    def settle_state_forks(self) -> SlotPairs:
        """After a step's forks and frees: the children's state slots, as (parent slot, child slot)
        copies that must run, all at once, before anything else touches the slots."""
        return self._states.settle() if self._states is not None else []

    def free(self, seq: Sequence) -> None:
        """Give back a sequence's blocks, wherever they are (device or swap space)."""
        self.prefix.forget(seq.seq_id)
        for key in [k for k, owner in self._inflight.items() if owner == seq.seq_id]:
            del self._inflight[key]
        if seq.seq_id in self._device:
            self._device.free(seq.seq_id)
        elif self._swap is not None and seq.seq_id in self._swap:
            self._swap.free(seq.seq_id)
        for states in (self._states, self._swap_states):
            if states is not None and seq.seq_id in states:
                states.free(seq.seq_id)

    # ------------------------------------------------------------------ swapping
    @staticmethod
    def _distinct(manager: BlockManager, seqs: list[Sequence]) -> list[int]:
        return list(dict.fromkeys(b for s in seqs for b in manager.block_table(s.seq_id) if b != HOLE))

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        if self._swap is None:
            return False
        if self._states is not None and (self._swap_states is None or self._swap_states.num_free < len(seqs)):
            return False
        return all(len(self._distinct(src, seqs)) <= dst.num_free_blocks
                   for src, dst in zip(self._blocks, self._swap.managers))

    def swap_out(self, seqs: list[Sequence]) -> list[BlockPairs]:
        """Move the sequences' blocks to the CPU pool (shared blocks once) and free them here.
        Returns, per layer group, the (device block, CPU block) copies to run before the device
        blocks are reused."""
        return [self._move(seqs, src, dst) for src, dst in zip(self._blocks, self._swap.managers)]

    def can_swap_in(self, seqs: list[Sequence], reserve: int = 0) -> bool:
        if self._states is not None and self._states.num_free < len(seqs):
            return False
        return all(dst.growable or len(self._distinct(src, seqs)) + reserve <= dst.num_free_blocks
                   for src, dst in zip(self._swap.managers, self._blocks))

    def swap_in_fits_at_all(self, seqs: list[Sequence]) -> bool:
        """Whether the sequences' swapped-out blocks fit the device pools when nothing else holds
        any (if not, they can never come back)."""
        return all(dst.growable or len(self._distinct(src, seqs)) <= dst.num_blocks
                   for src, dst in zip(self._swap.managers, self._blocks))

    def swap_in(self, seqs: list[Sequence]) -> list[BlockPairs]:
        """The reverse of :meth:`swap_out`: returns the (CPU block, device block) copies per group."""
        return [self._move(seqs, src, dst) for src, dst in zip(self._swap.managers, self._blocks)]

    def swap_out_states(self, seqs: list[Sequence]) -> SlotPairs:
        """With :meth:`swap_out`: the (device slot, CPU slot) copies of the sequences' states."""
        return self._move_states(seqs, self._states, self._swap_states)

    def swap_in_states(self, seqs: list[Sequence]) -> SlotPairs:
        """With :meth:`swap_in`: the (CPU slot, device slot) copies of the sequences' states."""
        return self._move_states(seqs, self._swap_states, self._states)

    @staticmethod
    def _move_states(seqs: list[Sequence], src: StateSlotManager | None, dst: StateSlotManager | None) -> SlotPairs:
        if src is None:
            return []
        pairs = []
        for s in seqs:
            pairs.append((src.slot(s.seq_id), dst.allocate(s.seq_id)))
            src.free(s.seq_id)
        return pairs

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
        for states, blocks in ((self._states, self._device), (self._swap_states, self._swap)):
            if states is not None:
                states.check_invariants()
                held = len(blocks.managers[0].sequences) if blocks is not None else 0
                assert states.num_used == held, "state slots and sequences disagree"

    def num_used_blocks(self) -> int:
        return self._device.num_used_blocks + (self._swap.num_used_blocks if self._swap else 0)

    def num_used_state_slots(self) -> int:
        return sum(s.num_used for s in (self._states, self._swap_states) if s is not None)
