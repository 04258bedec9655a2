"""Layer groups: one block table per sequence for each set of layers that see the same span.

A model's attention layers fall into groups, one per layer kind (:mod:`hf_paged.kinds`): the
full-attention layers, the layers of each distinct sliding window ``W``, the chunked layers of
each chunk size. A sliding layer reads only its last ``W`` tokens, so its group
gives back every block that falls wholly outside the window (vLLM V1's hybrid KV cache manager
does the same), while the full group keeps everything. Each group is one :class:`BlockManager`;
:class:`GroupedBlockManager` drives them together (same sequences, same tokens) and keeps every
call all-or-nothing across groups. Pure Python, like the block manager.

What a sliding group keeps, and why: before a forward whose first new token sits at position
``L``, the tokens at ``L - W + 1`` and later, at block granularity; exactly the ``W - 1`` tokens
stock ``DynamicSlidingWindowLayer`` keeps, plus at most the partial blocks at either end. While
a layer *records its past* (transformers does this for an assistant model, whose candidate
tokens may be rolled back by ``crop``), nothing is released until the crop.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from hf_paged.block_manager import BlockManager, NoFreeBlocksError
from hf_paged.kinds import KVSpec, SharedKVSpec

SeqId = Hashable


@dataclass(frozen=True)
class LayerGroup:
    """Layers sharing one block table per sequence: the layers of one kind (:mod:`hf_paged.kinds`)."""

    spec: KVSpec
    layers: tuple[int, ...]

    @property
    def window(self) -> int | None:
        """Tokens of the past the group keeps (None: all)."""
        return self.spec.window

    @property
    def is_sliding(self) -> bool:
        """Whether the group gives blocks back as its sequences move on (sliding and chunked kinds)."""
        return self.spec.gives_back

    def first_needed(self, next_position: int) -> int:
        """The earliest token position the next forward (first new token at ``next_position``) reads."""
        return self.spec.first_needed(next_position)


def layer_groups(specs: Sequence[KVSpec | None]) -> list[LayerGroup]:
    """Group the layers that store K/V by spec (``specs[i]``: layer i's, None for a layer without
    K/V; a sharing layer stores nothing and joins no group). Full attention comes first, then the
    kinds that give blocks back, in increasing window."""
    by_spec: dict[KVSpec, list[int]] = {}
    for layer, spec in enumerate(specs):
        if spec is not None and spec.stores:
            by_spec.setdefault(spec, []).append(layer)
    order = sorted(by_spec, key=lambda s: (s.window is not None, s.window or 0, s.kind))
    return [LayerGroup(s, tuple(by_spec[s])) for s in order]


def group_of_layers(groups: Sequence[LayerGroup], specs: Sequence[KVSpec | None]) -> list[int]:
    """Layer -> index of the group whose blocks it reads (a sharing layer: its source's group;
    a layer without K/V: 0, never used)."""
    index = [0] * len(specs)
    for g, group in enumerate(groups):
        for layer in group.layers:
            index[layer] = g
    for layer, spec in enumerate(specs):
        if isinstance(spec, SharedKVSpec):
            index[layer] = index[spec.source]
    return index


def sliding_cap(group: LayerGroup, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int | None:
    """Most blocks a group that gives blocks back can hold at once in an engine (None for a full
    group): each sequence its window's blocks plus two partial ones, and the step's new tokens on top."""
    per_seq = group.spec.blocks_per_sequence(block_size)
    if per_seq is None:
        return None
    return max_num_seqs * per_seq + -(-max_num_batched_tokens // block_size)


def split_budget(total_bytes: int, bytes_per_block: Sequence[int], caps: Sequence[int | None]) -> list[int]:
    """Blocks per layer-group pool from one byte budget: equal counts, except that a group with a
    cap (a sliding group, see :func:`sliding_cap`) gets no more than it can ever use, and what it
    leaves goes to the others. Caps apply only beside an uncapped group (a model whose layers are
    all sliding spends its whole budget on them)."""
    groups = range(len(bytes_per_block))
    if all(cap is not None for cap in caps):
        caps = [None] * len(caps)
    sizes: list[int | None] = [None] * len(bytes_per_block)
    open_groups, remaining = set(groups), total_bytes
    while open_groups:
        share = remaining // sum(bytes_per_block[g] for g in open_groups)
        capped = [g for g in open_groups if caps[g] is not None and caps[g] < share]
        if not capped:
            break
        for g in capped:
            sizes[g] = caps[g]
            remaining -= caps[g] * bytes_per_block[g]
            open_groups.discard(g)
    for g in open_groups:
        sizes[g] = max(1, share)
    return sizes


class GroupedBlockManager:
    """One :class:`BlockManager` per layer group, holding the same sequences.

    ``num_blocks`` is each group's budget (a layer's pool holds that many blocks; one count for
    all groups, or one per group), or ``None`` to grow on demand.
    """

    def __init__(self, block_size: int, num_blocks: int | Sequence[int] | None, groups: Sequence[LayerGroup], *,
                 enable_prefix_caching: bool = False):
        if not groups:
            raise ValueError("a model needs at least one attention layer group")
        self.block_size = block_size
        self.groups = list(groups)
        budgets = list(num_blocks) if isinstance(num_blocks, (list, tuple)) else [num_blocks] * len(self.groups)
        if len(budgets) != len(self.groups):
            raise ValueError(f"{len(budgets)} block budgets for {len(self.groups)} layer groups")
        self.managers = [BlockManager(block_size, n, enable_prefix_caching=enable_prefix_caching) for n in budgets]

    # ------------------------------------------------------------------ facts
    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self.managers[0]

    def seq_len(self, seq_id: SeqId) -> int:
        return self.managers[0].seq_len(seq_id)

    @property
    def num_used_blocks(self) -> int:
        return sum(m.num_used_blocks for m in self.managers)

    @property
    def has_sliding(self) -> bool:
        """Whether some group gives blocks back (else :meth:`release_out_of_window` does nothing)."""
        return any(group.is_sliding for group in self.groups)

    def check_invariants(self) -> None:
        for manager in self.managers:
            manager.check_invariants()
        seqs = [sorted(map(repr, m.sequences)) for m in self.managers]
        assert all(s == seqs[0] for s in seqs), "layer groups hold different sequences"

    # ------------------------------------------------------------------ sequences
    def add_sequence(self, seq_id: SeqId) -> None:
        for manager in self.managers:
            manager.add_sequence(seq_id)

    def fork(self, parent: SeqId, child: SeqId) -> None:
        for manager in self.managers:
            manager.fork(parent, child)

    def free(self, seq_id: SeqId) -> None:
        for manager in self.managers:
            manager.free(seq_id)

    def truncate(self, seq_id: SeqId, length: int) -> None:
        """Keep the first ``length`` tokens in every group; checked in all groups before any changes."""
        for group, manager in zip(self.groups, self.managers):
            released = manager.num_released(seq_id) * self.block_size
            if group.is_sliding and length and group.first_needed(length) < released:
                raise RuntimeError(
                    f"cannot roll back to {length} tokens: the sliding layers (window {group.window}) already "
                    f"gave back their blocks before token {released}. Call cache.activate_past_recording() "
                    "before the forwards that may be rolled back, as for transformers' DynamicSlidingWindowLayer."
                )
        for manager in self.managers:
            manager.truncate(seq_id, length)

    def release_out_of_window(self, seq_id: SeqId, next_position: int,
                              recording: Sequence[bool] | None = None) -> None:
        """Before a forward from ``next_position``: sliding groups give back what it cannot read
        (a group whose layers record their past, ``recording[g]``, keeps everything until it is cropped)."""
        for g, (group, manager) in enumerate(zip(self.groups, self.managers)):
            if group.is_sliding and not (recording and recording[g]):
                manager.release_before(seq_id, group.first_needed(next_position))

    def append_many(self, requests: list[tuple[SeqId, int]]) -> list[tuple[list[list[int]], list[tuple[int, int]]]]:
        """``BlockManager.append_many`` in every group: (slots per request, copies) per group. All or
        nothing: with fixed budgets every group is checked before any allocates (one group checks
        itself before it allocates)."""
        for manager in self.managers if len(self.managers) > 1 else ():
            if not manager.can_append(requests):
                raise NoFreeBlocksError(manager.blocks_needed(requests), manager.num_free_blocks, manager.num_blocks)
        return [manager.append_many(requests) for manager in self.managers]
