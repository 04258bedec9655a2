"""The prefix index: which cached blocks hold the K/V of which token prefix (paper §4.4).

One index serves the engine (through ``KVCacheManager``) and ``generate()`` (through
``PagedKVCache`` on a model's persistent pool, :mod:`hf_paged.prefix_cache`). Pure Python, on
top of a :class:`GroupedBlockManager`: the blocks themselves, their reference counts and the
LRU of evictable cached blocks stay in the block managers.

Keys are chained: the key of block ``i`` of a token sequence is ``(hash(key of block i-1),
tokens of block i)``, so a block is reused only after the same prefix, and the tokens are
compared on lookup (a dict compares keys by equality, not by hash alone).

Sliding-window groups: a hit of ``length`` tokens needs, in a full group, every block before it;
in a sliding group only the blocks of its last ``window - 1`` tokens (earlier entries enter the
table as holes). Exact by construction: a hit reads only blocks holding the K/V of the same tokens
after the same prefix.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from hf_paged.block_manager import HOLE
from hf_paged.layer_groups import GroupedBlockManager

SeqId = Hashable
Key = tuple  # (hash of the parent key, tokens of the block)
Chain = list[tuple[tuple[int, ...], int]]  # (tokens, index of the parent entry or -1), parents first


class PrefixIndex:
    """Chained block keys over the block managers of every layer group.

    Per sequence it remembers the keys of the full blocks registered so far (the chain to extend).
    It also keeps each key's parent, so that a snapshot can rebuild chains; links nothing cached
    needs any more are pruned, keeping that map proportional to the pools.
    """

    def __init__(self, blocks: GroupedBlockManager):
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.groups = blocks.groups
        self._keys: dict[SeqId, list[Key]] = {}  # seq -> keys of its registered full blocks
        self._parents: dict[Key, Key | None] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0

    # ------------------------------------------------------------------ lookups
    def keys_of(self, token_ids: Sequence[int], count: int, start: int = 0, parent: Key | None = None,
                root: Hashable = None) -> list[Key]:
        """Chained keys of ``count`` full blocks of ``token_ids`` from block ``start`` (``parent``:
        the key of block ``start - 1``). ``root`` stands before the first block: sequences whose
        K/V differ for the same tokens (another LoRA adapter) chain from another root, so they
        never share blocks; None is the base model's."""
        keys, bs = [], self.block_size
        if start == 0 and parent is None:
            parent = root
        for i in range(start, start + count):
            parent = (hash(parent), tuple(token_ids[i * bs : (i + 1) * bs]))
            keys.append(parent)
        return keys

    def tables_for(self, keys: list[Key], length: int) -> list[list[int]] | None:
        """Each group's block table for the first ``length`` tokens of a sequence whose block keys
        are ``keys`` (the last block may be partly used: it is copied before it is written), or
        None when some group lacks a block those tokens' next forward reads."""
        count = -(-length // self.block_size)
        if count > len(keys):
            return None
        tables = []
        for group, manager in zip(self.groups, self.blocks.managers):
            first = group.first_needed(length) // self.block_size
            window = [manager.cached_block(key) for key in keys[first:count]]
            if None in window:
                return None
            tables.append([HOLE] * first + window)
        return tables

    def longest_hit(self, token_ids: Sequence[int], max_blocks: int, root: Hashable = None) -> list[Key]:
        """Keys of the longest run of leading full blocks (at most ``max_blocks``) that every group
        can serve (chained from ``root``: see :meth:`keys_of`)."""
        keys = self.keys_of(token_ids, max(max_blocks, 0), root=root)
        hit = min((len(m.match_prefix(keys)) for g, m in zip(self.groups, self.blocks.managers) if not g.is_sliding),
                  default=len(keys))
        while hit > 0 and self.tables_for(keys, hit * self.block_size) is None:
            hit -= 1
        return keys[:hit]

    # ------------------------------------------------------------------ sequences
    def adopt(self, seq_id: SeqId, keys: list[Key], length: int, tables: list[list[int]]) -> None:
        """Register ``seq_id`` in every group with ``tables`` (from :meth:`tables_for`) holding its
        first ``length`` tokens."""
        for manager, table in zip(self.blocks.managers, tables):
            manager.add_sequence(seq_id, table, length)
        self._keys[seq_id] = list(keys[: length // self.block_size])

    def num_registered(self, seq_id: SeqId) -> int:
        """Leading full blocks of the sequence that are in the index."""
        return len(self._keys.get(seq_id, ()))

    def register(self, seq_id: SeqId, token_ids: Sequence[int], computed: int, root: Hashable = None) -> list[Key]:
        """Index the full blocks among the first ``computed`` tokens of the sequence that are not
        indexed yet (in every group still holding them; first block registered under a key wins),
        chained from ``root`` (see :meth:`keys_of`). Returns the new keys."""
        keys = self._keys.setdefault(seq_id, [])
        full = computed // self.block_size
        if full <= len(keys):
            return []
        parent = keys[-1] if keys else root
        new = self.keys_of(token_ids, full - len(keys), len(keys), parent)
        for i, key in enumerate(new, start=len(keys)):
            self._parents.setdefault(key, parent)
            parent = key
            for manager in self.blocks.managers:
                if i >= manager.num_released(seq_id):
                    manager.register_block(seq_id, i, key)
        keys.extend(new)
        if len(self._parents) > 2 * sum(m.num_blocks for m in self.blocks.managers) + 1024:
            self._prune_parents()
        return new

    def fork(self, parent: SeqId, child: SeqId) -> None:
        self._keys[child] = list(self._keys.get(parent, []))

    def truncate(self, seq_id: SeqId, length: int) -> None:
        """The sequence keeps its first ``length`` tokens (blocks after them are no longer its own)."""
        if seq_id in self._keys:
            del self._keys[seq_id][length // self.block_size :]

    def forget(self, seq_id: SeqId) -> None:
        self._keys.pop(seq_id, None)

    def record(self, queried: int, hit: int) -> None:
        """Count a lookup: ``queried`` tokens asked for, ``hit`` found cached."""
        self.queried_tokens += queried
        self.hit_tokens += hit

    def clear(self) -> int:
        """Forget every cached block (held ones stay with their sequences). Returns how many were cached."""
        dropped = sum(manager.uncache_all() for manager in self.blocks.managers)
        self._parents.clear()
        return dropped

    @property
    def num_chain_links(self) -> int:
        """Parent links kept for snapshots (pruned to those cached blocks need)."""
        return len(self._parents)

    def _prune_parents(self) -> None:
        keep: dict[Key, Key | None] = {}
        for manager in self.blocks.managers:
            for key in manager.cached_blocks():
                while key is not None and key not in keep and key in self._parents:
                    keep[key] = self._parents[key]
                    key = keep[key]
        self._parents = keep

    # ------------------------------------------------------------------ snapshots
    def export(self) -> tuple[Chain, list[list[tuple[int, int]]]]:
        """What a snapshot holds: the chain, as ``(tokens, index of the parent entry or -1)`` with
        parents first, and per layer group ``(chain entry, block)`` for each cached block. Keys are
        not saved (they contain Python hashes, which differ between processes): a loader rebuilds
        them from the tokens with its own hash. Chains from a ``root`` (a LoRA adapter's blocks)
        are left out: a loader could not tell which adapter computed them."""
        index: dict[Key, int] = {}
        chain: Chain = []

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
        for manager in self.blocks.managers:
            entries = [(add(key), block) for key, block in manager.cached_blocks().items()]
            groups.append([(i, block) for i, block in entries if i is not None])
        return chain, groups

    def import_(self, chain: Chain, groups: list[list[int]]) -> list[list[tuple[int, int]]]:
        """Take blocks for a snapshot's cached blocks (``groups[g]``: chain entries) that are not
        cached yet, register them under keys rebuilt from the chain, and park them as evictable.
        Returns per group ``(position in groups[g], block)``: where storage must copy each one's
        K/V. Stops in a group whose fixed budget has no free block left."""
        keys: list[Key] = []
        for tokens, parent in chain:
            keys.append((hash(keys[parent] if parent >= 0 else None), tuple(tokens)))
            self._parents.setdefault(keys[-1], keys[parent] if parent >= 0 else None)
        placed = []
        for manager, entries in zip(self.blocks.managers, groups):
            todo = [(pos, keys[i]) for pos, i in enumerate(entries) if manager.cached_block(keys[i]) is None]
            room = len(todo) if manager.growable else min(len(todo), manager.num_free_blocks)
            todo = todo[:room]
            blocks = manager.allocate_blocks(len(todo)) if todo else []
            for (_, key), block in zip(todo, blocks):
                manager.cache_block(block, key)
            manager.release_blocks(blocks)
            placed.append([(pos, block) for (pos, _), block in zip(todo, blocks)])
        return placed
