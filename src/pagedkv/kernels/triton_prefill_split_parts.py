"""The split prefill programs' shared parts: the kv loop over prefix pages and chunk rows, the store, the operands.

`triton_prefill_split` (a program per query head) and `triton_prefill_packed` (a program per
kv head, its GQA group packed into the rows) differ only in how a program finds its rows and
loads Q; both then run `attend` (this split's share of the query tile's kv tiles, prefix
first, then the chunk causally by each row's own token), `finish` (store the rows, or this
split's share and the last split's log-sum-exp merge), and take the same `launch_operands`.
The split kernel's module docstring says what each part does and why.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.triton_common import LOG2E, arrive, load_kv_tile


@triton.jit
def fold_tile(acc, l_i, m_i, q, k, v, qk_scale, visible, key_valid, MASKED: tl.constexpr):
    """Fold one kv tile (k, v `[BLOCK_N, D]`) into the rows' running (acc, sum, max).

    MASKED: `visible` `[BLOCK_M, BLOCK_N]` says which scores count; V rows of keys outside
    `key_valid` `[BLOCK_N]` are zeroed (stale slots may hold NaN, and 0 * NaN is NaN).
    """
    qk = tl.dot(q, tl.trans(k))
    if MASKED:
        qk = tl.where(visible, qk * qk_scale, -1.0e6)
        v = tl.where(key_valid[:, None], v, 0.0)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        qk = qk - m_new[:, None]
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        qk = qk * qk_scale - m_new[:, None]
    p = tl.exp2(qk)
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def prefix_tile(kc_desc, vc_desc, k_cache_ptr, v_cache_ptr, table_row, stride_bt_b, start, ctx, kv_col,
                 head_offset, stride_cache_b, stride_cache_o, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, PAGED_TMA: tl.constexpr):
    """K and V `[BLOCK_N, HEAD_DIM]` of prefix positions start .. start + BLOCK_N - 1."""
    if PAGED_TMA:  # the tile lies inside one page: one bulk copy each
        block = tl.load(table_row + (start // BLOCK_SIZE) * stride_bt_b).to(tl.int32)
        row = block * BLOCK_SIZE + start % BLOCK_SIZE
        k = kc_desc.load([row, kv_col])
        v = vc_desc.load([row, kv_col])
    else:
        tokens = start + tl.arange(0, BLOCK_N)
        dims = tl.arange(0, HEAD_DIM)
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table_row, stride_bt_b, tokens, tokens < ctx, head_offset, dims,
                            dims < HEAD_DIM, stride_cache_b, stride_cache_o, BLOCK_SIZE)
    return k, v


@triton.jit
def merge_splits(o, lse, partial_out_ptr, partial_lse_ptr, counters_ptr, out_ptr, counter_index, split, token_rows,
                 row_mask, head, num_heads, num_tokens, stride_out_t, stride_out_h,
                 HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Store this split's normalised rows and log2-sum-exp; the last split of the tile to arrive merges them all.

    Row r is query head `head` (one for all rows, or one per row) of token `token_rows[r]`.
    partial_out `[NUM_SPLITS, num_tokens, num_heads, HEAD_DIM]` fp32, partial_lse `[NUM_SPLITS,
    num_tokens, num_heads]`; the counter goes back to 0 (see `triton_common.arrive`).
    """
    dims = tl.arange(0, HEAD_DIM)
    slot = token_rows * num_heads + head  # [BLOCK_M] int64
    part = split.to(tl.int64) * num_tokens * num_heads
    tl.store(partial_out_ptr + (part + slot)[:, None] * HEAD_DIM + dims[None, :], o, mask=row_mask[:, None])
    tl.store(partial_lse_ptr + part + slot, lse, mask=row_mask)
    counter = counters_ptr + counter_index
    if arrive(counter) == NUM_SPLITS - 1:
        tl.debug_barrier()
        m = tl.zeros_like(lse) + float("-inf")
        for s in tl.static_range(NUM_SPLITS):
            part_lse = tl.load(partial_lse_ptr + s * num_tokens * num_heads + slot, mask=row_mask,
                               other=float("-inf"), cache_modifier=".cg")
            m = tl.maximum(m, part_lse)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        total = tl.zeros_like(lse)
        acc = tl.zeros_like(o)
        for s in tl.static_range(NUM_SPLITS):
            rows = s * num_tokens * num_heads + slot
            weight = tl.exp2(tl.load(partial_lse_ptr + rows, mask=row_mask, other=float("-inf"),
                                     cache_modifier=".cg") - m_safe)
            part_o = tl.load(partial_out_ptr + rows[:, None] * HEAD_DIM + dims[None, :], mask=row_mask[:, None],
                             other=0.0, cache_modifier=".cg")
            acc += part_o * weight[:, None]
            total += weight
        merged = acc / tl.where(total > 0, total, 1.0)[:, None]
        offsets = (token_rows * stride_out_t + head * stride_out_h)[:, None] + dims[None, :]
        tl.store(out_ptr + offsets, merged.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
        tl.store(counter, 0)


@triton.jit
def program_tile(cu_seqlens_q_ptr, NUM_SPLITS: tl.constexpr):
    """(sequence, query tile, split, chunk start, chunk length) of this program; tiles run last first."""
    seq = tl.program_id(1)
    tile = tl.num_programs(2) // NUM_SPLITS - 1 - tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(cu_seqlens_q_ptr + seq).to(tl.int32)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1).to(tl.int32) - q_start
    return seq, tile, split, q_start, q_len


@triton.jit
def attend(acc, l_i, m_i, q, row_tokens, cols, ctx, q_start, q_len, tile, split, seq, kv_head, kv_col,
           k_desc, v_desc, kc_desc, vc_desc, k_cache_ptr, v_cache_ptr, block_tables_ptr, stride_bt_s, stride_bt_b,
           stride_cache_h, stride_cache_b, stride_cache_o, qk_scale, HEAD_DIM: tl.constexpr,
           BLOCK_SIZE: tl.constexpr, TILE_TOKENS: tl.constexpr, BLOCK_N: tl.constexpr, PAGED_TMA: tl.constexpr,
           NUM_STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Fold this split's share of query tile `tile`'s kv tiles into (acc, l_i, m_i).

    The tile holds chunk tokens [tile * TILE_TOKENS, (tile + 1) * TILE_TOKENS); row r is
    token `row_tokens[r]`. The kv tiles it sees, numbered prefix first, then the chunk's own:
      | prefix: full tiles | ragged tail | chunk: wholly before the first token | causal |
      0               prefix_full    num_prefix                           diagonal    num_tiles
    and this split's share of them, [lo, hi).
    """
    prefix_full = ctx // BLOCK_N
    num_prefix = tl.cdiv(ctx, BLOCK_N)
    if TILE_TOKENS % BLOCK_N == 0:
        diagonal = num_prefix + tile * (TILE_TOKENS // BLOCK_N)
    else:  # a tile of fewer tokens than a kv tile (the GQA-packed program's)
        diagonal = num_prefix + tile * TILE_TOKENS // BLOCK_N
    num_tiles = num_prefix + tl.cdiv(tl.minimum(q_len, (tile + 1) * TILE_TOKENS), BLOCK_N)
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    lo = tl.minimum(split * per_split, num_tiles)
    hi = tl.minimum(lo + per_split, num_tiles)

    # Cached prefix, paged: whole tiles unmasked, then the ragged last tile masked.
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    head_offset = kv_head.to(tl.int64) * stride_cache_h
    for t in tl.range(lo, tl.minimum(hi, prefix_full), num_stages=NUM_STAGES, warp_specialize=WARP_SPECIALIZE):
        k, v = prefix_tile(kc_desc, vc_desc, k_cache_ptr, v_cache_ptr, table_row, stride_bt_b, t * BLOCK_N, ctx,
                           kv_col, head_offset, stride_cache_b, stride_cache_o, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
                           PAGED_TMA)
        acc, l_i, m_i = fold_tile(acc, l_i, m_i, q, k, v, qk_scale, None, None, False)
    if (prefix_full < num_prefix) & (lo <= prefix_full) & (prefix_full < hi):
        start = prefix_full * BLOCK_N
        k, v = prefix_tile(kc_desc, vc_desc, k_cache_ptr, v_cache_ptr, table_row, stride_bt_b, start, ctx, kv_col,
                           head_offset, stride_cache_b, stride_cache_o, HEAD_DIM, BLOCK_SIZE, BLOCK_N, PAGED_TMA)
        key_valid = start + cols < ctx
        visible = key_valid[None, :] & (row_tokens >= 0)[:, None]
        acc, l_i, m_i = fold_tile(acc, l_i, m_i, q, k, v, qk_scale, visible, key_valid, True)

    # The chunk's own keys, contiguous rows of key/value: before the diagonal unmasked, from it on causal.
    for t in tl.range(tl.maximum(lo, num_prefix), tl.minimum(hi, diagonal), num_stages=NUM_STAGES,
                      warp_specialize=WARP_SPECIALIZE):
        row = q_start + (t - num_prefix) * BLOCK_N
        k = k_desc.load([row, kv_col])
        v = v_desc.load([row, kv_col])
        acc, l_i, m_i = fold_tile(acc, l_i, m_i, q, k, v, qk_scale, None, None, False)
    for t in tl.range(tl.maximum(lo, diagonal), hi):
        start = (t - num_prefix) * BLOCK_N
        k = k_desc.load([q_start + start, kv_col])
        v = v_desc.load([q_start + start, kv_col])
        keys = start + cols
        key_valid = keys < q_len
        visible = (keys[None, :] <= row_tokens[:, None]) & key_valid[None, :]
        acc, l_i, m_i = fold_tile(acc, l_i, m_i, q, k, v, qk_scale, visible, key_valid, True)
    return acc, l_i, m_i


@triton.jit
def finish(acc, l_i, m_i, out_ptr, partial_out_ptr, partial_lse_ptr, counters_ptr, seq, tile, split, token_rows,
           row_mask, head, num_heads, num_tokens, stride_out_t, stride_out_h, HEAD_DIM: tl.constexpr,
           NUM_SPLITS: tl.constexpr):
    """Store the rows (query head `head`, one or one per row, of tokens `token_rows`), or this split's share.

    The split counters are one per (sequence, query tile, program_id(0)).
    """
    if NUM_SPLITS == 1:
        o = acc / l_i[:, None]
        dims = tl.arange(0, HEAD_DIM)
        offsets = (token_rows * stride_out_t + head * stride_out_h)[:, None] + dims[None, :]
        tl.store(out_ptr + offsets, o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:  # a split that saw no tile has l = 0: weight 0 in the merge
        has_any = l_i > 0
        o = acc / tl.where(has_any, l_i, 1.0)[:, None]
        lse = tl.where(has_any, m_i + tl.log2(tl.where(has_any, l_i, 1.0)), float("-inf"))
        counter_index = (seq * (tl.num_programs(2) // NUM_SPLITS) + tile) * tl.num_programs(0) + tl.program_id(0)
        merge_splits(o, lse, partial_out_ptr, partial_lse_ptr, counters_ptr, out_ptr, counter_index, split,
                     token_rows, row_mask, head, num_heads, num_tokens, stride_out_t, stride_out_h,
                     HEAD_DIM, NUM_SPLITS)


def rows_2d(tensor: torch.Tensor) -> torch.Tensor:
    """A `[rows, heads, dim]` view (unit stride in dim, heads packed) as `[rows, heads * dim]`."""
    return tensor.as_strided((tensor.shape[0], tensor.shape[1] * tensor.shape[2]), (tensor.stride(0), 1))


def launch_operands(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, out: torch.Tensor, *, scale: float, block_n: int, num_splits: int,
                    num_counters: int) -> tuple[list, bool]:
    """(the arguments both split programs take after their Q operand, whether the pages go by TMA).

    TMA on pages needs whole tiles per page and pages that tile one 2-D array (no gap between
    blocks); otherwise the kernel gathers the prefix by rows and kc/vc are unused stand-ins.
    The split buffers are `merge_splits`'s (`out` itself, untouched, with one split).
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    paged_tma = block_size % block_n == 0 and k_cache.stride(0) == block_size * k_cache.stride(1)
    k_desc = TensorDescriptor.from_tensor(rows_2d(key), [block_n, head_dim])
    v_desc = TensorDescriptor.from_tensor(rows_2d(value), [block_n, head_dim])
    if paged_tma:
        pool_rows = (num_blocks * block_size, num_kv_heads * head_dim)
        kc_desc = TensorDescriptor(k_cache, list(pool_rows), [k_cache.stride(1), 1], [block_n, head_dim])
        vc_desc = TensorDescriptor(v_cache, list(pool_rows), [v_cache.stride(1), 1], [block_n, head_dim])
    else:
        kc_desc, vc_desc = k_desc, v_desc  # unused (the gather path), any descriptor of the right block
    num_tokens, num_heads, _ = query.shape
    if num_splits > 1:  # fresh zeros: the counters reset themselves, but a per-call buffer starts clean
        partial_out = torch.empty(num_splits, num_tokens, num_heads, head_dim, dtype=torch.float32, device=out.device)
        partial_lse = torch.empty(num_splits, num_tokens, num_heads, dtype=torch.float32, device=out.device)
        counters = torch.zeros(num_counters, dtype=torch.int32, device=out.device)
    else:
        partial_out = partial_lse = counters = out  # never touched with one split
    return [k_desc, v_desc, kc_desc, vc_desc, k_cache, v_cache, block_tables, seq_lens.contiguous(),
            cu_seqlens_q.contiguous(), out, partial_out, partial_lse, counters, scale * LOG2E, num_tokens,
            out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), block_tables.stride(1)], paged_tma
