"""The block manager: physical KV blocks, reference counts and per-sequence block tables.

Pure Python on purpose (no torch): it only decides *where* tokens go. Storage executes its
decisions (writes to slots, block copies). The three primitives are the paper's (§4.3-4.4):

* ``fork(parent, child)`` — the child shares every block of the parent (reference count + 1);
* ``append_slots(seq, n)`` — room for ``n`` more tokens; a block is allocated only when the last
  one is full, and a shared last block is copied on write first;
* ``free(seq)`` — reference count − 1 on each block, blocks at zero return to the free list.

A sliding-window layer group reads only the last ``W`` tokens: ``release_before(seq, position)``
gives back the blocks wholly before ``position`` and leaves :data:`HOLE` in their table entries,
so a table keeps its logical → physical numbering. Nothing may read a hole.

A slot is ``block_id * block_size + offset``. Every call that allocates is all-or-nothing: when the
budget cannot cover it, :class:`NoFreeBlocksError` is raised before anything changes, so a
scheduler can catch it, preempt someone, and retry.

Prefix caching (optional): a full block can be registered under a key (the engine uses a chained
key of its tokens). When its last reference goes, a registered block is not wiped but parked in
an LRU of *evictable* blocks: a later sequence with the same prefix adopts it again; it is only
reused for other data (and its key dropped) when no plain free block is left.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

SeqId = Hashable
HOLE = -1  # a table entry whose block was released (out of a sliding window): never read


class BlockManagerError(RuntimeError):
    """Misuse of the block manager (unknown sequence, double free, bad arguments)."""


class UnknownSequenceError(BlockManagerError, KeyError):
    """The sequence id is not (or no longer) known to the block manager."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


class NoFreeBlocksError(RuntimeError):
    """A fixed block budget cannot cover an allocation; nothing was changed.

    ``needed`` blocks were asked for while ``free`` were available.
    """

    def __init__(self, needed: int, free: int, total: int, note: str = ""):
        self.needed, self.free, self.total = needed, free, total
        super().__init__(
            f"out of KV cache blocks: {needed} needed, {free} free of {total} "
            f"(raise num_blocks, or use num_blocks=None to let the pool grow){note}"
        )


def check_block_options(block_size: int, num_blocks: int | None) -> None:
    """Raise ``ValueError`` naming the option unless ``block_size`` is a positive int and
    ``num_blocks`` a positive int or ``None`` (a pool that grows)."""
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if num_blocks is not None and (not isinstance(num_blocks, int) or num_blocks < 1):
        raise ValueError(f"num_blocks must be a positive int or None, got {num_blocks!r}")


@dataclass
class _Sequence:
    table: list[int] = field(default_factory=list)
    length: int = 0  # tokens stored
    released: int = 0  # leading table entries that are holes


