"""The paging core: pure-Python bookkeeping of KV blocks (no torch import).

The allocator hands out block ids, block tables map a sequence's tokens onto them, and
`memory` accounts what paging saves against a contiguous max-length reservation.
"""

from pagedkv.core.allocator import BlockAllocator
from pagedkv.core.block_table import BlockCopy, BlockTable, num_blocks_for
from pagedkv.core.memory import (
    KV_CACHE_DTYPES,
    MemoryReport,
    ModelSpec,
    check_kv_cache_dtype,
    kv_cache_dtype_bytes,
    memory_report,
)
from pagedkv.core.workload import DEFAULT_MIX, LengthBucket, SplitMix64, generate_lengths

__all__ = [
    "DEFAULT_MIX",
    "KV_CACHE_DTYPES",
    "BlockAllocator",
    "BlockCopy",
    "BlockTable",
    "LengthBucket",
    "MemoryReport",
    "ModelSpec",
    "SplitMix64",
    "check_kv_cache_dtype",
    "generate_lengths",
    "kv_cache_dtype_bytes",
    "memory_report",
    "num_blocks_for",
]
