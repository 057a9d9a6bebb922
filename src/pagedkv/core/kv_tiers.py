"""KV tiers, the bookkeeping: which block hashes live in host memory and on disk, and what moves.

The GPU prefix cache (`prefix_cache.py`) holds full blocks by their hash-chain key. When it evicts one, the block's
contents spill to a host tier (a pool of host blocks), and from the host tier to an optional disk tier (one file per
key). A new prompt is looked up GPU first, then host, then disk:

    prompt keys    | h0  | h1  | h2  | h3  | h4  |
    GPU cache      | hit | hit |     |     |     |   shared, as before
    host tier      |     |     | hit | hit |     |   restored: one batched host -> GPU copy
    disk tier      |     |     |     |     | hit |   loaded into a host block first, then as above

Nothing here touches a tensor. Each step the scheduler collects a `TierCopies` of what the runner must move (GPU ->
host offloads, host -> GPU restores, disk loads and writes), the same way it hands out swap and copy-on-write copies.

So that an eviction rarely has to wait for its copy, each step also pre-spills: it copies the GPU cache's next few
evictions into free host blocks beside the step (`pre_spill`).

Eviction inside a tier is LRU over keys, and a prefix's tail goes before its head: a prefix touched as a whole is
queued tail first, so its head ends up most recently used. Evicting a head first would strand the tail, which a
hash-chain lookup can never reach again. The disk's LRU follows use on every tier, not write time: a prompt's
prefix touches its files as it is admitted (`prefix_used`), so a system prompt that stays hot on the GPU or the
host keeps its files while colder blocks' writes evict colder files, and a shutdown writes the most recently used
blocks of the host and the GPU (`persist`). The host tier passes over blocks whose disk write is still queued while
others can be taken (`host_tier.py`): this module tells it which writes are queued and which have finished.

A host block a copy of this step reads or fills (a restore, a swap-in, a spill, whose disk write reads it after the
copies) is busy until the next step begins: the runner's copies of one step act as if device-to-host ran first (a
restore of a block spilled in the same step reads the spill), so reusing it for an offload in the same step would
overwrite it before it is read. Blocks freed in a step go back to the free list
at the next step for the same reason. The same host pool backs swap preemption: a swapped sequence owns host blocks,
and may evict cached ones to get them.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pagedkv.core.block_table import BlockCopy
from pagedkv.core.host_tier import HostTier
from pagedkv.core.prefix_cache import BlockHash
from pagedkv.errors import require_positive_int


class DiskIndex:
    """Which keys have a file on disk, LRU, under a cap in blocks (files all have one block's size)."""

    def __init__(self, capacity_blocks: int):
        require_positive_int("capacity_blocks", capacity_blocks)
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[BlockHash, None] = OrderedDict()

    @property
    def num_blocks(self) -> int:
        """Files indexed."""
        return len(self._lru)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._lru

    def keys(self) -> list[BlockHash]:
        """Every indexed key, least recently used first."""
        return list(self._lru)

    def add(self, key: BlockHash) -> list[BlockHash]:
        """Index `key` (most recently used); returns the keys evicted to stay under the cap."""
        self._lru[key] = None
        self._lru.move_to_end(key)
        evicted = []
        while len(self._lru) > self.capacity_blocks:
            evicted.append(self._lru.popitem(last=False)[0])
        return evicted

    def touch(self, keys: Sequence[BlockHash]) -> None:
        """Mark a prefix's keys used (those indexed), tail first (see the module docstring)."""
        self.touch_in_order(keys[::-1])

    def touch_in_order(self, keys: Sequence[BlockHash]) -> None:
        """Mark keys used (those indexed), each newer than the one before it."""
        lru = self._lru
        for key in keys:
            if key in lru:
                lru.move_to_end(key)

    def remove(self, key: BlockHash) -> None:
        """Forget `key` (its file is gone, torn or unreadable)."""
        self._lru.pop(key, None)

    def check_integrity(self) -> None:
        """Assert the cap holds."""
        assert len(self._lru) <= self.capacity_blocks, f"{len(self._lru)} disk blocks over the cap"


@dataclass
class TierCopies:
    """What the runner moves for one step: device-to-host first, then host-to-device (as if: see the module)."""

    offload: list[BlockCopy] = field(default_factory=list)  # (GPU block, host block): spills
    pre_offload: list[BlockCopy] = field(default_factory=list)  # (GPU block, host block): ahead of eviction
    restore: list[BlockCopy] = field(default_factory=list)  # (host block, GPU block): prefix hits, beside the step
    restore_in_step: list[BlockCopy] = field(default_factory=list)  # (host block, GPU block): before its kernels
    disk_loads: list[tuple[BlockHash, int]] = field(default_factory=list)  # key -> host block
    disk_writes: list[tuple[BlockHash, int]] = field(default_factory=list)  # key <- host block
    disk_deletes: list[BlockHash] = field(default_factory=list)  # files evicted by the size cap

    def __bool__(self) -> bool:
        """Whether the step must run for these copies (pre-spills are optional work: they do not count)."""
        return bool(self.offload or self.restore or self.restore_in_step or self.disk_loads or self.disk_writes
                    or self.disk_deletes)


@dataclass
class TierStats:
    """Counters since construction (blocks)."""

    gpu_hit_blocks: int = 0
    host_hit_blocks: int = 0  # restored from a host block that was already there
    disk_hit_blocks: int = 0  # restored from a host block loaded from disk for it
    offloaded_blocks: int = 0
    restored_blocks: int = 0
    disk_loaded_blocks: int = 0
    disk_load_misses: int = 0  # files that were indexed but unreadable, torn or from another config
    disk_written_blocks: int = 0
    disk_write_failures: int = 0


class KVTiers:
    """The host and disk tiers behind the GPU prefix cache, and the copies they ask for."""

    def __init__(self, num_host_blocks: int, *, cache_on_host: bool = True, disk_capacity_blocks: int = 0):
        require_positive_int("num_host_blocks", num_host_blocks)
        require_positive_int("disk_capacity_blocks", disk_capacity_blocks, allow_zero=True)
        self.host = HostTier(num_host_blocks)
        self.cache_on_host = cache_on_host  # False: the pool only backs swap preemption
        self.disk = DiskIndex(disk_capacity_blocks) if disk_capacity_blocks and cache_on_host else None
        self.disk_disabled_reason: str | None = None
        self._loading: dict[BlockHash, int] = {}  # key -> host block its disk load fills
        self._from_disk: set[int] = set()  # host blocks loaded from disk, not restored yet
        self._writes: dict[BlockHash, list[int]] = {}  # key -> host blocks of its queued disk writes, in order
        self.copies = TierCopies()
        self.stats = TierStats()
        # Called with a restore's host blocks as soon as they are chosen, before the admission's evictions and
        # allocation (the runner starts their copies to the device then; `EngineConfig.kv_offload_early_restore`).
        self.stage_restore: Callable[[list[int]], None] | None = None

    def stage(self, host_blocks: Sequence[int]) -> None:
        """Hand a restore's host blocks to `stage_restore` (when set), unless a spill of this step fills one of them:
        its copy to the host runs only with the step's moves (such a restore reads the spill's gathered blocks, on
        the step's own path)."""
        if self.stage_restore is None:
            return
        if self.copies.offload and not {copy.dst for copy in self.copies.offload}.isdisjoint(host_blocks):
            return
        self.stage_restore(list(host_blocks))

    def begin_step(self) -> None:
        """A new step (see `HostTier.begin_step`). Disk loads may run on across steps until `finish_loads`."""
        self.host.begin_step()

    @property
    def num_loading(self) -> int:
        """Keys being loaded from disk (their prompts wait for them)."""
        return len(self._loading)

    def take_copies(self) -> TierCopies:
        """This step's copies, handed to the runner (and cleared here)."""
        copies, self.copies = self.copies, TierCopies()
        return copies

    def _allocate_host(self, num_blocks: int) -> list[int] | None:
        blocks = self.host.allocate(num_blocks)
        if self.host.last_evicted and self._from_disk:
            self._from_disk.difference_update(self.host.last_evicted)
        return blocks

    # ------------------------------------------------------------------ spilling
    def on_gpu_evict(self, key: BlockHash, gpu_block: int) -> None:
        """The GPU cache is dropping `key`'s block: copy it to the host first unless it is there already."""
        if not self.cache_on_host or key in self.host or key in self._loading:
            return
        blocks = self._allocate_host(1)
        if blocks is None:
            return  # every host block is busy or owned by a swapped sequence: the block is simply dropped
        self.host.mark_busy(blocks)  # see the module docstring
        self.host.insert(key, blocks[0])
        self.copies.offload.append(BlockCopy(gpu_block, blocks[0]))
        self.stats.offloaded_blocks += 1
        self._queue_write(key, blocks[0])

    def pre_spill(self, candidates: Sequence[tuple[BlockHash, int]], max_blocks: int) -> bool:
        """Copy up to `max_blocks` of `candidates` (GPU blocks whose KV is computed, next to be evicted first: the
        evictable ones, or with write-through committed blocks of running requests) to the host now, beside the
        step, so that evicting them later needs no copy. A key named twice is copied once. Only free host blocks
        are used: a guess about the future never evicts a cached host block. True when every candidate is on the host (or loading)
        after the call: a call on the same candidates and host would do nothing."""
        if not self.cache_on_host:
            return True
        # Plain dict lookups: this runs at every step that changed the GPU cache's evictable blocks.
        on_host, loading = self.host._block_of, self._loading
        todo, named = [], set()  # two requests that computed one prefix in a step commit its keys twice
        for key, gpu_block in candidates:
            if key not in on_host and key not in loading and key not in named:
                named.add(key)
                todo.append((key, gpu_block))
        take = min(len(todo), max_blocks, self.host.allocator.num_free)
        if take > 0:
            # Free blocks only (take <= num_free: nothing is evicted): nothing else reads or writes them this step.
            for (key, gpu_block), block in zip(todo, self.host.allocate(take)):
                self.host.insert(key, block)
                self.copies.pre_offload.append(BlockCopy(gpu_block, block))
                self._queue_write(key, block)
            self.stats.offloaded_blocks += take
        return take == len(todo)

    def _queue_write(self, key: BlockHash, host_block: int) -> None:
        if self.disk is None or key in self.disk:
            return
        self.copies.disk_writes.append((key, host_block))
        self.copies.disk_deletes.extend(self.disk.add(key))
        self._writes.setdefault(key, []).append(host_block)  # a key's writes finish in order (one writer thread)
        self.host.start_write(host_block)

    # ------------------------------------------------------------------ lookup
    def match_host(self, keys: Sequence[BlockHash]) -> list[int]:
        """Host blocks of the longest prefix of `keys` (which continue a GPU hit) cached on the host."""
        return self.host.match(keys) if self.cache_on_host else []

    def prefix_used(self, keys: Sequence[BlockHash]) -> None:
        """A prompt's prefix `keys` are hit (on the GPU or the host) or wanted: the disk tier's LRU follows use, not
        write time, so that a prefix hot on the GPU or the host keeps its files (what a restart reads), while the
        writes of colder blocks evict files of colder prefixes. Call before the admission's evictions spill."""
        if self.disk is not None and keys:
            self.disk.touch(keys)

    def restore(self, host_blocks: Sequence[int], gpu_blocks: Sequence[int], *, in_step: bool = False) -> None:
        """Copy host hits into freshly allocated GPU blocks (this step's batched host-to-device copy): before the
        step's kernels (`in_step`: the request computes in this step) or beside them (it computes in the next)."""
        self.host.touch(host_blocks)
        self.host.mark_busy(host_blocks)
        copies = self.copies.restore_in_step if in_step else self.copies.restore
        copies.extend(map(BlockCopy, host_blocks, gpu_blocks))
        from_disk = self._from_disk.intersection(host_blocks) if self._from_disk else ()
        self._from_disk.difference_update(from_disk)
        self.stats.disk_hit_blocks += len(from_disk)
        self.stats.host_hit_blocks += len(host_blocks) - len(from_disk)
        self.stats.restored_blocks += len(host_blocks)

    def prefetch(self, keys: Sequence[BlockHash]) -> bool:
        """Start loading from disk the keys that continue the host hits of `keys`; whether any load is pending.

        `keys` are the prompt's keys past its GPU hits. A request waits while this returns True.
        """
        if self.disk is None:
            return False
        keys = keys[len(self.match_host(keys)):]
        # The chain goes on while keys are on disk; one the host has already is a later restore's.
        return self.load(list(itertools.takewhile(lambda key: key not in self.host and self.can_load(key), keys)))

    def can_load(self, key: BlockHash) -> bool:
        """Whether `key` is on disk (or being loaded from it), so a prefetch could bring it to the host."""
        return key in self._loading or (self.disk is not None and key in self.disk)

    def load(self, keys: Sequence[BlockHash]) -> bool:
        """Start loading `keys` (each on the host, on disk or loading already); whether any load is pending.

        For callers that pick the keys themselves (layer groups need blocks that are not one chain).
        """
        pending = False
        for key in keys:
            if key in self._loading:
                pending = True
            elif key not in self.host and self.disk is not None and key in self.disk:
                if not self._start_load(key):
                    break
                pending = True
        return pending

    def _start_load(self, key: BlockHash) -> bool:
        blocks = self._allocate_host(1)
        if blocks is None:
            return False
        self._loading[key] = blocks[0]
        self.copies.disk_loads.append((key, blocks[0]))
        return True

    def finish_loads(self, results: Sequence[tuple[BlockHash, bool | None]]) -> None:
        """The runner read these keys (True), found their files missing, torn or foreign (False: a miss), or
        dropped the read with the step that failed (None: the file stays indexed, a prompt may load it again)."""
        for key, ok in results:
            block = self._loading.pop(key, None)
            if block is None:
                continue
            if ok and self.host.insert(key, block):
                self._from_disk.add(block)
                self.stats.disk_loaded_blocks += 1
                if self.disk is not None:
                    self.disk.touch([key])
            else:
                self.host.free([block])
                if ok is False:
                    self.stats.disk_load_misses += 1
                    if self.disk is not None:
                        self.disk.remove(key)

    def finish_writes(self, results: Sequence[tuple[BlockHash, bool]]) -> None:
        """The runner wrote these keys' files (True), or failed to (False: the key is forgotten)."""
        for key, ok in results:
            blocks = self._writes.get(key)
            if blocks:
                self.host.end_write(blocks.pop(0))
                if not blocks:
                    del self._writes[key]
            if ok:
                self.stats.disk_written_blocks += 1
            else:
                self.stats.disk_write_failures += 1
                if self.disk is not None:
                    self.disk.remove(key)

    def disable_disk(self, reason: str) -> None:
        """Serve on without the disk tier (not writable, full)."""
        self.disk = None
        self.disk_disabled_reason = reason

    def persist(self, gpu_cached: Sequence[tuple[BlockHash, int]]) -> tuple[list, list]:
        """What a shutdown writes so a restart finds it: ((key, GPU block), (key, host block)) not on disk yet.

        `gpu_cached`: the GPU cache's blocks, least recently used first. The disk keeps the most recently used
        keys of the three tiers, up to its cap: those only the host holds in its LRU order, then the GPU's in
        its order (the working set; written from the host where it has them too), all counted newer than keys
        only the disk has. Keys already on disk are touched, not written again, and keys that later ones would
        evict at once are neither."""
        if self.disk is None:
            return [], []
        host = self.host
        gpu_keys = {key for key, _ in gpu_cached}
        newest = [(key, block, False) for block in host._lru if (key := host._key_of[block]) not in gpu_keys]
        newest += [(key, host._block_of[key], False) if key in host else (key, block, True)
                   for key, block in gpu_cached]
        newest = newest[-self.disk.capacity_blocks:]  # (earlier ones would be evicted by later ones)
        self.disk.touch_in_order([key for key, _, _ in newest if key in self.disk])
        from_gpu, from_host = [], []
        for key, block, on_gpu in newest:
            if key not in self.disk:
                self.copies.disk_deletes.extend(self.disk.add(key))
                (from_gpu if on_gpu else from_host).append((key, block))
        return from_gpu, from_host

    # ------------------------------------------------------------------ swap
    def allocate_swap(self, num_blocks: int) -> list[int] | None:
        """Host blocks a swapped-out sequence will own (evicting cached ones if needed); None if short."""
        return self._allocate_host(num_blocks)

    def free_swap(self, blocks: Sequence[int]) -> None:
        """A swapped sequence gave its host blocks back (swapped in, or aborted)."""
        self.host.free(blocks)

    def check_integrity(self, num_swapped_blocks: int) -> None:
        """Assert every host block is cached, swapped, loading or being freed, and the disk cap holds."""
        self.host.check_integrity()
        loading = set(self._loading.values())
        assert not loading & set(self.host._key_of), "a host block is both cached and loading"
        accounted = self.host.num_cached + num_swapped_blocks + len(loading) + len(self.host._release_later)
        assert accounted == self.host.allocator.num_used, (
            f"host tier leaked: {self.host.allocator.num_used} blocks used, {accounted} accounted for")
        assert self._from_disk <= set(self.host._key_of), "a block loaded from disk is no longer cached"
        if self.disk is not None:
            self.disk.check_integrity()
        queued = {}
        for blocks in self._writes.values():
            for block in blocks:
                queued[block] = queued.get(block, 0) + 1
        assert queued == self.host._writing, "the host tier's disk write counts differ from the queued writes"
