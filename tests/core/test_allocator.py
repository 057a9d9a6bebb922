"""BlockAllocator: all-or-nothing allocation, reference counts, misuse errors, threads."""

import threading

import pytest

from pagedkv import (
    BlockAllocator,
    DoubleFreeError,
    InvalidArgumentError,
    InvalidBlockError,
    OutOfBlocksError,
    PagedKVError,
)


def snapshot(allocator):
    return (list(allocator._free), list(allocator._ref_counts), allocator.peak_used)


def test_fresh_pool_hands_out_low_ids_first():
    allocator = BlockAllocator(8)
    assert allocator.allocate(3) == [0, 1, 2]
    assert allocator.num_used == 3 and allocator.num_free == 5
    assert allocator.usage == pytest.approx(3 / 8)
    allocator.check_integrity()


def test_exhaustion_raises_and_changes_nothing():
    allocator = BlockAllocator(4)
    allocator.allocate(3)
    before = snapshot(allocator)
    with pytest.raises(OutOfBlocksError) as info:
        allocator.allocate(2)
    assert "2" in str(info.value) and "1 free" in str(info.value)
    assert (info.value.num_requested, info.value.num_free) == (2, 1)
    assert snapshot(allocator) == before
    assert allocator.allocate(1) == [3]
    with pytest.raises(OutOfBlocksError):
        allocator.allocate_one()
    allocator.check_integrity()


def test_double_free_and_bad_ids_change_nothing():
    allocator = BlockAllocator(4)
    blocks = allocator.allocate(2)
    allocator.free([blocks[0]])
    before = snapshot(allocator)
    with pytest.raises(DoubleFreeError):
        allocator.free([blocks[0]])
    with pytest.raises(DoubleFreeError):
        allocator.free_one(blocks[0])
    with pytest.raises(DoubleFreeError):
        allocator.free([blocks[1], blocks[1]])  # listed twice
    with pytest.raises(DoubleFreeError):
        allocator.free([blocks[1], blocks[0]])  # one valid, one already free: all or nothing
    with pytest.raises(InvalidBlockError, match="outside the pool"):
        allocator.free([4])
    with pytest.raises(InvalidBlockError):
        allocator.free([-1])
    with pytest.raises(InvalidBlockError):
        allocator.free_one(99)
    with pytest.raises(InvalidBlockError):
        allocator.incref([blocks[0]])  # free blocks cannot be shared
    assert snapshot(allocator) == before
    allocator.check_integrity()


@pytest.mark.parametrize("bad", [True, 1.0, -1, 4, "1", None])
def test_a_bad_id_among_good_ones_is_named_and_changes_nothing(bad):
    """Lists of ids are checked as a whole first (types, extremes, duplicates, counts); a bad one among them is
    still named, and neither a free nor a share changes anything."""
    allocator = BlockAllocator(4)
    blocks = allocator.allocate(3)
    before = snapshot(allocator)
    for call in (allocator.free, allocator.incref):
        with pytest.raises(InvalidBlockError, match=repr(bad) if isinstance(bad, (str, type(None))) else str(bad)):
            call([blocks[0], blocks[1], bad])
    assert snapshot(allocator) == before
    allocator.check_integrity()


@pytest.mark.parametrize("bad", [0, -3, 1.5, "2", True, None])
def test_bad_counts_are_typed_errors(bad):
    with pytest.raises(InvalidArgumentError):
        BlockAllocator(bad)
    allocator = BlockAllocator(4)
    with pytest.raises(PagedKVError):
        allocator.allocate(bad)
    assert allocator.num_used == 0


def test_reference_counts_share_blocks():
    allocator = BlockAllocator(4)
    [block] = allocator.allocate(1)
    allocator.incref([block])
    assert allocator.ref_count(block) == 2
    assert allocator.free([block]) == []  # one owner left
    assert allocator.num_used == 1
    assert allocator.free_one(block) is True
    assert allocator.num_used == 0
    allocator.check_integrity()


def test_watermark_admission():
    allocator = BlockAllocator(100)
    allocator.allocate(80)
    assert allocator.can_allocate(20)
    assert not allocator.can_allocate(21)
    assert allocator.can_allocate(10, watermark=0.10)
    assert not allocator.can_allocate(11, watermark=0.10)
    with pytest.raises(InvalidArgumentError):
        allocator.can_allocate(1, watermark=1.0)
    with pytest.raises(InvalidArgumentError):
        allocator.can_allocate(1, watermark=-0.1)


def test_peak_tracking():
    allocator = BlockAllocator(10)
    blocks = allocator.allocate(7)
    allocator.free(blocks)
    allocator.allocate(2)
    assert allocator.peak_used == 7
    allocator.reset_peak()
    assert allocator.peak_used == 2


def test_freed_blocks_are_reused_first():
    allocator = BlockAllocator(64)
    first = allocator.allocate(5)
    allocator.free(first)
    assert allocator.allocate(5) == first


def test_500_cycles_of_16_sequences_end_empty():
    allocator = BlockAllocator(512)
    for cycle in range(500):
        held = [allocator.allocate(1 + (cycle * 7 + seq) % 4) for seq in range(16)]
        for extra in range(cycle % 3):
            held[extra].append(allocator.allocate_one())
        for blocks in reversed(held) if cycle % 2 else held:
            allocator.free(blocks)
    assert allocator.num_used == 0
    allocator.check_integrity()


def test_eight_threads_stress():
    allocator = BlockAllocator(256)
    errors = []
    barrier = threading.Barrier(8)

    def worker(seed):
        barrier.wait()
        owned = []
        try:
            for step in range(3000):
                kind = (seed * 31 + step * 17) % 5
                if kind == 0 and allocator.can_allocate(3):
                    try:
                        owned.append(allocator.allocate(3))
                    except OutOfBlocksError:
                        pass
                elif kind == 1:
                    try:
                        owned.append([allocator.allocate_one()])
                    except OutOfBlocksError:
                        pass
                elif kind == 2 and owned:
                    blocks = owned.pop()
                    allocator.incref(blocks)  # share, then drop both owners below
                    allocator.free(blocks)
                    owned.append(blocks)
                elif owned:
                    blocks = owned.pop(0)
                    if len(blocks) == 1:
                        allocator.free_one(blocks[0])
                    else:
                        allocator.free(blocks)
            for blocks in owned:
                allocator.free(blocks)
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert allocator.num_used == 0
    allocator.check_integrity()
