"""Triton paged prefill attention: causal varlen attention over each sequence's block table.

Sequence b's q_len new tokens (rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1 of `query`) sit
at kv positions ctx .. seq_len-1, where ctx = seq_len - q_len is its cached prefix. Their K/V
were already stored by `write_kv`, so prefix and new tokens are read the same way, through
the block table:

    kv positions   | 0 ............ ctx-1 | ctx ........ seq_len-1 |
                   |   cached prefix      |   new (query) tokens   |
    query tile t   rows t*BLOCK_M .. (t+1)*BLOCK_M-1, at positions ctx + row

Grid `(cdiv(max_seqlen_q, BLOCK_M), num_seqs, num_heads)`, FlashAttention-2 style: a program
holds BLOCK_M query rows of one head and streams BLOCK_N kv tokens at a time. Causal tile
skipping: tile t reads kv only up to ctx + (t+1)*BLOCK_M. Tiles wholly below the diagonal
(every query row sees every key) run without a mask; the diagonal tiles run masked. With a
sliding window every tile is masked and the loop starts at the window's first visible key.
GQA: the kv head of query head h is h // group; the group's programs read the same K/V tiles,
which mostly hit L2. (`triton_unified` packs the group into the rows instead.) Every tensor
but the caches is addressed through its strides.

FP8 caches (`KV_FP8`): tiles are converted to the query's dtype in registers; the program's
KV head's K scale is folded into `qk_scale` by the caller and its V scale into the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.triton_common import LOG2E, load_kv_tile, online_softmax_step, tile_scores
from pagedkv.kernels.launch import bound
from pagedkv.kernels.triton_fp8 import fp8_query, to_compute
from pagedkv.kernels.tuning import PrefillTuning


@triton.jit
def prefill_tiles(
    acc, l_i, m_i, q, pos_q, lo, hi,
    k_cache_ptr, v_cache_ptr, table_row, stride_bt_b, head_offset,
    qk_scale, soft_cap, sliding_window,
    stride_cache_b, stride_cache_o,
    DIM_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Fold kv positions [lo, hi) into the rows of `q` at kv positions `pos_q`, causal (and windowed) when MASKED."""
    dims = tl.arange(0, DIM_PAD)
    dim_mask = dims < HEAD_DIM
    for start in range(lo, hi, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        token_mask = tokens < hi
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table_row, stride_bt_b, tokens, token_mask, head_offset,
                            dims, dim_mask, stride_cache_b, stride_cache_o, BLOCK_SIZE)
        k, v = to_compute(k, q.dtype, KV_FP8), to_compute(v, q.dtype, KV_FP8)
        s = tile_scores(q, k, qk_scale, soft_cap, True, USE_SOFT_CAP, DOT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32
        if MASKED:
            visible = token_mask[None, :] & (tokens[None, :] <= pos_q[:, None])
            if USE_WINDOW:
                visible = visible & (tokens[None, :] > pos_q[:, None] - sliding_window)
            s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, True, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def causal_attend(acc, l_i, m_i, q, pos_q, first_pos, last_pos, sliding_window,
                  k_cache_ptr, v_cache_ptr, table_row, stride_bt_b, head_offset, qk_scale, soft_cap,
                  stride_cache_b, stride_cache_o,
                  DIM_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
                  KV_FP8: tl.constexpr):
    """All the kv tiles a query tile with rows at kv positions first_pos .. last_pos sees.

    Keys before first_pos are visible to every row: those tiles run unmasked; the diagonal
    tiles run masked. With a window every tile is masked, from the window's first key.
    """
    hi = last_pos + 1
    if USE_WINDOW:
        lo = tl.maximum(first_pos - sliding_window + 1, 0)
        acc, l_i, m_i = prefill_tiles(
            acc, l_i, m_i, q, pos_q, lo, hi, k_cache_ptr, v_cache_ptr, table_row, stride_bt_b, head_offset,
            qk_scale, soft_cap, sliding_window, stride_cache_b, stride_cache_o,
            DIM_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, True, True, USE_SOFT_CAP, KV_FP8)
    else:
        mid = first_pos // BLOCK_N * BLOCK_N  # unmasked tiles [0, mid), then masked tiles [mid, hi)
        acc, l_i, m_i = prefill_tiles(
            acc, l_i, m_i, q, pos_q, 0, mid, k_cache_ptr, v_cache_ptr, table_row, stride_bt_b, head_offset,
            qk_scale, soft_cap, sliding_window, stride_cache_b, stride_cache_o,
            DIM_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, False, False, USE_SOFT_CAP, KV_FP8)
        acc, l_i, m_i = prefill_tiles(
            acc, l_i, m_i, q, pos_q, mid, hi, k_cache_ptr, v_cache_ptr, table_row, stride_bt_b, head_offset,
            qk_scale, soft_cap, sliding_window, stride_cache_b, stride_cache_o,
            DIM_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, True, False, USE_SOFT_CAP, KV_FP8)
    return acc, l_i, m_i


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr, qk_scale, soft_cap, sliding_window,
    stride_q_t, stride_q_h, stride_q_d, stride_out_t, stride_out_h, stride_out_d,
    stride_cache_b, stride_cache_o, stride_cache_h, stride_bt_s, stride_bt_b, stride_lens, stride_cu,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, KV_FP8: tl.constexpr,
):
    # Launch the last (longest, under the causal mask) query tiles first, so the short ones fill the tail.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq * stride_cu).to(tl.int32)
    q_len = tl.load(cu_seqlens_q_ptr + (seq + 1) * stride_cu).to(tl.int32) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq * stride_lens).to(tl.int32)
    ctx = seq_len - q_len
    v_scale = 1.0
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr + head // GROUP)
        v_scale = tl.load(v_scale_ptr + head // GROUP)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, DIM_PAD)
    row_mask = rows < q_len
    dim_mask = dims < HEAD_DIM
    pos_q = ctx + rows  # [BLOCK_M] kv position of each query row
    token_rows = (q_start + rows).to(tl.int64)
    q_offsets = token_rows[:, None] * stride_q_t + head * stride_q_h + dims[None, :] * stride_q_d
    q = tl.load(q_ptr + q_offsets, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)  # [BLOCK_M, DIM_PAD]
    q = fp8_query(q, KV_FP8)  # fp16 for a bf16 query over FP8 tiles

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
    first_pos = ctx + tile * BLOCK_M
    acc, l_i, m_i = causal_attend(
        acc, l_i, m_i, q, pos_q, first_pos, tl.minimum(first_pos + BLOCK_M, seq_len) - 1, sliding_window,
        k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt_s, stride_bt_b,
        (head // GROUP).to(tl.int64) * stride_cache_h, qk_scale, soft_cap, stride_cache_b, stride_cache_o,
        DIM_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, USE_WINDOW, USE_SOFT_CAP, KV_FP8)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_FP8:
        o = o * v_scale
    out_offsets = token_rows[:, None] * stride_out_t + head * stride_out_h + dims[None, :] * stride_out_d
    tl.store(out_ptr + out_offsets, o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def triton_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             out: torch.Tensor, *, scale: float, max_seqlen_q: int, sliding_window: int | None,
                             soft_cap: float | None, tuning: PrefillTuning, k_scale: torch.Tensor | None = None,
                             v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the prefill kernel into `out`; see `pagedkv.kernels.paged_prefill_attention`."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_tokens == 0 or num_seqs == 0 or max_seqlen_q == 0:
        return out
    block_m, block_n, num_warps = tuning.tiles_for(head_dim)
    # No point in query tiles much taller than the longest chunk (decode-like chunks of a few tokens).
    block_m = min(block_m, max(16, triton.next_power_of_2(max_seqlen_q)))
    grid = (triton.cdiv(max_seqlen_q, block_m), num_seqs, num_heads)
    config = bound(_prefill_kernel).config(
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        USE_WINDOW=sliding_window is not None, USE_SOFT_CAP=soft_cap is not None, KV_FP8=k_scale is not None,
        num_warps=num_warps, num_stages=tuning.num_stages)
    config.launch(
        grid,
        (query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out,
         k_scale if k_scale is not None else seq_lens, v_scale if v_scale is not None else seq_lens),
        (float(scale if soft_cap is not None else scale * LOG2E), float(soft_cap or 1.0), int(sliding_window or 0),
         *query.stride(), *out.stride(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
         *block_tables.stride(), seq_lens.stride(0), cu_seqlens_q.stride(0)))
    return out
