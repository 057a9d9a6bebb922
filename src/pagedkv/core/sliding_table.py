"""A sliding-window group's block table: blocks that fell out of the window go back to the pool.

A sliding window W shows a query at position i the keys j with i - W < j <= i. Once every
query still to run is at or past position p, the blocks wholly before p - W + 1 are never
read again. The table gives them back and keeps its positions: their entries hold the null
block, so `block_ids[pos // B]` still addresses every live token.

    positions     | 0 .. B-1 | B .. 2B-1 | 2B .. 3B-1 | 3B .. 4B-1 |
    block_ids     [   null   ,   null    ,     19     ,     4      ]
                  └ dropped (freed) ────┘└ the window ─────────────┘

The null block is the pool's scratch block (id `allocator.num_blocks`, one past the ids the
allocator hands out): never owned, always a valid index. Attention kernels start their key
loop at the window's first block, so they never read it; the plain-torch reference masks
the positions it gathers from it. Dropped entries are never handed back to the device: a
row already on the device keeps stale ids there, which are never read either.
"""

from __future__ import annotations

from pagedkv.core.block_table import BlockTable
from pagedkv.errors import InvalidArgumentError, SequenceTooLongError


class SlidingBlockTable(BlockTable):
    """A `BlockTable` whose leading `num_dropped` entries are the null block."""

    def __init__(self, allocator, block_size: int, max_num_tokens: int | None = None):
        super().__init__(allocator, block_size, max_num_tokens)
        self.null_block = allocator.num_blocks
        self.num_dropped = 0

    @property
    def num_held(self) -> int:
        """Blocks this table owns (entries that are not the null block)."""
        return len(self.block_ids) - self.num_dropped

    @property
    def held_block_ids(self) -> list[int]:
        """The owned blocks, in logical order."""
        return self.block_ids[self.num_dropped:]

    def drop_before(self, first_live_block: int) -> list[int]:
        """Give back every held block before logical block `first_live_block`; returns their ids.

        Never drops the last block: a partial last block is still being written.
        """
        stop = min(first_live_block, len(self.block_ids) - 1)
        if stop <= self.num_dropped:
            return []
        dropped = self.block_ids[self.num_dropped:stop]
        self.allocator.free(dropped)
        self.block_ids[self.num_dropped:stop] = [self.null_block] * len(dropped)
        self.num_dropped = stop
        return dropped

    def extend_window(self, num_blocks: int, hits: list[int]) -> None:
        """An empty table takes a cached prefix of `num_blocks` full blocks, holding only `hits`, its last ones.

        The first `num_blocks - len(hits)` entries are the null block (outside the window).
        """
        if self.block_ids:
            raise InvalidArgumentError(f"extend_window needs an empty table; it holds {len(self.block_ids)} blocks")
        if len(hits) > num_blocks:
            raise InvalidArgumentError(f"{len(hits)} hit blocks for a prefix of {num_blocks} blocks")
        num_tokens = num_blocks * self.block_size
        if self.max_num_tokens is not None and num_tokens > self.max_num_tokens:
            raise SequenceTooLongError(
                f"Sequence would grow to {num_tokens} tokens, past its maximum of {self.max_num_tokens}")
        self.allocator.incref(hits)
        self.num_dropped = num_blocks - len(hits)
        self.block_ids = [self.null_block] * self.num_dropped + list(hits)
        self.num_tokens = num_tokens

    def restore(self, num_tokens: int, block_ids: list[int], num_dropped: int) -> None:
        """An empty table takes `block_ids` (owned, null-led: `num_dropped` nulls first) for `num_tokens`."""
        self.block_ids, self.num_tokens, self.num_dropped = block_ids, num_tokens, num_dropped

    def fork(self) -> SlidingBlockTable:
        """A new table sharing every held block (each gains an owner) and the same dropped prefix."""
        child = SlidingBlockTable(self.allocator, self.block_size, self.max_num_tokens)
        held = self.held_block_ids
        if held:
            self.allocator.incref(held)
        child.restore(self.num_tokens, list(self.block_ids), self.num_dropped)
        return child

    def free(self) -> list[int]:
        """Give every held block back; returns the ids that became free."""
        held = self.held_block_ids
        released = self.allocator.free(held) if held else []
        self.block_ids = []
        self.num_tokens = 0
        self.num_dropped = 0
        return released

    def truncate(self, num_tokens: int) -> list[int]:
        """Not supported: a window's dropped blocks cannot come back."""
        raise InvalidArgumentError("a sliding-window table cannot be truncated")

    def __repr__(self) -> str:
        return (f"SlidingBlockTable(num_tokens={self.num_tokens}, num_dropped={self.num_dropped}, "
                f"held={self.held_block_ids})")
