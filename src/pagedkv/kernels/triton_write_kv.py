"""Triton `write_kv`: scatter new tokens' K and V into their pool slots.

One program stores one token's `[num_kv_heads, head_dim]` K and V. Its slot is read from
`slot_mapping`; a negative slot is a padding token (of a static or CUDA-graph batch) and the
program returns without storing. The slot's offset in the cache is computed in int64:
`block_id * stride_block` passes 2**31 elements in a pool of a few GiB. Key, value and
slot_mapping are read through their strides, so views of them are fine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_key_t, stride_key_h, stride_key_d, stride_value_t, stride_value_h, stride_value_d, stride_slot,
    stride_cache_b, stride_cache_o, stride_cache_h,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token * stride_slot).to(tl.int64)
    if slot < 0:
        return
    block_id = slot // BLOCK_SIZE
    block_offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)  # [HEADS_PAD, DIM_PAD]
    src_k = key_ptr + token.to(tl.int64) * stride_key_t + heads[:, None] * stride_key_h + dims[None, :] * stride_key_d
    src_v = value_ptr + token.to(tl.int64) * stride_value_t + heads[:, None] * stride_value_h \
        + dims[None, :] * stride_value_d
    dst = block_id * stride_cache_b + block_offset * stride_cache_o + heads[:, None] * stride_cache_h + dims[None, :]
    tl.store(k_cache_ptr + dst, tl.load(src_k, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(src_v, mask=mask), mask=mask)


def triton_write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, *, num_warps: int = 4) -> None:
    """Launch one program per token; see `pagedkv.kernels.write_kv` for the contract."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), slot_mapping.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), DIM_PAD=triton.next_power_of_2(head_dim),
        num_warps=num_warps,
    )
