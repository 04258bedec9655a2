"""State slots: one slot of a recurrent-state pool per sequence (pure Python, like the block manager).

A recurrent layer (:mod:`hf_paged.kinds.recurrent`) keeps a fixed-size state per sequence, so a
sequence needs exactly one slot, the same index in every recurrent layer's pool, from admission
to its end. Forks (``n > 1`` samples, beams) give the child a copy of the parent's state, never
the parent's slot: states are updated in place, a shared slot would mix two sequences.

Forks are settled in batches (:meth:`StateSlotManager.settle`): a beam step forks every new
beam from its parent and then frees the old beams, so children get their slots only after the
frees, and the copies come back as one list to run as a *simultaneous* copy (gather all sources,
then scatter): a child may be given a slot that is still the source of another child's copy.
"""

from __future__ import annotations

from collections.abc import Hashable

SeqId = Hashable
SlotPairs = list[tuple[int, int]]  # (source slot, destination slot)


class NoFreeSlotsError(RuntimeError):
    """Raised when a state pool has no free slot; nothing changed."""

    def __init__(self, needed: int, free: int, total: int):
        super().__init__(f"need {needed} state slots, {free} of {total} free")
        self.needed, self.free, self.total = needed, free, total


class StateSlotManager:
    """``num_slots`` slots, each held by at most one sequence."""

    def __init__(self, num_slots: int):
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest slot first
        self._slot_of: dict[SeqId, int] = {}
        self._forks: dict[SeqId, int] = {}  # child -> the slot its state is copied from (until settle)
        self.peak = 0

    # ------------------------------------------------------------------ facts
    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._slot_of or seq_id in self._forks

    def slot(self, seq_id: SeqId) -> int:
        return self._slot_of[seq_id]

    @property
    def num_used(self) -> int:
        return len(self._slot_of)

    @property
    def num_free(self) -> int:
        return len(self._free)

    # ------------------------------------------------------------------ sequences
    def allocate(self, seq_id: SeqId) -> int:
        """A slot for a new sequence (its state starts empty: the first forward fills it)."""
        if seq_id in self:
            raise ValueError(f"sequence {seq_id!r} already holds a state slot")
        if not self._free:
            raise NoFreeSlotsError(1, 0, self.num_slots)
        slot = self._slot_of[seq_id] = self._free.pop()
        self.peak = max(self.peak, len(self._slot_of))
        return slot

    def fork(self, parent: SeqId, child: SeqId) -> None:
        """``child`` continues from ``parent``'s state: it gets its own slot (and the copy) at
        :meth:`settle`. A parent that is itself an unsettled child passes on its source."""
        if child in self:
            raise ValueError(f"sequence {child!r} already holds a state slot")
        source = self._slot_of.get(parent, self._forks.get(parent))
        if source is None:
            raise KeyError(f"fork from unknown sequence {parent!r}")
        self._forks[child] = source

    def free(self, seq_id: SeqId) -> None:
        """Give the slot back (an unsettled child just forgets its fork)."""
        if self._forks.pop(seq_id, None) is not None:
            return
        self._free.append(self._slot_of.pop(seq_id))
        self._free.sort(reverse=True)

    def settle(self) -> SlotPairs:
        """Give every forked child a slot; returns the (source, destination) copies, to run at once."""
        if len(self._forks) > len(self._free):
            raise NoFreeSlotsError(len(self._forks), len(self._free), self.num_slots)
        copies = []
        for child, source in self._forks.items():
            slot = self._slot_of[child] = self._free.pop()
            copies.append((source, slot))
        self._forks.clear()
        self.peak = max(self.peak, len(self._slot_of))
        return copies

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        held = list(self._slot_of.values())
        assert len(set(held)) == len(held), "two sequences hold one state slot"
        assert not set(held) & set(self._free), "a held state slot is also free"
        assert len(held) + len(self._free) == self.num_slots, "state slots lost"
