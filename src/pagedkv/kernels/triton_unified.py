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

Split KV. A step of a few query tiles is a grid of a few dozen programs (80 new tokens of one sequence on
Qwen3-0.6B's 8 kv heads: 40), each walking its sequence's whole prefix: a warm chat turn's 80-token message on a
16K-token restored prefix took 0.42 ms per layer on an H200 (11.8 ms of its 13.4 ms step), against ~20 us of
reading the prefix at the HBM's rate. So a grid under `UnifiedTuning.target_programs_per_sm` programs per SM gets
a third axis of splits (a host int from the grid alone, fixed per captured shape; one compiled variant for every
split count, `SPLIT`): split s of a query tile folds its share of the tile's kv tiles (whole tiles, balanced; the
diagonal's masked ones in the split they fall in), stores its normalised rows and log2-sum-exp, and the last split
to arrive merges them in one online pass (`_merge_parts`; the counters reset themselves, so a captured graph
replays). A tile's split count is decided on the device from its own keys (at least `min_split_tokens` per split):
decode rows and short prompts in the same launch store directly, their other split programs return at once. A grid
padded for many sequences (the engine's mixed-step graphs at the default `max_num_seqs` of 256) stays unsplit.

FP8 caches (`KV_FP8`): as in the prefill kernel, the program's one KV head's K scale goes
into `qk_scale` and its V scale onto the output; tiles convert in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.triton_common import LOG2E, arrive
from pagedkv.kernels.triton_fp8 import fp8_query
from pagedkv.kernels.triton_prefill import causal_attend, prefill_tiles
from pagedkv.kernels.tuning import UnifiedTuning, num_sms


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
    partial_out_ptr, partial_lse_ptr, counters_ptr, num_tokens, num_heads, min_split_tiles,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, KV_FP8: tl.constexpr, SPLIT: tl.constexpr,
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
    last_pos = tl.minimum(first_pos + BLOCK_Q, seq_len) - 1
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    head_offset = kv_head.to(tl.int64) * stride_cache_h
    if not SPLIT:
        acc, l_i, m_i = causal_attend(
            acc, l_i, m_i, q, ctx + q_tokens, first_pos, last_pos, sliding_window, k_cache_ptr, v_cache_ptr,
            table_row, stride_bt_b, head_offset, qk_scale, soft_cap, stride_cache_b, stride_cache_o,
            DIM_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, USE_WINDOW, USE_SOFT_CAP, KV_FP8)
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if KV_FP8:
            o = o * v_scale
        out_offsets = token_rows[:, None] * stride_out_t + heads[:, None] * stride_out_h + dims[None, :] * stride_out_d
        tl.store(out_ptr + out_offsets, o.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # split s folds its share of the tile's kv tiles (whole tiles): unmasked below the diagonal, masked on it
        split = tl.program_id(2)
        hi = last_pos + 1
        mid = first_pos // BLOCK_N * BLOCK_N
        num_tiles = tl.cdiv(hi, BLOCK_N)
        num_parts = tl.maximum(tl.minimum(num_tiles // min_split_tiles, tl.num_programs(2)), 1)
        if split >= num_parts:  # keys too few for this many splits: the tile's other splits cover them
            return
        lo_s = split * num_tiles // num_parts * BLOCK_N
        hi_s = tl.minimum((split + 1) * num_tiles // num_parts * BLOCK_N, hi)
        pos_q = ctx + q_tokens
        acc, l_i, m_i = prefill_tiles(
            acc, l_i, m_i, q, pos_q, lo_s, tl.minimum(hi_s, mid), k_cache_ptr, v_cache_ptr, table_row,
            stride_bt_b, head_offset, qk_scale, soft_cap, sliding_window, stride_cache_b, stride_cache_o,
            DIM_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, False, False, USE_SOFT_CAP, KV_FP8)
        acc, l_i, m_i = prefill_tiles(
            acc, l_i, m_i, q, pos_q, tl.maximum(lo_s, mid), hi_s, k_cache_ptr, v_cache_ptr, table_row,
            stride_bt_b, head_offset, qk_scale, soft_cap, sliding_window, stride_cache_b, stride_cache_o,
            DIM_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, True, False, USE_SOFT_CAP, KV_FP8)
        has_any = l_i > 0
        o = acc / tl.where(has_any, l_i, 1.0)[:, None]
        if KV_FP8:
            o = o * v_scale
        out_offsets = token_rows[:, None] * stride_out_t + heads[:, None] * stride_out_h + dims[None, :]
        if num_parts == 1:  # a decode row or a short prompt in a split launch: no merge
            tl.store(out_ptr + out_offsets, o.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            lse = tl.where(has_any, m_i + tl.log2(tl.where(has_any, l_i, 1.0)), float("-inf"))
            _merge_parts(o, lse, partial_out_ptr, partial_lse_ptr, counters_ptr + tile * tl.num_programs(1) + kv_head,
                         out_ptr + out_offsets, split.to(tl.int64), num_parts, token_rows * num_heads + heads, row_mask,
                         num_tokens * num_heads, dims, DIM_PAD)


@triton.jit
def _merge_parts(o, lse, partial_out_ptr, partial_lse_ptr, counter_ptr, out_ptrs, split, num_parts, slots, row_mask,
                 part_stride, dims, DIM_PAD: tl.constexpr):
    """Store this split's normalised rows (`slots`: token * num_heads + head, int64) and log2-sum-exp; the last of
    the tile's `num_parts` splits to arrive merges them all into `out_ptrs` (one online pass, loaded through L2:
    other programs of the launch wrote them; a loop, not unrolled, so its registers do not grow with the splits)
    and resets the counter (so a captured graph replays).

    partial_out `[splits, num_tokens, num_heads, DIM_PAD]` fp32, partial_lse `[splits, num_tokens, num_heads]`."""
    rows = split * part_stride + slots
    tl.store(partial_out_ptr + rows[:, None] * DIM_PAD + dims[None, :], o, mask=row_mask[:, None])
    tl.store(partial_lse_ptr + rows, lse, mask=row_mask)
    if arrive(counter_ptr) == num_parts - 1:
        tl.debug_barrier()
        m = tl.full(lse.shape, float("-inf"), dtype=tl.float32)
        total = tl.zeros(lse.shape, dtype=tl.float32)
        acc = tl.zeros(o.shape, dtype=tl.float32)
        for s in range(0, num_parts):
            rows = slots + s * part_stride  # (splits x tokens x heads fits int32; slots are int64)
            part_lse = tl.load(partial_lse_ptr + rows, mask=row_mask, other=float("-inf"), cache_modifier=".cg")
            m_new = tl.maximum(m, part_lse)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)
            weight = tl.exp2(part_lse - m_safe)
            part_o = tl.load(partial_out_ptr + rows[:, None] * DIM_PAD + dims[None, :], mask=row_mask[:, None],
                             other=0.0, cache_modifier=".cg")
            acc = acc * alpha[:, None] + part_o * weight[:, None]
            total = total * alpha + weight
            m = m_new
        merged = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(out_ptrs, merged.to(out_ptrs.dtype.element_ty), mask=row_mask[:, None])
        tl.store(counter_ptr, 0)


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
    tiles, _ = grid = unified_grid(num_tokens, num_seqs, num_kv_heads, block_q)
    num_splits = unified_splits(tuning, tiles * num_kv_heads, query, out, sliding_window)
    if num_splits > 1:  # merge buffers (the counters reset themselves; fresh zeros keep a call self-contained)
        partial_out = torch.empty(num_splits, num_tokens, num_heads, head_dim, dtype=torch.float32,
                                  device=out.device)  # (head_dim is a power of 2 here: DIM_PAD)
        partial_lse = torch.empty(num_splits, num_tokens, num_heads, dtype=torch.float32, device=out.device)
        counters = torch.zeros(tiles * num_kv_heads, dtype=torch.int32, device=out.device)
    else:
        partial_out = partial_lse = counters = out  # never touched with one split
    _unified_kernel[(*grid, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out,
        k_scale if k_scale is not None else seq_lens, v_scale if v_scale is not None else seq_lens,
        scale if soft_cap is not None else scale * LOG2E, float(soft_cap or 1.0), int(sliding_window or 0),
        num_seqs, (num_seqs - 1).bit_length(),
        *query.stride(), *out.stride(),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *block_tables.stride(), seq_lens.stride(0),
        cu_seqlens_q.stride(0),
        partial_out, partial_lse, counters, num_tokens, num_heads, max(1, -(-tuning.min_split_tokens // block_n)),
        GROUP=group, HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        USE_WINDOW=sliding_window is not None, USE_SOFT_CAP=soft_cap is not None, KV_FP8=k_scale is not None,
        SPLIT=num_splits > 1, num_warps=num_warps, num_stages=tuning.num_stages,
    )
    return out


def unified_splits(tuning: UnifiedTuning, grid_programs: int, query: torch.Tensor, out: torch.Tensor,
                   sliding_window: int | None) -> int:
    """The launch's kv split count (`UnifiedTuning.splits_for`); 1 where the split path does not apply: a
    sliding window (its tiles start at the window, not at 0), a head dim that is not a power of 2 or an
    output whose head dim is strided (the merge stores whole power-of-2 rows)."""
    head_dim = query.shape[2]
    if sliding_window is not None or head_dim & (head_dim - 1) or out.stride(2) != 1:
        return 1
    return tuning.splits_for(grid_programs, num_sms(query.device))
