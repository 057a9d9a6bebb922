"""Stream-K paged decode: persistent programs share one flat stream of tiles, whatever the lengths.

Small decode work (batch 1 x 32K, 8 x 4K, 64 x 512 on 8 kv heads) loses a third of the
bandwidth to per-program start-up (three dependent loads before the first K byte), to
waves of equal programs starting and ending together, and to the merge launch. Here the
grid is fixed by the machine, `P = programs_per_sm * num_sms` (what fits at once: one
wave), and the work is one flat stream of tiles, sequence-major, kv-head minor:

    flat tile t:  | seq 0: head 0 tiles | head 1 tiles | ... | seq 1: head 0 tiles | ...
    item          (sequence, kv head): max(1, cdiv(visible length, BLOCK_N)) tiles
    program p     tiles [p * W, (p + 1) * W), W = cdiv(total tiles, P)

Each program runs ONE loop over its tiles, so the software pipeline keeps prefetching
across item boundaries (the item's length is loaded at the top of each iteration: loading
it at the bottom, for the next one, crashed Triton 3.6's pipeliner on sm_90, "Op used
before defined"). The loop body is branch-free: at an item's last tile (or the
program's) the rows are finished with masked stores and the softmax state is reset with
`where`. An item wholly inside a program is written straight to `out`. An item cut by a
program boundary leaves one partial per program it touches; after the loop, each of its
programs counts itself in on the item's counter, and the last one merges the partials
(`triton_common.merge_partials`) and resets the counter.

Partial slots: a program's first segment that started before it (`started_here` false)
goes to slot p, its segment cut at its end to slot P + p. So item I, beginning at flat
tile S with T tiles, has parts from programs p_first = S // W .. p_last = (S + T - 1) // W:
part 0 in slot P + p_first, part c >= 1 in slot p_first + c.

The split comes from device data (seq_lens, loaded whole by every program into a
SEQS_PAD vector and prefix-summed in registers), and the grid from host ints only, so a
step captures in a CUDA graph. An empty sequence is one tile of nothing (its rows come out
as zeros), so every item has at least one tile.

FP8 caches (`KV_FP8`): an item's KV head changes along the stream, so its K and V scales
are loaded with its length at the top of each iteration (two cached scalar loads); the K
scale multiplies the softmax scale, the V scale the rows finished at the item's end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.triton_common import (
    LOG2E,
    arrive,
    load_kv_tile,
    merge_chunk,
    merge_group_rows,
    merge_partials,
    online_softmax_step,
    tile_scores,
)
from pagedkv.kernels.triton_decode import group_padding
from pagedkv.kernels.triton_fp8 import fp8_query, to_compute
from pagedkv.kernels.tuning import DecodeTuning

#: The longest batch stream-K takes (every program holds all seq_lens in registers); larger
#: batches fill the GPU anyway and run the split grid. Batches up to 64 share one compiled
#: SEQS_PAD (the vector is cheap), so an engine's graph sizes compile once.
MAX_STREAM_K_SEQS = 4096


@triton.jit
def _visible_tiles(lens, sliding_window, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr):
    """Tiles of an item of a sequence of length `lens`: at least 1, so an empty sequence is one masked tile."""
    if USE_WINDOW:
        lens = tl.minimum(lens, sliding_window)
    return tl.maximum(tl.cdiv(lens, BLOCK_N), 1)


@triton.jit
def _locate(t, seqs, tiles, seq_end, NUM_KV_HEADS: tl.constexpr):
    """(seq, kv_head, item tiles, item's first flat tile) of the item holding flat tile `t`."""
    seq = tl.sum((seq_end <= t).to(tl.int32), axis=0)
    num_tiles = tl.sum(tl.where(seqs == seq, tiles, 0), axis=0)
    seq_begin = tl.sum(tl.where(seqs == seq, seq_end, 0), axis=0) - num_tiles * NUM_KV_HEADS
    kv_head = (t - seq_begin) // tl.maximum(num_tiles, 1)
    return seq, kv_head, num_tiles, seq_begin + kv_head * num_tiles


@triton.jit
def _finish_cut_item(partial_out_ptr, partial_lse_ptr, counters_ptr, out_ptr, seq, kv_head, item_begin, num_tiles,
                     per_program, num_programs, stride_out_s, stride_out_h, stride_out_d,
                     NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
                     HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, MERGE_CHUNK: tl.constexpr):
    """Count this program in on a cut item; the last of its programs merges the parts and resets the counter."""
    p_first = item_begin // per_program
    num_parts = (item_begin + num_tiles - 1) // per_program - p_first + 1
    counter = counters_ptr + seq * NUM_KV_HEADS + kv_head
    if arrive(counter) == num_parts - 1:
        tl.debug_barrier()
        merged = merge_partials(partial_out_ptr, partial_lse_ptr, num_parts, p_first.to(tl.int64) * GROUP, GROUP,
                                num_programs * GROUP, 1, GROUP, GROUP_P2, DIM_PAD, MERGE_CHUNK)
        rows = tl.arange(0, GROUP_P2)
        dims = tl.arange(0, DIM_PAD)
        offsets = seq.to(tl.int64) * stride_out_s + (kv_head * GROUP + rows)[:, None] * stride_out_h \
            + dims[None, :] * stride_out_d
        tl.store(out_ptr + offsets, merged.to(out_ptr.dtype.element_ty),
                 mask=(rows < GROUP)[:, None] & (dims < HEAD_DIM)[None, :])
        tl.store(counter, 0)


@triton.jit
def _stream_k_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
    partial_out_ptr, partial_lse_ptr, counters_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale, soft_cap, sliding_window, num_seqs,
    stride_q_s, stride_q_h, stride_q_d, stride_out_s, stride_out_h, stride_out_d,
    stride_cache_b, stride_cache_o, stride_cache_h, stride_bt_s, stride_bt_b, stride_lens,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SEQS_PAD: tl.constexpr, MERGE_CHUNK: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, KV_FP8: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)

    # The plan, identical in every program: each sequence's tiles, prefix-summed into the flat stream.
    seqs = tl.arange(0, SEQS_PAD)
    lens = tl.load(seq_lens_ptr + seqs * stride_lens, mask=seqs < num_seqs, other=0).to(tl.int32)
    tiles = tl.where(seqs < num_seqs, _visible_tiles(lens, sliding_window, BLOCK_N, USE_WINDOW), 0)
    seq_end = tl.cumsum(tiles, axis=0) * NUM_KV_HEADS  # [SEQS_PAD] flat tile where each sequence's items end
    total = tl.sum(tiles, axis=0) * NUM_KV_HEADS
    per_program = tl.cdiv(total, num_programs)
    t_begin = pid * per_program
    t_end = tl.minimum(t_begin + per_program, total)  # an idle program (t_begin >= t_end) runs no tile
    first_seq, first_head, first_tiles, first_begin = _locate(t_begin, seqs, tiles, seq_end, NUM_KV_HEADS)
    last_seq, last_head, last_tiles, last_begin = _locate(t_end - 1, seqs, tiles, seq_end, NUM_KV_HEADS)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_DIM
    out_mask = row_mask[:, None] & dim_mask[None, :]

    # Loop state: the current item and tile, and whether the item began in this program.
    seq, kv_head = first_seq, first_head
    tile = t_begin - first_begin
    started_here = tile == 0
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)
    for t in range(t_begin, t_end):
        seq_len = tl.load(seq_lens_ptr + seq * stride_lens).to(tl.int32)
        item_qk_scale = qk_scale
        v_scale = 1.0
        if KV_FP8:
            item_qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
            v_scale = tl.load(v_scale_ptr + kv_head)
        num_tiles = _visible_tiles(seq_len, sliding_window, BLOCK_N, USE_WINDOW)
        kv_start = 0
        if USE_WINDOW:
            kv_start = tl.maximum(seq_len - sliding_window, 0)
        heads = kv_head * GROUP + rows
        q = tl.load(q_ptr + seq.to(tl.int64) * stride_q_s + heads[:, None] * stride_q_h + dims[None, :] * stride_q_d,
                    mask=out_mask, other=0.0)  # [GROUP_PAD, DIM_PAD]
        q = fp8_query(q, KV_FP8)  # fp16 for a bf16 query over FP8 tiles
        tokens = kv_start + tile * BLOCK_N + tl.arange(0, BLOCK_N)
        token_mask = tokens < seq_len
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt_s, stride_bt_b,
                            tokens, token_mask, kv_head.to(tl.int64) * stride_cache_h, dims, dim_mask,
                            stride_cache_b, stride_cache_o, BLOCK_SIZE)
        k, v = to_compute(k, q.dtype, KV_FP8), to_compute(v, q.dtype, KV_FP8)
        s = tile_scores(q, k, item_qk_scale, soft_cap, USE_DOT, USE_SOFT_CAP, DOT_PRECISION)
        s = tl.where(token_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, USE_DOT, DOT_PRECISION)

        # Finish the rows at the item's last tile (whole: straight to out) or the program's (a part).
        last_tile = tile == num_tiles - 1
        is_end = last_tile | (t == t_end - 1)
        whole = started_here & last_tile
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if KV_FP8:
            o = o * v_scale
        out_rows = seq.to(tl.int64) * stride_out_s + heads * stride_out_h
        tl.store(out_ptr + out_rows[:, None] + dims[None, :] * stride_out_d, o.to(out_ptr.dtype.element_ty),
                 mask=out_mask & whole)
        part_rows = tl.where(started_here, num_programs + pid, pid).to(tl.int64) * GROUP + rows  # [GROUP_PAD]
        is_part = is_end ^ whole
        tl.store(partial_out_ptr + part_rows[:, None] * DIM_PAD + dims[None, :], o, mask=out_mask & is_part)
        tl.store(partial_lse_ptr + part_rows, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), mask=row_mask & is_part)
        m_i = tl.where(is_end, float("-inf"), m_i)
        l_i = tl.where(is_end, 0.0, l_i)
        acc = tl.where(is_end, 0.0, acc)

        # Step to the next tile: the next kv head after the item's last tile, the next sequence after the last head.
        tile += 1
        next_item = tile == num_tiles
        tile = tl.where(next_item, 0, tile)
        started_here = started_here | next_item
        kv_head += next_item.to(tl.int32)
        next_seq = kv_head == NUM_KV_HEADS
        kv_head = tl.where(next_seq, 0, kv_head)
        seq += next_seq.to(tl.int32)

    # Items cut by this program's boundaries: at most the first and the last (the same item when one spans it).
    if t_begin < t_end:
        if (first_begin < t_begin) | (first_begin + first_tiles > t_end):
            _finish_cut_item(partial_out_ptr, partial_lse_ptr, counters_ptr, out_ptr, first_seq, first_head,
                             first_begin, first_tiles, per_program, num_programs,
                             stride_out_s, stride_out_h, stride_out_d,
                             NUM_KV_HEADS, GROUP, GROUP_P2, HEAD_DIM, DIM_PAD, MERGE_CHUNK)
        if (last_begin != first_begin) & (last_begin + last_tiles > t_end):
            _finish_cut_item(partial_out_ptr, partial_lse_ptr, counters_ptr, out_ptr, last_seq, last_head,
                             last_begin, last_tiles, per_program, num_programs,
                             stride_out_s, stride_out_h, stride_out_d,
                             NUM_KV_HEADS, GROUP, GROUP_P2, HEAD_DIM, DIM_PAD, MERGE_CHUNK)


