"""The block allocator: a free list of physical KV block ids with reference counts.

Nothing about a block says who owns it. The allocator only knows how many owners a block
has (its reference count); block tables know which blocks a sequence uses. A block with a
count of 0 is on the free list. `allocate` and `free` are O(1) per block: the free list is a
Python list used as a stack, so the most recently freed block is handed out first, which
keeps a warm working set and makes a second batch land on the first batch's blocks.

One allocator can be shared by threads (the server's event loop and the engine thread, say).
Multi-block and shared-block operations take the allocator's lock. The single-block fast
paths (`allocate_one`, and `free_one` of a block with one owner) do not: they rely on
CPython's `list.pop` / `list.append` being atomic, and on a block with one owner being
touched by that owner alone. An uncontended lock costs about as much as the whole operation;
`BlockTable` takes the single-block path whenever it grows by one block (a decode crossing a
block boundary), and prefix-cache eviction frees one block at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from pagedkv.errors import (
    DoubleFreeError,
    InvalidArgumentError,
    InvalidBlockError,
    OutOfBlocksError,
    require_positive_int,
)


class BlockAllocator:
    """Hands out block ids in `[0, num_blocks)`, all-or-nothing, with reference counts.

    Shortfalls are tier-1 answers (`can_allocate` returns False) or tier-2 errors
    (`allocate` raises `OutOfBlocksError` and changes nothing).
    """

    def __init__(self, num_blocks: int):
        require_positive_int("num_blocks", num_blocks)
        self.num_blocks = num_blocks
        # Reversed so that block 0 is handed out first: tables of a fresh pool read 0, 1, 2, ...
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._ref_counts: list[int] = [0] * num_blocks
        # Peak usage is tracked as the low-water mark of the free list (one compare per allocation).
        self._min_free = num_blocks
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Blocks on the free list."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks with at least one owner."""
        return self.num_blocks - len(self._free)

    @property
    def peak_used(self) -> int:
        """The most blocks that were ever in use at once since construction or `reset_peak`."""
        return self.num_blocks - self._min_free

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, in [0, 1]."""
        return self.num_used / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        """The number of owners of `block_id` (0 when free)."""
        self._check_in_range(block_id)
        return self._ref_counts[block_id]

    def can_allocate(self, num_blocks: int, watermark: float = 0.0) -> bool:
        """Whether `num_blocks` could be allocated while keeping `watermark` of the pool free.

        This is the admission check: a new sequence is admitted only if, after taking its
        blocks, at least `watermark * num_blocks` blocks stay free for running sequences to
        grow into.
        """
        require_positive_int("num_blocks", num_blocks, allow_zero=True)
        if not 0.0 <= watermark < 1.0:
            raise InvalidArgumentError(f"watermark must be in [0, 1), got {watermark}")
        reserve = int(watermark * self.num_blocks)
        return len(self._free) - num_blocks >= reserve

    # ------------------------------------------------------------------ mutations
    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks, each with a reference count of 1.

        All or nothing: on a shortfall raises `OutOfBlocksError` naming the requested and
        free counts, and the pool is unchanged.
        """
        require_positive_int("num_blocks", num_blocks)
        with self._lock:
            free = self._free
            if num_blocks > len(free):
                raise OutOfBlocksError(num_blocks, len(free))
            block_ids = []
            try:
                # One atomic pop at a time: a lock-free allocate_one() may run concurrently.
                for _ in range(num_blocks):
                    block_ids.append(free.pop())
            except IndexError:
                free.extend(reversed(block_ids))
                raise OutOfBlocksError(num_blocks, len(free)) from None
            ref_counts = self._ref_counts
            for block_id in block_ids:
                ref_counts[block_id] = 1
            self._note_usage(len(free))
            return block_ids

    def allocate_one(self) -> int:
        """Take one free block (the common decode-time case, without a list or the lock)."""
        free = self._free
        try:
            block_id = free.pop()
        except IndexError:
            raise OutOfBlocksError(1, 0) from None
        self._ref_counts[block_id] = 1
        if len(free) < self._min_free:
            self._min_free = len(free)
        return block_id

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one owner to each block (sharing). Every block must be allocated; else nothing changes."""
        block_ids = list(block_ids)
        with self._lock:
            ref_counts = self._ref_counts
            if not self._all_held(block_ids):
                for block_id in block_ids:  # find the first bad id, for its error
                    self._check_in_range(block_id)
                    if ref_counts[block_id] == 0:
                        raise InvalidBlockError(f"Cannot share block {block_id}: it is free")
            for block_id in block_ids:
                ref_counts[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> list[int]:
        """Drop one owner from each block; blocks whose count reaches 0 return to the free list.

        Returns the ids that went back to the free list. A block that is out of range, already
        free, or listed twice raises and nothing changes.
        """
        with self._lock:
            ref_counts = self._ref_counts
            if len(block_ids) == 1:
                block_id = block_ids[0]
                self._check_in_range(block_id)
                if ref_counts[block_id] == 0:
                    raise DoubleFreeError(f"Block {block_id} is already free")
            else:
                self._validate_free(block_ids)
            released = []
            for block_id in block_ids:
                count = ref_counts[block_id] - 1
                ref_counts[block_id] = count
                if count == 0:
                    released.append(block_id)
            # Pushed in reverse so the next allocate() hands them out in their original order.
            self._free.extend(reversed(released))
            return released

    def _note_usage(self, num_free: int) -> None:
        if num_free < self._min_free:
            self._min_free = num_free

    def free_one(self, block_id: int) -> bool:
        """Drop one owner of a single block; returns True if it went back to the free list."""
        if block_id.__class__ is not int or not 0 <= block_id < self.num_blocks:
            self._check_in_range(block_id)
        ref_counts = self._ref_counts
        if ref_counts[block_id] == 1:
            # Sole owner: nobody else may touch this block, so no lock is needed.
            ref_counts[block_id] = 0
            self._free.append(block_id)
            return True
        with self._lock:
            count = ref_counts[block_id]
            if count == 0:
                raise DoubleFreeError(f"Block {block_id} is already free")
            ref_counts[block_id] = count - 1
            if count == 1:
                self._free.append(block_id)
                return True
            return False

    def reset_peak(self) -> None:
        """Restart peak tracking from the current usage."""
        with self._lock:
            self._min_free = len(self._free)

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """Assert the free list and the reference counts agree (tests call this after every scenario)."""
        with self._lock:
            free_set = set(self._free)
            assert len(free_set) == len(self._free), "a block is on the free list twice"
            for block_id, count in enumerate(self._ref_counts):
                assert count >= 0, f"block {block_id} has a negative reference count {count}"
                assert (count == 0) == (block_id in free_set), (
                    f"block {block_id}: ref count {count} but on free list = {block_id in free_set}"
                )
            assert self._min_free <= len(self._free), "peak below current usage"

    def _check_in_range(self, block_id: object) -> None:
        if isinstance(block_id, bool) or not isinstance(block_id, int):
            raise InvalidBlockError(f"Block id must be an int, got {block_id!r}")
        if not 0 <= block_id < self.num_blocks:
            raise InvalidBlockError(f"Block id {block_id} is outside the pool [0, {self.num_blocks})")

    def _all_in_range(self, block_ids: Sequence[int]) -> bool:
        """Whether every id is an int (not a bool) inside the pool: by their distinct types and extremes, not a
        Python check per id (the per-id checks run only to name a bad one)."""
        return not block_ids or (set(map(type, block_ids)) == {int} and min(block_ids) >= 0
                                 and max(block_ids) < self.num_blocks)

    def _all_held(self, block_ids: Sequence[int]) -> bool:
        """Whether every id is in the pool and allocated (checked as a whole; see `_all_in_range`)."""
        return self._all_in_range(block_ids) and 0 not in map(self._ref_counts.__getitem__, block_ids)

    def _validate_free(self, block_ids: Sequence[int]) -> None:
        if self._all_held(block_ids) and len(set(block_ids)) == len(block_ids):
            return
        seen: set[int] = set()
        for block_id in block_ids:
            self._check_in_range(block_id)
            if block_id in seen:
                raise DoubleFreeError(f"Block {block_id} is listed twice in one free")
            seen.add(block_id)
            if self._ref_counts[block_id] == 0:
                raise DoubleFreeError(f"Block {block_id} is already free")

    def __repr__(self) -> str:
        return f"BlockAllocator(num_blocks={self.num_blocks}, used={self.num_used}, peak={self.peak_used})"
