"""Triton paged decode attention: one query token per sequence, GQA-grouped, split-KV.

Grid `(num_seqs, num_kv_heads, num_splits)`. One program owns one kv head of one sequence
and all `group = num_heads // num_kv_heads` query heads that read it, so each K/V tile is
loaded from memory once for the whole group:

    q      [GROUP_PAD, DIM_PAD]   the group's queries (rows >= group and dims >= head_dim are 0)
    k, v   [BLOCK_N, DIM_PAD]     BLOCK_N tokens, gathered row by row through the block table
    s      [GROUP_PAD, BLOCK_N]   tl.dot(q, k^T) when the group is large (M padded to 16),
                                  else a broadcast multiply-sum

(`triton_common` has the tile gather, the scores and the online softmax.)

Split-KV: the sequence's visible kv range is cut into `num_splits` pieces of whole tiles;
split `s` writes its normalised partial output and log2-sum-exp. The partials are merged
either by `_merge_kernel`, a second launch, or (`merge="in_kernel"`) by the last split
program of each (sequence, kv head) to arrive, counted with an atomic counter that it
resets. An empty split (a short sequence in a batch split for a long one) writes lse =
-inf and weighs nothing in the merge; a sequence of length 0 comes out as zeros.

Every tensor but the caches is addressed through its strides, so views (a query sliced
from a fused QKV projection, `block_tables[:, ::2]`, `seq_lens[::2]`) read the right memory.

FP8 caches (`KV_FP8`): tiles are loaded as bytes and converted to the query's dtype in
registers (exact); the program's one KV head has one K scale, folded into the softmax scale,
and one V scale, applied to the normalised output (and so to every split's partial, which
keeps the merge linear).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.triton_common import (
    LOG2E,
    load_kv_tile,
    merge_chunk,
    merge_group_rows,
    online_softmax_step,
    store_split_part,
    tile_scores,
)
from pagedkv.kernels.launch import bound
from pagedkv.kernels.triton_fp8 import fp8_query, to_compute
from pagedkv.kernels.tuning import DecodeTuning


@triton.jit
def split_range(seq_len, sliding_window, num_splits, split, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr):
    """This split's piece [lo, hi) of the visible range [kv_start, seq_len), in whole BLOCK_N tiles."""
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(seq_len - sliding_window, 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - kv_start, num_splits), BLOCK_N) * BLOCK_N
    lo = kv_start + split * split_len
    return lo, tl.minimum(lo + split_len, seq_len)


@triton.jit
def attend_range(q, m_i, l_i, acc, lo, hi, k_cache_ptr, v_cache_ptr, table_row, stride_bt_b, head_offset, dims,
                 dim_mask, stride_cache_b, stride_cache_o, qk_scale, soft_cap, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr):
    """Fold kv positions [lo, hi) of one sequence's pages into the softmax state of the rows of `q`."""
    for start in range(lo, hi, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        token_mask = tokens < hi
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table_row, stride_bt_b, tokens, token_mask, head_offset,
                            dims, dim_mask, stride_cache_b, stride_cache_o, BLOCK_SIZE)
        k, v = to_compute(k, q.dtype, KV_FP8), to_compute(v, q.dtype, KV_FP8)
        s = tile_scores(q, k, qk_scale, soft_cap, USE_DOT, USE_SOFT_CAP, DOT_PRECISION)
        s = tl.where(token_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, USE_DOT, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, partial_out_ptr, partial_lse_ptr, counters_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale, soft_cap, sliding_window, num_splits,
    stride_q_s, stride_q_h, stride_q_d, stride_out_s, stride_out_h, stride_out_d,
    stride_cache_b, stride_cache_o, stride_cache_h, stride_bt_s, stride_bt_b, stride_lens,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, IS_SPLIT: tl.constexpr,
    MERGE_IN_KERNEL: tl.constexpr, MERGE_CHUNK: tl.constexpr, KV_FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    v_scale = 1.0
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)

    # The visible range [kv_start, seq_len), then this split's piece [lo, hi) of it.
    seq_len = tl.load(seq_lens_ptr + seq * stride_lens).to(tl.int32)
    lo, hi = split_range(seq_len, sliding_window, num_splits, split, BLOCK_N, USE_WINDOW)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_DIM
    out_mask = row_mask[:, None] & dim_mask[None, :]
    heads = kv_head * GROUP + rows  # [GROUP_PAD] query heads of this kv head
    q_offsets = seq.to(tl.int64) * stride_q_s + heads[:, None] * stride_q_h + dims[None, :] * stride_q_d
    q = tl.load(q_ptr + q_offsets, mask=out_mask, other=0.0)  # [GROUP_PAD, DIM_PAD]
    q = fp8_query(q, KV_FP8)  # fp16 for a bf16 query over FP8 tiles

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)  # running max, log2 units
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    head_offset = kv_head.to(tl.int64) * stride_cache_h

    m_i, l_i, acc = attend_range(q, m_i, l_i, acc, lo, hi, k_cache_ptr, v_cache_ptr, table_row, stride_bt_b,
                                 head_offset, dims, dim_mask, stride_cache_b, stride_cache_o, qk_scale, soft_cap,
                                 BLOCK_SIZE, BLOCK_N, USE_DOT, USE_SOFT_CAP, DOT_PRECISION, KV_FP8)

    has_any = l_i > 0
    o = acc / tl.where(has_any, l_i, 1.0)[:, None]
    if KV_FP8:
        o = o * v_scale
    out_rows = seq.to(tl.int64) * stride_out_s + heads * stride_out_h  # [GROUP_PAD]
    if IS_SPLIT:
        store_split_part(o, m_i, l_i, partial_out_ptr, partial_lse_ptr, counters_ptr, out_ptr, seq, kv_head * GROUP,
                         GROUP * tl.num_programs(1), split, num_splits, seq * tl.num_programs(1) + kv_head,
                         stride_out_s, stride_out_h, stride_out_d, GROUP, GROUP_PAD, GROUP_P2, HEAD_DIM, DIM_PAD,
                         MERGE_IN_KERNEL, MERGE_CHUNK)
    else:
        tl.store(out_ptr + out_rows[:, None] + dims[None, :] * stride_out_d, o.to(out_ptr.dtype.element_ty),
                 mask=out_mask)


