"""Triton building blocks every paged attention kernel shares: gather a K/V tile, score it, fold it in, merge.

A tile is BLOCK_N consecutive kv positions of one sequence and one kv head. Its rows are
found through the block table one token at a time, so a tile may span several small pages:

    row(j) = block_tables[seq, j // BLOCK_SIZE] * stride_block + (j % BLOCK_SIZE) * stride_offset

in int64 (a pool of a few GiB passes 2**31 elements). Masked lanes are never dereferenced,
so slots past a sequence's length (NaN, another sequence's data) cannot leak in.

Scores are kept in log2 units (the scale is folded with log2(e)) and folded into a running
(max, sum, acc) triple by the online softmax, in fp32. A row that sees nothing in a tile
(past its window, a padding row, an empty sequence) stays NaN-free: its max is -inf and
the step uses 0 in its place.

In-kernel merge ("the last-arriving program reduces"). When several programs each hold a
normalised partial output and its log2-sum-exp for the same rows, each one stores its
partial, then counts itself in with one atomic add on a per-rows counter:

    store partial -> barrier -> atomic_add(counter, 1)   (acq_rel, gpu scope: the partial is
                                                          visible before the count)
    the program that reads n - 1 merges the n partials (loaded from L2, bypassing L1),
    writes the rows, and stores 0 back into the counter

so every counter is zero again when the kernel ends: no host memset, nothing for the host
to reset between CUDA-graph replays. This is the pattern of CUDA's threadFenceReduction
sample and cooperative-groups grid sync (barrier, then one thread's fenced atomic).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def tanh(x):
    """tanh from exp2 (portable across Triton versions and the interpreter); saturates cleanly to +-1."""
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, table_row, stride_bt_b, tokens, token_mask, head_offset, dims, dim_mask,
                 stride_cache_b, stride_cache_o, BLOCK_SIZE: tl.constexpr):
    """K and V `[BLOCK_N, DIM_PAD]` of kv positions `tokens` (masked lanes read as 0) through one table row."""
    block_ids = tl.load(table_row + (tokens // BLOCK_SIZE) * stride_bt_b, mask=token_mask, other=0).to(tl.int64)
    token_rows = block_ids * stride_cache_b + (tokens % BLOCK_SIZE) * stride_cache_o + head_offset  # [BLOCK_N]
    offsets = token_rows[:, None] + dims[None, :]  # [BLOCK_N, DIM_PAD] int64
    mask = token_mask[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + offsets, mask=mask, other=0.0)
    v = tl.load(v_cache_ptr + offsets, mask=mask, other=0.0)
    return k, v


@triton.jit
def tile_scores(q, k, qk_scale, soft_cap, USE_DOT: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """Scores `[M, BLOCK_N]` in log2 units: scale * q.k, or cap * tanh(scale * q.k / cap) with a soft cap."""
    if USE_DOT:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    else:
        s = tl.sum(q[:, None, :].to(tl.float32) * k[None, :, :].to(tl.float32), axis=2)
    if USE_SOFT_CAP:
        s = soft_cap * tanh(s * qk_scale / soft_cap) * 1.4426950408889634
    else:
        s = s * qk_scale
    return s


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold a tile of scores `s` (-inf where hidden) and its values into (running max, running sum, acc)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if USE_DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    else:
        pv = tl.sum(p[:, :, None] * v[None, :, :].to(tl.float32), axis=1)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def arrive(counter_ptr):
    """Count this program's stored partial in; returns how many had arrived before it."""
    tl.debug_barrier()  # every thread's partial stores are issued before thread 0's release
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")