class BlockManager:
    """Allocator of fixed-size KV blocks with reference counting and copy-on-write.

    Args:
        block_size: tokens per block.
        num_blocks: a fixed budget of physical blocks, or ``None`` for a pool that grows on demand
            (capacity doubles; storage follows ``num_blocks``).
    """

    def __init__(
        self, block_size: int = 16, num_blocks: int | None = None, *, initial_blocks: int = 16,
        enable_prefix_caching: bool = False,
    ):
        check_block_options(block_size, num_blocks)
        self.block_size = block_size
        self.growable = num_blocks is None
        total = initial_blocks if num_blocks is None else num_blocks
        self._ref_counts: list[int] = [0] * total
        self._free: list[int] = list(range(total - 1, -1, -1))  # pop() hands out low ids first
        self._seqs: dict[SeqId, _Sequence] = {}
        self._num_shared = 0  # blocks with a reference count above one
        self.blocks_peak = 0
        self.enable_prefix_caching = enable_prefix_caching
        self._key_of_block: dict[int, Hashable] = {}
        self._block_of_key: dict[Hashable, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, LRU first
        self.num_evictions = 0  # cached blocks reused for other data

    # ------------------------------------------------------------------ pool facts
    @property
    def num_blocks(self) -> int:
        """Physical blocks the pool has now (grows when ``growable``)."""
        return len(self._ref_counts)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out (plain free ones and evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered under a prefix key (held or evictable)."""
        return len(self._key_of_block)

    @property
    def num_shared_blocks(self) -> int:
        """Blocks held by more than one sequence (kept up to date, so reading it is free)."""
        return self._num_shared

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # ------------------------------------------------------------------ sequences
    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    @property
    def sequences(self) -> list[SeqId]:
        return list(self._seqs)

    def _get(self, seq_id: SeqId) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(f"unknown sequence {seq_id!r} (never added, or already freed)") from None

    def add_sequence(self, seq_id: SeqId, table: list[int] | None = None, length: int = 0) -> None:
        """Register a sequence: empty, or adopting existing blocks (a cached prefix, swapped-in
        blocks) that hold its first ``length`` tokens; each adopted block gains a reference."""
        if seq_id in self._seqs:
            raise BlockManagerError(f"sequence {seq_id!r} already exists")
        table = list(table or [])
        if len(table) != -(-length // self.block_size):
            raise BlockManagerError(f"{len(table)} blocks cannot hold exactly {length} tokens")
        released = next((i for i, block in enumerate(table) if block != HOLE), len(table))
        if HOLE in table[released:]:
            raise BlockManagerError("holes may only lead a table")
        for block in table[released:]:
            if self._ref_counts[block] == 0:
                if block not in self._evictable:
                    raise BlockManagerError(f"cannot adopt free block {block}")
                del self._evictable[block]
            self._add_ref(block)
        self._seqs[seq_id] = _Sequence(table, length, released)
        self.blocks_peak = max(self.blocks_peak, self.num_used_blocks)

    def block_table(self, seq_id: SeqId) -> list[int]:
        """Logical → physical block ids of a sequence (a copy; released entries are ``HOLE``)."""
        return list(self._get(seq_id).table)

    def num_released(self, seq_id: SeqId) -> int:
        """Leading blocks of the sequence given back by :meth:`release_before`."""
        return self._get(seq_id).released

    def seq_len(self, seq_id: SeqId) -> int:
        return self._get(seq_id).length

    def slot(self, seq_id: SeqId, position: int) -> int:
        """Slot of the token at ``position`` (0-based, among the tokens stored) of a sequence."""
        seq = self._get(seq_id)
        if not 0 <= position < seq.length:
            raise IndexError(f"position {position} outside sequence {seq_id!r} of length {seq.length}")
        if position // self.block_size < seq.released:
            raise IndexError(f"position {position} of sequence {seq_id!r} was released (out of the window)")
        return seq.table[position // self.block_size] * self.block_size + position % self.block_size

    # ------------------------------------------------------------------ allocation
    def _grow(self, needed: int) -> None:
        old = self.num_blocks
        new = max(2 * old, old + needed)
        self._ref_counts.extend([0] * (new - old))
        self._free[:0] = range(new - 1, old - 1, -1)  # new ids go below: old freed ids are reused first

    def _reserve(self, needed: int) -> None:
        """Make sure ``needed`` blocks can be taken, or raise without changing anything."""
        if needed <= self.num_free_blocks:
            return
        if not self.growable:
            raise NoFreeBlocksError(needed, self.num_free_blocks, self.num_blocks)
        self._grow(needed - self.num_free_blocks)

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:  # evict the least recently used cached block
            block, _ = self._evictable.popitem(last=False)
            del self._block_of_key[self._key_of_block.pop(block)]
            self.num_evictions += 1
        self._ref_counts[block] = 1
        return block

    def _add_ref(self, block: int) -> None:
        rc = self._ref_counts[block] = self._ref_counts[block] + 1
        self._num_shared += rc == 2

    def _release(self, block: int) -> None:
        rc = self._ref_counts[block]
        if rc <= 0:
            raise BlockManagerError(f"double free of block {block}")
        self._ref_counts[block] = rc - 1
        self._num_shared -= rc == 2
        if rc == 1:
            if block in self._key_of_block:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def allocate_blocks(self, n: int) -> list[int]:
        """``n`` fresh blocks with one reference each, outside any sequence (swap targets)."""
        self._reserve(n)
        blocks = [self._take() for _ in range(n)]
        self.blocks_peak = max(self.blocks_peak, self.num_used_blocks)
        return blocks

    def release_blocks(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block (the counterpart of ``allocate_blocks``)."""
        for block in blocks:
            self._release(block)

    # ------------------------------------------------------------------ prefix caching
    def match_prefix(self, keys: Iterable[Hashable]) -> list[int]:
        """Blocks registered under the leading ``keys``, up to the first miss."""
        blocks = []
        for key in keys:
            block = self._block_of_key.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def cached_block(self, key: Hashable) -> int | None:
        """The block registered under ``key`` (held or evictable), if any."""
        return self._block_of_key.get(key)

    def cached_blocks(self) -> dict[Hashable, int]:
        """Every registered key and its block (held or evictable)."""
        return dict(self._block_of_key)

    def cache_block(self, block: int, key: Hashable) -> None:
        """Register a block taken with :meth:`allocate_blocks` under ``key`` (a loaded snapshot);
        :meth:`release_blocks` then parks it as evictable."""
        if self._ref_counts[block] != 1 or key in self._block_of_key or block in self._key_of_block:
            raise BlockManagerError(f"block {block} cannot be cached under a new key")
        self._block_of_key[key] = block
        self._key_of_block[block] = key

    def uncache_all(self) -> int:
        """Drop every key: evictable blocks become plain free ones, held ones stay with their
        sequences. Returns how many blocks were cached."""
        dropped = len(self._key_of_block)
        self._free.extend(reversed(self._evictable))
        self._evictable.clear()
        self._key_of_block.clear()
        self._block_of_key.clear()
        return dropped

    def _must_copy(self, block: int, released: int = 0) -> bool:
        """Whether writing into ``block`` (partly filled, the last of a sequence) needs a copy first:
        another sequence holds it, or it is cached (a cached block's contents never change; a
        sequence adopting a prefix that ends inside a cached block writes into a copy)."""
        return self._ref_counts[block] - released > 1 or block in self._key_of_block

    def register_block(self, seq_id: SeqId, index: int, key: Hashable) -> None:
        """Register the sequence's full block number ``index`` under ``key`` (first one wins)."""
        seq = self._get(seq_id)
        if (index + 1) * self.block_size > seq.length:
            raise BlockManagerError(f"block {index} of sequence {seq_id!r} is not full")
        block = seq.table[index]
        if block == HOLE:
            raise BlockManagerError(f"block {index} of sequence {seq_id!r} was released")
        if key in self._block_of_key or block in self._key_of_block:
            return
        self._block_of_key[key] = block
        self._key_of_block[block] = key

    def _blocks_needed(self, requests: list[tuple[_Sequence, int]]) -> int:
        """Exact number of blocks ``append_many`` will take (simulating copy-on-write releases)."""
        bs, needed, released = self.block_size, 0, {}
        for seq, n in requests:
            if n <= 0:
                continue
            needed += -(-(seq.length + n) // bs) - len(seq.table)
            if seq.length % bs:
                last = seq.table[-1]
                if self._must_copy(last, released.get(last, 0)):
                    needed += 1
                    released[last] = released.get(last, 0) + 1
        return needed

    def blocks_needed(self, requests: Iterable[tuple[SeqId, int]]) -> int:
        """How many blocks ``append_many(requests)`` would take (copy-on-write included)."""
        return self._blocks_needed([(self._get(s), n) for s, n in requests])

    def can_append(self, requests: Iterable[tuple[SeqId, int]], reserve: int = 0) -> bool:
        """Whether ``append_many(requests)`` would succeed, leaving ``reserve`` blocks free."""
        return self.growable or self.blocks_needed(requests) + reserve <= self.num_free_blocks

    def append_slots(self, seq_id: SeqId, n: int = 1) -> tuple[list[int], list[tuple[int, int]]]:
        """Room for ``n`` more tokens of one sequence: returns (slots, copies).

        ``copies`` lists (src_block, dst_block) pairs that storage must copy before writing
        (copy-on-write of a shared, partially filled last block).
        """
        slots, copies = self.append_many([(seq_id, n)])
        return slots[0], copies

    def append_many(self, requests: list[tuple[SeqId, int]]) -> tuple[list[list[int]], list[tuple[int, int]]]:
        """``append_slots`` for several sequences at once, all-or-nothing."""
        seqs = [(self._get(s), n) for s, n in requests]
        for s, n in requests:
            if not isinstance(n, int) or n < 0:
                raise BlockManagerError(f"cannot append {n!r} tokens to sequence {s!r}")
        if len({s for s, _ in requests}) != len(requests):
            raise BlockManagerError("a sequence appears twice in one append_many call")
        self._reserve(self._blocks_needed(seqs))
        bs = self.block_size
        all_slots: list[list[int]] = []
        copies: list[tuple[int, int]] = []
        for seq, n in seqs:
            slots: list[int] = []
            if n and seq.length % bs and self._must_copy(seq.table[-1]):
                shared = seq.table[-1]
                seq.table[-1] = self._take()
                self._release(shared)
                copies.append((shared, seq.table[-1]))
            for pos in range(seq.length, seq.length + n):
                if pos % bs == 0:
                    seq.table.append(self._take())
                slots.append(seq.table[pos // bs] * bs + pos % bs)
            seq.length += n
            all_slots.append(slots)
        self.blocks_peak = max(self.blocks_peak, self.num_used_blocks)
        return all_slots, copies

    def fork(self, parent: SeqId, child: SeqId) -> None:
        """The child shares all of the parent's blocks (no copy; reference counts + 1)."""
        src = self._get(parent)
        if child in self._seqs:
            raise BlockManagerError(f"cannot fork into existing sequence {child!r}")
        for block in src.table[src.released :]:
            self._add_ref(block)
        self._seqs[child] = _Sequence(list(src.table), src.length, src.released)

    def free(self, seq_id: SeqId) -> None:
        """Drop a sequence: every block loses one reference; blocks at zero are free again."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise UnknownSequenceError(f"cannot free unknown sequence {seq_id!r} (double free?)")
        for block in seq.table[seq.released :]:
            self._release(block)

    def release_before(self, seq_id: SeqId, position: int) -> int:
        """Give back the blocks holding only tokens before ``position`` (a sliding window no
        longer reaches them); their entries become :data:`HOLE`. Returns how many were released."""
        seq = self._get(seq_id)
        upto = min(position, seq.length) // self.block_size
        for i in range(seq.released, upto):
            self._release(seq.table[i])
            seq.table[i] = HOLE
        released, seq.released = max(upto - seq.released, 0), max(seq.released, upto)
        return released

    def truncate(self, seq_id: SeqId, length: int) -> None:
        """Keep only the first ``length`` tokens (blocks past them lose a reference)."""
        seq = self._get(seq_id)
        if not 0 <= length <= seq.length:
            raise BlockManagerError(f"cannot truncate sequence {seq_id!r} of length {seq.length} to {length}")
        keep = -(-length // self.block_size)
        if length and keep <= seq.released:
            raise BlockManagerError(
                f"cannot truncate sequence {seq_id!r} to {length} tokens: its blocks before token "
                f"{seq.released * self.block_size} were released (out of the sliding window)")
        for block in seq.table[max(keep, seq.released) :]:
            self._release(block)
        seq.released = min(seq.released, keep)
        del seq.table[keep:]
        seq.length = length
        last = seq.table[-1] if seq.table else None
        if length % self.block_size and last in self._key_of_block and self._ref_counts[last] == 1:
            del self._block_of_key[self._key_of_block.pop(last)]  # it will be written again

    def free_all(self) -> None:
        for seq_id in list(self._seqs):
            self.free(seq_id)

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
        counts = [0] * self.num_blocks
        for seq in self._seqs.values():
            assert len(seq.table) == -(-seq.length // self.block_size), "table length does not match tokens"
            assert all(b == HOLE for b in seq.table[: seq.released]), "a released entry is not a hole"
            for block in seq.table[seq.released :]:
                assert block != HOLE, "a hole after a held block"
                counts[block] += 1
        assert counts == self._ref_counts, "reference counts differ from the tables holding each block"
        assert self._num_shared == sum(1 for c in counts if c > 1), "the shared-block count is off"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        unreferenced = {b for b, c in enumerate(counts) if c == 0}
        assert free | set(self._evictable) == unreferenced, "free + evictable differ from unreferenced blocks"
        assert not free & set(self._evictable), "a block is both free and evictable"
        assert set(self._evictable) <= set(self._key_of_block), "an evictable block has no key"
        assert all(self._block_of_key[k] == b for b, k in self._key_of_block.items()), "key maps disagree"
        assert len(self._block_of_key) == len(self._key_of_block)
        assert self.num_free_blocks + self.num_used_blocks == self.num_blocks