def stream_k_num_programs(num_seqs: int, num_kv_heads: int, max_tiles_per_item: int, sm_count: int,
                          programs_per_sm: int) -> int:
    """Persistent programs for a step, from host ints: the machine's slots, but no more than there are tiles."""
    return max(1, min(programs_per_sm * sm_count, num_seqs * num_kv_heads * max_tiles_per_item))


def triton_stream_k_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, *,
                           scale: float, max_seq_len: int, sliding_window: int | None, soft_cap: float | None,
                           tuning: DecodeTuning, sm_count: int, counters: torch.Tensor | None = None,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the stream-K decode kernel into `out`; see `pagedkv.kernels.paged_decode_attention`.

    `max_seq_len` (a host bound of seq_lens) only caps the grid for tiny steps. `counters`: at
    least `num_seqs * num_kv_heads` int32 zeros, left zero by the kernel; allocated when None.
    """
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    use_dot = group >= tuning.dot_min_group
    group_p2, dim_pad = merge_group_rows(group), triton.next_power_of_2(head_dim)
    block_n = tuning.block_n_for(head_dim)
    span = min(max_seq_len, sliding_window or max_seq_len)
    per_sm = tuning.stream_k_programs_per_sm(head_dim, sliding_window is not None or soft_cap is not None)
    num_programs = stream_k_num_programs(num_seqs, num_kv_heads, max(1, -(-span // block_n)), sm_count, per_sm)
    partial_out = torch.empty(2 * num_programs, group, dim_pad, dtype=torch.float32, device=query.device)
    partial_lse = torch.empty(2 * num_programs, group, dtype=torch.float32, device=query.device)
    if counters is None:
        counters = torch.zeros(num_seqs * num_kv_heads, dtype=torch.int32, device=query.device)
    _stream_k_decode_kernel[(num_programs,)](
        query, k_cache, v_cache, block_tables, seq_lens, out, partial_out, partial_lse, counters,
        k_scale if k_scale is not None else seq_lens, v_scale if v_scale is not None else seq_lens,
        scale if soft_cap is not None else scale * LOG2E, float(soft_cap or 1.0), int(sliding_window or 0), num_seqs,
        *query.stride(), *out.stride(),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *block_tables.stride(), seq_lens.stride(0),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=group_padding(group, use_dot), GROUP_P2=group_p2,
        HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        SEQS_PAD=max(64, triton.next_power_of_2(num_seqs)), MERGE_CHUNK=merge_chunk(group_p2, dim_pad),
        USE_DOT=use_dot, DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        USE_WINDOW=sliding_window is not None, USE_SOFT_CAP=soft_cap is not None, KV_FP8=k_scale is not None,
        num_warps=tuning.num_warps, num_stages=tuning.num_stages,
    )
    return out
