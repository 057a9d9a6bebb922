"""A sequence's tables across layer groups: the blocks they hold, swapping them out and back, checking them.

A sequence of a hybrid model holds a table per layer group. A sliding group's table leads with
null entries (blocks that left the window, `SlidingBlockTable`), which hold nothing and are
not copied. Swapping out records, per group, what the table needs to come back exactly as it
was: its token count, its dropped entries, and the host blocks of its held ones in logical
order. Swapping in gives each group fresh GPU blocks for those and rebuilds its table.

    group   table tokens   dropped   held GPU blocks    ->  host blocks
    0 full      70            0      [3, 9, 12, 40, 41]      [0, 1, 2, 3, 4]
    1 W=32      70            2      [7, 8, 15]              [5, 6, 7]

The block manager owns the pools and the tables; these functions only pair blocks with
blocks, build tables and count owners, so the manager's methods read as the policy they are.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.core.block_table import BlockCopy, BlockTable
from pagedkv.core.kv_groups import KVGroupSpec
from pagedkv.core.sliding_table import SlidingBlockTable

#: Per group: (table tokens, dropped entries, host blocks in logical order).
SwappedGroup = tuple[int, int, list[int]]


def held_blocks(tables: Sequence[BlockTable]) -> list[list[int]]:
    """Each group's owned blocks in logical order (a sliding table's null entries left out)."""
    return [t.held_block_ids if isinstance(t, SlidingBlockTable) else list(t.block_ids) for t in tables]


def pair_swap_out(tables: Sequence[BlockTable], cpu_blocks: list[int]) -> tuple[list[BlockCopy], list[SwappedGroup]]:
    """(GPU src, CPU dst) copies for every held block, and what each group needs to come back."""
    copies: list[BlockCopy] = []
    groups: list[SwappedGroup] = []
    cursor = 0
    for table, blocks in zip(tables, held_blocks(tables)):
        mine = cpu_blocks[cursor:cursor + len(blocks)]
        cursor += len(blocks)
        copies += [BlockCopy(gpu, cpu) for gpu, cpu in zip(blocks, mine)]
        groups.append((table.num_tokens, getattr(table, "num_dropped", 0), mine))
    return copies, groups


def rebuild_swapped_in(swapped: Sequence[SwappedGroup], layout_groups: Sequence[KVGroupSpec], gpu_blocks: list[int],
                       allocator, block_size: int, max_num_tokens: int | None,
                       null_block: int) -> tuple[list[BlockTable], list[BlockCopy]]:
    """Each group's table rebuilt on `gpu_blocks` (owned, in order), and the (CPU src, GPU dst) copies."""
    tables: list[BlockTable] = []
    copies: list[BlockCopy] = []
    cursor = 0
    for (table_tokens, num_dropped, cpu), group in zip(swapped, layout_groups):
        mine = gpu_blocks[cursor:cursor + len(cpu)]
        cursor += len(cpu)
        copies += [BlockCopy(c, g) for c, g in zip(cpu, mine)]
        if group.is_sliding:
            table = SlidingBlockTable(allocator, block_size, max_num_tokens)
            table.restore(table_tokens, [null_block] * num_dropped + mine, num_dropped)
        else:
            table = BlockTable(allocator, block_size, max_num_tokens)
            table.block_ids, table.num_tokens = mine, table_tokens
        tables.append(table)
    return tables, copies


def count_table_owners(tables_by_seq: dict[int, list[BlockTable]], layout_groups: Sequence[KVGroupSpec],
                       num_tokens: dict[int, int], null_block: int, block_size: int,
                       max_query_tokens: int) -> dict[int, int]:
    """Assert every sequence's tables are well formed; returns how many tables hold each block.

    Held entries are never the null block; a sliding table leads with exactly its dropped
    null entries and holds at most its group's bound; full tables agree on the token count.
    """
    owners: dict[int, int] = {}
    for seq_id, tables in tables_by_seq.items():
        for table, group, held in zip(tables, layout_groups, held_blocks(tables)):
            assert null_block not in held, f"seq {seq_id}: a held entry is the null block"
            if group.is_sliding:
                assert all(b == null_block for b in table.block_ids[:table.num_dropped])
                bound = group.max_blocks_per_seq(table.num_tokens, block_size, max_query_tokens)
                assert table.num_held <= bound, f"seq {seq_id}: {table.num_held} blocks > bound {bound}"
            else:
                assert table.num_tokens == num_tokens[seq_id], f"seq {seq_id}: full groups disagree"
            for block_id in held:
                owners[block_id] = owners.get(block_id, 0) + 1
    return owners
