"""The prefix cache: full blocks keyed by a hash chain over their tokens, evicted LRU.

A full block's key is `sha256(parent_key || its token ids)`, so equal keys mean equal whole
prefixes, not just equal blocks. A new request walks its prompt block by block and shares
every leading block whose key is cached instead of recomputing it:

    prompt blocks  | t0..t15 | t16..t31 | t32..t47 | t48..t50 |
    keys           |   h0    |   h1     |   h2     |  (partial: never cached)
    cache          |  hit    |  hit     |  miss    |
                   └ shared (ref count + 1) ┘└ computed by this request ┘

The cache holds one reference on every cached block, so a cached block outlives the
sequences that made it. A block referenced only by the cache (ref count 1) is free in all
but name: it still holds valid KV, sits in an LRU queue, and is evicted (its reference
dropped, back to the free list) only when the allocator runs short.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence

from pagedkv.core.allocator import BlockAllocator

BlockHash = bytes
_ROOT = b"\x00" * 32  # the parent of a prompt's first block


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The chained key of one full block: sha256 over the parent's key and the token ids."""
    digest = hashlib.sha256(parent or _ROOT)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


def hash_blocks(token_ids: Sequence[int], block_size: int, parent: BlockHash | None = None) -> list[BlockHash]:
    """Keys of every full block of `token_ids`, chained from `parent` (each `hash_block`'s key).

    The tokens are packed once and each block's key is one sha256 call over the parent and a slice: 2.5x
    faster than `hash_block` per block (0.7 against 1.8 ms for a 16K-token prompt), on the admission's path.
    """
    num_tokens = len(token_ids) // block_size * block_size
    if not num_tokens:
        return []
    data = struct.pack(f"<{num_tokens}q", *token_ids[:num_tokens])
    step = block_size * 8
    sha256 = hashlib.sha256
    key = parent or _ROOT
    keys = []
    for start in range(0, len(data), step):
        key = sha256(key + data[start:start + step]).digest()
        keys.append(key)
    return keys


def cached_prefix(block_of: dict[BlockHash, int], keys: Sequence[BlockHash]) -> list[int]:
    """The blocks `block_of` holds for the longest prefix of `keys` (a chain: the first miss ends it)."""
    blocks = []
    for key in keys:
        block = block_of.get(key)
        if block is None:
            break
        blocks.append(block)
    return blocks


def block_keys(token_ids: Sequence[int], block_size: int, known: Sequence[BlockHash] = (), start: int = 0,
               parent: BlockHash | None = None) -> list[BlockHash]:
    """Keys of full blocks `start`.. of `token_ids`, chained from `parent` (the key of block start - 1).

    Keys in `known` (those of the leading blocks, hashed once by whoever saw the prompt first,
    such as a router) are reused rather than hashed again; the rest are hashed.
    """
    num_full = len(token_ids) // block_size
    reused = list(known[start:num_full])
    if reused:
        parent = reused[-1]
    first_new = start + len(reused)
    return reused + hash_blocks(token_ids[first_new * block_size:num_full * block_size], block_size, parent)


