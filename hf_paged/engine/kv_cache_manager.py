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

from collections.abc import Hashable

from hf_paged.block_manager import BlockManager, NoFreeBlocksError
from hf_paged.engine.sequence import Sequence

BlockPairs = list[tuple[int, int]]  # (source block, destination block)


class KVCacheManager:
    def __init__(self, block_size: int, num_blocks: int | None, *, enable_prefix_caching: bool = True,
                 swap_space_blocks: int = 0):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = BlockManager(block_size, num_blocks, enable_prefix_caching=enable_prefix_caching)
        self._swap = BlockManager(block_size, swap_space_blocks) if swap_space_blocks else None
        self._keys: dict[int, list[Hashable]] = {}  # seq_id -> keys of its registered full blocks
        self._inflight: dict[Hashable, int] = {}  # key -> seq computing that block right now
        self._prefix_queried_tokens = 0
        self._prefix_hit_tokens = 0

    # ------------------------------------------------------------------ facts
    @property
    def num_blocks(self) -> int:
        """Device blocks the pool has now (it grows when no budget was set)."""
        return self._blocks.num_blocks

    @property
    def growable(self) -> bool:
        return self._blocks.growable

    def block_table(self, seq: Sequence) -> list[int]:
        return self._blocks.block_table(seq.seq_id)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def holds(self, seq: Sequence) -> bool:
        return seq.seq_id in self._blocks

    def stats(self) -> dict[str, int]:
        """Block counts (device and swap space) and prefix-cache counters."""
        blocks, swap = self._blocks, self._swap
        return {
            "block_size": self.block_size, "blocks_total": blocks.num_blocks, "blocks_used": blocks.num_used_blocks,
            "blocks_free": blocks.num_free_blocks, "blocks_cached": blocks.num_cached_blocks,
            "blocks_shared": blocks.num_shared_blocks, "blocks_peak": blocks.blocks_peak,
            "swap_blocks_total": swap.num_blocks if swap else 0, "swap_blocks_used": swap.num_used_blocks if swap else 0,
            "prefix_queried_tokens": self._prefix_queried_tokens, "prefix_hit_tokens": self._prefix_hit_tokens,
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

    def allocate_prefix(self, seq: Sequence) -> int:
        """Register ``seq`` with every cached full block of its known tokens (all but the last,
        which must be computed to get logits). Returns the number of tokens found cached."""
        matched: list[int] = []
        keys: list[Hashable] = []
        if self.enable_prefix_caching:
            keys = self._prompt_keys(seq)
            matched = self._blocks.match_prefix(keys)
            keys = keys[: len(matched)]
        cached = len(matched) * self.block_size
        self._blocks.add_sequence(seq.seq_id, matched, cached)
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
        """Register in the prefix cache the full blocks that ``seq`` has now computed."""
        if not self.enable_prefix_caching:
            return
        keys = self._keys[seq.seq_id]
        full = seq.num_computed_tokens // self.block_size
        if full > len(keys):
            new = self._chain(seq.token_ids, len(keys), full - len(keys), keys[-1] if keys else None)
            for i, key in enumerate(new, start=len(keys)):
                self._blocks.register_block(seq.seq_id, i, key)
                if self._inflight.get(key) == seq.seq_id:
                    del self._inflight[key]
            keys.extend(new)

    # ------------------------------------------------------------------ slots
    def can_append(self, work: list[tuple[Sequence, int]], reserve: int = 0) -> bool:
        return self._blocks.can_append([(seq.seq_id, n) for seq, n in work], reserve)

    def append(self, work: list[tuple[Sequence, int]]) -> BlockPairs:
        """Slots for ``n`` more tokens of each sequence. Returns the copy-on-write copies that
        must run before the tokens are written."""
        _, copies = self._blocks.append_many([(seq.seq_id, n) for seq, n in work])
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        self._blocks.fork(parent.seq_id, child.seq_id)
        self._keys[child.seq_id] = list(self._keys.get(parent.seq_id, []))

    def free(self, seq: Sequence) -> None:
        """Give back a sequence's blocks, wherever they are (device or swap space)."""
        self._keys.pop(seq.seq_id, None)
        for key in [k for k, owner in self._inflight.items() if owner == seq.seq_id]:
            del self._inflight[key]
        if seq.seq_id in self._blocks:
            self._blocks.free(seq.seq_id)
        elif self._swap is not None and seq.seq_id in self._swap:
            self._swap.free(seq.seq_id)

    # ------------------------------------------------------------------ swapping
    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        if self._swap is None:
            return False
        distinct = {b for s in seqs for b in self._blocks.block_table(s.seq_id)}
        return len(distinct) <= self._swap.num_free_blocks

    def swap_out(self, seqs: list[Sequence]) -> BlockPairs:
        """Move the sequences' blocks to the CPU pool (shared blocks once) and free them here.
        Returns the (device block, CPU block) copies to run before the device blocks are reused."""
        return self._move(seqs, self._blocks, self._swap)

    def can_swap_in(self, seqs: list[Sequence], reserve: int = 0) -> bool:
        distinct = {b for s in seqs for b in self._swap.block_table(s.seq_id)}
        return self._blocks.growable or len(distinct) + reserve <= self._blocks.num_free_blocks

    def swap_in(self, seqs: list[Sequence]) -> BlockPairs:
        """The reverse of :meth:`swap_out`: returns the (CPU block, device block) copies."""
        return self._move(seqs, self._swap, self._blocks)

    @staticmethod
    def _move(seqs: list[Sequence], src: BlockManager, dst: BlockManager) -> BlockPairs:
        tables = {s.seq_id: src.block_table(s.seq_id) for s in seqs}
        distinct = list(dict.fromkeys(b for t in tables.values() for b in t))
        if len(distinct) > dst.num_free_blocks and not dst.growable:
            raise NoFreeBlocksError(len(distinct), dst.num_free_blocks, dst.num_blocks)
        new = dst.allocate_blocks(len(distinct))
        mapping = dict(zip(distinct, new))
        for s in seqs:
            dst.add_sequence(s.seq_id, [mapping[b] for b in tables[s.seq_id]], src.seq_len(s.seq_id))
            src.free(s.seq_id)
        dst.release_blocks(new)  # the sequences hold them now
        return list(mapping.items())

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        self._blocks.check_invariants()
        if self._swap is not None:
            self._swap.check_invariants()

    def num_used_blocks(self) -> int:
        return self._blocks.num_used_blocks + (self._swap.num_used_blocks if self._swap else 0)
