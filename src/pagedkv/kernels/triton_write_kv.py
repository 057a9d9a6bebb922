"""Triton `write_kv`: scatter new tokens' K and V into their pool slots.

One program stores one token's `[num_kv_heads, head_dim]` K and V. Its slot is read from
`slot_mapping`; a negative slot is a padding token (of a static or CUDA-graph batch) and the
program returns without storing. The slot's offset in the cache is computed in int64:
`block_id * stride_block` passes 2**31 elements in a pool of a few GiB. Key, value and
slot_mapping are read through their strides, so views of them are fine.

An FP8 cache is quantized in the same pass (`KV_FP8`): each head's values are divided by
its scale, clamped and rounded to FP8 in registers (`triton_fp8.quantize`), then stored as
one byte each. No second pass over the data, no staging buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.launch import bound
from pagedkv.kernels.triton_fp8 import fp8_format, quantize


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_key_t, stride_key_h, stride_key_d, stride_value_t, stride_value_h, stride_value_d, stride_slot,
    stride_cache_b, stride_cache_o, stride_cache_h,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    KV_FP8: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, FP8_MAX: tl.constexpr,
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
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    if KV_FP8:
        head_mask = heads < NUM_KV_HEADS
        k_scale = tl.load(k_scale_ptr + heads, mask=head_mask, other=1.0)[:, None]  # [HEADS_PAD, 1]
        v_scale = tl.load(v_scale_ptr + heads, mask=head_mask, other=1.0)[:, None]
        k = quantize(k, k_scale, MANT_BITS, MIN_EXP, FP8_MAX)
        v = quantize(v, v_scale, MANT_BITS, MIN_EXP, FP8_MAX)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def triton_write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, *, num_warps: int = 4, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """Launch one program per token; see `pagedkv.kernels.write_kv` for the contract (scales: FP8 caches)."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    mant_bits, min_exp, fp8_max = fp8_format(k_cache.dtype)
    kv_fp8 = k_scale is not None
    bound(_write_kv_kernel).config(
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), DIM_PAD=triton.next_power_of_2(head_dim),
        KV_FP8=kv_fp8, MANT_BITS=mant_bits, MIN_EXP=min_exp, FP8_MAX=fp8_max, num_warps=num_warps,
    ).launch((num_tokens, 1, 1),
             (key, value, k_cache, v_cache, slot_mapping, k_scale if kv_fp8 else key, v_scale if kv_fp8 else key),
             (*key.stride(), *value.stride(), slot_mapping.stride(0), k_cache.stride(0), k_cache.stride(1),
              k_cache.stride(2)))