@triton.jit
def _merge_kernel(
    partial_out_ptr, partial_lse_ptr, out_ptr, num_splits,
    stride_out_s, stride_out_h, stride_out_d,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, DIM_PAD)
    base = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_splits
    # Pass 1: the largest log2-sum-exp over all splits (SPLITS_PAD floats, cheap).
    splits = tl.arange(0, SPLITS_PAD)
    lse = tl.load(partial_lse_ptr + base + splits, mask=splits < num_splits, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    # All splits empty (seq_len 0): weigh nothing, write zeros rather than NaN.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    total = tl.sum(tl.exp2(lse - lse_max), axis=0)
    # Pass 2: the weighted sum of partial outputs, SPLIT_CHUNK splits at a time so that a
    # 100-way split does not hold a [100, head_dim] fp32 tile in registers.
    acc = tl.zeros([DIM_PAD], dtype=tl.float32)
    for first in range(0, num_splits, SPLIT_CHUNK):
        chunk = first + tl.arange(0, SPLIT_CHUNK)
        chunk_mask = chunk < num_splits
        weights = tl.exp2(tl.load(partial_lse_ptr + base + chunk, mask=chunk_mask, other=float("-inf")) - lse_max)
        partial = tl.load(partial_out_ptr + (base + chunk)[:, None] * DIM_PAD + dims[None, :],
                          mask=chunk_mask[:, None], other=0.0)  # [SPLIT_CHUNK, DIM_PAD]
        acc += tl.sum(partial * weights[:, None], axis=0)
    o = acc / tl.where(total > 0, total, 1.0)
    out_offsets = seq.to(tl.int64) * stride_out_s + head * stride_out_h + dims * stride_out_d
    tl.store(out_ptr + out_offsets, o.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def group_padding(group: int, use_dot: bool) -> int:
    """Rows of the query tile: tl.dot needs M >= 16; the multiply-sum only a power of 2."""
    return max(16, triton.next_power_of_2(group)) if use_dot else triton.next_power_of_2(group)


def triton_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, *,
                            scale: float, num_splits: int, sliding_window: int | None, soft_cap: float | None,
                            tuning: DecodeTuning, counters: torch.Tensor | None = None,
                            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the decode kernel (and the merge kernel when `num_splits > 1`) into `out`.

    `counters` (`merge="in_kernel"` only): at least `num_seqs * num_kv_heads` int32 zeros,
    left zero by the kernel; allocated per call when None. `k_scale`/`v_scale`: FP8 caches.
    """
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    use_dot = group >= tuning.dot_min_group
    group_p2, dim_pad = merge_group_rows(group), triton.next_power_of_2(head_dim)
    is_split = num_splits > 1
    fp8 = k_scale is not None
    merge_in_kernel = is_split and tuning.merge == "in_kernel"
    if is_split:
        partial_out = torch.empty(num_seqs, num_heads, num_splits, dim_pad, dtype=torch.float32, device=query.device)
        partial_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        partial_out = partial_lse = out  # unused by the kernel when IS_SPLIT is False
    if merge_in_kernel and counters is None:
        counters = torch.zeros(num_seqs * num_kv_heads, dtype=torch.int32, device=query.device)
    config = bound(_decode_kernel).config(
        GROUP=group, GROUP_PAD=group_padding(group, use_dot), GROUP_P2=group_p2, HEAD_DIM=head_dim,
        DIM_PAD=dim_pad, BLOCK_SIZE=block_size, BLOCK_N=tuning.block_n_for(head_dim, fp8), USE_DOT=use_dot,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        USE_WINDOW=sliding_window is not None, USE_SOFT_CAP=soft_cap is not None, IS_SPLIT=is_split,
        MERGE_IN_KERNEL=merge_in_kernel, MERGE_CHUNK=merge_chunk(group_p2, dim_pad), KV_FP8=fp8,
        num_warps=tuning.num_warps_for(fp8), num_stages=tuning.num_stages)
    config.launch(
        (num_seqs, num_kv_heads, num_splits),
        (query, k_cache, v_cache, block_tables, seq_lens, out, partial_out, partial_lse,
         counters if merge_in_kernel else seq_lens, k_scale if k_scale is not None else seq_lens,
         v_scale if v_scale is not None else seq_lens),
        (float(scale if soft_cap is not None else scale * LOG2E), float(soft_cap or 1.0), int(sliding_window or 0),
         num_splits, *query.stride(), *out.stride(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
         *block_tables.stride(), seq_lens.stride(0)))
    if is_split and not merge_in_kernel:
        bound(_merge_kernel).config(
            HEAD_DIM=head_dim, DIM_PAD=dim_pad, SPLITS_PAD=triton.next_power_of_2(num_splits), SPLIT_CHUNK=16,
            num_warps=4,
        ).launch((num_seqs, num_heads, 1), (partial_out, partial_lse, out), (num_splits, *out.stride()))
    return out
