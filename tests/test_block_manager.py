"""The block manager on its own: primitives, errors, and hypothesis-driven invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged.block_manager import BlockManager, BlockManagerError, NoFreeBlocksError, UnknownSequenceError


def test_append_allocates_only_when_last_block_is_full():
    bm = BlockManager(block_size=4, num_blocks=8)
    bm.add_sequence("a")
    slots, copies = bm.append_slots("a", 3)
    assert copies == [] and bm.num_used_blocks == 1
    assert slots == [0, 1, 2]
    slots, _ = bm.append_slots("a", 2)
    assert bm.num_used_blocks == 2 and slots == [3, 4]
    assert bm.block_table("a") == [0, 1] and bm.seq_len("a") == 5
    assert bm.slot("a", 4) == 4


def _forked(block_size: int, num_blocks: int, parent_tokens: int) -> BlockManager:
    """A manager whose sequence "p" holds ``parent_tokens`` tokens and was just forked into "c"."""
    bm = BlockManager(block_size=block_size, num_blocks=num_blocks)
    bm.add_sequence("p")
    bm.append_slots("p", parent_tokens)
    bm.fork("p", "c")
    return bm


def test_fork_shares_and_copy_on_write_copies_only_the_partial_block():
    bm = _forked(block_size=4, num_blocks=8, parent_tokens=6)  # blocks [0 full, 1 half]
    assert bm.block_table("c") == bm.block_table("p")
    assert bm.ref_count(0) == 2 and bm.ref_count(1) == 2 and bm.num_shared_blocks == 2
    slots, copies = bm.append_slots("c", 1)
    assert copies == [(1, 2)]  # the shared half block is copied into a fresh one
    assert bm.block_table("c") == [0, 2] and slots == [2 * 4 + 2]
    assert bm.ref_count(1) == 1 and bm.ref_count(0) == 2
    slots, copies = bm.append_slots("p", 1)  # now the parent owns block 1 alone: no copy
    assert copies == [] and slots == [1 * 4 + 2]
    bm.check_invariants()


def test_full_shared_last_block_needs_no_copy():
    bm = _forked(block_size=4, num_blocks=8, parent_tokens=4)
    _, copies = bm.append_slots("c", 1)
    assert copies == [] and bm.block_table("c")[0] == bm.block_table("p")[0]


def test_free_returns_blocks_at_zero_references():
    bm = _forked(block_size=2, num_blocks=4, parent_tokens=4)
    bm.free("p")
    assert bm.num_free_blocks == 2  # still held by c
    bm.free("c")
    assert bm.num_free_blocks == 4


def test_misuse_is_reported_clearly():
    bm = BlockManager(block_size=2, num_blocks=4)
    bm.add_sequence("a")
    with pytest.raises(BlockManagerError, match="already exists"):
        bm.add_sequence("a")
    bm.free("a")
    with pytest.raises(UnknownSequenceError, match="double free"):
        bm.free("a")
    with pytest.raises(UnknownSequenceError, match="unknown sequence 'zz'"):
        bm.append_slots("zz", 1)
    with pytest.raises(UnknownSequenceError):
        bm.fork("zz", "b")
    bm.add_sequence("b")
    with pytest.raises(BlockManagerError, match="existing"):
        bm.fork("b", "b")
    with pytest.raises(BlockManagerError, match="cannot append"):
        bm.append_slots("b", -1)
    with pytest.raises(BlockManagerError, match="twice"):
        bm.append_many([("b", 1), ("b", 1)])
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(block_size=0)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(block_size=4, num_blocks=0)


def test_exhaustion_is_typed_and_changes_nothing():
    bm = BlockManager(block_size=4, num_blocks=3)
    bm.add_sequence("a")
    bm.add_sequence("b")
    bm.append_slots("a", 8)
    with pytest.raises(NoFreeBlocksError) as info:
        bm.append_many([("b", 4), ("a", 1)])  # needs 2, 1 free
    assert (info.value.needed, info.value.free, info.value.total) == (2, 1, 3)
    assert bm.seq_len("b") == 0 and bm.seq_len("a") == 8 and bm.num_free_blocks == 1
    assert not bm.can_append([("b", 5)]) and bm.can_append([("b", 4)])
    bm.check_invariants()


def test_growable_pool_grows_on_demand():
    bm = BlockManager(block_size=4, num_blocks=None, initial_blocks=2)
    bm.add_sequence("a")
    bm.append_slots("a", 40)
    assert bm.num_blocks >= 10 and bm.num_used_blocks == 10
    bm.free("a")
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


def test_copy_on_write_budget_is_exact_when_two_sharers_append():
    """Two sequences share a partial block: only the first writer copies; 1 block suffices."""
    bm = _forked(block_size=4, num_blocks=2, parent_tokens=2)
    _, copies = bm.append_many([("p", 1), ("c", 1)])
    assert len(copies) == 1 and bm.num_free_blocks == 0


def test_truncate_releases_blocks():
    bm = BlockManager(block_size=4, num_blocks=4)
    bm.add_sequence("a")
    bm.append_slots("a", 9)
    bm.truncate("a", 4)
    assert bm.block_table("a") == [0] and bm.num_free_blocks == 3
    with pytest.raises(BlockManagerError):
        bm.truncate("a", 5)


# ---------------------------------------------------------------------------- property tests
_ops = st.lists(
    st.tuples(st.sampled_from(["add", "append", "fork", "free", "truncate"]), st.integers(0, 7), st.integers(0, 9)),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=_ops, block_size=st.sampled_from([1, 2, 4]), budget=st.sampled_from([None, 6, 12]))
def test_random_operation_sequences_keep_invariants(ops, block_size, budget):
    """Refcount = tables holding the block; free + used = total; freeing all returns every block;
    appended slots lie in the sequence's own blocks; copy-on-write targets are exclusive."""
    bm = BlockManager(block_size=block_size, num_blocks=budget, initial_blocks=3)
    live: list[int] = []
    next_id = 0
    for op, a, b in ops:
        try:
            if op == "add" or not live:
                bm.add_sequence(next_id)
                live.append(next_id)
                next_id += 1
            elif op == "append":
                seq = live[a % len(live)]
                before = bm.seq_len(seq)
                slots, copies = bm.append_slots(seq, b)
                assert len(slots) == b and bm.seq_len(seq) == before + b
                table = bm.block_table(seq)
                assert all(s // block_size in table for s in slots)
                assert all(bm.ref_count(dst) == 1 for _, dst in copies)
            elif op == "fork":
                parent = live[a % len(live)]
                bm.fork(parent, next_id)
                assert bm.block_table(next_id) == bm.block_table(parent)
                live.append(next_id)
                next_id += 1
            elif op == "free":
                bm.free(live.pop(a % len(live)))
            else:
                seq = live[a % len(live)]
                bm.truncate(seq, min(b, bm.seq_len(seq)))
        except NoFreeBlocksError:
            assert budget is not None
        bm.check_invariants()
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
        if budget is not None:
            assert bm.num_blocks == budget
    for seq in live:
        bm.free(seq)
    assert bm.num_free_blocks == bm.num_blocks and bm.num_used_blocks == 0
    bm.check_invariants()


def test_prefix_cache_keeps_released_blocks_until_evicted():
    bm = BlockManager(block_size=2, num_blocks=3, enable_prefix_caching=True)
    bm.add_sequence("a")
    bm.append_slots("a", 4)
    bm.register_block("a", 0, "k0")
    bm.register_block("a", 1, "k1")
    first = bm.block_table("a")
    bm.free("a")
    assert bm.num_free_blocks == 3 and bm.num_cached_blocks == 2
    assert bm.match_prefix(["k0", "k1", "k2"]) == first
    bm.add_sequence("b", bm.match_prefix(["k0"]), 2)  # adopts the cached block
    assert bm.ref_count(first[0]) == 1
    bm.add_sequence("c")
    bm.append_slots("c", 4)  # needs 2 blocks: the free one, then evicts k1's block (LRU)
    assert bm.match_prefix(["k0", "k1"]) == first[:1] and bm.num_cached_blocks == 1
    with pytest.raises(BlockManagerError, match="not full"):
        bm.register_block("b", 1, "k9")
    bm.check_invariants()


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "append", "fork", "free", "register", "adopt"]),
                              st.integers(0, 7), st.integers(0, 9)), max_size=60),
       budget=st.sampled_from([None, 8]))