class PrefixCache:
    """Maps block keys to physical blocks; holds one reference per cached block."""

    def __init__(self, allocator: BlockAllocator, on_evict: Callable[[BlockHash, int], None] | None = None):
        self.allocator = allocator
        self.on_evict = on_evict  # called as on_evict(key, block) before an evicted block is freed (KV tiers)
        self._block_of: dict[BlockHash, int] = {}
        self._key_of: dict[int, BlockHash] = {}
        # Cached blocks that only the cache references, least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.version = 0  # bumped whenever the evictable blocks or their order may have changed
        self.num_queries = 0  # blocks looked up
        self.num_hits = 0  # blocks found

    def recent_keys(self, limit: int) -> list[BlockHash]:
        """Up to `limit` keys of cached blocks, the most recently cached first (what a replica tells routers)."""
        return list(itertools.islice(reversed(self._block_of), limit))

    @property
    def num_cached(self) -> int:
        """Blocks the cache holds (in use by sequences or evictable)."""
        return len(self._block_of)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no sequence uses: reclaimable on demand."""
        return len(self._evictable)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._block_of

    def block_of(self, key: BlockHash) -> int | None:
        """The block cached under `key`, or None."""
        return self._block_of.get(key)

    def match(self, keys: Sequence[BlockHash]) -> list[int]:
        """The blocks of the longest cached prefix of `keys` (no references taken)."""
        return cached_prefix(self._block_of, keys)

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        """Count a lookup for the hit-rate statistics."""
        self.num_queries += num_queried
        self.num_hits += num_hit

    def acquire(self, block_ids: Sequence[int]) -> None:
        """A sequence is about to share these cached blocks: they stop being evictable."""
        self.version += 1
        for block_id in block_ids:
            self._evictable.pop(block_id, None)

    def insert(self, key: BlockHash, block_id: int) -> bool:
        """Cache a full, computed block under `key` (the cache takes a reference).

        Returns False (and changes nothing) if the key is already cached by another block or
        the block is already cached: two sequences that computed the same prefix in one step
        keep the first copy, and the second stays private.
        """
        if key in self._block_of or block_id in self._key_of:
            return False
        self.allocator.incref([block_id])
        self._block_of[key] = block_id
        self._key_of[block_id] = key
        return True

    def adopt(self, key: BlockHash, block_id: int) -> None:
        """Cache a freshly allocated block under `key`, its allocation's reference becoming the cache's.

        For blocks restored from a lower tier: the caller then shares them like any hit.
        """
        assert key not in self._block_of and block_id not in self._key_of, "adopting a cached key or block"
        self._block_of[key] = block_id
        self._key_of[block_id] = key

    def on_released(self, block_ids: Sequence[int]) -> None:
        """Sequences dropped references to these blocks: those now held only by the cache become evictable.

        A table's blocks are queued tail first, so its head is evicted last: the hash chain
        only ever reaches a tail through its head.
        """
        self.version += 1
        for block_id in reversed(block_ids):
            if block_id in self._key_of and self.allocator.ref_count(block_id) == 1:
                self._evictable[block_id] = None
                self._evictable.move_to_end(block_id)

    def evict(self, num_blocks: int) -> int:
        """Drop up to `num_blocks` least recently used evictable blocks; returns how many were freed."""
        freed = 0
        self.version += 1
        while freed < num_blocks and self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            key = self._key_of.pop(block_id)
            del self._block_of[key]
            if self.on_evict is not None:
                self.on_evict(key, block_id)
            self.allocator.free_one(block_id)
            freed += 1
        return freed

    def next_evicted(self, limit: int) -> list[tuple[BlockHash, int]]:
        """(key, block) of up to `limit` evictable blocks, in the order `evict` would take them."""
        key_of = self._key_of
        return [(key_of[block_id], block_id) for block_id in itertools.islice(self._evictable, limit)]

    def cached_blocks(self) -> list[tuple[BlockHash, int]]:
        """(key, block) of every cached block, least recently used first: the evictable ones in eviction order,
        then those sequences use (the latest cached first, so that a prefix's head comes after its tail)."""
        key_of = self._key_of
        in_use = [(key, block) for key, block in reversed(self._block_of.items()) if block not in self._evictable]
        return [(key_of[block], block) for block in self._evictable] + in_use

    def check_integrity(self) -> None:
        """Assert the two maps agree and evictable blocks are referenced by the cache alone."""
        assert len(self._block_of) == len(self._key_of), "key and block maps differ in size"
        for key, block_id in self._block_of.items():
            assert self._key_of.get(block_id) == key, f"block {block_id} maps back to another key"
            assert self.allocator.ref_count(block_id) >= 1, f"cached block {block_id} is free"
        for block_id in self._evictable:
            assert block_id in self._key_of, f"evictable block {block_id} is not cached"
            assert self.allocator.ref_count(block_id) == 1, (
                f"evictable block {block_id} has {self.allocator.ref_count(block_id)} owners"
            )
