"""Hopper prefill in Gluon: a TMA producer and two wgmma consumer warp groups per program, persistent.

The split prefill (`triton_prefill_split`) leaves Hopper's scheduling to Triton's compiler:
every warp both loads and computes, and a program's two warp groups run the same code. This
kernel writes the schedule FlashAttention-3 uses, in Gluon (Triton's explicit-layout dialect):

    default partition (4 warps, few registers)   consumer 0 (4 warps, 240 regs)   consumer 1
    TMA: Q tile -> q_smem[i % 2]                  rows 0-63 of the Q tile           rows 64-127
    TMA: K, V tiles -> a ring of STAGES buffers   wgmma QK^T, softmax, wgmma PV     the same K/V
         (waits kv_empty, fills kv_ready)         (waits kv_ready, frees kv_empty)

A work item is (query tile of 128 chunk tokens, sequence, query head); the grid is one
program per SM and each walks the items `pid, pid + grid, ...`, longest tiles (last in the
chunk, under the causal mask) first, heads fastest so a GQA group's programs share K/V in L2.
The producer runs ahead into the next item (its Q goes to the other Q buffer) while the
consumers finish the current one.

Each item's kv tiles (128 keys each) are the cached prefix, then the chunk's own keys:
  - prefix tiles come from the pool through the block table, one TMA box per page (pages
    of 16 tokens: 8 boxes per tile; a page of >= 128 tokens holds whole tiles). Pages past
    the prefix's last are not read (the last page is read again; those keys are masked).
  - the chunk's tiles come from the step's key/value rows, contiguous, one box each.
Only two tiles are masked: the prefix's ragged last tile (keys past the prefix) and the
chunk's diagonal tile (key > query). A masked key's score is -inf, so its probability is 0;
its V row still enters the PV product (0 x V), so it must be finite. The ragged tile's last
page may hold stale slots (never-written memory can hold NaN), and a diagonal tile that runs
past the chunk's end holds the next sequence's rows (one bad request must not poison its
neighbour): each consumer zeroes those V rows in shared memory before its PV product.
A consumer whose 64 rows all lie past the chunk (a tile of 64 tokens or fewer) still computes
them (an idle branch spilled registers); the default route sends steps of few items on long keys
to the split kernel, which splits the keys.

Covered: bf16/fp16, head_dim 64 or 128, no sliding window, no soft cap, no FP8 cache,
TMA-aligned rows, pages of 16+ tokens that divide 128 or are a multiple of it, sm_90.
`triton_prefill_split.triton_prefill` routes every covered call with the chunk's K/V here
(PAGEDKV_PREFILL_KERNEL=auto, the default); the split kernel takes the rest.
PAGEDKV_PREFILL_KERNEL=split keeps the split kernel (an A/B switch).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from pagedkv.kernels.triton_common import LOG2E
from pagedkv.kernels.tuning import num_sms

TILE_M = gl.constexpr(128)  # query rows per item: two consumers of 64
HALF_M = gl.constexpr(64)
TILE_N = gl.constexpr(128)  # keys per kv tile
STAGES = gl.constexpr(2)  # K/V ring depth (a stage is 64 KiB at head_dim 128)
Q_BUFFERS = gl.constexpr(2)
CHUNK = gl.constexpr(64)  # columns of one 128-byte TMA box row (16-bit)
CONSUMER_REGS = gl.constexpr(240)


@gluon.jit
def _item(item, cu_seqlens_q_ptr, seq_lens_ptr, num_seqs, num_heads, num_q_tiles):
    """(skip, head, seq, tile, q_start, q_len, ctx) of work item `item`: tiles last first, heads fastest."""
    per_tile = num_seqs * num_heads
    tile = num_q_tiles - 1 - item // per_tile
    seq = (item % per_tile) // num_heads
    head = item % num_heads
    q_start = gl.load(cu_seqlens_q_ptr + seq).to(gl.int32)  # int32: TMA coordinates are 32-bit
    q_len = gl.load(cu_seqlens_q_ptr + seq + 1).to(gl.int32) - q_start
    ctx = gl.load(seq_lens_ptr + seq).to(gl.int32) - q_len
    return tile * TILE_M >= q_len, head, seq, tile, q_start, q_len, ctx


@gluon.jit
def _num_tiles(tile, q_len, ctx):
    """(prefix tiles, the prefix's whole tiles, all kv tiles) of a query tile."""
    num_prefix = (ctx + TILE_N - 1) // TILE_N
    new_keys = gl.minimum(q_len, (tile + 1) * TILE_M)
    return num_prefix, ctx // TILE_N, num_prefix + (new_keys + TILE_N - 1) // TILE_N


@gluon.jit
def _producer(q_desc, k_desc, v_desc, kc_desc, vc_desc, q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty,
              block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr, stride_bt_s, stride_bt_b, num_seqs, num_heads,
              num_q_tiles, num_items, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
              PAGE_ROWS: gl.constexpr):
    """Load each item's Q tile, then its K/V tiles into the ring, a stage ahead of the consumers."""
    kv_count = 0
    q_count = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        skip, head, seq, tile, q_start, q_len, ctx = _item(item, cu_seqlens_q_ptr, seq_lens_ptr, num_seqs,
                                                           num_heads, num_q_tiles)
        if not skip:
            num_prefix, prefix_full, num_tiles = _num_tiles(tile, q_len, ctx)
            kv_col = (head // GROUP) * HEAD_DIM
            qb = q_count % Q_BUFFERS
            mbarrier.wait(q_empty.index(qb), ((q_count // Q_BUFFERS) & 1) ^ 1)
            mbarrier.expect(q_ready.index(qb), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [q_start + tile * TILE_M, head * HEAD_DIM], q_ready.index(qb),
                                            q_smem.index(qb))
            q_count += 1
            table_row = block_tables_ptr + seq.to(gl.int64) * stride_bt_s
            last_page = (ctx + BLOCK_SIZE - 1) // BLOCK_SIZE - 1
            for t in range(num_tiles):
                stage = kv_count % STAGES
                mbarrier.wait(kv_empty.index(stage), ((kv_count // STAGES) & 1) ^ 1)
                ready = kv_ready.index(stage)
                mbarrier.expect(ready, 2 * k_desc.block_type.nbytes)
                if t < num_prefix:
                    for j in gl.static_range(TILE_N // PAGE_ROWS):
                        token = t * TILE_N + j * PAGE_ROWS
                        page = gl.minimum(token // BLOCK_SIZE, last_page)
                        row = gl.load(table_row + page * stride_bt_b).to(gl.int32) * BLOCK_SIZE + token % BLOCK_SIZE
                        for c in gl.static_range(HEAD_DIM // CHUNK):
                            k_dst = k_smem.index(stage).slice(j * PAGE_ROWS, PAGE_ROWS, dim=0)
                            v_dst = v_smem.index(stage).slice(j * PAGE_ROWS, PAGE_ROWS, dim=0)
                            tma.async_copy_global_to_shared(kc_desc, [row, kv_col + c * CHUNK], ready,
                                                            k_dst.slice(c * CHUNK, CHUNK, dim=1))
                            tma.async_copy_global_to_shared(vc_desc, [row, kv_col + c * CHUNK], ready,
                                                            v_dst.slice(c * CHUNK, CHUNK, dim=1))
                else:
                    row = q_start + (t - num_prefix) * TILE_N
                    tma.async_copy_global_to_shared(k_desc, [row, kv_col], ready, k_smem.index(stage))
                    tma.async_copy_global_to_shared(v_desc, [row, kv_col], ready, v_smem.index(stage))
                kv_count += 1


@gluon.jit
def _zero_rows_from(tile, first, HEAD_DIM: gl.constexpr):
    """Zero rows `first` .. of a [TILE_N, HEAD_DIM] shared tile, visible to this warp group's next wgmma.

    Both consumers rewrite the same tile (kept rows unchanged, the rest zeros) through the generic proxy
    while the other's wgmma may read it through the async proxy: unordered, but the bytes it reads are
    the same either way. The tile's stage is refilled only after both consumers released it.
    """
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8], [4, 1], [1, 0])
    values = tile.load(layout)
    keep = gl.arange(0, TILE_N, layout=gl.SliceLayout(1, layout)) < first
    tile.store(gl.where(keep[:, None], values, gl.zeros_like(values)))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty, seq_lens_ptr, cu_seqlens_q_ptr, out_ptr,
              qk_scale, stride_out_t, stride_out_h, num_seqs, num_heads, num_q_tiles, num_items,
              HEAD_DIM: gl.constexpr, HALF: gl.constexpr):
    """Rows HALF * 64 .. + 63 of each item's Q tile: the online softmax over its kv tiles, then the store."""
    dtype: gl.constexpr = q_smem.dtype
    qk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, TILE_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_qk: gl.constexpr = gl.SliceLayout(1, qk_layout)
    col_qk: gl.constexpr = gl.SliceLayout(0, qk_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    cols = gl.arange(0, TILE_N, layout=col_qk)
    dims = gl.arange(0, HEAD_DIM, layout=col_o)
    kv_count = 0
    q_count = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        skip, head, seq, tile, q_start, q_len, ctx = _item(item, cu_seqlens_q_ptr, seq_lens_ptr, num_seqs,
                                                           num_heads, num_q_tiles)
        if not skip:
            num_prefix, prefix_full, num_tiles = _num_tiles(tile, q_len, ctx)
            first_row = tile * TILE_M + HALF * HALF_M
            rows = first_row + gl.arange(0, HALF_M, layout=row_qk)  # chunk-relative token of each row
            qb = q_count % Q_BUFFERS
            mbarrier.wait(q_ready.index(qb), (q_count // Q_BUFFERS) & 1)
            q = q_smem.index(qb).slice(HALF * HALF_M, HALF_M, dim=0)
            m_i = gl.full([HALF_M], float("-inf"), gl.float32, layout=row_qk)
            l_i = gl.zeros([HALF_M], gl.float32, layout=row_qk)
            acc = gl.zeros([HALF_M, HEAD_DIM], gl.float32, layout=o_layout)
            for t in range(num_tiles):
                stage = kv_count % STAGES
                mbarrier.wait(kv_ready.index(stage), (kv_count // STAGES) & 1)
                qk = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)),
                                   gl.zeros([HALF_M, TILE_N], gl.float32, layout=qk_layout), use_acc=False)
                if (t == prefix_full) | (t == num_tiles - 1):  # the prefix's ragged tile, the diagonal
                    chunk_tile = t - num_prefix
                    limit = gl.where(t < num_prefix, ctx - t * TILE_N + 0 * rows, rows - chunk_tile * TILE_N + 1)
                    qk = gl.where(cols[None, :] < limit[:, None], qk, float("-inf"))
                    # V rows that are not this sequence's keys enter PV times 0: zero them (a stale page slot
                    # past the prefix, or the next sequence's rows past the chunk, may not be finite).
                    keys_here = gl.where(t < num_prefix, ctx - t * TILE_N, q_len - chunk_tile * TILE_N)
                    if keys_here < TILE_N:
                        _zero_rows_from(v_smem.index(stage), keys_here, HEAD_DIM)
                m_new = gl.maximum(m_i, gl.max(qk, axis=1) * qk_scale)
                p = gl.exp2(qk * qk_scale - m_new[:, None])
                alpha = gl.exp2(m_i - m_new)
                l_i = l_i * alpha + gl.sum(p, axis=1)
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(stage), acc)
                mbarrier.arrive(kv_empty.index(stage), count=1)
                m_i = m_new
                kv_count += 1
            mbarrier.arrive(q_empty.index(qb), count=1)
            q_count += 1
            out = acc / gl.convert_layout(l_i, row_o)[:, None]
            out_rows = first_row + gl.arange(0, HALF_M, layout=row_o)
            offsets = (q_start + out_rows).to(gl.int64) * stride_out_t + head * stride_out_h
            gl.store(out_ptr + offsets[:, None] + dims[None, :], out.to(dtype), mask=(out_rows < q_len)[:, None])


@gluon.jit
def _gluon_prefill_kernel(q_desc, k_desc, v_desc, kc_desc, vc_desc, block_tables_ptr, seq_lens_ptr,
                          cu_seqlens_q_ptr, out_ptr, qk_scale, stride_out_t, stride_out_h, stride_bt_s, stride_bt_b,
                          num_seqs, num_heads, num_q_tiles, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
                          BLOCK_SIZE: gl.constexpr, PAGE_ROWS: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    num_items = num_q_tiles * num_seqs * num_heads
    q_smem = gl.allocate_shared_memory(dtype, [Q_BUFFERS, TILE_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, TILE_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, TILE_N, HEAD_DIM], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(Q_BUFFERS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)
    gl.warp_specialize([
        (_producer, (q_desc, k_desc, v_desc, kc_desc, vc_desc, q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready,
                     kv_empty, block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr, stride_bt_s, stride_bt_b, num_seqs,
                     num_heads, num_q_tiles, num_items, GROUP, HEAD_DIM, BLOCK_SIZE, PAGE_ROWS)),
        (_consumer, (q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty, seq_lens_ptr, cu_seqlens_q_ptr,
                     out_ptr, qk_scale, stride_out_t, stride_out_h, num_seqs, num_heads, num_q_tiles, num_items,
                     HEAD_DIM, 0)),
        (_consumer, (q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty, seq_lens_ptr, cu_seqlens_q_ptr,
                     out_ptr, qk_scale, stride_out_t, stride_out_h, num_seqs, num_heads, num_q_tiles, num_items,
                     HEAD_DIM, 1)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


def unsupported_reason(query: torch.Tensor, k_cache: torch.Tensor) -> str | None:
    """Why this kernel cannot run inputs the split kernel accepts (None when it can)."""
    if query.device.type != "cuda" or torch.version.hip is not None or \
            torch.cuda.get_device_capability(query.device) != (9, 0):
        return "a device other than sm_90 (Hopper)"
    block_size = k_cache.shape[1]
    if block_size < 16 or (TILE_N.value % block_size and block_size % TILE_N.value):
        return f"block_size {block_size} (16+ tokens that divide {TILE_N.value} or are a multiple of it)"
    if k_cache.stride(0) != block_size * k_cache.stride(1):
        return f"cache strides {tuple(k_cache.stride())} (pages must tile one 2-D array for TMA)"
    return None


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.as_strided((tensor.shape[0], tensor.shape[1] * tensor.shape[2]), (tensor.stride(0), 1))


def gluon_prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, out: torch.Tensor, *, scale: float,
                            max_seqlen_q: int) -> torch.Tensor:
    """Launch the kernel into `out`; inputs passed the split kernel's `unsupported_reason` and this module's."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if num_tokens == 0 or num_seqs == 0 or max_seqlen_q == 0:
        return out
    dtype = gl.bfloat16 if query.dtype == torch.bfloat16 else gl.float16
    tile_layout = gl.NVMMASharedLayout.get_default_for([TILE_M.value, head_dim], dtype)
    page_rows = min(block_size, TILE_N.value)
    page_layout = gl.NVMMASharedLayout.get_default_for([page_rows, CHUNK.value], dtype)
    q_desc = TensorDescriptor.from_tensor(_rows(query), [TILE_M.value, head_dim], tile_layout)
    k_desc = TensorDescriptor.from_tensor(_rows(key), [TILE_N.value, head_dim], tile_layout)
    v_desc = TensorDescriptor.from_tensor(_rows(value), [TILE_N.value, head_dim], tile_layout)
    pool_shape = [num_blocks * block_size, num_kv_heads * head_dim]
    kc_desc = TensorDescriptor(k_cache, pool_shape, [k_cache.stride(1), 1], [page_rows, CHUNK.value], page_layout)
    vc_desc = TensorDescriptor(v_cache, pool_shape, [v_cache.stride(1), 1], [page_rows, CHUNK.value], page_layout)
    num_q_tiles = triton.cdiv(max_seqlen_q, TILE_M.value)
    grid = (min(num_sms(query.device), num_q_tiles * num_seqs * num_heads),)
    _gluon_prefill_kernel[grid](q_desc, k_desc, v_desc, kc_desc, vc_desc, block_tables, seq_lens.contiguous(),
                          cu_seqlens_q.contiguous(), out, scale * LOG2E, out.stride(0), out.stride(1),
                          block_tables.stride(0), block_tables.stride(1), num_seqs, num_heads, num_q_tiles,
                          GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
                          PAGE_ROWS=page_rows, num_warps=4)
    return out
