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
(`triton_prefill.py`) and logs why, once per reason. `SplitPrefillTuning.pack_gqa` (opt-in)
runs the same loops (`triton_prefill_split_parts`) in a program per kv head: `triton_prefill_packed`.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from pagedkv.env import env_choice
from pagedkv.kernels import triton_prefill_packed as packed
from pagedkv.kernels.triton_prefill import triton_prefill_attention
from pagedkv.kernels.triton_prefill_split_parts import attend, finish, launch_operands, program_tile, rows_2d
from pagedkv.kernels.tuning import PrefillTuning, SplitPrefillTuning, num_sms

logger = logging.getLogger(__name__)
PREFILL_KERNELS = ("auto", "gluon", "split", "paged")
_DEFAULT_SPLIT = SplitPrefillTuning()


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
    seq, tile, split, q_start, q_len = program_tile(cu_seqlens_q_ptr, NUM_SPLITS)
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
    acc, l_i, m_i = attend(acc, l_i, m_i, q, rows, cols, ctx, q_start, q_len, tile, split, seq, kv_head, kv_col,
                           k_desc, v_desc, kc_desc, vc_desc, k_cache_ptr, v_cache_ptr, block_tables_ptr, stride_bt_s,
                           stride_bt_b, stride_cache_h, stride_cache_b, stride_cache_o, qk_scale, HEAD_DIM,
                           BLOCK_SIZE, BLOCK_M, BLOCK_N, PAGED_TMA, NUM_STAGES, WARP_SPECIALIZE, NUM_SPLITS)
    finish(acc, l_i, m_i, out_ptr, partial_out_ptr, partial_lse_ptr, counters_ptr, seq, tile, split,
           (q_start + rows).to(tl.int64), rows < q_len, head, tl.num_programs(0), num_tokens, stride_out_t,
           stride_out_h, HEAD_DIM, NUM_SPLITS)


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
    `tuning.pack_gqa` runs the GQA-packed program (`triton_prefill_packed`) where the group fits.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_tokens == 0 or num_seqs == 0 or max_seqlen_q == 0:
        return out
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    if tuning.pack_gqa:
        launch, reason = packed.packed_launch(tuning, head_dim, num_heads, num_kv_heads, num_seqs, max_seqlen_q,
                                              max_seq_len, num_sms(query.device))
        if reason is None:
            return packed.triton_packed_prefill_attention(query, key, value, k_cache, v_cache, block_tables,
                                                          seq_lens, cu_seqlens_q, out, scale=scale,
                                                          max_seqlen_q=max_seqlen_q, launch=launch,
                                                          warp_specialize=tuning.warp_specialize)
        packed.log_unpacked(reason)
    block_m, block_n, num_warps, num_stages, maxnreg, num_splits = tuning.resolve(
        head_dim, num_heads, num_seqs, max_seqlen_q, max_seq_len, num_sms(query.device))
    num_q_tiles = triton.cdiv(max_seqlen_q, block_m)
    operands, paged_tma = launch_operands(query, key, value, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                                          out, scale=scale, block_n=block_n, num_splits=num_splits,
                                          num_counters=num_seqs * num_q_tiles * num_heads)
    options = {} if maxnreg is None else {"maxnreg": maxnreg}
    _split_prefill_kernel[(num_heads, num_seqs, num_q_tiles * num_splits)](
        TensorDescriptor.from_tensor(rows_2d(query), [block_m, head_dim]), *operands,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_N=block_n, PAGED_TMA=paged_tma, NUM_STAGES=num_stages, WARP_SPECIALIZE=tuning.warp_specialize,
        NUM_SPLITS=num_splits, num_warps=num_warps, num_stages=num_stages, **options)
    return out


@functools.lru_cache(maxsize=64)
def _log_fallback(reason: str) -> None:
    """Say once per distinct reason why a call given its chunk K/V still ran the all-paged kernel."""
    logger.info("prefill: the split kernel does not cover %s; the paged prefill kernel runs instead", reason)


