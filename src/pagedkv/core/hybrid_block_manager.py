"""The block manager of a model with sliding-window layers: one table per layer group, one pool.

The scheduler talks to it exactly as to `KVBlockManager` (it has the same questions and
answers, in blocks of the one shared pool). Inside, every sequence has one table per group
(`pagedkv.core.kv_groups`):

- **full groups** behave like the one-table manager: a prompt's blocks are claimed at
  admission, and every token keeps its block until the sequence ends;
- **sliding groups** claim blocks only for the tokens a step computes (`schedule`), and
  give back the blocks that fell out of the window as soon as a step is launched
  (`release_out_of_window`), so a sequence holds at most ceil((W - 1) / B) + 1 blocks of a
  sliding group between steps and in a decode step; a prefill chunk of C tokens briefly
  needs ceil((W + C - 2) / B) + 1.

Prefix caching, per group. Every full block a sequence computes is cached in every group
under the same hash-chain key (`pagedkv.core.prefix_cache`). A sliding group's block stays
cached after it leaves its sequence's window (it becomes evictable, still valid KV). A new
prompt hits k blocks when every full group has blocks 0..k-1 cached and every sliding group
has the blocks its window needs at position k * B; the rest of a sliding group's hit
prefix is the null block:

    prefix blocks     |  0  |  1  |  2  |  3  |  4  |  5  |   (k = 6, W = 2 blocks)
    full group        | hit | hit | hit | hit | hit | hit |
    sliding group     |null |null |null |null | hit | hit |

Eviction reclaims cached blocks of any group when the free list runs short (the group with
the most evictable blocks first).

With KV tiers, an evicted block of any group spills to the host tier (and disk) under a key that
includes its group, and the hit rule above runs over all tiers at once (`group_tiers.py`): a hit
block missing on the GPU is restored from the host, or loaded from disk first. Swap preemption
takes its host blocks from the same host pool.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.core.allocator import BlockAllocator
from pagedkv.core.block_table import BlockCopy, BlockTable, num_blocks_for
from pagedkv.core.group_swap import GroupSwap
from pagedkv.core.group_tables import count_table_owners, held_blocks
from pagedkv.core.group_tiers import GroupHit, GroupTiers, eviction_hook, group_key
from pagedkv.core.kv_groups import KVLayout
from pagedkv.core.kv_tiers import KVTiers
from pagedkv.core.pool_queries import PRE_SPILL_BLOCKS, WRITE_THROUGH_BLOCKS, PoolQueries
from pagedkv.core.prefix_cache import BlockHash, PrefixCache, block_keys
from pagedkv.core.sliding_table import SlidingBlockTable
from pagedkv.errors import InvalidArgumentError, OutOfBlocksError, require_positive_int


class HybridBlockManager(GroupSwap, PoolQueries):
    """Per-group block tables over one GPU pool, with per-group prefix caches, and a host pool of
    `num_swap_blocks` (swap preemption) plus `num_offload_blocks` (the host tier) behind them;
    `disk_capacity_blocks` > 0 adds the disk tier."""

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 num_swap_blocks: int = 0, max_num_tokens: int | None = None, max_query_tokens: int = 2048,
                 num_offload_blocks: int = 0, disk_capacity_blocks: int = 0, max_in_step_restore_blocks: int = 0,
                 write_through: bool = False):
        require_positive_int("block_size", block_size)
        self._init_restores(max_in_step_restore_blocks)
        require_positive_int("num_swap_blocks", num_swap_blocks, allow_zero=True)
        require_positive_int("num_offload_blocks", num_offload_blocks, allow_zero=True)
        require_positive_int("max_query_tokens", max_query_tokens)
        self.layout = layout
        self.block_size = block_size
        self.max_num_tokens = max_num_tokens
        self.max_query_tokens = max_query_tokens  # the longest chunk a step schedules: admission counts one
        self.allocator = BlockAllocator(num_blocks)
        self.null_block = num_blocks  # the pool's scratch block: what dropped entries hold
        self.groups = layout.groups
        # NOTE: the step loop visits every running sequence's groups (7 for Gemma-3-1B): index lists, not a
        # property per group per call, keep that visit cheap.
        self._full_groups = tuple(g for g, group in enumerate(self.groups) if not group.is_sliding)
        self._sliding_groups = tuple((g, group.sliding_window) for g, group in enumerate(self.groups)
                                     if group.is_sliding)
        num_host_blocks = num_swap_blocks + num_offload_blocks
        cache_on_host = bool(num_offload_blocks) and enable_prefix_caching
        self.tiers = KVTiers(num_host_blocks, cache_on_host=cache_on_host,
                             disk_capacity_blocks=disk_capacity_blocks) if num_host_blocks else None
        spills = self.tiers is not None and cache_on_host
        self.caches = [PrefixCache(self.allocator, eviction_hook(self.tiers, g) if spills else None)
                       for g in range(len(self.groups))] if enable_prefix_caching else None
        # The hit-rate statistics live on one cache: a hit is decided for all groups at once.
        self.prefix_cache = self.caches[0] if self.caches else None
        self._group_tiers = GroupTiers(self.groups, self.caches, self.tiers, block_size) if self.caches else None
        self._init_write_through(write_through and self.caches is not None)
        self._tables: dict[int, list[BlockTable]] = {}
        self._num_tokens: dict[int, int] = {}  # tokens with slots in the full groups (the scheduler's view)
        # seq id -> (per group: table tokens, dropped entries, CPU blocks in logical order), tokens
        self._swapped: dict[int, tuple[list[tuple[int, int, list[int]]], int]] = {}
        self._block_keys: dict[int, list[BlockHash]] = {}
        self.num_prefix_hit_tokens = 0

    # ------------------------------------------------------------------ capacity
    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation could get now: the free list plus every group's evictable cached blocks."""
        evictable = sum(cache.num_evictable for cache in self.caches) if self.caches else 0
        return self.allocator.num_free + evictable

    def table(self, seq_id: int) -> BlockTable:
        """The sequence's table of group 0."""
        return self._tables[seq_id][0]

    def group_table(self, seq_id: int, group: int) -> BlockTable:
        """The sequence's table of `group`."""
        return self._tables[seq_id][group]

    def block_ids(self, seq_id: int) -> list[int]:
        return self._tables[seq_id][0].block_ids

    def num_tokens(self, seq_id: int) -> int:
        """Tokens with slots (in the full groups; sliding groups claim theirs step by step)."""
        return self._num_tokens[seq_id]

    def num_held_blocks(self, seq_id: int, group: int) -> int:
        """Blocks the sequence owns in `group` (dropped entries excluded)."""
        table = self._tables[seq_id][group]
        return table.num_held if isinstance(table, SlidingBlockTable) else table.num_blocks

    # ------------------------------------------------------------------ admission
    def _match(self, token_ids: Sequence[int],
               known_keys: Sequence[BlockHash] = ()) -> tuple[int, list[BlockHash], list[GroupHit]]:
        """(hit blocks k, keys of the prompt's full blocks, each group's hit for k); `known_keys` reused.

        With KV tiers a hit block may be in host memory (a restore); see `group_tiers.py`.
        """
        if self.caches is None:
            return 0, [], [GroupHit(0, [], []) for _ in self.groups]
        keys = block_keys(token_ids, self.block_size, known_keys)
        num_hit, hits = self._group_tiers.match(keys, (len(token_ids) - 1) // self.block_size)
        return num_hit, keys, hits

    def blocks_to_admit(self, token_ids: Sequence[int], reserve_tokens: int | None = None,
                        known_keys: Sequence[BlockHash] = ()) -> int:
        """New blocks a prompt takes at admission: every full block of it, and a first chunk in sliding groups
        (restored blocks are new blocks too)."""
        if reserve_tokens is not None:
            raise InvalidArgumentError("naive max-length reservation is for one-table models only")
        num_hit, _, hits = self._match(token_ids, known_keys)
        total = num_blocks_for(len(token_ids), self.block_size)
        chunk_blocks = num_blocks_for(min(len(token_ids), num_hit * self.block_size + self.max_query_tokens),
                                      self.block_size)
        new = 0
        for group, hit in zip(self.groups, hits):
            new += (chunk_blocks if group.is_sliding else total) - num_hit + hit.gpu.count(None)
            new += sum(1 for b in hit.gpu_hits if self.allocator.ref_count(b) == 1)  # evictable hits stop being free
        return new

    def admit(self, seq_id: int, token_ids: Sequence[int], reserve_tokens: int | None = None,
              known_keys: Sequence[BlockHash] = ()) -> int:
        """Create the sequence's tables, sharing cached prefix blocks per group (restoring those the host
        tier holds); returns the cached token count."""
        if seq_id in self._tables or seq_id in self._swapped:
            raise InvalidArgumentError(f"sequence {seq_id} already has blocks")
        if reserve_tokens is not None:
            raise InvalidArgumentError("naive max-length reservation is for one-table models only")
        num_hit, keys, hits = self._match(token_ids, known_keys)
        if self.caches is not None:
            self.prefix_cache.record_lookup(min(len(keys), (len(token_ids) - 1) // self.block_size), num_hit)
            for cache, hit in zip(self.caches, hits):
                cache.acquire(hit.gpu_hits)  # before any restore allocates: an eviction must not take them
            if self._restoring_blocks and any(not self._restoring_blocks.isdisjoint(h.gpu_hits) for h in hits):
                self._restoring_seqs.add(seq_id)  # another request's restore fills these this step
            if self.tiers is not None:
                self.tiers.stats.gpu_hit_blocks += sum(len(hit.gpu_hits) for hit in hits)
                if self.tiers.disk is not None:  # each group's blocks of the hit, block by block
                    self.tiers.prefix_used([group_key(keys[i], g) for i in range(num_hit)
                                            for g, hit in enumerate(hits) if i >= hit.first])
                self._restore(seq_id, keys, hits)
        tables = []
        for group, hit in zip(self.groups, hits):
            if group.is_sliding:
                table = SlidingBlockTable(self.allocator, self.block_size, self.max_num_tokens)
                table.extend_window(num_hit, hit.gpu)
            else:
                table = BlockTable(self.allocator, self.block_size, self.max_num_tokens)
                table.extend_shared(hit.gpu)
            tables.append(table)
        self._tables[seq_id] = tables
        self._num_tokens[seq_id] = num_hit * self.block_size
        self._block_keys[seq_id] = keys[:num_hit]
        self.num_prefix_hit_tokens += num_hit * self.block_size
        return num_hit * self.block_size

    def _restore(self, seq_id: int, keys: list[BlockHash], hits: list[GroupHit]) -> None:
        """Fill the hit's blocks that are on the host with fresh GPU blocks (cached, then shared like GPU hits)."""
        wanted = [(g, i) for g, hit in enumerate(hits) for i, gpu in enumerate(hit.gpu) if gpu is None]
        if not wanted:
            return
        host_blocks = [hits[g].host[i] for g, i in wanted]
        self.tiers.host.mark_busy(host_blocks)  # the GPU evictions below spill to the host: not over these
        self._ensure_free(len(wanted))
        gpu_blocks = self.allocator.allocate(len(wanted))
        for (g, i), block in zip(wanted, gpu_blocks):
            self.caches[g].adopt(keys[hits[g].first + i], block)  # the allocation's reference is the cache's
            hits[g].gpu[i] = block
        self._queue_restore(seq_id, host_blocks, gpu_blocks)

    # ------------------------------------------------------------------ KV tiers
    def prefetch(self, token_ids: Sequence[int], known_keys: Sequence[BlockHash] = ()) -> bool:
        """Start disk loads for the blocks of the prompt's longest hit over every tier that only the disk has;
        whether the prompt must wait for them (see `GroupTiers.prefetch`). `known_keys`: leading keys already
        hashed."""
        if self._group_tiers is None or self.tiers is None or self.tiers.disk is None:
            return False
        return self._group_tiers.prefetch(block_keys(token_ids, self.block_size, known_keys),
                                          (len(token_ids) - 1) // self.block_size)

    def pre_spill(self, max_blocks: int = PRE_SPILL_BLOCKS) -> None:
        """Copy the GPU caches' next evictions to the host tier ahead of time (beside this step; see `KVTiers`),
        then, with write-through, the blocks committed since (`_write_through_step`)."""
        if self.tiers is not None and self._group_tiers is not None and self.num_free_blocks > self.allocator.num_free:
            self.tiers.pre_spill(self._group_tiers.spill_candidates(2 * max_blocks), max_blocks)
        if self._write_through:
            self._write_through_step(WRITE_THROUGH_BLOCKS)

    def persist(self) -> tuple[list[tuple[BlockHash, int]], list[tuple[BlockHash, int]]]:
        """Cached blocks of every group to write to disk at shutdown, ((tier key, GPU block), (tier key, host
        block)) (see `KVTiers.persist`)."""
        if self.tiers is None or self._group_tiers is None:
            return [], []
        return self.tiers.persist(self._group_tiers.cached_blocks())

    # ------------------------------------------------------------------ growth
    def blocks_needed(self, seq_id: int, num_new_tokens: int) -> int:
        """New blocks `append_slots(seq_id, num_new_tokens)` would take (full groups only)."""
        tables = self._tables[seq_id]
        return sum(tables[g].num_blocks_needed(num_new_tokens) for g in self._full_groups)

    def append_slots(self, seq_id: int, num_new_tokens: int) -> list[BlockCopy]:
        """Give the full groups slots for `num_new_tokens` more tokens; returns copy-on-write copies."""
        self._check_length(seq_id, self._num_tokens[seq_id] + num_new_tokens)  # before any eviction
        self._ensure_free(self.blocks_needed(seq_id, num_new_tokens))
        return self._append_full(seq_id, num_new_tokens)

    def _check_length(self, seq_id: int, num_tokens: int) -> None:
        if self.max_num_tokens is not None and num_tokens > self.max_num_tokens:
            self._tables[seq_id][0].append_tokens(self.max_num_tokens + 1)  # raises SequenceTooLongError

    def _append_full(self, seq_id: int, num_new_tokens: int) -> list[BlockCopy]:
        """`append_slots` once the length is checked and the blocks are known to be free."""
        new_total = self._num_tokens[seq_id] + num_new_tokens
        tables = self._tables[seq_id]
        copies = []
        for g in self._full_groups:
            copies += tables[g].append_tokens(num_new_tokens)
        self._num_tokens[seq_id] = new_total
        return copies

    def _step_blocks(self, seq_id: int, num_computed_tokens: int, num_new_tokens: int) -> int:
        end = num_computed_tokens + num_new_tokens
        growth = end - self._num_tokens[seq_id]
        needed = self.blocks_needed(seq_id, growth) if growth > 0 else 0
        tables = self._tables[seq_id]
        for g, _ in self._sliding_groups:
            table = tables[g]
            if end > table.num_tokens:
                needed += table.num_blocks_needed(end - table.num_tokens)
        return needed

    def schedule(self, seq_id: int, num_computed_tokens: int, num_new_tokens: int) -> list[BlockCopy]:
        """Slots for tokens [num_computed, num_computed + num_new) in every group; returns copy-on-write copies.

        Sliding groups first give back what the window left behind, then claim the chunk's blocks.
        Raises `OutOfBlocksError` (no change) when the pool cannot give them.
        """
        return self._schedule(seq_id, num_computed_tokens, num_new_tokens, or_none=False)

    def try_schedule(self, seq_id: int, num_computed_tokens: int, num_new_tokens: int) -> list[BlockCopy] | None:
        """`schedule` when the pool can give the blocks now, else None with nothing changed (the scheduler then
        preempts a victim and asks again): one count of the blocks a step needs per group."""
        return self._schedule(seq_id, num_computed_tokens, num_new_tokens, or_none=True)

    def _schedule(self, seq_id: int, num_computed_tokens: int, num_new_tokens: int,
                  or_none: bool) -> list[BlockCopy] | None:
        end = num_computed_tokens + num_new_tokens
        self._check_length(seq_id, end)  # before anything changes
        # Counted before the window's release: that only turns entries into the null block, never the last one.
        needed = self._step_blocks(seq_id, num_computed_tokens, num_new_tokens)
        if or_none and needed and needed > self.num_free_blocks:
            return None
        self.release_out_of_window(seq_id, num_computed_tokens)
        if needed == 0:
            # The common decode step: the chunk fits in every table's last block, which no one else holds
            # (`num_blocks_needed` counts a shared last block's copy). Only the token counts move.
            return self._advance(seq_id, end)
        self._ensure_free(needed)
        copies = self._append_full(seq_id, end - self._num_tokens[seq_id]) if end > self._num_tokens[seq_id] else []
        tables = self._tables[seq_id]
        for g, _ in self._sliding_groups:
            table = tables[g]
            if end > table.num_tokens:
                copies += table.append_tokens(end - table.num_tokens)
        return copies

    def _advance(self, seq_id: int, end: int) -> list[BlockCopy]:
        """Tables whose last block has room for tokens up to `end`, and no copy-on-write pending: move them."""
        if end > self._num_tokens[seq_id]:
            self._num_tokens[seq_id] = end
        for table in self._tables[seq_id]:
            if end > table.num_tokens:
                table.num_tokens = end
        return []

    def commit(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int,
               known_keys: Sequence[BlockHash] = ()) -> None:
        """Tokens up to `num_computed_tokens` have KV: cache the newly full blocks in every group."""
        if self.caches is None:
            return
        keys = self._block_keys[seq_id]
        num_full = num_computed_tokens // self.block_size
        if num_full <= len(keys):
            return
        new_keys = block_keys(token_ids[:num_full * self.block_size], self.block_size, known_keys, len(keys),
                              keys[-1] if keys else None)
        for g, (table, cache) in enumerate(zip(self._tables[seq_id], self.caches)):
            for offset, key in enumerate(new_keys):
                index = len(keys) + offset
                if index < len(table.block_ids) and table.block_ids[index] != self.null_block:
                    cache.insert(key, table.block_ids[index])
            self._queue_write_through(cache, new_keys, g)
        keys.extend(new_keys)

    def release_out_of_window(self, seq_id: int, num_computed_tokens: int) -> None:
        """Every query left is at `num_computed_tokens` or later: sliding groups drop what no window reaches."""
        tables = self._tables.get(seq_id)
        if tables is None:
            return
        block_size = self.block_size
        for g, window in self._sliding_groups:
            table = tables[g]
            first_live = max(0, num_computed_tokens - window + 1) // block_size  # `KVGroup.first_live_block`
            if first_live <= table.num_dropped:
                continue  # nothing new left the window (the usual decode step)
            dropped = table.drop_before(first_live)
            if dropped and self.caches is not None:
                self.caches[g].on_released(dropped)

    # ------------------------------------------------------------------ release
    def free(self, seq_id: int) -> None:
        """Return all the sequence's blocks, GPU and swap (no-op for an unknown sequence)."""
        tables = self._tables.pop(seq_id, None)
        self._num_tokens.pop(seq_id, None)
        self._block_keys.pop(seq_id, None)
        for g, (table, held) in enumerate(zip(tables or (), held_blocks(tables or ()))):
            table.free()
            if self.caches is not None:
                self.caches[g].on_released(held)
        swapped = self._swapped.pop(seq_id, None)
        if swapped is not None:
            cpu = [b for _, _, blocks in swapped[0] for b in blocks]
            if cpu:
                self.tiers.free_swap(cpu)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent in every group (parallel sampling)."""
        if child_id in self._tables:
            raise InvalidArgumentError(f"sequence {child_id} already has blocks")
        self._tables[child_id] = [table.fork() for table in self._tables[parent_id]]
        self._num_tokens[child_id] = self._num_tokens[parent_id]
        self._block_keys[child_id] = list(self._block_keys[parent_id])

    # ------------------------------------------------------------------ internals
    def _ensure_free(self, num_blocks: int) -> None:
        shortfall = num_blocks - self.allocator.num_free
        if shortfall <= 0:
            return
        if self.num_free_blocks < num_blocks:
            raise OutOfBlocksError(num_blocks, self.num_free_blocks)
        while shortfall > 0:
            cache = max(self.caches, key=lambda c: c.num_evictable)
            shortfall -= cache.evict(min(shortfall, max(1, cache.num_evictable // self.num_groups)))

    def check_integrity(self) -> None:
        """Assert tables, caches and allocators agree per group, and sliding groups hold at most their bound."""
        self.allocator.check_integrity()
        owners = count_table_owners(self._tables, self.groups, self._num_tokens, self.null_block, self.block_size,
                                    self.max_query_tokens)
        for cache in self.caches or ():
            cache.check_integrity()
            for block_id in cache._key_of:
                owners[block_id] = owners.get(block_id, 0) + 1
        for block_id in range(self.num_blocks):
            count = self.allocator.ref_count(block_id)
            assert count == owners.get(block_id, 0), (
                f"block {block_id}: ref count {count}, but {owners.get(block_id, 0)} owners found")
        if self.tiers is not None:
            self.tiers.check_integrity(sum(len(blocks) for groups, _ in self._swapped.values()
                                           for _, _, blocks in groups))
