"""Split prefill: the chunk's own K/V read contiguously from the step's QKV, only the cached prefix through pages.

A prefill chunk's new tokens have their K and V in the step's projection output, one row per
token, in the same order as the queries. Only the cached prefix lives solely in the pool:

    kv positions   | 0 ............ ctx-1 | ctx ........ seq_len-1 |
                   |   cached prefix      |   new (query) tokens   |
                   |   paged: pool pages  |   contiguous: key/value rows cu_seqlens_q[b] ..

so a program (one query tile of BLOCK_M rows, one query head, one sequence) folds both into
one online softmax: first the prefix (every key visible to every row: no mask but on its
ragged last tile), then the chunk's own keys, causal (unmasked below the diagonal, masked on
it). One pass over both parts is the log-sum-exp merge of the two partial attentions done in
registers, with nothing written in between.

Hopper machinery, through Triton 3.6:
- Q, the chunk's K/V and, when a page holds whole kv tiles (block_size % BLOCK_N == 0), the
  pool's pages are read by TMA (host tensor descriptors): one bulk copy per tile, no address
  arithmetic in the loop. With smaller pages (16 tokens against 64-128-token tiles) the
  prefix is gathered row by row through the block table (`triton_common.load_kv_tile`),
  which Triton pipelines as asynchronous copies over `num_stages` buffers.
- Both dots are wgmma (tl.dot on sm_90, operands in shared memory). The launch follows the
  step's shape (`SplitPrefillTuning.resolve`): enough programs for 1.5 per SM get 128 x 64
  tiles, 2 stages and 128 registers, so that two programs share an SM and one's softmax
  overlaps the other's matrix products (what FlashAttention-3's ping-pong does inside one
  program); fewer get 128 x 128 tiles and 3 stages, one per SM.
- A step of under one program per SM on long keys (a 512-token chunk is 128 programs)
  splits each program's kv tiles `NUM_SPLITS` ways. Each split stores its normalised rows
  and log2-sum-exp; the last to arrive (counted by an atomic, `triton_common.arrive`) merges
  them by log-sum-exp and resets the counter.

Rows past a sequence's chunk read the next sequence's rows (or TMA's zero fill past the
tensor): they are never stored. Keys past a part's end are masked to -1e6 before the max
(finite, so no row ever computes inf - inf) and their V rows zeroed, so stale pool slots
(never-written memory may hold NaN bit patterns) cannot leak in.

Covered: bf16/fp16 model-dtype caches, no sliding window, no soft cap, head_dim 64 or 128,
TMA-aligned rows. `triton_prefill` (below) sends anything else to the all-paged kernel
(`triton_prefill.py`) and logs why, once per reason.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from pagedkv.env import env_choice
from pagedkv.kernels.triton_common import LOG2E, arrive, load_kv_tile
from pagedkv.kernels.triton_prefill import triton_prefill_attention
from pagedkv.kernels.tuning import PrefillTuning, SplitPrefillTuning, num_sms

logger = logging.getLogger(__name__)
PREFILL_KERNELS = ("split", "paged")


@triton.jit
def _fold(acc, l_i, m_i, q, k, v, qk_scale, visible, key_valid, MASKED: tl.constexpr):
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
def _prefix_tile(kc_desc, vc_desc, k_cache_ptr, v_cache_ptr, table_row, stride_bt_b, start, ctx, kv_col,
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
def _merge_splits(o, lse, partial_out_ptr, partial_lse_ptr, counters_ptr, out_ptr, counter_index, split, token_rows,
                  row_mask, head, num_heads, num_tokens, stride_out_t, stride_out_h,
                  HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Store this split's normalised rows and log2-sum-exp; the last split of the tile to arrive merges them all.

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
        offsets = token_rows[:, None] * stride_out_t + head * stride_out_h + dims[None, :]
        tl.store(out_ptr + offsets, merged.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
        tl.store(counter, 0)


@triton.jit
def _split_prefill_kernel(
    q_desc, k_desc, v_desc, kc_desc, vc_desc,
    k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr, out_ptr,
    partial_out_ptr, partial_lse_ptr, counters_ptr,
    qk_scale, num_tokens, stride_out_t, stride_out_h, stride_cache_b, stride_cache_o, stride_cache_h, stride_bt_s,
    stride_bt_b, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGED_TMA: tl.constexpr, NUM_STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    # Heads vary fastest, so a GQA group's programs run side by side and share K/V tiles in L2;
    # the last (longest, under the causal mask) query tiles of every sequence launch first.
    head = tl.program_id(0)
    seq = tl.program_id(1)
    tile = tl.num_programs(2) // NUM_SPLITS - 1 - tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(cu_seqlens_q_ptr + seq).to(tl.int32)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1).to(tl.int32) - q_start
    if tile * BLOCK_M >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + seq).to(tl.int32) - q_len
    kv_head = head // GROUP
    kv_col = kv_head * HEAD_DIM
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index within the chunk
    cols = tl.arange(0, BLOCK_N)
    q = q_desc.load([q_start + tile * BLOCK_M, head * HEAD_DIM])  # [BLOCK_M, HEAD_DIM]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # The kv tiles this query tile sees, numbered prefix first, then the chunk's own:
    #   | prefix: full tiles | ragged tail | chunk: below the diagonal | on the diagonal |
    #   0               prefix_full    num_prefix                  diagonal           num_tiles
    # and this split's share of them, [lo, hi).
    prefix_full = ctx // BLOCK_N
    num_prefix = tl.cdiv(ctx, BLOCK_N)
    diagonal = num_prefix + tile * (BLOCK_M // BLOCK_N)
    num_tiles = num_prefix + tl.cdiv(tl.minimum(q_len, (tile + 1) * BLOCK_M), BLOCK_N)
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    lo = tl.minimum(split * per_split, num_tiles)
    hi = tl.minimum(lo + per_split, num_tiles)

    # Cached prefix, paged: whole tiles unmasked, then the ragged last tile masked.
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    head_offset = kv_head.to(tl.int64) * stride_cache_h
    for t in tl.range(lo, tl.minimum(hi, prefix_full), num_stages=NUM_STAGES, warp_specialize=WARP_SPECIALIZE):
        k, v = _prefix_tile(kc_desc, vc_desc, k_cache_ptr, v_cache_ptr, table_row, stride_bt_b, t * BLOCK_N, ctx,
                            kv_col, head_offset, stride_cache_b, stride_cache_o, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
                            PAGED_TMA)
        acc, l_i, m_i = _fold(acc, l_i, m_i, q, k, v, qk_scale, None, None, False)
    if (prefix_full < num_prefix) & (lo <= prefix_full) & (prefix_full < hi):
        start = prefix_full * BLOCK_N
        k, v = _prefix_tile(kc_desc, vc_desc, k_cache_ptr, v_cache_ptr, table_row, stride_bt_b, start, ctx, kv_col,
                            head_offset, stride_cache_b, stride_cache_o, HEAD_DIM, BLOCK_SIZE, BLOCK_N, PAGED_TMA)
        key_valid = start + cols < ctx
        visible = key_valid[None, :] & (rows >= 0)[:, None]
        acc, l_i, m_i = _fold(acc, l_i, m_i, q, k, v, qk_scale, visible, key_valid, True)

    # The chunk's own keys, contiguous rows of key/value: below the diagonal unmasked, on it causal.
    for t in tl.range(tl.maximum(lo, num_prefix), tl.minimum(hi, diagonal), num_stages=NUM_STAGES,
                      warp_specialize=WARP_SPECIALIZE):
        row = q_start + (t - num_prefix) * BLOCK_N
        k = k_desc.load([row, kv_col])
        v = v_desc.load([row, kv_col])
        acc, l_i, m_i = _fold(acc, l_i, m_i, q, k, v, qk_scale, None, None, False)
    for t in tl.range(tl.maximum(lo, diagonal), hi):
        start = (t - num_prefix) * BLOCK_N
        k = k_desc.load([q_start + start, kv_col])
        v = v_desc.load([q_start + start, kv_col])
        keys = start + cols
        key_valid = keys < q_len
        visible = (keys[None, :] <= rows[:, None]) & key_valid[None, :]
        acc, l_i, m_i = _fold(acc, l_i, m_i, q, k, v, qk_scale, visible, key_valid, True)

    token_rows = (q_start + rows).to(tl.int64)
    row_mask = rows < q_len
    if NUM_SPLITS == 1:
        o = acc / l_i[:, None]
        dims = tl.arange(0, HEAD_DIM)
        offsets = token_rows[:, None] * stride_out_t + head * stride_out_h + dims[None, :]
        tl.store(out_ptr + offsets, o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:  # a split that saw no tile has l = 0: weight 0 in the merge
        has_any = l_i > 0
        o = acc / tl.where(has_any, l_i, 1.0)[:, None]
        lse = tl.where(has_any, m_i + tl.log2(tl.where(has_any, l_i, 1.0)), float("-inf"))
        counter_index = (seq * (tl.num_programs(2) // NUM_SPLITS) + tile) * tl.num_programs(0) + head
        _merge_splits(o, lse, partial_out_ptr, partial_lse_ptr, counters_ptr, out_ptr, counter_index, split,
                      token_rows, row_mask, head, tl.num_programs(0), num_tokens, stride_out_t, stride_out_h,
                      HEAD_DIM, NUM_SPLITS)


def _rows_2d(tensor: torch.Tensor) -> torch.Tensor:
    """A `[rows, heads, dim]` view (unit stride in dim, heads packed) as `[rows, heads * dim]`."""
    return tensor.as_strided((tensor.shape[0], tensor.shape[1] * tensor.shape[2]), (tensor.stride(0), 1))


def unsupported_reason(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, out: torch.Tensor, *, sliding_window: int | None,
                       soft_cap: float | None, k_scale: torch.Tensor | None) -> str | None:
    """Why the split kernel cannot run these inputs (None when it can): the fallback's log line."""
    if k_scale is not None:
        return "an FP8 cache (the chunk's K/V would skip the cache's quantization)"
    if sliding_window is not None or soft_cap is not None:
        return "a sliding window or soft cap"
    if query.dtype not in (torch.float16, torch.bfloat16) or k_cache.dtype != query.dtype:
        return f"dtype {query.dtype} over a {k_cache.dtype} cache (bf16/fp16 only)"
    head_dim = query.shape[2]
    if head_dim not in (64, 128):
        return f"head_dim {head_dim} (64 or 128)"
    for name, tensor in (("query", query), ("key", key), ("value", value), ("out", out)):
        if tensor.stride(2) != 1 or tensor.stride(1) != head_dim:
            return f"{name} strides {tuple(tensor.stride())} (heads must be packed rows of unit stride)"
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.data_ptr() % 16 or tensor.stride(0) * tensor.element_size() % 16:
            return f"{name} not 16-byte aligned for TMA"
    if key.shape != value.shape or key.shape[0] != query.shape[0] or key.shape[1:] != k_cache.shape[2:]:
        return f"key/value {tuple(key.shape)} do not match query {tuple(query.shape)} and the cache"
    if k_cache.stride() != v_cache.stride() or k_cache.stride(2) != head_dim or k_cache.stride(3) != 1:
        return f"cache strides {tuple(k_cache.stride())}"
    return None


