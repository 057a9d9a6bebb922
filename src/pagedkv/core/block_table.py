"""One sequence's block table: logical block -> physical block, token position -> slot.

A sequence's tokens live in fixed-size blocks scattered over the pool:

    token positions   | 0 .. B-1 | B .. 2B-1 | 2B .. 3B-1 | ...
    block_ids         [    7     ,     2     ,     19     , ... ]
    slot(p)           = block_ids[p // B] * B + p % B

A slot is the flat index of one token's K/V in a pool tensor of `num_blocks * B` token rows.
Appending tokens claims a new block only when the last one is full. Blocks may be shared
with other tables (`fork`, prefix caching); a shared block is never written: appending into
a shared, partly filled last block first moves the table onto a private copy
(copy-on-write), and the caller is handed the (src, dst) pair to copy on the device.
"""

from __future__ import annotations

from typing import NamedTuple

from pagedkv.core.allocator import BlockAllocator
from pagedkv.errors import InvalidArgumentError, OutOfBlocksError, SequenceTooLongError, require_positive_int


class BlockCopy(NamedTuple):
    """Copy every token row of block `src` into block `dst` (copy-on-write, swap)."""

    src: int
    dst: int


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


class BlockTable:
    """The physical blocks of one sequence, in logical order, plus its token count."""

    def __init__(self, allocator: BlockAllocator, block_size: int, max_num_tokens: int | None = None):
        require_positive_int("block_size", block_size)
        if max_num_tokens is not None:
            require_positive_int("max_num_tokens", max_num_tokens)
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_tokens = max_num_tokens
        self.block_ids: list[int] = []
        self.num_tokens = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_blocks(self) -> int:
        """Blocks this table holds."""
        return len(self.block_ids)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the held blocks can store without claiming another."""
        return len(self.block_ids) * self.block_size

    def num_blocks_needed(self, num_new_tokens: int) -> int:
        """Blocks `append_tokens(num_new_tokens)` would take from the pool, copy-on-write included."""
        if num_new_tokens.__class__ is not int or num_new_tokens < 0:
            require_positive_int("num_new_tokens", num_new_tokens, allow_zero=True)
        block_size = self.block_size
        num_tokens = self.num_tokens
        block_ids = self.block_ids
        needed = -(-(num_tokens + num_new_tokens) // block_size) - len(block_ids)
        if needed < 0:
            needed = 0
        # Shared partial last block (copy-on-write): only possible when the table is mid-block.
        if num_new_tokens and num_tokens % block_size and block_ids \
                and self.allocator._ref_counts[block_ids[-1]] > 1:
            needed += 1
        return needed

    def physical(self, position: int) -> tuple[int, int]:
        """(block id, offset in block) of the token at `position`."""
        self._check_position(position)
        return self.block_ids[position // self.block_size], position % self.block_size

    def slot(self, position: int) -> int:
        """Flat slot index of the token at `position`: block_id * block_size + offset."""
        block_id, offset = self.physical(position)
        return block_id * self.block_size + offset

    def slot_mapping(self, start: int, end: int) -> list[int]:
        """Slots of the tokens at positions [start, end), which must already have blocks."""
        if not 0 <= start <= end:
            raise InvalidArgumentError(f"slot_mapping range [{start}, {end}) is not a valid range")
        if end > self.capacity_tokens:
            raise InvalidArgumentError(
                f"slot_mapping end {end} is past the table's capacity of {self.capacity_tokens} tokens"
            )
        block_size = self.block_size
        block_ids = self.block_ids
        return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]

    # ------------------------------------------------------------------ mutations
    def append_tokens(self, num_new_tokens: int) -> list[BlockCopy]:
        """Grow by `num_new_tokens`, claiming blocks only when the last one is full.

        All or nothing: raises `OutOfBlocksError` or `SequenceTooLongError` and changes
        nothing on failure. Returns the copy-on-write copies the caller must perform on the
        device before writing the new tokens (at most one: the shared partial last block).
        """
        if num_new_tokens.__class__ is not int or num_new_tokens < 0:
            require_positive_int("num_new_tokens", num_new_tokens, allow_zero=True)
        new_total = self.num_tokens + num_new_tokens
        if self.max_num_tokens is not None and new_total > self.max_num_tokens:
            raise SequenceTooLongError(
                f"Sequence would grow to {new_total} tokens, past its maximum of {self.max_num_tokens}"
            )
        if num_new_tokens == 0:
            return []
        copies: list[BlockCopy] = []
        needed = self.num_blocks_needed(num_new_tokens)
        if needed > 0:
            if needed > self.allocator.num_free:
                raise OutOfBlocksError(needed, self.allocator.num_free)
            # One block is the common case (a decode crossing a block boundary): the lock-free path.
            new_ids = [self.allocator.allocate_one()] if needed == 1 else self.allocator.allocate(needed)
            if self._last_block_is_shared_partial():
                private = new_ids.pop(0)
                shared = self.block_ids[-1]
                self.block_ids[-1] = private
                self.allocator.free([shared])
                copies.append(BlockCopy(shared, private))
            self.block_ids.extend(new_ids)
        self.num_tokens = new_total
        return copies

    def reserve(self, num_tokens: int) -> None:
        """Claim blocks up front so that `num_tokens` tokens fit without further allocation.

        This is naive, max-length reservation (for comparison with paging): the blocks are
        held from now on, and later appends fill them without touching the allocator.
        """
        require_positive_int("num_tokens", num_tokens, allow_zero=True)
        if self.max_num_tokens is not None and num_tokens > self.max_num_tokens:
            raise SequenceTooLongError(
                f"Cannot reserve {num_tokens} tokens, past the maximum of {self.max_num_tokens}"
            )
        needed = num_blocks_for(num_tokens, self.block_size) - len(self.block_ids)
        if needed > 0:
            self.block_ids.extend(self.allocator.allocate(needed))

    def extend_shared(self, block_ids: list[int]) -> None:
        """Append full blocks owned elsewhere (prefix-cache hits), adding one owner to each.

        The table must be block-aligned (no partial last block) and the blocks are taken as
        full: `num_tokens` grows by `len(block_ids) * block_size`.
        """
        if self.num_tokens % self.block_size:
            raise InvalidArgumentError(
                f"extend_shared needs a block-aligned table; it holds {self.num_tokens} tokens "
                f"(block size {self.block_size})"
            )
        new_total = self.num_tokens + len(block_ids) * self.block_size
        if self.max_num_tokens is not None and new_total > self.max_num_tokens:
            raise SequenceTooLongError(
                f"Sequence would grow to {new_total} tokens, past its maximum of {self.max_num_tokens}"
            )
        self.allocator.incref(block_ids)
        self.block_ids.extend(block_ids)
        self.num_tokens = new_total

    def truncate(self, num_tokens: int) -> list[int]:
        """Keep only the first `num_tokens` tokens; blocks past them lose this table's ownership.

        Returns the ids that became free. Used to roll back an append and to crop a cache.
        """
        require_positive_int("num_tokens", num_tokens, allow_zero=True)
        if num_tokens > self.num_tokens:
            raise InvalidArgumentError(f"cannot truncate {self.num_tokens} tokens to {num_tokens}")
        keep_blocks = num_blocks_for(num_tokens, self.block_size)
        dropped = self.block_ids[keep_blocks:]
        released = self.allocator.free(dropped) if dropped else []
        del self.block_ids[keep_blocks:]
        self.num_tokens = num_tokens
        return released

    def fork(self) -> BlockTable:
        """A new table that shares every block of this one (each block gains an owner).

        The next write into a shared partial block by either table copies it first.
        """
        if self.num_blocks > num_blocks_for(self.num_tokens, self.block_size):
            raise InvalidArgumentError(
                f"cannot fork a table holding reserved blocks ({self.num_blocks} blocks for {self.num_tokens} tokens): "
                f"both tables would write into the same empty blocks"
            )
        child = BlockTable(self.allocator, self.block_size, self.max_num_tokens)
        self.allocator.incref(self.block_ids)
        child.block_ids = list(self.block_ids)
        child.num_tokens = self.num_tokens
        return child

    def free(self) -> list[int]:
        """Give every block back (drop this table's ownership); returns the ids that became free."""
        released = self.allocator.free(self.block_ids) if self.block_ids else []
        self.block_ids = []
        self.num_tokens = 0
        return released

    # ------------------------------------------------------------------ internals
    def _last_block_is_shared_partial(self) -> bool:
        return (
            bool(self.block_ids)
            and self.num_tokens % self.block_size != 0
            and self.allocator.ref_count(self.block_ids[-1]) > 1
        )

    def _check_position(self, position: int) -> None:
        if isinstance(position, bool) or not isinstance(position, int):
            raise InvalidArgumentError(f"position must be an int, got {position!r}")
        if not 0 <= position < self.capacity_tokens:
            raise InvalidArgumentError(
                f"position {position} is outside the table's {self.capacity_tokens} token slots"
            )

    def __repr__(self) -> str:
        return f"BlockTable(num_tokens={self.num_tokens}, block_ids={self.block_ids})"
