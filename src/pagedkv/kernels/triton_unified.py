"""Unified varlen paged attention: decode rows and prefill chunks of one step in ONE launch.

As in vLLM's Triton unified attention, every sequence of the batch is a chunk of q_len new
tokens (1 for a decode row) at the end of its seq_len kv positions, and one kernel serves
them all. A program owns one query tile of one sequence and one kv head; its BLOCK_M rows
pack BLOCK_Q = BLOCK_M // group query tokens x the GQA group, token-major:

    row r  ->  query token tile * BLOCK_Q + r // group,  query head kv_head * group + r % group

so each K/V tile is loaded once for the whole group (a decode row fills `group` rows; a
prefill tile fills all of them). The rest is the prefill kernel's causal loop
(`triton_prefill.causal_attend`): unmasked tiles below the diagonal, masked ones on it.

Finding a tile's sequence. Sequence b's tiles start at global tile index

    tile_start(b) = cu_seqlens_q[b] // BLOCK_Q + b

which is strictly increasing and leaves each sequence at least cdiv(q_len_b, BLOCK_Q) tiles
(floor((a + n) / B) - floor(a / B) + 1 >= ceil(n / B)). A program binary-searches
cu_seqlens_q for the last b with tile_start(b) <= its tile, in ceil(log2(num_seqs)) steps
that are host ints. The grid is (num_tokens // BLOCK_Q + num_seqs, num_kv_heads): host ints
fixed for a captured shape, never a device read, so a mixed step captures in a CUDA graph.
Spare tiles (past a sequence's last token) return at once. Programs run from the last tile
to the first: the engine puts prefill chunks after the decode rows, so the long programs
start first and the short decode ones fill in behind them.

FP8 caches (`KV_FP8`): as in the prefill kernel, the program's one KV head's K scale goes
into `qk_scale` and its V scale onto the output; tiles convert in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.triton_common import LOG2E
from pagedkv.kernels.triton_fp8 import fp8_query
from pagedkv.kernels.triton_prefill import causal_attend
from pagedkv.kernels.tuning import UnifiedTuning


@triton.jit
def _find_sequence(cu_seqlens_q_ptr, stride_cu, tile, num_seqs, search_steps, BLOCK_Q: tl.constexpr):
    """The last sequence b in [0, num_seqs) with cu_seqlens_q[b] // BLOCK_Q + b <= tile.

    Invariant: the answer is in [lo, hi). Once hi = lo + 1, mid = lo and lo stays, so a
    fixed number of steps (ceil(log2(num_seqs))) is exact with no branch.
    """
    lo = tl.program_id(1) * 0  # an int32 tensor, so the loop carries one type
    hi = lo + num_seqs
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        start = tl.load(cu_seqlens_q_ptr + mid * stride_cu).to(tl.int32) // BLOCK_Q + mid
        go_right = start <= tile
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit
def _unified_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr, qk_scale, soft_cap, sliding_window, num_seqs, search_steps,
    stride_q_t, stride_q_h, stride_q_d, stride_out_t, stride_out_h, stride_out_d,
    stride_cache_b, stride_cache_o, stride_cache_h, stride_bt_s, stride_bt_b, stride_lens, stride_cu,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, KV_FP8: tl.constexpr,
):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(cu_seqlens_q_ptr, stride_cu, tile, num_seqs, search_steps, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq * stride_cu).to(tl.int32)
    q_len = tl.load(cu_seqlens_q_ptr + (seq + 1) * stride_cu).to(tl.int32) - q_start
    local_tile = tile - (q_start // BLOCK_Q + seq)
    if local_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq * stride_lens).to(tl.int32)
    ctx = seq_len - q_len
    v_scale = 1.0
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)

    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, DIM_PAD)
    q_tokens = local_tile * BLOCK_Q + rows // GROUP  # [BLOCK_M] token of each row within the chunk
    heads = kv_head * GROUP + rows % GROUP
    row_mask = (rows < BLOCK_Q * GROUP) & (q_tokens < q_len)
    dim_mask = dims < HEAD_DIM
    mask = row_mask[:, None] & dim_mask[None, :]
    token_rows = (q_start + q_tokens).to(tl.int64)
    q = tl.load(q_ptr + token_rows[:, None] * stride_q_t + heads[:, None] * stride_q_h + dims[None, :] * stride_q_d,
                mask=mask, other=0.0)  # [BLOCK_M, DIM_PAD]
    q = fp8_query(q, KV_FP8)  # fp16 for a bf16 query over FP8 tiles

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
    first_pos = ctx + local_tile * BLOCK_Q
    acc, l_i, m_i = causal_attend(
        acc, l_i, m_i, q, ctx + q_tokens, first_pos, tl.minimum(first_pos + BLOCK_Q, seq_len) - 1, sliding_window,
        k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt_s, stride_bt_b,
        kv_head.to(tl.int64) * stride_cache_h, qk_scale, soft_cap, stride_cache_b, stride_cache_o,
        DIM_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, USE_WINDOW, USE_SOFT_CAP, KV_FP8)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_FP8:
        o = o * v_scale
    out_offsets = token_rows[:, None] * stride_out_t + heads[:, None] * stride_out_h + dims[None, :] * stride_out_d
    tl.store(out_ptr + out_offsets, o.to(out_ptr.dtype.element_ty), mask=mask)


def unified_grid(num_tokens: int, num_seqs: int, num_kv_heads: int, block_q: int) -> tuple[int, int]:
    """Query tiles x kv heads: enough tiles for any split of num_tokens among num_seqs sequences."""
    return num_tokens // block_q + num_seqs, num_kv_heads


def triton_unified_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             out: torch.Tensor, *, scale: float, max_seqlen_q: int, sliding_window: int | None,
                             soft_cap: float | None, tuning: UnifiedTuning, k_scale: torch.Tensor | None = None,
                             v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the unified kernel into `out`; see `pagedkv.kernels.paged_attention`."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_tokens == 0 or num_seqs == 0 or max_seqlen_q == 0:
        return out
    group = num_heads // num_kv_heads
    block_m, block_n, num_warps = tuning.tiles_for(head_dim, group, max_seqlen_q)
    block_q = block_m // group
    _unified_kernel[unified_grid(num_tokens, num_seqs, num_kv_heads, block_q)](
        query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out,
        k_scale if k_scale is not None else seq_lens, v_scale if v_scale is not None else seq_lens,
        scale if soft_cap is not None else scale * LOG2E, float(soft_cap or 1.0), int(sliding_window or 0),
        num_seqs, (num_seqs - 1).bit_length(),
        *query.stride(), *out.stride(),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *block_tables.stride(), seq_lens.stride(0),
        cu_seqlens_q.stride(0),
        GROUP=group, HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        USE_WINDOW=sliding_window is not None, USE_SOFT_CAP=soft_cap is not None, KV_FP8=k_scale is not None,
        num_warps=num_warps, num_stages=tuning.num_stages,
    )
    return out