def triton_split_prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                   k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                                   seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, out: torch.Tensor, *,
                                   scale: float, max_seqlen_q: int, tuning: SplitPrefillTuning,
                                   max_seq_len: int | None = None) -> torch.Tensor:
    """Launch the split prefill kernel into `out` (inputs passed `unsupported_reason`); see the module docstring.

    `max_seq_len` (host int; default the tables' capacity) bounds every sequence's kv length:
    with `tuning`'s defaults it decides whether a step of few programs splits its kv ranges.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if num_tokens == 0 or num_seqs == 0 or max_seqlen_q == 0:
        return out
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    block_m, block_n, num_warps, num_stages, maxnreg, num_splits = tuning.resolve(
        head_dim, num_heads, num_seqs, max_seqlen_q, max_seq_len, num_sms(query.device))
    # TMA on pages needs whole tiles per page and pages that tile one 2-D array (no gap between blocks).
    paged_tma = block_size % block_n == 0 and k_cache.stride(0) == block_size * k_cache.stride(1)
    q_desc = TensorDescriptor.from_tensor(_rows_2d(query), [block_m, head_dim])
    k_desc = TensorDescriptor.from_tensor(_rows_2d(key), [block_n, head_dim])
    v_desc = TensorDescriptor.from_tensor(_rows_2d(value), [block_n, head_dim])
    if paged_tma:
        pool_rows = (num_blocks * block_size, num_kv_heads * head_dim)
        kc_desc = TensorDescriptor(k_cache, list(pool_rows), [k_cache.stride(1), 1], [block_n, head_dim])
        vc_desc = TensorDescriptor(v_cache, list(pool_rows), [v_cache.stride(1), 1], [block_n, head_dim])
    else:
        kc_desc, vc_desc = k_desc, v_desc  # unused (the gather path), any descriptor of the right block
    num_q_tiles = triton.cdiv(max_seqlen_q, block_m)
    if num_splits > 1:  # fresh zeros: the counters reset themselves, but a per-call buffer starts clean
        partial_out = torch.empty(num_splits, num_tokens, num_heads, head_dim, dtype=torch.float32, device=out.device)
        partial_lse = torch.empty(num_splits, num_tokens, num_heads, dtype=torch.float32, device=out.device)
        counters = torch.zeros(num_seqs * num_q_tiles * num_heads, dtype=torch.int32, device=out.device)
    else:
        partial_out = partial_lse = counters = out  # never touched with one split
    options = {} if maxnreg is None else {"maxnreg": maxnreg}
    _split_prefill_kernel[(num_heads, num_seqs, num_q_tiles * num_splits)](
        q_desc, k_desc, v_desc, kc_desc, vc_desc, k_cache, v_cache, block_tables, seq_lens.contiguous(),
        cu_seqlens_q.contiguous(), out, partial_out, partial_lse, counters,
        scale * LOG2E, num_tokens, out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_tables.stride(0), block_tables.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_N=block_n, PAGED_TMA=paged_tma, NUM_STAGES=num_stages, WARP_SPECIALIZE=tuning.warp_specialize,
        NUM_SPLITS=num_splits, num_warps=num_warps, num_stages=num_stages, **options)
    return out


@functools.lru_cache(maxsize=64)
def _log_fallback(reason: str) -> None:
    """Say once per distinct reason why a call given its chunk K/V still ran the all-paged kernel."""
    logger.info("prefill: the split kernel does not cover %s; the paged prefill kernel runs instead", reason)


def prefill_route(key: torch.Tensor | None) -> str:
    """"split" or "paged": which prefill kernel a call with these chunk K/V asks for.

    PAGEDKV_PREFILL_KERNEL=paged turns the split kernel off (an A/B switch, read per call).
    """
    if key is None:
        return "paged"
    return env_choice("PAGEDKV_PREFILL_KERNEL", PREFILL_KERNELS, "split")


def triton_prefill(query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   cu_seqlens_q: torch.Tensor, out: torch.Tensor, *, scale: float, max_seqlen_q: int,
                   sliding_window: int | None, soft_cap: float | None, tuning: PrefillTuning,
                   split_tuning: SplitPrefillTuning, k_scale: torch.Tensor | None,
                   v_scale: torch.Tensor | None, max_seq_len: int | None = None) -> torch.Tensor:
    """The split kernel where the chunk K/V are given and covered, else the all-paged kernel (reason logged once)."""
    if prefill_route(key) == "split" and max_seqlen_q >= split_tuning.min_query_tokens:
        reason = unsupported_reason(query, key, value, k_cache, v_cache, out, sliding_window=sliding_window,
                                    soft_cap=soft_cap, k_scale=k_scale)
        if reason is None:
            return triton_split_prefill_attention(query, key, value, k_cache, v_cache, block_tables, seq_lens,
                                                  cu_seqlens_q, out, scale=scale, max_seqlen_q=max_seqlen_q,
                                                  tuning=split_tuning, max_seq_len=max_seq_len)
        _log_fallback(reason)
    return triton_prefill_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale=scale,
                                    max_seqlen_q=max_seqlen_q, sliding_window=sliding_window, soft_cap=soft_cap,
                                    tuning=tuning, k_scale=k_scale, v_scale=v_scale)
