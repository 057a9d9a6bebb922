"""The KV block manager: every sequence's block table over one pool, plus prefix cache and KV tiers.

This is the bookkeeping half of the KV cache; the tensors live elsewhere (the runner's
`KVPool`). The scheduler asks it questions in blocks ("can this prompt be admitted and
still leave the watermark free?") and tells it what happened ("these tokens were
computed"). Everything it decides that touches K/V tensors comes back as a list of block
copies for the runner: copy-on-write copies, swap-outs (GPU block -> host block),
swap-ins (host block -> GPU block), and the KV tiers' spills and restores (`kv_tiers.py`).

With KV tiers a prompt's prefix is looked up on the GPU, in host memory (restored into fresh
GPU blocks), then on disk (loaded into host blocks first). A step's first
`max_in_step_restore_blocks` restored blocks are copied before its kernels, so their requests
compute in the same step; restores beyond that run beside the step, and their requests compute
from the next one (see `pagedkv.engine.kv_offload` for what each costs). Swap preemption takes host blocks from the same pool.

Free capacity counts evictable prefix-cache blocks: they hold valid KV that nobody uses,
and are reclaimed (LRU) the moment an allocation needs them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from pagedkv.core.allocator import BlockAllocator
from pagedkv.core.block_table import BlockCopy, BlockTable, num_blocks_for
from pagedkv.core.kv_tiers import KVTiers
from pagedkv.core.pool_queries import PRE_SPILL_BLOCKS, WRITE_THROUGH_BLOCKS, PoolQueries
from pagedkv.core.prefix_cache import BlockHash, PrefixCache, block_keys
from pagedkv.errors import InvalidArgumentError, OutOfBlocksError, require_positive_int

__all__ = ["PRE_SPILL_BLOCKS", "KVBlockManager", "PoolQueries"]  # the first and last live in pool_queries.py


class KVBlockManager(PoolQueries):
    """Block tables by sequence id, over a GPU pool and a host pool of `num_swap_blocks` (swap preemption)
    plus `num_offload_blocks` (the host tier); `disk_capacity_blocks` > 0 adds the disk tier."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 num_swap_blocks: int = 0, max_num_tokens: int | None = None, num_offload_blocks: int = 0,
                 disk_capacity_blocks: int = 0, max_in_step_restore_blocks: int = 0, write_through: bool = False):
        require_positive_int("block_size", block_size)
        self._init_restores(max_in_step_restore_blocks)
        require_positive_int("num_swap_blocks", num_swap_blocks, allow_zero=True)
        require_positive_int("num_offload_blocks", num_offload_blocks, allow_zero=True)
        self.block_size = block_size
        self.max_num_tokens = max_num_tokens
        self.allocator = BlockAllocator(num_blocks)
        num_host_blocks = num_swap_blocks + num_offload_blocks
        cache_on_host = bool(num_offload_blocks) and enable_prefix_caching
        self.tiers = KVTiers(num_host_blocks, cache_on_host=cache_on_host,
                             disk_capacity_blocks=disk_capacity_blocks) if num_host_blocks else None
        on_evict = self.tiers.on_gpu_evict if self.tiers is not None and cache_on_host else None
        self.prefix_cache = PrefixCache(self.allocator, on_evict) if enable_prefix_caching else None
        self._init_write_through(write_through)
        self._pre_spilled: tuple | None = None  # (cache, host, loading) state a `pre_spill` found settled
        self._tables: dict[int, BlockTable] = {}
        self._swapped: dict[int, tuple[list[int], int]] = {}  # seq id -> (host blocks, num tokens)
        self._block_keys: dict[int, list[BlockHash]] = {}  # seq id -> keys of its full blocks so far
        self.num_prefix_hit_tokens = 0

    # ------------------------------------------------------------------ capacity
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation could get now: the free list plus evictable cached blocks."""
        evictable = self.prefix_cache.num_evictable if self.prefix_cache else 0
        return self.allocator.num_free + evictable

    def table(self, seq_id: int) -> BlockTable:
        """The block table of a sequence on the GPU."""
        return self._tables[seq_id]

    #: One table per sequence: every layer is in group 0 (`HybridBlockManager` has one per layer group).
    num_groups = 1

    def group_table(self, seq_id: int, group: int) -> BlockTable:
        """The sequence's table of `group` (only group 0 exists)."""
        return self._tables[seq_id]

    def num_tokens(self, seq_id: int) -> int:
        """Tokens with slots in the sequence's table."""
        return self._tables[seq_id].num_tokens

    # ------------------------------------------------------------------ admission
    def match_prefix(self, token_ids: Sequence[int],
                     known_keys: Sequence[BlockHash] = ()) -> tuple[list[int], list[BlockHash]]:
        """Cached blocks that can be shared for a new prompt, and the keys of its full blocks.

        At least one prompt token is always left to compute: the model must run on the last
        prompt token to produce the first output's logits. `known_keys` are keys of the leading
        blocks already computed (see `block_keys`); only the rest are hashed.
        """
        if self.prefix_cache is None:
            return [], []
        keys = block_keys(token_ids, self.block_size, known_keys)
        max_hit_blocks = (len(token_ids) - 1) // self.block_size
        return self.prefix_cache.match(keys[:max_hit_blocks]), keys

    def blocks_to_admit(self, token_ids: Sequence[int], reserve_tokens: int | None = None,
                        known_keys: Sequence[BlockHash] = ()) -> int:
        """New blocks a prompt takes at admission (after prefix hits; or `reserve_tokens` worth)."""
        if reserve_tokens is not None:
            return num_blocks_for(reserve_tokens, self.block_size)
        hits, _ = self.match_prefix(token_ids, known_keys)
        # Hit blocks that are evictable stop being free once shared.
        evictable_hits = sum(1 for b in hits if self.allocator.ref_count(b) == 1)
        return num_blocks_for(len(token_ids), self.block_size) - len(hits) + evictable_hits

    def admit(self, seq_id: int, token_ids: Sequence[int], reserve_tokens: int | None = None,
              known_keys: Sequence[BlockHash] = ()) -> int:
        """Create the sequence's table, sharing cached prefix blocks; returns the cached token count.

        With `reserve_tokens` (naive, max-length reservation) the table claims blocks for that
        many tokens at once and shares nothing. Raises `OutOfBlocksError` (no change) if the
        reservation does not fit.
        """
        if seq_id in self._tables or seq_id in self._swapped:
            raise InvalidArgumentError(f"sequence {seq_id} already has blocks")
        table = BlockTable(self.allocator, self.block_size, self.max_num_tokens)
        if reserve_tokens is not None:
            self._ensure_free(num_blocks_for(reserve_tokens, self.block_size))
            table.reserve(reserve_tokens)
            self._tables[seq_id] = table
            self._block_keys[seq_id] = []
            return 0
        hits, keys = self.match_prefix(token_ids, known_keys)
        max_hit_blocks = (len(token_ids) - 1) // self.block_size
        if self.prefix_cache is not None:
            # Only blocks that could hit count as queried (the last prompt token is never served).
            self.prefix_cache.record_lookup(min(len(keys), max_hit_blocks), len(hits))
            self.prefix_cache.acquire(hits)
            if self._restoring_blocks and not self._restoring_blocks.isdisjoint(hits):
                self._restoring_seqs.add(seq_id)  # another request's restore fills these this step
        table.extend_shared(hits)
        if self.tiers is not None and self.prefix_cache is not None:
            self.tiers.stats.gpu_hit_blocks += len(hits)
            self.tiers.prefix_used(keys[:max_hit_blocks])
            restored = self._restore(seq_id, keys[len(hits):max_hit_blocks])
            table.extend_shared(restored)
            hits = hits + restored
        self._tables[seq_id] = table
        self._block_keys[seq_id] = keys[:len(hits)]
        num_cached = len(hits) * self.block_size
        self.num_prefix_hit_tokens += num_cached
        return num_cached

    def _restore(self, seq_id: int, keys: list[BlockHash]) -> list[int]:
        """GPU blocks for the host-tier hits among `keys` (which continue the GPU hits), with their copies."""
        host_blocks = self.tiers.match_host(keys)
        for index, key in enumerate(keys[:len(host_blocks)]):
            if key in self.prefix_cache:
                # the GPU lost an earlier block of this chain but holds this one: compute from here on
                host_blocks = host_blocks[:index]
                break
        if not host_blocks:
            return []
        self.tiers.host.mark_busy(host_blocks)  # the GPU evictions below spill to the host: not over these
        self.tiers.stage(host_blocks)  # their copies may start now, before the evictions' bookkeeping
        self._ensure_free(len(host_blocks))
        gpu_blocks = self.allocator.allocate(len(host_blocks))
        for key, block in zip(keys, gpu_blocks):
            self.prefix_cache.adopt(key, block)  # the allocation's reference is the cache's
        self._queue_restore(seq_id, host_blocks, gpu_blocks)
        return gpu_blocks

    # ------------------------------------------------------------------ KV tiers
    def prefetch(self, token_ids: Sequence[int], known_keys: Sequence[BlockHash] = ()) -> bool:
        """Start disk loads for the prompt's prefix beyond the GPU and host hits; whether the prompt must wait."""
        tiers = self.tiers
        if tiers is None or tiers.disk is None or self.prefix_cache is None:
            return False
        hits, keys = self.match_prefix(token_ids, known_keys)
        return tiers.prefetch(keys[len(hits):(len(token_ids) - 1) // self.block_size])

    def recent_keys(self, limit: int) -> list[BlockHash]:
        """Up to `limit` keys a prompt would hit here, the GPU cache's most recent first, then the host tier's
        (a host hit is a copy, not a prefill, so a router should send the prefix here too)."""
        keys = super().recent_keys(limit)
        tiers = self.tiers
        if tiers is None or not tiers.cache_on_host or len(keys) >= limit:
            return keys
        on_gpu = set(keys)
        keys += itertools.islice((key for key in tiers.host.recent_keys(limit) if key not in on_gpu),
                                 limit - len(keys))
        return keys

    def pre_spill(self, max_blocks: int = PRE_SPILL_BLOCKS) -> None:
        """Copy the GPU cache's next evictions to the host tier ahead of time (beside this step; see `KVTiers`),
        then, with write-through, the blocks committed since (`_write_through_step`: the next evictions come
        first, as they need the free host blocks soonest)."""
        if self.tiers is not None and self.prefix_cache is not None and self.prefix_cache.num_evictable \
                and self._pre_spilled != self._pre_spill_state():
            # (A decode step changes neither the cache's eviction order nor the host: the skip above spares the
            # scan that found every candidate on the host already.)
            settled = self.tiers.pre_spill(self.prefix_cache.next_evicted(2 * max_blocks), max_blocks)
            self._pre_spilled = self._pre_spill_state() if settled else None
        if self._write_through:
            self._write_through_step(WRITE_THROUGH_BLOCKS)

    def _pre_spill_state(self) -> tuple[int, int, int]:
        """What a settled `pre_spill` depends on: the GPU cache's evictable blocks, the host tier, disk loads."""
        return self.prefix_cache.version, self.tiers.host.version, self.tiers.num_loading

    def persist(self) -> tuple[list[tuple[BlockHash, int]], list[tuple[BlockHash, int]]]:
        """Cached blocks to write to disk at shutdown, ((key, GPU block), (key, host block)) (see `KVTiers.persist`)."""
        if self.tiers is None or self.prefix_cache is None:
            return [], []
        return self.tiers.persist(self.prefix_cache.cached_blocks())

    # ------------------------------------------------------------------ growth
    def blocks_needed(self, seq_id: int, num_new_tokens: int) -> int:
        """New blocks `append_slots(seq_id, num_new_tokens)` would take."""
        return self._tables[seq_id].num_blocks_needed(num_new_tokens)

    def append_slots(self, seq_id: int, num_new_tokens: int) -> list[BlockCopy]:
        """Give the sequence slots for `num_new_tokens` tokens; returns copy-on-write copies.

        Raises `OutOfBlocksError` (no change) when even evicting every cached block would not
        free enough.
        """
        table = self._tables[seq_id]
        return self._append(table, num_new_tokens, table.num_blocks_needed(num_new_tokens))

    def _append(self, table: BlockTable, num_new_tokens: int, needed: int) -> list[BlockCopy]:
        """`append_slots` with its new blocks already counted (`needed`, from `num_blocks_needed`)."""
        if needed:
            if table.max_num_tokens is not None and table.num_tokens + num_new_tokens > table.max_num_tokens:
                return table.append_tokens(num_new_tokens)  # raises SequenceTooLongError before any eviction
            self._ensure_free(needed)
        return table.append_tokens(num_new_tokens)

    def schedule(self, seq_id: int, num_computed_tokens: int, num_new_tokens: int) -> list[BlockCopy]:
        """Slots for tokens [num_computed, num_computed + num_new) (`append_slots` of what is missing)."""
        slots_needed = num_computed_tokens + num_new_tokens - self._tables[seq_id].num_tokens
        return self.append_slots(seq_id, slots_needed) if slots_needed > 0 else []

    def try_schedule(self, seq_id: int, num_computed_tokens: int, num_new_tokens: int) -> list[BlockCopy] | None:
        """`schedule` when the pool can give the slots now, else None with nothing changed (the scheduler then
        preempts a victim and asks again)."""
        table = self._tables[seq_id]
        slots_needed = num_computed_tokens + num_new_tokens - table.num_tokens
        if slots_needed <= 0:
            return []
        # NOTE: counted once and handed down; `_ensure_free` then evicts without raising (needed <= free).
        needed = table.num_blocks_needed(slots_needed)
        if needed > self.num_free_blocks:
            return None
        return self._append(table, slots_needed, needed)

    def release_out_of_window(self, seq_id: int, num_computed_tokens: int) -> None:
        """Nothing to release: every layer keeps every token (sliding groups are `HybridBlockManager`'s)."""

    def blocks_to_resume(self, seq_id: int, num_tokens: int) -> int:
        """Blocks a swapped sequence takes to come back and reach `num_tokens` tokens."""
        return max(self.blocks_to_swap_in(seq_id), num_blocks_for(num_tokens, self.block_size))

    def block_ids(self, seq_id: int) -> list[int]:
        """The sequence's physical blocks in logical order."""
        return self._tables[seq_id].block_ids

    def commit(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int,
               known_keys: Sequence[BlockHash] = ()) -> None:
        """Tokens up to `num_computed_tokens` now have KV: cache the sequence's newly full blocks.

        `known_keys` (keys of the leading blocks, see `block_keys`) are reused, not hashed again.
        """
        if self.prefix_cache is None:
            return
        keys = self._block_keys[seq_id]
        table = self._tables[seq_id]
        num_full = num_computed_tokens // self.block_size
        if num_full <= len(keys):
            return
        new_keys = block_keys(token_ids[:num_full * self.block_size], self.block_size, known_keys, len(keys),
                              keys[-1] if keys else None)
        for offset, key in enumerate(new_keys):
            self.prefix_cache.insert(key, table.block_ids[len(keys) + offset])
        self._queue_write_through(self.prefix_cache, new_keys)
        keys.extend(new_keys)

    # ------------------------------------------------------------------ release
    def free(self, seq_id: int) -> None:
        """Return all the sequence's blocks, GPU and swap (no-op for an unknown sequence)."""
        table = self._tables.pop(seq_id, None)
        self._block_keys.pop(seq_id, None)
        if table is not None:
            held = list(table.block_ids)
            table.free()
            if self.prefix_cache is not None:
                self.prefix_cache.on_released(held)
        swapped = self._swapped.pop(seq_id, None)
        if swapped is not None and swapped[0]:
            self.tiers.free_swap(swapped[0])

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (parallel sampling)."""
        if child_id in self._tables:
            raise InvalidArgumentError(f"sequence {child_id} already has blocks")
        self._tables[child_id] = self._tables[parent_id].fork()
        self._block_keys[child_id] = list(self._block_keys[parent_id])

    # ------------------------------------------------------------------ swap
    def can_swap_out(self, seq_id: int) -> bool:
        """Whether the host pool can take all the sequence's blocks (evicting cached host blocks if need be)."""
        return self.tiers is not None and self._tables[seq_id].num_blocks <= self.tiers.host.num_available

    def swap_out(self, seq_id: int) -> list[BlockCopy]:
        """Move the sequence to host blocks; returns (GPU src, host dst) copies to run *before* reuse."""
        table = self._tables[seq_id]
        if not self.can_swap_out(seq_id):
            raise OutOfBlocksError(table.num_blocks, self.tiers.host.num_available if self.tiers else 0)
        cpu_blocks = self.tiers.allocate_swap(table.num_blocks)
        copies = [BlockCopy(gpu, cpu) for gpu, cpu in zip(table.block_ids, cpu_blocks)]
        num_tokens = table.num_tokens
        self.free(seq_id)
        self._swapped[seq_id] = (cpu_blocks, num_tokens)
        return copies

    def blocks_to_swap_in(self, seq_id: int) -> int:
        """GPU blocks a swap-in takes."""
        return len(self._swapped[seq_id][0])

    def swap_in(self, seq_id: int) -> list[BlockCopy]:
        """Bring a swapped sequence back to fresh GPU blocks; returns (CPU src, GPU dst) copies."""
        cpu_blocks, num_tokens = self._swapped[seq_id]
        self._ensure_free(len(cpu_blocks))
        table = BlockTable(self.allocator, self.block_size, self.max_num_tokens)
        table.append_tokens(num_tokens)
        del self._swapped[seq_id]
        self._tables[seq_id] = table
        self._block_keys[seq_id] = []  # the next commit() re-hashes the full blocks, re-caching them
        copies = [BlockCopy(cpu, gpu) for cpu, gpu in zip(cpu_blocks, table.block_ids)]
        if cpu_blocks:
            self.tiers.free_swap(cpu_blocks)  # reusable from the next step, once this step's copy has read them
        return copies

    # ------------------------------------------------------------------ internals
    def _ensure_free(self, num_blocks: int) -> None:
        shortfall = num_blocks - self.allocator.num_free
        if shortfall <= 0:
            return
        if self.prefix_cache is None or self.prefix_cache.num_evictable < shortfall:
            raise OutOfBlocksError(num_blocks, self.num_free_blocks)
        self.prefix_cache.evict(shortfall)

    def check_integrity(self) -> None:
        """Assert tables, cache and allocators agree: every owner accounted for, nothing leaked."""
        self.allocator.check_integrity()
        owners: dict[int, int] = {}
        for table in self._tables.values():
            assert table.num_blocks >= num_blocks_for(table.num_tokens, self.block_size)
            for block_id in table.block_ids:
                owners[block_id] = owners.get(block_id, 0) + 1
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity()
            for block_id in self.prefix_cache._key_of:
                owners[block_id] = owners.get(block_id, 0) + 1
        for block_id in range(self.num_blocks):
            count = self.allocator.ref_count(block_id)
            assert count == owners.get(block_id, 0), (
                f"block {block_id}: ref count {count}, but {owners.get(block_id, 0)} owners found"
            )
        if self.tiers is not None:
            self.tiers.check_integrity(sum(len(blocks) for blocks, _ in self._swapped.values()))
