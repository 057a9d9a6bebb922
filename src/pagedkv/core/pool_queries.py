"""What every block manager answers the same way: pool capacity, admission against the watermark, restores.

`KVBlockManager` (one table per sequence) and `HybridBlockManager` (one table per layer group per
sequence) keep their tables differently, but the scheduler asks both the same questions about the
one GPU pool and the host pool behind it. The answers that read only the allocator, the tables'
keys and the KV tiers live here, once, as the base class both derive from; so does the restore
bookkeeping (which restored blocks are copied before a step's kernels, which beside it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from pagedkv.core.group_tiers import group_key
from pagedkv.core.kv_tiers import TierCopies
from pagedkv.core.prefix_cache import BlockHash
from pagedkv.errors import require_positive_int


class PoolQueries:
    """What every block manager answers the same way from its allocators and tables (`_tables`, `_swapped`)."""

    @property
    def num_blocks(self) -> int:
        """Blocks in the GPU pool (shared by every table)."""
        return self.allocator.num_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by sequences (cached-but-unused blocks count as free)."""
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool held by sequences."""
        return self.num_used_blocks / self.num_blocks

    @property
    def num_free_swap_blocks(self) -> int:
        """Host blocks a swap-out could get (0 without a host pool); blocks freed this step count as free."""
        return self.tiers.host.num_available + self.tiers.host.num_releasing if self.tiers else 0

    def watermark_blocks(self, watermark: float) -> int:
        """Blocks that admission keeps free for running sequences to grow into."""
        return int(watermark * self.num_blocks)

    def has_table(self, seq_id: int) -> bool:
        """Whether `seq_id` holds GPU blocks."""
        return seq_id in self._tables

    def can_admit(self, num_new_blocks: int, watermark: float) -> bool:
        """Whether `num_new_blocks` fit while `watermark` of the pool stays free."""
        return self.num_free_blocks - num_new_blocks >= self.watermark_blocks(watermark)

    def is_swapped(self, seq_id: int) -> bool:
        """Whether the sequence's KV lives in the swap space."""
        return seq_id in self._swapped

    # KV tiers (None: none). A manager with them fills `_restoring_blocks` (GPU blocks whose restore copy runs
    # beside this step) and `_restoring_seqs` (sequences that wait a step for those blocks) as it admits.
    tiers = None

    def _init_write_through(self, enabled: bool) -> None:
        """Write-through (`EngineConfig.kv_offload_write_through`): blocks committed since the last steps, to copy
        to the host tier ahead of any eviction. Off (None) without a host tier that caches prefixes."""
        on = enabled and self.tiers is not None and self.tiers.cache_on_host
        self._write_through: deque | None = deque() if on else None

    def _queue_write_through(self, cache, keys: Sequence[BlockHash], group: int | None = None) -> None:
        """Newly committed `keys` of `cache` (their KV computed by a step already launched), to copy to the host
        tier from the next step on; `group`: the layer group whose cache it is (the tiers key its blocks apart)."""
        if self._write_through is not None:
            self._write_through.extend((cache, key, group) for key in keys)

    def _write_through_step(self, max_blocks: int) -> None:
        """Copy up to `max_blocks` of the committed blocks not on the host yet to free host blocks, oldest first,
        beside this step (`KVTiers.pre_spill`: a key on the host or loading is skipped; with no free host block
        the rest are dropped, and their eviction spills them as without write-through). A committed block was
        computed by a step whose kernels were launched before this one's copies, which wait for them."""
        queue = self._write_through
        if not queue:
            return
        candidates = []
        while queue and len(candidates) < max_blocks:
            cache, key, group = queue.popleft()
            block = cache.block_of(key)  # None: evicted since (it spilled then, or was dropped)
            if block is not None:
                candidates.append((key if group is None else group_key(key, group), block))
        if candidates and not self.tiers.pre_spill(candidates, max_blocks) and not self.tiers.host.allocator.num_free:
            queue.clear()  # the host tier is full: its LRU, not write-through, decides what it keeps

    def _init_restores(self, max_in_step_restore_blocks: int) -> None:
        """The restore state both managers keep (see `_queue_restore`)."""
        require_positive_int("max_in_step_restore_blocks", max_in_step_restore_blocks, allow_zero=True)
        self.max_in_step_restore_blocks = max_in_step_restore_blocks  # restored blocks a step copies before its kernels
        self._num_in_step_restore_blocks = 0  # restored this step before its kernels
        self._restoring_blocks: set[int] = set()
        self._restoring_seqs: set[int] = set()

    def begin_step(self) -> None:
        """A new step: last step's restores are ordered before it, so their sequences may compute."""
        if self.tiers is not None:
            self._restoring_blocks.clear()
            self._restoring_seqs.clear()
            self._num_in_step_restore_blocks = 0
            self.tiers.begin_step()

    def is_restoring(self, seq_id: int) -> bool:
        """Whether the sequence's blocks are being restored beside this step (it computes from the next)."""
        return seq_id in self._restoring_seqs

    def _queue_restore(self, seq_id: int, host_blocks: Sequence[int], gpu_blocks: Sequence[int]) -> None:
        """Queue the copies of a request's restored blocks: before the step's kernels while the step's in-step
        budget lasts (it computes in this step), else beside the step (it computes from the next)."""
        in_step = self._num_in_step_restore_blocks + len(gpu_blocks) <= self.max_in_step_restore_blocks
        self.tiers.restore(host_blocks, gpu_blocks, in_step=in_step)
        if in_step:
            self._num_in_step_restore_blocks += len(gpu_blocks)
        else:
            self._restoring_blocks.update(gpu_blocks)
            self._restoring_seqs.add(seq_id)

    def prefetch(self, token_ids: Sequence[int], known_keys: Sequence[BlockHash] = ()) -> bool:
        """Whether the prompt waits for disk loads (never, without KV tiers). `known_keys`: see `match_prefix`."""
        return False

    def recent_keys(self, limit: int) -> list[BlockHash]:
        """Up to `limit` keys of prefix blocks a prompt would hit here, the most recently cached first: what a
        replica tells the routers (`pagedkv.distributed.router`). The GPU prefix cache's; `KVBlockManager` adds
        its host tier's."""
        return self.prefix_cache.recent_keys(limit) if self.prefix_cache is not None else []

    def pre_spill(self) -> None:
        """Copy next evictions to the host tier ahead of time (no KV tiers: nothing to do)."""

    def take_tier_copies(self) -> TierCopies:
        """The KV tiers' copies for this step (empty without tiers)."""
        return self.tiers.take_copies() if self.tiers is not None else TierCopies()


#: Blocks per step the host tier copies ahead of their eviction (see `KVBlockManager.pre_spill`).
PRE_SPILL_BLOCKS = 32
#: Committed blocks per step write-through copies to the host tier (`PoolQueries._write_through_step`): 128
#: blocks of a Qwen3-0.6B-shape pool (16 tokens, 1.8 MB) are 235 MB, ~4 ms of PCIe at 55 GB/s, about one
#: decode step on a long context; a 16K-token prompt's 1,030 blocks are on the host a few steps after it.
WRITE_THROUGH_BLOCKS = 128