def _auto_keeps_split(query: torch.Tensor, seq_lens: torch.Tensor, max_seqlen_q: int, max_seq_len: int | None,
                      block_tables: torch.Tensor, k_cache: torch.Tensor, tuning: SplitPrefillTuning) -> str | None:
    """Why the default route keeps the split kernel for a call the Gluon kernel could take (None: it does not).

    Launch settings given explicitly (or GQA packing asked for) are the split kernel's. A step of at
    most half as many (query tile, sequence, head) items as SMs on long keys: the Gluon kernel runs one
    item per SM and never splits the keys, the split kernel splits them and fills twice the SMs.
    """
    if tuning != _DEFAULT_SPLIT:
        return "explicit split-kernel settings"
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * k_cache.shape[1]
    items = -(-max_seqlen_q // 128) * seq_lens.shape[0] * query.shape[1]
    if _is_hopper(query.device) and 2 * items <= num_sms(query.device) and \
            max_seq_len >= 2 * tuning.min_split_tokens:
        return f"{items} work items for {num_sms(query.device)} SMs on {max_seq_len} keys"
    return None


def _gluon_reason(query: torch.Tensor, k_cache: torch.Tensor) -> str | None:
    """Why the Gluon kernel cannot run a call the split kernel covers (its import failing is a reason too)."""
    if not _is_hopper(query.device):
        return "a device other than sm_90 (Hopper)"
    try:
        from pagedkv.kernels.gluon_prefill import unsupported_reason as gluon_unsupported
    except ImportError as error:  # a Triton without Gluon's Hopper module
        return f"this Triton ({error})"
    return gluon_unsupported(query, k_cache)


@functools.lru_cache(maxsize=16)
def _is_hopper(device: torch.device) -> bool:
    return (device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device) == (9, 0))


@functools.lru_cache(maxsize=64)
def _log_gluon_fallback(reason: str) -> None:
    """Say once per distinct reason why a call that asked for the Gluon kernel ran the split kernel."""
    logger.info("prefill: the Gluon kernel does not cover %s; the split kernel runs instead", reason)


def prefill_route(key: torch.Tensor | None) -> str:
    """"auto", "gluon", "split" or "paged": which prefill kernel a call with these chunk K/V asks for.

    PAGEDKV_PREFILL_KERNEL (read per call; default "auto": the Gluon kernel where it covers the
    call, else the split kernel) switches: "gluon" asks for the Gluon kernel and logs once per
    reason when it cannot run, "split" keeps the split kernel, "paged" the all-paged kernel.
    """
    if key is None:
        return "paged"
    return env_choice("PAGEDKV_PREFILL_KERNEL", PREFILL_KERNELS, "auto")


def triton_prefill(query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   cu_seqlens_q: torch.Tensor, out: torch.Tensor, *, scale: float, max_seqlen_q: int,
                   sliding_window: int | None, soft_cap: float | None, tuning: PrefillTuning,
                   split_tuning: SplitPrefillTuning, k_scale: torch.Tensor | None,
                   v_scale: torch.Tensor | None, max_seq_len: int | None = None) -> torch.Tensor:
    """Given the chunk K/V: the Gluon kernel on Hopper, else the split kernel, where covered; else the all-paged
    kernel (the reason logged once)."""
    route = prefill_route(key)
    if route != "paged" and max_seqlen_q >= split_tuning.min_query_tokens:
        reason = unsupported_reason(query, key, value, k_cache, v_cache, out, sliding_window=sliding_window,
                                    soft_cap=soft_cap, k_scale=k_scale)
        split = split_tuning.with_env_packing()
        wants_gluon = route == "gluon" or route == "auto" and reason is None and _auto_keeps_split(
            query, seq_lens, max_seqlen_q, max_seq_len, block_tables, k_cache, split) is None
        if reason is None and wants_gluon:
            hopper_reason = _gluon_reason(query, k_cache)
            if hopper_reason is None:
                from pagedkv.kernels.gluon_prefill import gluon_prefill_attention

                return gluon_prefill_attention(query, key, value, k_cache, v_cache, block_tables, seq_lens,
                                               cu_seqlens_q, out, scale=scale, max_seqlen_q=max_seqlen_q)
            if route == "gluon":
                _log_gluon_fallback(hopper_reason)
        if reason is None:
            return triton_split_prefill_attention(query, key, value, k_cache, v_cache, block_tables, seq_lens,
                                                  cu_seqlens_q, out, scale=scale, max_seqlen_q=max_seqlen_q,
                                                  tuning=split, max_seq_len=max_seq_len)
        _log_fallback(reason)
    return triton_prefill_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale=scale,
                                    max_seqlen_q=max_seqlen_q, sliding_window=sliding_window, soft_cap=soft_cap,
                                    tuning=tuning, k_scale=k_scale, v_scale=v_scale)
