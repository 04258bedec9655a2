"""The scheduler's one door to KV memory: slots, forks, frees, the prefix cache and swapping.

Like vLLM V1's ``kv_cache_manager``: the scheduler asks in terms of sequences and token counts;
block ids, reference counts and copies stay behind this facade (block manager + storage).

Prefix cache keys are chained: the key of a sequence's block ``i`` is
``(hash(key of block i-1), tokens of block i)``, so a block is reused only after the same
prefix, and the tokens themselves are compared (no reliance on a hash alone for the block).
"""

from __future__ import annotations

from collections.abc import Hashable

from hf_paged.block_manager import BlockManager, NoFreeBlocksError
from hf_paged.engine.sequence import Sequence
from hf_paged.storage import PagedKVStorage


class KVCacheManager:
    def __init__(
        self, block_size: int, num_blocks: int | None, *, enable_prefix_caching: bool = True,
        swap_space_blocks: int = 0, pin_memory: bool = False,
    ):
        self.block_size = block_size
        self.blocks = BlockManager(block_size, num_blocks, enable_prefix_caching=enable_prefix_caching)
        self.storage = PagedKVStorage(block_size)
        self.swap = BlockManager(block_size, swap_space_blocks) if swap_space_blocks else None
        self.swap_storage = PagedKVStorage(block_size, device="cpu", pin_memory=pin_memory)
        self.enable_prefix_caching = enable_prefix_caching
        self._keys: dict[int, list[Hashable]] = {}  # seq_id -> keys of its registered full blocks
        self._inflight: dict[Hashable, int] = {}  # key -> seq computing that block right now
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    # ------------------------------------------------------------------ facts
    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free_blocks

    def block_table(self, seq: Sequence) -> list[int]:
        return self.blocks.block_table(seq.seq_id)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

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
            matched = self.blocks.match_prefix(keys)
            keys = keys[: len(matched)]
        cached = len(matched) * self.block_size
        self.blocks.add_sequence(seq.seq_id, matched, cached)
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
        self.prefix_queried_tokens += seq.num_tokens
        self.prefix_hit_tokens += seq.num_computed_tokens

    def commit(self, seq: Sequence) -> None:
        """Register the full blocks that ``seq`` has now computed (prefix caching)."""
        if not self.enable_prefix_caching:
            return
        keys = self._keys[seq.seq_id]
        full = seq.num_computed_tokens // self.block_size
        if full > len(keys):
            new = self._chain(seq.token_ids, len(keys), full - len(keys), keys[-1] if keys else None)
            for i, key in enumerate(new, start=len(keys)):
                self.blocks.register_block(seq.seq_id, i, key)
                if self._inflight.get(key) == seq.seq_id:
                    del self._inflight[key]
            keys.extend(new)

    # ------------------------------------------------------------------ slots
    def can_append(self, work: list[tuple[Sequence, int]], reserve: int = 0) -> bool:
        return self.blocks.can_append([(seq.seq_id, n) for seq, n in work], reserve)

    def append(self, work: list[tuple[Sequence, int]]) -> None:
        """Slots for ``n`` more tokens of each sequence; copy-on-write copies run at once."""
        _, copies = self.blocks.append_many([(seq.seq_id, n) for seq, n in work])
        self.storage.grow(self.blocks.num_blocks)
        self.storage.copy_blocks(copies)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        self.blocks.fork(parent.seq_id, child.seq_id)
        self._keys[child.seq_id] = list(self._keys.get(parent.seq_id, []))

    def free(self, seq: Sequence) -> None:
        """Give back a sequence's blocks, wherever they are (device or swap space)."""
        self._keys.pop(seq.seq_id, None)
        for key in [k for k, owner in self._inflight.items() if owner == seq.seq_id]:
            del self._inflight[key]
        if seq.seq_id in self.blocks:
            self.blocks.free(seq.seq_id)
        elif self.swap is not None and seq.seq_id in self.swap:
            self.swap.free(seq.seq_id)

    def holds(self, seq: Sequence) -> bool:
        return seq.seq_id in self.blocks

    # ------------------------------------------------------------------ swapping
    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        if self.swap is None:
            return False
        distinct = {b for s in seqs for b in self.blocks.block_table(s.seq_id)}
        return len(distinct) <= self.swap.num_free_blocks

    def swap_out(self, seqs: list[Sequence]) -> None:
        """Move the sequences' blocks to the CPU pool (shared blocks once) and free them here."""
        self._move(seqs, self.blocks, self.storage, self.swap, self.swap_storage)

    def can_swap_in(self, seqs: list[Sequence], reserve: int = 0) -> bool:
        distinct = {b for s in seqs for b in self.swap.block_table(s.seq_id)}
        return self.blocks.growable or len(distinct) + reserve <= self.blocks.num_free_blocks

    def swap_in(self, seqs: list[Sequence]) -> None:
        self._move(seqs, self.swap, self.swap_storage, self.blocks, self.storage)

    @staticmethod
    def _move(seqs, src: BlockManager, src_storage, dst: BlockManager, dst_storage) -> None:
        tables = {s.seq_id: src.block_table(s.seq_id) for s in seqs}
        distinct = list(dict.fromkeys(b for t in tables.values() for b in t))
        if len(distinct) > dst.num_free_blocks and not dst.growable:
            raise NoFreeBlocksError(len(distinct), dst.num_free_blocks, dst.num_blocks)
        new = dst.allocate_blocks(len(distinct))
        mapping = dict(zip(distinct, new))
        dst_storage.grow(dst.num_blocks)
        src_storage.transfer(dst_storage, list(mapping.items()), dst.num_blocks)
        for s in seqs:
            dst.add_sequence(s.seq_id, [mapping[b] for b in tables[s.seq_id]], src.seq_len(s.seq_id))
            src.free(s.seq_id)
        dst.release_blocks(new)  # the sequences hold them now

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        self.blocks.check_invariants()
        if self.swap is not None:
            self.swap.check_invariants()

    def num_used_blocks(self) -> int:
        return self.blocks.num_used_blocks + (self.swap.num_used_blocks if self.swap else 0)