def test_random_operations_with_prefix_caching_keep_invariants(ops, budget):
    """Registered keys always name the block holding them; evictable blocks are unreferenced and
    keyed; adopting a cached prefix moves blocks out of the evictable set; freeing all returns all."""
    bm = BlockManager(block_size=2, num_blocks=budget, initial_blocks=3, enable_prefix_caching=True)
    live, next_id = [], 0
    for op, a, b in ops:
        try:
            if op == "add" or not live:
                bm.add_sequence(next_id)
                live.append(next_id)
                next_id += 1
            elif op == "append":
                bm.append_slots(live[a % len(live)], b)
            elif op == "fork":
                bm.fork(live[a % len(live)], next_id)
                live.append(next_id)
                next_id += 1
            elif op == "free":
                bm.free(live.pop(a % len(live)))
            elif op == "register":
                seq = live[a % len(live)]
                full = bm.seq_len(seq) // 2
                if full:
                    bm.register_block(seq, b % full, ("key", b % 4, b % full))
            else:
                keys = [("key", b % 4, i) for i in range(a % 4)]
                blocks = bm.match_prefix(keys)
                bm.add_sequence(next_id, blocks, 2 * len(blocks))
                live.append(next_id)
                next_id += 1
        except NoFreeBlocksError:
            assert budget is not None
        bm.check_invariants()
    for seq in live:
        bm.free(seq)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()
