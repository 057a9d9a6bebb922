"""BlockTable: addresses, slots, growth, copy-on-write and misuse."""

import pytest

from pagedkv import (
    BlockAllocator,
    BlockCopy,
    BlockTable,
    InvalidArgumentError,
    OutOfBlocksError,
    SequenceTooLongError,
)


def test_hand_computed_addresses():
    allocator = BlockAllocator(32)
    allocator.allocate(7)  # blocks 0..6 taken: the table gets 7, 8, 9
    table = BlockTable(allocator, block_size=16)
    table.append_tokens(40)
    assert table.block_ids == [7, 8, 9]
    assert table.physical(0) == (7, 0)
    assert table.physical(15) == (7, 15)
    assert table.physical(16) == (8, 0)
    assert table.physical(39) == (9, 7)
    assert table.slot(0) == 7 * 16
    assert table.slot(17) == 8 * 16 + 1
    assert table.slot(39) == 9 * 16 + 7
    assert table.slot_mapping(14, 18) == [126, 127, 128, 129]


def test_claims_a_block_only_when_the_last_is_full():
    allocator = BlockAllocator(8)
    table = BlockTable(allocator, block_size=4)
    claimed = []
    for _ in range(13):
        table.append_tokens(1)
        claimed.append(table.num_blocks)
    assert claimed == [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4]
    assert table.num_blocks_needed(3) == 0
    assert table.num_blocks_needed(4) == 1


def test_no_two_live_tokens_share_a_slot():
    allocator = BlockAllocator(200)
    tables = []
    for length in (1, 16, 17, 100, 33, 64, 5):
        table = BlockTable(allocator, block_size=16)
        for chunk in (length // 2, length - length // 2):
            table.append_tokens(chunk)
        tables.append(table)
    tables[2].free()
    tables[2].append_tokens(50)  # reuses freed blocks
    slots = [s for t in tables for s in t.slot_mapping(0, t.num_tokens)]
    assert len(slots) == len(set(slots)) == sum(t.num_tokens for t in tables)
    allocator.check_integrity()


def test_all_or_nothing_append():
    allocator = BlockAllocator(3)
    table = BlockTable(allocator, block_size=4)
    table.append_tokens(6)
    with pytest.raises(OutOfBlocksError):
        table.append_tokens(7)  # needs 2 more, 1 free
    assert table.num_tokens == 6 and table.block_ids == [0, 1]
    assert allocator.num_used == 2


def test_max_length_is_enforced_without_change():
    allocator = BlockAllocator(10)
    table = BlockTable(allocator, block_size=4, max_num_tokens=10)
    table.append_tokens(8)
    with pytest.raises(SequenceTooLongError, match="11 tokens.*maximum of 10"):
        table.append_tokens(3)
    assert table.num_tokens == 8 and allocator.num_used == 2


def test_bad_arguments():
    allocator = BlockAllocator(4)
    for bad in (0, -1, 2.0, "16"):
        with pytest.raises(InvalidArgumentError):
            BlockTable(allocator, block_size=bad)
    table = BlockTable(allocator, 4)
    table.append_tokens(3)
    with pytest.raises(InvalidArgumentError):
        table.append_tokens(-1)
    with pytest.raises(InvalidArgumentError):
        table.slot(4)
    with pytest.raises(InvalidArgumentError):
        table.slot_mapping(2, 9)
    with pytest.raises(InvalidArgumentError):
        table.slot_mapping(3, 1)


def test_fork_shares_then_copies_on_write():
    allocator = BlockAllocator(16)
    parent = BlockTable(allocator, block_size=4)
    parent.append_tokens(6)  # blocks [0, 1], last one half full
    child = parent.fork()
    assert child.block_ids == parent.block_ids == [0, 1]
    assert allocator.ref_count(0) == allocator.ref_count(1) == 2
    assert child.num_blocks_needed(1) == 1  # the shared partial block must be copied

    copies = child.append_tokens(1)
    assert copies == [BlockCopy(src=1, dst=2)]
    assert child.block_ids == [0, 2] and parent.block_ids == [0, 1]
    assert allocator.ref_count(1) == 1 and allocator.ref_count(0) == 2

    # The parent's partial block is now private again: no copy.
    assert parent.append_tokens(1) == []
    assert parent.block_ids == [0, 1]
    child.free()
    parent.free()
    assert allocator.num_used == 0
    allocator.check_integrity()


def test_fork_of_full_blocks_needs_no_copy():
    allocator = BlockAllocator(8)
    parent = BlockTable(allocator, block_size=4)
    parent.append_tokens(8)
    child = parent.fork()
    assert child.append_tokens(1) == []
    assert child.block_ids[:2] == parent.block_ids
    child.free()
    parent.free()
    assert allocator.num_used == 0


def test_extend_shared():
    allocator = BlockAllocator(8)
    owner = BlockTable(allocator, 4)
    owner.append_tokens(8)
    reader = BlockTable(allocator, 4)
    reader.extend_shared(owner.block_ids)
    assert reader.num_tokens == 8 and allocator.ref_count(0) == 2
    reader.append_tokens(2)
    with pytest.raises(InvalidArgumentError, match="block-aligned"):
        reader.extend_shared([0])
    reader.free()
    owner.free()
    assert allocator.num_used == 0


def test_truncate_releases_trailing_blocks():
    allocator = BlockAllocator(8)
    table = BlockTable(allocator, 4)
    table.append_tokens(10)  # 3 blocks
    assert table.truncate(5) == [2]
    assert table.num_tokens == 5 and table.block_ids == [0, 1]
    assert table.truncate(0) == [0, 1]
    assert allocator.num_used == 0
    with pytest.raises(InvalidArgumentError):
        table.truncate(3)


def test_a_table_with_reserved_blocks_cannot_fork():
    allocator = BlockAllocator(8)
    table = BlockTable(allocator, 4)
    table.reserve(16)
    table.append_tokens(6)
    with pytest.raises(InvalidArgumentError, match="reserved blocks"):
        table.fork()
    assert [allocator.ref_count(b) for b in table.block_ids] == [1, 1, 1, 1]
