"""KV tiers for layer groups: which blocks of which group a prefix hit takes from the GPU, host or disk.

A model with sliding-window layers keeps one prefix cache per layer group (`hybrid_block_manager.py`),
and every group caches its own block under the same hash-chain key. The tiers below the GPU
(`kv_tiers.py`) hold blocks of every group in one host pool and one disk directory, so there the
group is part of the key: `group_key(key, g)`. A group's block spills, is restored and is written
to disk on its own, exactly like a block of a one-table model.

The hit rule is the GPU cache's, over all tiers at once. A prompt hits k blocks when every full group
has blocks 0..k-1 and every sliding group the blocks its window needs at position k * B (from
`first_live_block`), each one in any tier:

    prefix blocks     |  0  |  1  |  2  |  3  |  4  |  5  |     (k = 6, a window of 2 blocks)
    full group        | gpu | gpu |host |host |disk |disk |
    sliding group     |  -  |  -  |  -  |  -  |host | gpu |     - : outside the window, never needed

GPU blocks are shared, host blocks restored into fresh GPU blocks, disk blocks loaded into host
blocks first (the prompt waits for them). A sliding group's blocks before the window are not
looked up in any tier: the prompt never reads them, so a tier need not keep them to serve a hit.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedkv.core.kv_groups import KVGroupSpec
from pagedkv.core.kv_tiers import KVTiers
from pagedkv.core.prefix_cache import BlockHash, PrefixCache


@functools.lru_cache(maxsize=1 << 16)
def group_key(key: BlockHash, group: int) -> BlockHash:
    """The tiers' key of `group`'s block under hash-chain `key`: the group is part of it (memoized: an admission
    looks up every group's key of each of its hit blocks, ~1 us of sha256 each, a few ms for a long prompt)."""
    return hashlib.sha256(b"pagedkv-layer-group" + group.to_bytes(4, "little") + key).digest()


def eviction_hook(tiers: KVTiers, group: int) -> Callable[[BlockHash, int], None]:
    """What `group`'s GPU prefix cache calls as it evicts a block: spill it under its group key."""
    return lambda key, block: tiers.on_gpu_evict(group_key(key, group), block)


@dataclass
class GroupHit:
    """One group's part of a hit of k blocks: blocks [first, k), each from the GPU cache or a lower tier."""

    first: int  # blocks before it are outside the window: the table holds the null block there
    gpu: list[int | None]  # per block of [first, k): the GPU cache's block, or None (a lower tier's)
    host: list[int | None]  # per block: the host block a restore copies, where `gpu` is None (None: on disk)

    @property
    def gpu_hits(self) -> list[int]:
        """The GPU cache's blocks this hit shares."""
        return [block for block in self.gpu if block is not None]


class GroupTiers:
    """The per-group GPU caches and the tiers behind them: the longest hit of a prompt's keys over all of them,
    and what the tiers must load, spill and persist for it."""

    def __init__(self, groups: Sequence[KVGroupSpec], caches: Sequence[PrefixCache], tiers: KVTiers | None,
                 block_size: int):
        self.groups = groups
        self.caches = caches
        self.tiers = tiers if tiers is not None and tiers.cache_on_host else None
        self.block_size = block_size

    def match(self, keys: Sequence[BlockHash], max_hit: int, *, with_disk: bool = False,
              max_lower_blocks: int | None = None) -> tuple[int, list[GroupHit]]:
        """(k, each group's `GroupHit`): the longest hit of at most `max_hit` blocks of `keys`.

        Blocks count where the GPU or the host has them, and with `with_disk` also where the disk
        has them. `max_lower_blocks` caps the blocks the hit takes from below the GPU (what the
        host pool can hold at once); the hit shrinks until it fits.
        """
        found: dict[tuple[int, int], tuple | None] = {}  # (group, block) -> where; looked up lazily

        def where(g: int, i: int):
            if (g, i) not in found:
                found[g, i] = self._find(keys[i], g, with_disk)
            return found[g, i]

        num_hit = max_hit
        for g, group in enumerate(self.groups):
            if not group.is_sliding:  # a full group needs every block: its first gap bounds the hit
                num_hit = next((i for i in range(num_hit) if where(g, i) is None), num_hit)
        while num_hit:
            # Full groups hold every block below the bound; only the windows of sliding groups move with k.
            if all(where(g, i) is not None for g, group in enumerate(self.groups) if group.is_sliding
                   for i in range(group.first_live_block(num_hit * self.block_size, self.block_size), num_hit)):
                hits = [self._hit(where, g, num_hit) for g in range(len(self.groups))]
                lower = sum(block is None for hit in hits for block in hit.gpu)
                if max_lower_blocks is None or lower <= max_lower_blocks:
                    return num_hit, hits
            num_hit -= 1
        return 0, [GroupHit(0, [], []) for _ in self.groups]

    def _find(self, key: BlockHash, group: int, with_disk: bool) -> tuple[int | None, int | None] | None:
        """(GPU block, host block) holding `key` in `group`, preferring the GPU; (None, None) on disk; None."""
        gpu = self.caches[group].match([key])
        if gpu:
            return gpu[0], None
        if self.tiers is None:
            return None
        tier_key = group_key(key, group)
        host = self.tiers.host.match([tier_key])
        if host:
            return None, host[0]
        return (None, None) if with_disk and self.tiers.can_load(tier_key) else None

    def _hit(self, where: Callable[[int, int], tuple], g: int, num_hit: int) -> GroupHit:
        first = self.groups[g].first_live_block(num_hit * self.block_size, self.block_size)
        window = [where(g, i) for i in range(first, num_hit)]
        return GroupHit(first, [gpu for gpu, _ in window], [host for _, host in window])

    def prefetch(self, keys: Sequence[BlockHash], max_hit: int) -> bool:
        """Start loading the blocks of the longest hit over every tier (capped to what the host pool can hold at
        once) that only the disk has; whether the prompt must wait for them."""
        tiers = self.tiers
        if tiers is None or tiers.disk is None:
            return False
        _, hits = self.match(keys, max_hit, with_disk=True, max_lower_blocks=tiers.host.num_available)
        loads = [group_key(keys[hit.first + i], g) for g, hit in enumerate(hits)
                 for i, (gpu, host) in enumerate(zip(hit.gpu, hit.host)) if gpu is None and host is None]
        if not loads:
            return False
        host_blocks = [block for hit in hits for block in hit.host if block is not None]
        tiers.host.touch(host_blocks)
        tiers.host.mark_busy(host_blocks)  # the loads' host blocks must not evict the hit's other blocks
        return tiers.load(loads)

    def spill_candidates(self, limit: int) -> list[tuple[BlockHash, int]]:
        """(tier key, GPU block) of up to `limit` blocks the caches would evict next, taken from every group
        in turn (the manager evicts from the group with the most evictable blocks first)."""
        caches = sorted(enumerate(self.caches), key=lambda item: -item[1].num_evictable)
        per_group = [[(group_key(key, g), block) for key, block in cache.next_evicted(limit)] for g, cache in caches]
        mixed = (item for row in itertools.zip_longest(*per_group) for item in row if item is not None)
        return list(itertools.islice(mixed, limit))

    def cached_blocks(self) -> list[tuple[BlockHash, int]]:
        """(tier key, GPU block) of every block every group's GPU cache holds, least recently used first (what a
        shutdown writes): the groups interleaved from their most recent blocks back, so that a cut to the disk's
        cap keeps every group's newest blocks (a hit needs all of them), not one group's whole cache."""
        newest_first = [[(group_key(key, g), block) for key, block in reversed(cache.cached_blocks())]
                        for g, cache in enumerate(self.caches)]
        mixed = [item for row in itertools.zip_longest(*newest_first) for item in row if item is not None]
        return mixed[::-1]
