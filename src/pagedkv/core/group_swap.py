"""Swap preemption of a sequence that holds a table per layer group (`HybridBlockManager`'s swap space).

Swapping out copies every group's held blocks (a sliding group's dropped entries hold none) to host
blocks from the KV tiers' host pool and frees the GPU tables; swapping in takes fresh GPU blocks for
them and rebuilds each group's table as it was. `group_tables.py` pairs the blocks and builds the
tables; this mixin is the policy around them: whether the host pool can take a sequence, and what a
swapped sequence costs to come back.
"""

from __future__ import annotations

from pagedkv.core.block_table import BlockCopy, num_blocks_for
from pagedkv.core.group_tables import held_blocks, pair_swap_out, rebuild_swapped_in
from pagedkv.errors import OutOfBlocksError


class GroupSwap:
    """Swap out and in for a manager with per-group tables (`_tables`, `_swapped`, `_num_tokens`, `tiers`)."""

    def blocks_to_resume(self, seq_id: int, num_tokens: int) -> int:
        """Blocks a swapped sequence takes to come back and reach `num_tokens` tokens (an upper bound)."""
        groups, _ = self._swapped[seq_id]
        total = 0
        for (table_tokens, _, cpu_blocks), group in zip(groups, self.groups):
            grow = num_blocks_for(num_tokens, self.block_size) - num_blocks_for(table_tokens, self.block_size)
            total += len(cpu_blocks) + max(0, grow)
        return total

    def can_swap_out(self, seq_id: int) -> bool:
        """Whether the host pool can take every held block of the sequence (evicting cached host blocks)."""
        return self.tiers is not None and sum(map(len, held_blocks(self._tables[seq_id]))) <= \
            self.tiers.host.num_available

    def swap_out(self, seq_id: int) -> list[BlockCopy]:
        """Move the sequence's held blocks to CPU blocks; returns (GPU src, CPU dst) copies to run before reuse."""
        tables = self._tables[seq_id]
        num_held = sum(map(len, held_blocks(tables)))
        if not self.can_swap_out(seq_id):
            raise OutOfBlocksError(num_held, self.num_free_swap_blocks)
        copies, groups = pair_swap_out(tables, self.tiers.allocate_swap(num_held))
        num_tokens = self._num_tokens[seq_id]
        self.free(seq_id)
        self._swapped[seq_id] = (groups, num_tokens)
        return copies

    def blocks_to_swap_in(self, seq_id: int) -> int:
        """GPU blocks a swap-in takes."""
        return sum(len(blocks) for _, _, blocks in self._swapped[seq_id][0])

    def swap_in(self, seq_id: int) -> list[BlockCopy]:
        """Bring a swapped sequence back to fresh GPU blocks; returns (CPU src, GPU dst) copies."""
        groups, num_tokens = self._swapped[seq_id]
        num_blocks = self.blocks_to_swap_in(seq_id)
        self._ensure_free(num_blocks)
        gpu_blocks = self.allocator.allocate(num_blocks) if num_blocks else []
        del self._swapped[seq_id]
        self._tables[seq_id], copies = rebuild_swapped_in(groups, self.groups, gpu_blocks, self.allocator,
                                                          self.block_size, self.max_num_tokens, self.null_block)
        self._num_tokens[seq_id] = num_tokens
        self._block_keys[seq_id] = []  # the next commit() re-hashes the full blocks, re-caching the held ones
        cpu_all = [b for _, _, blocks in groups for b in blocks]
        if cpu_all:
            self.tiers.free_swap(cpu_all)  # reusable from the next step, once this step's copy has read them
        return copies
