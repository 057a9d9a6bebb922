"""Tiled paged decode for small work: block-table slices preloaded, kv heads packed, a split plan by SM count.

The split kernel reaches only 58-67% of copy at batch 1 x 32K, 8 x 4K and 64 x 512. It
(`triton_decode`) loads each tile's block-table entries inside the loop and K/V through
them, a load feeding a load: Triton's pipeliner then keeps K/V one tile deep whatever
`num_stages` says (sm_90 cubins of stages 3 and 4 are identical), so each program has one
32 KiB tile in flight and its start-up is three dependent round trips (seq_len, table, K).
This kernel changes four things, each a launch parameter so a sweep can weigh them:

1. The block table is read ahead of the loop (`table="gather"` or `"select"`): a chunk of
   TABLE_CHUNK entries per outer step, loaded before the first tile and independent of
   seq_len. Inside the loop a tile's block ids come from that register vector
   (`tl.gather`, or a one-hot select where gather lowers badly), so the K/V addresses no
   longer depend on a load in the loop and the pipeliner may keep `num_stages - 1` tiles in
   flight. `table="inline"` keeps the split kernel's per-tile table load, for comparison.

       outer step c:  table_vec = table[first_page .. first_page + TABLE_CHUNK)   (one load)
       tile t:        block_ids = table_vec[token // PAGE - first_page]           (registers)

2. The split plan is host arithmetic on the SM count (`tiles_plan`): split_tokens, a
   multiple of BLOCK_N, such that programs = items x splits stays within
   `programs_per_sm * num_sms` (one wave of what fits, rounded down, not up into a second
   wave). Split s covers [s * split_tokens, (s + 1) * split_tokens): its range does not
   depend on seq_len, so the table and seq_len loads go out together.

3. HEADS kv heads per program ("packed heads"). The q rows are the HEADS * GROUP query
   heads of kv heads [h0, h0 + HEADS), and a tile holds BLOCK_N tokens of all HEADS heads:

       tile row c = n * HEADS + h:  token n, kv head h0 + h   (a token's HEADS rows are one
                                                               contiguous HEADS * D run)
       s[r, c] = q_r . k_c   where kv head of row r (r // GROUP) == h, else -inf

   The masked products are wasted tensor-core work (decode is ~50x under the ridge point);
   what it buys is longer contiguous reads per token and, for group 4 with HEADS 4, a full
   16-row M for tl.dot instead of 4 real rows in 16.

4. Splits are merged in-kernel by the last program of each (sequence, head group) to
   arrive (`merge="in_kernel"`, `triton_common.merge_partials`) or by the split kernel's
   merge launch (`merge="launch"`): partials have `triton_decode`'s layout,
   [num_seqs, num_heads, num_splits, DIM_PAD].

Sliding window: splits start at the window's first token rounded down to BLOCK_N, so every
range stays tile- (and, when PAGE divides BLOCK_N, page-) aligned; tokens before the window
are masked, and so are the table entries of pages wholly before it. Masked lanes are never
dereferenced, as in every kernel here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.triton_common import (
    LOG2E,
    merge_chunk,
    merge_group_rows,
    online_softmax_step,
    split_partials,
    store_split_part,
    tile_scores,
)
from pagedkv.kernels.launch import bound
from pagedkv.kernels.triton_decode import _merge_kernel
from pagedkv.kernels.triton_fp8 import fp8_query, to_compute
from pagedkv.kernels.tuning import DecodeTuning, tiles_plan

#: `DecodeTuning.table` modes -> the kernel's TABLE_MODE.
TABLE_MODES = {"inline": 0, "gather": 1, "select": 2}
#: Chunk step of the inline mode: one outer step covers any sequence.
_ONE_CHUNK = 1 << 30


@triton.jit
def _fold_range(q, k_cache_ptr, v_cache_ptr, table_row, stride_bt_b, table_vec, first_page, range_lo, range_hi,
                kv_start, same_head, tile_tokens, head_offsets, dims, dim_mask, m_i, l_i, acc, qk_scale, soft_cap,
                stride_cache_b, stride_cache_o, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                TABLE_MODE: tl.constexpr, TABLE_CHUNK: tl.constexpr, USE_DOT: tl.constexpr,
                DOT_PRECISION: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
                KV_FP8: tl.constexpr):
    """Fold the tiles of kv positions [range_lo, range_hi) into (m_i, l_i, acc).

    `qk_scale` is a scalar, or `[ROWS_PAD, 1]` per-row scales (FP8: each row's KV head's K scale
    folded in)."""
    for start in range(range_lo, range_hi, BLOCK_N):
        tokens = start + tile_tokens  # [TILE_ROWS]
        token_mask = tokens < range_hi
        if USE_WINDOW:
            token_mask = token_mask & (tokens >= kv_start)
        page = tokens // BLOCK_SIZE
        if TABLE_MODE == 0:
            block_ids = tl.load(table_row + page * stride_bt_b, mask=token_mask, other=0)
        elif TABLE_MODE == 1:
            index = tl.minimum(page - first_page, TABLE_CHUNK - 1)  # masked lanes may point past the chunk
            block_ids = tl.gather(table_vec, index, 0)
        else:
            slots = tl.arange(0, TABLE_CHUNK)
            block_ids = tl.sum(tl.where((page - first_page)[:, None] == slots[None, :], table_vec[None, :], 0), axis=1)
        token_rows = block_ids.to(tl.int64) * stride_cache_b + (tokens % BLOCK_SIZE) * stride_cache_o + head_offsets
        offsets = token_rows[:, None] + dims[None, :]  # [TILE_ROWS, DIM_PAD] int64
        mask = token_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=mask, other=0.0)
        v = tl.load(v_cache_ptr + offsets, mask=mask, other=0.0)
        k, v = to_compute(k, q.dtype, KV_FP8), to_compute(v, q.dtype, KV_FP8)
        s = tile_scores(q, k, qk_scale, soft_cap, USE_DOT, USE_SOFT_CAP, DOT_PRECISION)
        s = tl.where(token_mask[None, :] & same_head, s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, USE_DOT, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["num_splits", "split_tokens", "table_cols"])
def _tiles_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, partial_out_ptr, partial_lse_ptr, counters_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale, soft_cap, sliding_window, num_splits, split_tokens, table_cols,
    stride_q_s, stride_q_h, stride_q_d, stride_out_s, stride_out_h, stride_out_d,
    stride_cache_b, stride_cache_o, stride_cache_h, stride_bt_s, stride_bt_b, stride_lens,
    GROUP: tl.constexpr, HEADS: tl.constexpr, ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, ROWS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    TABLE_MODE: tl.constexpr, TABLE_CHUNK: tl.constexpr, CHUNK_TOKENS: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    IS_SPLIT: tl.constexpr, MERGE_IN_KERNEL: tl.constexpr, MERGE_CHUNK: tl.constexpr, KV_FP8: tl.constexpr,
):
    split = tl.program_id(0)  # splits vary fastest: an item's splits start (and finish) together
    head_group = tl.program_id(1)
    seq = tl.program_id(2)

    # This split's range [lo, hi): host arithmetic on split_tokens, seq_len only clips it.
    seq_len = tl.load(seq_lens_ptr + seq * stride_lens).to(tl.int32)
    kv_start = 0
    base = 0
    if USE_WINDOW:
        kv_start = tl.maximum(seq_len - sliding_window, 0)
        base = (kv_start // BLOCK_N) * BLOCK_N
    lo = base + split * split_tokens
    hi = tl.minimum(lo + split_tokens, seq_len)

    rows = tl.arange(0, ROWS_PAD)
    dims = tl.arange(0, DIM_PAD)
    row_mask = rows < ROWS
    dim_mask = dims < HEAD_DIM
    out_mask = row_mask[:, None] & dim_mask[None, :]
    heads = head_group * ROWS + rows  # [ROWS_PAD] query heads of kv heads [head_group * HEADS, + HEADS)
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_q_s + heads[:, None] * stride_q_h + dims[None, :] * stride_q_d,
                mask=out_mask, other=0.0)  # [ROWS_PAD, DIM_PAD]
    q = fp8_query(q, KV_FP8)  # fp16 for a bf16 query over FP8 tiles
    row_scale = qk_scale
    v_scale = 1.0
    if KV_FP8:  # a program reads HEADS kv heads: each row takes its own head's scales
        row_heads = head_group * HEADS + tl.minimum(rows, ROWS - 1) // GROUP
        row_scale = (qk_scale * tl.load(k_scale_ptr + row_heads))[:, None]  # [ROWS_PAD, 1]
        v_scale = tl.load(v_scale_ptr + row_heads)[:, None]

    cols = tl.arange(0, BLOCK_N * HEADS)
    tile_tokens = cols // HEADS  # [TILE_ROWS] token of tile row c = n * HEADS + h
    col_heads = cols % HEADS
    same_head = (rows // GROUP)[:, None] == col_heads[None, :]  # [ROWS_PAD, TILE_ROWS]
    head_offsets = (head_group * HEADS + col_heads).to(tl.int64) * stride_cache_h
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_s

    m_i = tl.full([ROWS_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS_PAD], dtype=tl.float32)
    acc = tl.zeros([ROWS_PAD, DIM_PAD], dtype=tl.float32)
    if TABLE_MODE == 0:
        m_i, l_i, acc = _fold_range(q, k_cache_ptr, v_cache_ptr, table_row, stride_bt_b, rows, 0, lo, hi, kv_start,
                                    same_head, tile_tokens, head_offsets, dims, dim_mask, m_i, l_i, acc, row_scale,
                                    soft_cap, stride_cache_b, stride_cache_o, BLOCK_SIZE, BLOCK_N, TABLE_MODE,
                                    TABLE_CHUNK, USE_DOT, DOT_PRECISION, USE_WINDOW, USE_SOFT_CAP, KV_FP8)
    else:
        slots = tl.arange(0, TABLE_CHUNK)
        for chunk_lo in range(lo, hi, CHUNK_TOKENS):
            # Read ahead: the chunk's block ids in one load, masked by the table's width and the window
            # (entries of pages wholly before the window are never read: they may hold anything).
            first_page = chunk_lo // BLOCK_SIZE
            pages = first_page + slots
            table_vec = tl.load(table_row + pages * stride_bt_b,
                                mask=(pages < table_cols) & (pages >= kv_start // BLOCK_SIZE), other=0)
            m_i, l_i, acc = _fold_range(q, k_cache_ptr, v_cache_ptr, table_row, stride_bt_b, table_vec, first_page,
                                        chunk_lo, tl.minimum(chunk_lo + CHUNK_TOKENS, hi), kv_start, same_head,
                                        tile_tokens, head_offsets, dims, dim_mask, m_i, l_i, acc, row_scale, soft_cap,
                                        stride_cache_b, stride_cache_o, BLOCK_SIZE, BLOCK_N, TABLE_MODE, TABLE_CHUNK,
                                        USE_DOT, DOT_PRECISION, USE_WINDOW, USE_SOFT_CAP, KV_FP8)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_FP8:
        o = o * v_scale  # linear, so split partials merge as they are
    if IS_SPLIT:
        store_split_part(o, m_i, l_i, partial_out_ptr, partial_lse_ptr, counters_ptr, out_ptr, seq, head_group * ROWS,
                         ROWS * tl.num_programs(1), split, num_splits, seq * tl.num_programs(1) + head_group,
                         stride_out_s, stride_out_h, stride_out_d, ROWS, ROWS_PAD, ROWS_P2, HEAD_DIM, DIM_PAD,
                         MERGE_IN_KERNEL, MERGE_CHUNK)
    else:
        out_rows = seq.to(tl.int64) * stride_out_s + heads * stride_out_h  # [ROWS_PAD]
        tl.store(out_ptr + out_rows[:, None] + dims[None, :] * stride_out_d, o.to(out_ptr.dtype.element_ty),
                 mask=out_mask)


def chunk_tokens(table_chunk: int, block_size: int, block_n: int, aligned: bool) -> int:
    """Tokens per outer step: a multiple of BLOCK_N whose pages fit TABLE_CHUNK entries wherever it starts.

    Aligned (PAGE divides BLOCK_N, so every chunk starts on a page): TABLE_CHUNK whole pages.
    Otherwise a range of n tokens may touch cdiv(n - 1, PAGE) + 1 pages.
    """
    limit = table_chunk * block_size if aligned else (table_chunk - 1) * block_size + 1
    return max(block_n, limit // block_n * block_n)


def tiles_launch_config(num_seqs: int, num_heads: int, head_dim: int, block_size: int, num_kv_heads: int,
                        max_seq_len: int, sliding_window: int | None, sm_count: int,
                        tuning: DecodeTuning) -> dict:
    """The host ints and constexprs of one launch: grid, split plan, tile and table sizes."""
    # A program's heads must all exist and its tile rows (BLOCK_N x heads) be a power of 2: the
    # packing narrows to the largest power-of-2 divisor of num_kv_heads within the tuning's.
    heads = 1
    while heads * 2 <= tuning.heads_per_program and num_kv_heads % (heads * 2) == 0:
        heads *= 2
    group = num_heads // num_kv_heads
    block_n = tuning.block_n_for(head_dim)  # FP8 too: 64-token FP8 tiles beat 128 here (fp8_tiles_sweep_h200.jsonl)
    span = max(1, max_seq_len)
    if sliding_window is not None:
        # At most `window` visible tokens, but the first tile starts up to BLOCK_N - 1 before them.
        span = min(span, sliding_window) + block_n - 1
    num_splits, split_tokens = tiles_plan(num_seqs * (num_kv_heads // heads), span, block_n, sm_count, tuning)
    aligned = block_n % block_size == 0
    table_chunk = tuning.table_chunk
    if not aligned:
        table_chunk = max(table_chunk, triton.next_power_of_2(-(-block_n // block_size) + 1))
    rows = heads * group
    return {
        "grid": (num_splits, num_kv_heads // heads, num_seqs), "num_splits": num_splits,
        "split_tokens": split_tokens, "HEADS": heads, "GROUP": group, "ROWS": rows,
        "ROWS_PAD": max(16, triton.next_power_of_2(rows)), "ROWS_P2": merge_group_rows(rows),
        "BLOCK_N": block_n, "TABLE_CHUNK": table_chunk,
        "CHUNK_TOKENS": (chunk_tokens(table_chunk, block_size, block_n, aligned) if tuning.table != "inline"
                         else _ONE_CHUNK),
    }


def triton_tiles_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, *, scale: float,
                        max_seq_len: int, sliding_window: int | None, soft_cap: float | None, tuning: DecodeTuning,
                        sm_count: int, counters: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the tiled decode kernel (and the merge kernel for `merge="launch"` splits) into `out`.

    FP8 caches take `k_scale`/`v_scale` (`[num_kv_heads]` float32) and run on `fp8_num_warps` warps
    with the model-dtype tile (measured on the H200: 64 tokens on 2 warps took 179 / 37 / 35 us at
    B=64 x 4096 / 1 x 32768 / 8 x 4096, against 231 / 45 / 43 on 4 warps and 331 / 57 / 56 at 128 tokens).

    `max_seq_len`: a host bound of seq_lens (sizes the split plan). `counters` (`merge="in_kernel"`):
    at least `num_seqs * num_kv_heads` int32 zeros, left zero; allocated when None.
    """
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_seqs == 0:
        return out
    fp8 = k_scale is not None
    config = tiles_launch_config(num_seqs, num_heads, head_dim, block_size, num_kv_heads, max_seq_len,
                                 sliding_window, sm_count, tuning)
    num_splits, dim_pad = config["num_splits"], triton.next_power_of_2(head_dim)
    is_split = num_splits > 1
    merge_in_kernel = is_split and tuning.merge == "in_kernel"
    # (out stands in for the partials when IS_SPLIT is False: the kernel never touches them then)
    partial_out, partial_lse = split_partials(num_seqs, num_heads, num_splits, dim_pad, query.device) if is_split \
        else (out, out)
    if merge_in_kernel and counters is None:
        counters = torch.zeros(num_seqs * num_kv_heads, dtype=torch.int32, device=query.device)
    grid = tuple(config["grid"]) + (1,) * (3 - len(config["grid"]))
    bound(_tiles_decode_kernel).config(
        GROUP=config["GROUP"], HEADS=config["HEADS"], ROWS=config["ROWS"], ROWS_PAD=config["ROWS_PAD"],
        ROWS_P2=config["ROWS_P2"], HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK_SIZE=block_size,
        BLOCK_N=config["BLOCK_N"], TABLE_MODE=TABLE_MODES[tuning.table], TABLE_CHUNK=config["TABLE_CHUNK"],
        CHUNK_TOKENS=config["CHUNK_TOKENS"], USE_DOT=True,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        USE_WINDOW=sliding_window is not None, USE_SOFT_CAP=soft_cap is not None, IS_SPLIT=is_split,
        MERGE_IN_KERNEL=merge_in_kernel, MERGE_CHUNK=merge_chunk(config["ROWS_P2"], dim_pad), KV_FP8=fp8,
        num_warps=tuning.num_warps_for(fp8), num_stages=tuning.num_stages,
    ).launch(
        grid,
        (query, k_cache, v_cache, block_tables, seq_lens, out, partial_out, partial_lse,
         counters if merge_in_kernel else seq_lens, k_scale if fp8 else seq_lens, v_scale if fp8 else seq_lens),
        (float(scale if soft_cap is not None else scale * LOG2E), float(soft_cap or 1.0), int(sliding_window or 0),
         num_splits, config["split_tokens"], block_tables.shape[1], *query.stride(), *out.stride(),
         k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *block_tables.stride(), seq_lens.stride(0)))
    if is_split and not merge_in_kernel:
        # Up to 8192 partial floats per load (64 fp32 registers a thread): 64 splits at head_dim 128 merge
        # in one L2 round trip, where 16-split chunks would make four dependent ones.
        splits_pad = triton.next_power_of_2(num_splits)
        bound(_merge_kernel).config(HEAD_DIM=head_dim, DIM_PAD=dim_pad, SPLITS_PAD=splits_pad,
                                    SPLIT_CHUNK=min(splits_pad, max(1, 8192 // dim_pad)), num_warps=4,
                                    ).launch((num_seqs, num_heads, 1), (partial_out, partial_lse, out),
                                             (num_splits, *out.stride()))
    return out