@triton.jit
def merge_partials(partial_out_ptr, partial_lse_ptr, num_parts, first_row, part_stride, first_extra, group_stride,
                   GROUP: tl.constexpr, GROUP_P2: tl.constexpr, DIM_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Log-sum-exp merge of `num_parts` partials for GROUP rows; returns `[GROUP_P2, DIM_PAD]` fp32.

    Row g of part c lives at partial row `first_row + c * part_stride + (c == 0) * first_extra +
    g * group_stride` (rows of DIM_PAD floats; one lse per row). Parts with lse = -inf weigh
    nothing; rows whose every part is -inf come out as zeros. One online pass, CHUNK parts
    at a time, loaded through L2 (.cg): they were written by other programs of this launch.
    """
    groups = tl.arange(0, GROUP_P2)
    dims = tl.arange(0, DIM_PAD)
    m = tl.full([GROUP_P2], float("-inf"), dtype=tl.float32)
    total = tl.zeros([GROUP_P2], dtype=tl.float32)
    acc = tl.zeros([GROUP_P2, DIM_PAD], dtype=tl.float32)
    for first in range(0, num_parts, CHUNK):
        parts = first + tl.arange(0, CHUNK)
        extra = tl.where(parts == 0, first_extra, 0)
        rows = first_row + parts[:, None].to(tl.int64) * part_stride + extra[:, None] \
            + groups[None, :] * group_stride  # [CHUNK, GROUP_P2]
        valid = (parts < num_parts)[:, None] & (groups < GROUP)[None, :]
        lse = tl.load(partial_lse_ptr + rows, mask=valid, other=float("-inf"), cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        weights = tl.exp2(lse - m_safe[None, :])  # [CHUNK, GROUP_P2]
        partial = tl.load(partial_out_ptr + rows[:, :, None] * DIM_PAD + dims[None, None, :],
                          mask=valid[:, :, None], other=0.0, cache_modifier=".cg")  # [CHUNK, GROUP_P2, DIM_PAD]
        acc = acc * alpha[:, None] + tl.sum(partial * weights[:, :, None], axis=0)
        total = total * alpha + tl.sum(weights, axis=0)
        m = m_new
    return acc / tl.where(total > 0, total, 1.0)[:, None]


def merge_group_rows(group: int) -> int:
    """GROUP_P2 of `merge_partials`: the group padded to a power of 2, at least 2 (no size-1 tensor dims)."""
    return max(2, triton.next_power_of_2(group))


def merge_chunk(group_p2: int, dim_pad: int) -> int:
    """Parts merged per step: a `[CHUNK, GROUP_P2, DIM_PAD]` fp32 tile of at most 4096 elements.

    32 registers per thread at 4 warps; 8192 raised the split decode kernel from 108 to 138
    registers (sm_90, Triton 3.6), and so from 4 to 3 programs per SM.
    """
    return max(1, min(32, 4096 // (group_p2 * dim_pad)))


@triton.jit
def store_split_part(o, m_i, l_i, partial_out_ptr, partial_lse_ptr, counters_ptr, out_ptr, seq, first_head,
                     num_heads, split, num_splits, counter_index, stride_out_s, stride_out_h, stride_out_d,
                     ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, ROWS_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                     DIM_PAD: tl.constexpr, MERGE_IN_KERNEL: tl.constexpr, MERGE_CHUNK: tl.constexpr):
    """Store one split's normalised rows `o` and log2-sum-exp; with MERGE_IN_KERNEL the last split to arrive merges.

    Rows are query heads [first_head, first_head + ROWS) of sequence `seq`. Layout (shared with
    the merge launch): partial_out [num_seqs, num_heads, num_splits, DIM_PAD] fp32,
    partial_lse [num_seqs, num_heads, num_splits]. `counter_index` names the rows' counter.
    """
    rows = tl.arange(0, ROWS_PAD)
    dims = tl.arange(0, DIM_PAD)
    row_mask = rows < ROWS
    dim_mask = dims < HEAD_DIM
    has_any = l_i > 0
    slot = (seq.to(tl.int64) * num_heads + first_head + rows) * num_splits + split  # [ROWS_PAD]
    tl.store(partial_out_ptr + slot[:, None] * DIM_PAD + dims[None, :], o, mask=row_mask[:, None] & dim_mask[None, :])
    lse = tl.where(has_any, m_i + tl.log2(tl.where(has_any, l_i, 1.0)), float("-inf"))
    tl.store(partial_lse_ptr + slot, lse, mask=row_mask)
    if MERGE_IN_KERNEL:
        counter = counters_ptr + counter_index
        if arrive(counter) == num_splits - 1:
            tl.debug_barrier()
            merged = merge_partials(partial_out_ptr, partial_lse_ptr, num_splits,
                                    (seq.to(tl.int64) * num_heads + first_head) * num_splits, 1, 0, num_splits,
                                    ROWS, ROWS_P2, DIM_PAD, MERGE_CHUNK)  # [ROWS_P2, DIM_PAD]
            group_rows = tl.arange(0, ROWS_P2)
            offsets = seq.to(tl.int64) * stride_out_s + (first_head + group_rows)[:, None] * stride_out_h \
                + dims[None, :] * stride_out_d
            tl.store(out_ptr + offsets, merged.to(out_ptr.dtype.element_ty),
                     mask=(group_rows < ROWS)[:, None] & dim_mask[None, :])
            tl.store(counter, 0)


def split_partials(num_seqs: int, num_heads: int, num_splits: int, dim_pad: int, device) -> tuple:
    """Empty fp32 (partial_out, partial_lse) in `store_split_part`'s layout."""
    import torch

    return (torch.empty(num_seqs, num_heads, num_splits, dim_pad, dtype=torch.float32, device=device),
            torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=device))
