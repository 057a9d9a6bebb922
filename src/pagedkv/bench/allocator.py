"""`pagedkv bench allocator`: allocator throughput for small and huge pools (O(1) check)."""

from __future__ import annotations

import time

from pagedkv.core.allocator import BlockAllocator


def _pairs_per_second(num_blocks: int, num_pairs: int) -> float:
    allocator = BlockAllocator(num_blocks)
    allocate_one, free_one = allocator.allocate_one, allocator.free_one
    # Hold half the pool so the free list is neither full nor empty, as in a running engine.
    held = allocator.allocate(max(1, num_blocks // 2))
    start = time.perf_counter()
    for _ in range(num_pairs):
        free_one(allocate_one())
    elapsed = time.perf_counter() - start
    allocator.free(held)
    allocator.check_integrity()
    return num_pairs / elapsed


def _list_pairs_per_second(num_blocks: int, num_pairs: int) -> float:
    allocator = BlockAllocator(num_blocks)
    allocate, free = allocator.allocate, allocator.free
    start = time.perf_counter()
    for _ in range(num_pairs):
        free(allocate(1))
    elapsed = time.perf_counter() - start
    allocator.check_integrity()
    return num_pairs / elapsed


def _multi_allocs_per_second(num_blocks: int, blocks_per_alloc: int, num_allocs: int) -> float:
    allocator = BlockAllocator(num_blocks)
    allocate, free = allocator.allocate, allocator.free
    start = time.perf_counter()
    for _ in range(num_allocs):
        free(allocate(blocks_per_alloc))
    elapsed = time.perf_counter() - start
    allocator.check_integrity()
    return num_allocs / elapsed


def run(pool_sizes=(1_024, 1_048_576), num_pairs: int = 1_000_000, blocks_per_alloc: int = 16,
        repeats: int = 3) -> dict:
    """Measure each figure `repeats` times per pool size and keep the best (least disturbed) run."""
    rows = []
    for num_blocks in pool_sizes:
        rows.append({
            "num_blocks": num_blocks,
            "single_pairs_per_s": max(_pairs_per_second(num_blocks, num_pairs) for _ in range(repeats)),
            "list_api_pairs_per_s": max(_list_pairs_per_second(num_blocks, num_pairs // 2) for _ in range(repeats)),
            "multi_allocs_per_s": max(
                _multi_allocs_per_second(num_blocks, blocks_per_alloc, num_pairs // 4) for _ in range(repeats)
            ),
            "blocks_per_multi_alloc": blocks_per_alloc,
        })
    small, large = rows[0], rows[-1]
    return {
        "benchmark": "allocator",
        "rows": rows,
        "large_over_small_single": large["single_pairs_per_s"] / small["single_pairs_per_s"],
        "target_pairs_per_s": 2_000_000,
    }
