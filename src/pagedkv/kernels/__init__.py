"""Paged attention kernels: K/V live in a pool of fixed-size blocks, read through block tables.

- `KVPool`: every layer's `[num_blocks, block_size, num_kv_heads, head_dim]` K and V caches.
- `write_kv`: scatter new tokens' K/V into their slots.
- `paged_decode_attention`: one query per sequence; GQA-grouped, split-KV (flash-decoding),
  or the tiles schedule (`DecodeTuning(schedule="tiles")`).
- `paged_prefill_attention`: causal varlen attention over a cached prefix plus the new chunk.
- `paged_attention`: a mixed step (decode rows and prefill chunks) in one launch.
- `paged_decode_write_attention`: a decode step's K/V write and attention in one launch.
- `KernelWorkspace`: the self-resetting counters of the kernels that merge split-KV in-kernel.

Each kernel has a Triton implementation (CUDA, or CPU under TRITON_INTERPRET=1), a fast torch
path (gather + SDPA, what CPU runs) and a plain looped reference that defines the semantics.
"""

from pagedkv.kernels.ops import (
    paged_attention,
    paged_decode_attention,
    paged_decode_write_attention,
    paged_prefill_attention,
    resolve_backend,
    write_kv,
)
from pagedkv.kernels.pool import KVPool
from pagedkv.kernels.reference import (
    reference_decode_attention,
    reference_paged_attention,
    reference_prefill_attention,
    reference_write_kv,
)
from pagedkv.kernels.tuning import DecodeTuning, PrefillTuning, UnifiedTuning, choose_num_splits
from pagedkv.kernels.workspace import KernelWorkspace

__all__ = [
    "DecodeTuning",
    "KVPool",
    "KernelWorkspace",
    "PrefillTuning",
    "UnifiedTuning",
    "choose_num_splits",
    "paged_attention",
    "paged_decode_attention",
    "paged_decode_write_attention",
    "paged_prefill_attention",
    "reference_decode_attention",
    "reference_paged_attention",
    "reference_prefill_attention",
    "reference_write_kv",
    "resolve_backend",
    "write_kv",
]
