"""The host tier's pool of blocks: cached ones by key (LRU), owned ones (swapped sequences), and which ones a copy
or a disk write still reads.

Eviction is LRU over cached blocks, a prefix's tail before its head (`touch` queues a prefix tail first; see
`kv_tiers.py`). Two kinds of block are passed over:

    busy      a copy of this step reads or fills it (a restore, a swap-in, a spill): never evicted in this step
    writing   its disk write is still queued: evicted only when no other cached block is free to take

A write-behind to disk reads the host block on a writer thread. A spill into a block still being written has to
wait for that write first, on the step loop: behind a backlog of writes (a disk slower than the spills) that wait
was seen to take a third of a second. So `allocate` takes the least recently used blocks whose write is done, and
falls back to blocks still being written, in LRU order, only when too few are left. The tiers learn of a finished
write at the next poll, so a write just done still counts as writing for a step: a block taken in the fallback may
need no wait at all.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

from pagedkv.core.allocator import BlockAllocator
from pagedkv.core.prefix_cache import BlockHash, cached_prefix


class HostTier:
    """A pool of host blocks: cached ones by key (LRU, evictable) and owned ones (swapped sequences)."""

    def __init__(self, num_blocks: int):
        self.allocator = BlockAllocator(num_blocks)
        self._block_of: dict[BlockHash, int] = {}
        self._key_of: dict[int, BlockHash] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recently used first
        self.version = 0  # bumped whenever a key is cached or evicted
        self._busy: set[int] = set()  # read by this step's copies
        self._release_later: list[int] = []  # freed this step, free from the next
        self._writing: dict[int, int] = {}  # host block -> its disk writes still queued
        self._num_cached_written = 0  # cached blocks with no disk write queued
        self.last_evicted: list[int] = []  # cached blocks the last `allocate` evicted
        self.last_evicted_writing = 0  # how many of them were still being written to disk

    @property
    def num_blocks(self) -> int:
        """Host blocks in the pool."""
        return self.allocator.num_blocks

    @property
    def num_cached(self) -> int:
        """Host blocks holding a cached key."""
        return len(self._key_of)

    @property
    def num_available(self) -> int:
        """Blocks an allocation could get now: free ones plus cached ones not busy."""
        busy_cached = sum(1 for block in self._busy if block in self._key_of)
        return self.allocator.num_free + len(self._lru) - busy_cached

    @property
    def num_releasing(self) -> int:
        """Blocks freed this step, free from the next."""
        return len(self._release_later)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._block_of

    def recent_keys(self, limit: int) -> list[BlockHash]:
        """Up to `limit` cached keys, the most recently used first."""
        return [self._key_of[block] for block in itertools.islice(reversed(self._lru), limit)]

    def begin_step(self) -> None:
        """A new step: busy and freed blocks come back (the runner orders this step's copies after last step's
        that read or fill the same host blocks: `KVOffload`)."""
        self._busy.clear()
        if self._release_later:
            self.allocator.free(self._release_later)
            self._release_later = []

    def match(self, keys: Sequence[BlockHash]) -> list[int]:
        """Host blocks of the longest cached prefix of `keys`."""
        return cached_prefix(self._block_of, keys)

    def touch(self, blocks: Sequence[int]) -> None:
        """Mark a prefix's blocks used: queued tail first, so the head is evicted last."""
        for block in reversed(blocks):
            if block in self._lru:
                self._lru.move_to_end(block)

    def mark_busy(self, blocks: Sequence[int]) -> None:
        """These blocks are read by this step's copies: keep them until the next step."""
        self._busy.update(blocks)

    # ------------------------------------------------------------------ disk writes
    def start_write(self, block: int) -> None:
        """A disk write of `block` was queued: it reads the block until `end_write`."""
        count = self._writing.get(block, 0)
        self._writing[block] = count + 1
        if not count and block in self._key_of:
            self._num_cached_written -= 1

    def end_write(self, block: int) -> None:
        """A queued disk write of `block` finished (or failed): it no longer reads the block."""
        count = self._writing.get(block, 0)
        assert count > 0, f"host block {block} ended a disk write it did not start"
        if count > 1:
            self._writing[block] = count - 1
            return
        del self._writing[block]
        if block in self._key_of:
            self._num_cached_written += 1

    def is_writing(self, block: int) -> bool:
        """Whether a disk write of `block` is still queued (a copy into it would wait for it)."""
        return block in self._writing

    # ------------------------------------------------------------------ allocation
    def _victims(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` cached blocks not busy, least recently used first: those with no disk write queued, then,
        if too few, those still being written. None if too many cached blocks are busy in this step."""
        written, writing = [], []
        written_left = self._num_cached_written  # written cached blocks not looked at yet
        for block in self._lru:  # stops as soon as it has enough, or no written block is left to find
            if len(written) == num_blocks or (not written_left and len(written) + len(writing) >= num_blocks):
                break
            is_writing = block in self._writing
            written_left -= not is_writing
            if block in self._busy:
                continue
            if not is_writing:
                written.append(block)
            elif len(writing) < num_blocks:
                writing.append(block)
        victims = written + writing[:num_blocks - len(written)]
        return victims if len(victims) == num_blocks else None

    def allocate(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` host blocks, evicting cached ones as needed (`_victims`); None (no change) if they cannot
        be had."""
        shortfall = num_blocks - self.allocator.num_free
        self.last_evicted = []
        self.last_evicted_writing = 0
        if shortfall > 0:
            if shortfall > len(self._lru):
                return None
            victims = self._victims(shortfall)
            if victims is None:
                return None
            for block in victims:
                del self._lru[block]
                del self._block_of[self._key_of.pop(block)]
                if block in self._writing:
                    self.last_evicted_writing += 1
                else:
                    self._num_cached_written -= 1
            self.allocator.free(victims)
            self.last_evicted = victims
            self.version += 1
        return self.allocator.allocate(num_blocks) if num_blocks else []

    def insert(self, key: BlockHash, block: int) -> bool:
        """Cache an allocated block under `key` (most recently used). False if the key is cached already."""
        if key in self._block_of:
            return False
        self._block_of[key] = block
        self._key_of[block] = key
        self.version += 1
        self._lru[block] = None
        self._num_cached_written += block not in self._writing
        return True

    def free(self, blocks: Sequence[int]) -> None:
        """Give back owned (uncached) blocks; they are reusable from the next step."""
        self._release_later.extend(blocks)

    def check_integrity(self) -> None:
        """Assert maps, LRU queue, write counts and allocator agree."""
        self.allocator.check_integrity()
        assert len(self._block_of) == len(self._key_of), "host key and block maps differ in size"
        for key, block in self._block_of.items():
            assert self._key_of.get(block) == key, f"host block {block} maps back to another key"
            assert self.allocator.ref_count(block) == 1, f"cached host block {block} has a bad ref count"
        assert set(self._lru) == set(self._key_of), "host LRU queue and cached blocks differ"
        assert not set(self._release_later) & set(self._key_of), "a host block is both cached and being freed"
        assert all(count > 0 and 0 <= block < self.num_blocks for block, count in self._writing.items()), (
            f"bad disk write counts {self._writing}")
        written = sum(1 for block in self._key_of if block not in self._writing)
        assert written == self._num_cached_written, f"{written} cached blocks written, {self._num_cached_written} counted"
