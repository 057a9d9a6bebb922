"""GQA-packed split prefill: one program holds a kv head's whole query-head group, so each K/V tile is read once.

The split kernel (`triton_prefill_split`) gives every query head its own programs, so with GQA
the `group` = num_heads // num_kv_heads programs of one kv head each read the same K/V tiles:
the cached prefix gathered row by row through the block table, the chunk's rows by TMA. Here
one program takes a kv head and BLOCK_M rows made of BLOCK_Q = BLOCK_M // group query tokens
x the group's heads, token-major (the unified kernel's layout):

    row r  ->  chunk token tile * BLOCK_Q + r // group,  query head kv_head * group + r % group

Token-major because one token's group heads are adjacent in the query and output rows
(group x head_dim contiguous elements, 1 KiB at Llama-3-8B's 4 x 128 bf16), so the tile's Q
load and output store are BLOCK_Q contiguous runs; head-major rows would be `group` x BLOCK_Q
runs of one head's row each (the causal mask costs the same either way: a shift or a mask of
the row index). Q is loaded by pointer, once per program: a 2-D TMA box of [BLOCK_Q, group x
head_dim] passes TMA's 256-element box limit, and a 3-D [BLOCK_Q, group, head_dim] box
reshaped to [BLOCK_M, head_dim] compiled (sm_90, Triton 3.6) to Q held in registers, with
more spills than the pointer load (256 stack bytes against 96-128). The pointer load is what
costs registers against the split kernel's TMA load of Q: uncapped, 201 against 186 (the
wide launch's 128-register cap then spills 96-128 bytes against 24-96).

Each row is masked by its own token's position. A query tile now spans BLOCK_Q tokens, fewer
than a kv tile may hold, so the chunk's unmasked tiles end at the last kv tile wholly before the
tile's first token (`attend`'s TILE_TOKENS). The prefix loop, the chunk loop, the kv-range split
(NUM_SPLITS, one counter per sequence x query tile x kv head) and the in-launch merge are the
split kernel's own (`triton_prefill_split_parts`).

Opt-in (`SplitPrefillTuning.pack_gqa`, or PAGEDKV_PREFILL_PACK_GQA=on for the engine): on the
H200 it was 1.7-3.6% slower than the unpacked program at page 16 and within 1% at pages 64 and 128
(it spills at 128 registers). The split kernel's launch sends a step here when the group is > 1 and
divides the resolved BLOCK_M; otherwise it runs the unpacked program and logs why, once per reason.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from pagedkv.kernels.triton_prefill_split_parts import attend, finish, launch_operands, program_tile
from pagedkv.kernels.tuning import SplitPrefillTuning

logger = logging.getLogger(__name__)


@triton.jit
def _packed_prefill_kernel(
    q_ptr, k_desc, v_desc, kc_desc, vc_desc,
    k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr, out_ptr,
    partial_out_ptr, partial_lse_ptr, counters_ptr,
    qk_scale, num_tokens, stride_out_t, stride_out_h, stride_cache_b, stride_cache_o, stride_cache_h, stride_bt_s,
    stride_bt_b, num_heads, stride_q_t, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, PAGED_TMA: tl.constexpr,
    NUM_STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    # As in the split kernel, the last (longest, under the causal mask) query tiles launch first.
    kv_head = tl.program_id(0)
    seq, tile, split, q_start, q_len = program_tile(cu_seqlens_q_ptr, NUM_SPLITS)
    if tile * BLOCK_Q >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + seq).to(tl.int32) - q_len
    rows = tl.arange(0, BLOCK_M)
    tokens = tile * BLOCK_Q + rows // GROUP  # [BLOCK_M] query index within the chunk
    dims = tl.arange(0, HEAD_DIM)
    q_tile = q_ptr + (q_start + tile * BLOCK_Q).to(tl.int64) * stride_q_t + kv_head * GROUP * HEAD_DIM
    q_rows = (rows // GROUP) * stride_q_t + (rows % GROUP) * HEAD_DIM  # [BLOCK_M] int32 within the tile
    q = tl.load(q_tile + q_rows[:, None] + dims[None, :], mask=(tokens < q_len)[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    acc, l_i, m_i = attend(acc, l_i, m_i, q, tokens, tl.arange(0, BLOCK_N), ctx, q_start, q_len, tile, split, seq,
                           kv_head, kv_head * HEAD_DIM, k_desc, v_desc, kc_desc, vc_desc, k_cache_ptr, v_cache_ptr,
                           block_tables_ptr, stride_bt_s, stride_bt_b, stride_cache_h, stride_cache_b,
                           stride_cache_o, qk_scale, HEAD_DIM, BLOCK_SIZE, BLOCK_Q, BLOCK_N, PAGED_TMA, NUM_STAGES,
                           WARP_SPECIALIZE, NUM_SPLITS)
    finish(acc, l_i, m_i, out_ptr, partial_out_ptr, partial_lse_ptr, counters_ptr, seq, tile, split,
           (q_start + tokens).to(tl.int64), tokens < q_len, kv_head * GROUP + rows % GROUP, num_heads, num_tokens,
           stride_out_t, stride_out_h, HEAD_DIM, NUM_SPLITS)


def packed_launch(tuning: SplitPrefillTuning, head_dim: int, num_heads: int, num_kv_heads: int, num_seqs: int,
                  max_seqlen_q: int, max_seq_len: int, sm_count: int) -> tuple[tuple | None, str | None]:
    """(the packed program's `resolve` tuple, None), or (None, why the step runs unpacked)."""
    group = num_heads // num_kv_heads
    if group < 2:
        return None, f"GQA group {group} (packing needs 2 or more query heads per kv head)"
    launch = tuning.resolve(head_dim, num_heads, num_seqs, max_seqlen_q, max_seq_len, sm_count, group=group)
    if launch[0] % group:
        return None, f"GQA group {group}, which does not divide the {launch[0]}-row query tile"
    return launch, None


@functools.lru_cache(maxsize=64)
def log_unpacked(reason: str) -> None:
    """Say once per distinct reason why a step asked to pack its GQA groups ran the unpacked split program."""
    logger.info("prefill: GQA packing does not cover a %s; the unpacked split kernel runs instead", reason)


def triton_packed_prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                                    seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, out: torch.Tensor, *,
                                    scale: float, max_seqlen_q: int, launch: tuple,
                                    warp_specialize: bool) -> torch.Tensor:
    """Launch the packed program into `out` with `packed_launch`'s tuple (inputs passed `unsupported_reason`)."""
    _, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    block_m, block_n, num_warps, num_stages, maxnreg, num_splits = launch
    block_q = block_m // group
    num_q_tiles = triton.cdiv(max_seqlen_q, block_q)
    operands, paged_tma = launch_operands(query, key, value, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                                          out, scale=scale, block_n=block_n, num_splits=num_splits,
                                          num_counters=num_seqs * num_q_tiles * num_kv_heads)
    options = {} if maxnreg is None else {"maxnreg": maxnreg}
    _packed_prefill_kernel[(num_kv_heads, num_seqs, num_q_tiles * num_splits)](
        query, *operands, num_heads, query.stride(0), GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n, PAGED_TMA=paged_tma, NUM_STAGES=num_stages,
        WARP_SPECIALIZE=warp_specialize, NUM_SPLITS=num_splits, num_warps=num_warps, num_stages=num_stages,
        **options)
    return out
