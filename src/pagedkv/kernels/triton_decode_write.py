"""Triton decode attention that also writes the new token's K/V into its page: one launch per layer and step.

A decode step of a small model is bound by host time, and every launch costs host time.
The unfused step writes the new K/V (`write_kv`) and then attends (`paged_decode_attention`);
here one kernel does both. Grid and tiles are the decode kernel's (`triton_decode`): one
program per (sequence, kv head, split) holds the GQA group's queries and walks its split of
the visible kv range through the block table.

The new token sits at position `seq_len - 1`; its slot comes from the block table:

    slot = block_tables[seq, (seq_len - 1) // block_size] * block_size + (seq_len - 1) % block_size

The ordering hazard: the program that attends over that position must see the new K/V, and
in a grid there is no order between one program's store and another's load. So nobody loads
it: the one split whose range covers `seq_len - 1` reads the cache only below it, folds the
new token into its softmax from registers (one more column, a multiply-sum), and then stores
it into the slot for later steps. The other splits never read that position. A row with
seq_len 0 (padding) writes nothing. The tile loop is the decode kernel's own, and so is its
register use (a tile patched with the new row held twice the registers).

Splits merge inside the launch (the last split program of each (sequence, kv head) to arrive
merges, see `triton_common`), so a split step is still one launch. `DecodeWriteStep` is the
hot path: it fixes everything a step's layers share (grid, metadata, scratch, constexprs) and
launches through a `BoundKernel`, passing only the layer's tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.launch import BoundConfig, BoundKernel
from pagedkv.kernels.pool import KVPool
from pagedkv.kernels.reference import reference_decode_attention, reference_write_kv
from pagedkv.kernels.triton_common import (
    LOG2E,
    merge_chunk,
    merge_group_rows,
    store_split_part,
    tanh,
)
from pagedkv.kernels.triton_decode import attend_range, group_padding, split_range
from pagedkv.kernels.tuning import DecodeTuning, choose_num_splits, num_sms
from pagedkv.kernels.workspace import KernelWorkspace


@triton.jit
def _fold_new_token(q, k_new, v_new, m_i, l_i, acc, qk_scale, soft_cap, fold, USE_SOFT_CAP: tl.constexpr):
    """Fold one kv position held in registers (`k_new`, `v_new`: `[DIM_PAD]`) into the softmax state, where `fold`.

    Row vectors and no branch: the first version folded a `[GROUP_PAD, 1]` score tile inside
    `if covers_new:` and was right under the interpreter but wrong on the H200 (errors of 1-14
    against the float64 reference); this form has neither the size-1 axis nor the
    data-dependent branch. A program that does not cover the new token keeps its state.
    """
    s = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1)  # [GROUP_PAD]
    if USE_SOFT_CAP:
        s = soft_cap * tanh(s * qk_scale / soft_cap) * 1.4426950408889634
    else:
        s = s * qk_scale
    m_new = tl.where(fold, tl.maximum(m_i, s), m_i)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.where(fold, tl.exp2(s - m_safe), 0.0)
    l_i = l_i * alpha + p
    acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)[None, :]
    return m_new, l_i, acc


@triton.jit
def _decode_write_kernel(
    # a layer's own tensors, then the step's (`DecodeWriteStep` passes the latter as `FixedArgs`)
    q_ptr, k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, partial_out_ptr, partial_lse_ptr, counters_ptr,
    # the same for the scalars
    qk_scale, soft_cap, sliding_window,
    stride_q_s, stride_q_h, stride_q_d, stride_k_s, stride_k_h, stride_k_d, stride_v_s, stride_v_h, stride_v_d,
    stride_out_s, stride_out_h, stride_out_d,
    num_splits, stride_cache_b, stride_cache_o, stride_cache_h, stride_bt_s, stride_bt_b, stride_lens,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, IS_SPLIT: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # The visible range [kv_start, seq_len), then this split's piece [lo, hi) of it (as `triton_decode`).
    seq_len = tl.load(seq_lens_ptr + seq * stride_lens).to(tl.int32)
    lo, hi = split_range(seq_len, sliding_window, num_splits, split, BLOCK_N, USE_WINDOW)
    # The splits partition [kv_start, seq_len): exactly one covers the new token (none when seq_len is 0). It
    # reads the cache below the new token only and takes the new token from registers.
    new_pos = seq_len - 1
    covers_new = (lo <= new_pos) & (new_pos < hi)
    read_hi = tl.where(covers_new, new_pos, hi)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_DIM
    out_mask = row_mask[:, None] & dim_mask[None, :]
    heads = kv_head * GROUP + rows  # [GROUP_PAD] query heads of this kv head
    q_offsets = seq.to(tl.int64) * stride_q_s + heads[:, None] * stride_q_h + dims[None, :] * stride_q_d
    q = tl.load(q_ptr + q_offsets, mask=out_mask, other=0.0)  # [GROUP_PAD, DIM_PAD]

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)  # running max, log2 units
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    head_offset = kv_head.to(tl.int64) * stride_cache_h

    m_i, l_i, acc = attend_range(q, m_i, l_i, acc, lo, read_hi, k_cache_ptr, v_cache_ptr, table_row, stride_bt_b,
                                 head_offset, dims, dim_mask, stride_cache_b, stride_cache_o, qk_scale, soft_cap,
                                 BLOCK_SIZE, BLOCK_N, USE_DOT, USE_SOFT_CAP, DOT_PRECISION, False)

    new_mask = dim_mask & covers_new
    k_new = tl.load(k_new_ptr + seq.to(tl.int64) * stride_k_s + kv_head * stride_k_h + dims * stride_k_d,
                    mask=new_mask, other=0.0)  # [DIM_PAD]
    v_new = tl.load(v_new_ptr + seq.to(tl.int64) * stride_v_s + kv_head * stride_v_h + dims * stride_v_d,
                    mask=new_mask, other=0.0)
    m_i, l_i, acc = _fold_new_token(q, k_new, v_new, m_i, l_i, acc, qk_scale, soft_cap, covers_new, USE_SOFT_CAP)
    # Stored for later steps after this program's reads, so that under the interpreter, which runs a
    # program's statements in order, a loop that read the slot would read the poison the tests put there.
    block_id = tl.load(table_row + (tl.maximum(new_pos, 0) // BLOCK_SIZE) * stride_bt_b, mask=covers_new,
                       other=0).to(tl.int64)
    slot_row = block_id * stride_cache_b + (tl.maximum(new_pos, 0) % BLOCK_SIZE) * stride_cache_o + head_offset
    tl.store(k_cache_ptr + slot_row + dims, k_new.to(k_cache_ptr.dtype.element_ty), mask=new_mask)
    tl.store(v_cache_ptr + slot_row + dims, v_new.to(v_cache_ptr.dtype.element_ty), mask=new_mask)

    has_any = l_i > 0
    o = acc / tl.where(has_any, l_i, 1.0)[:, None]
    if IS_SPLIT:  # splits always merge in the launch: the last to arrive reduces
        store_split_part(o, m_i, l_i, partial_out_ptr, partial_lse_ptr, counters_ptr, out_ptr, seq, kv_head * GROUP,
                         GROUP * tl.num_programs(1), split, num_splits, seq * tl.num_programs(1) + kv_head,
                         stride_out_s, stride_out_h, stride_out_d, GROUP, GROUP_PAD, GROUP_P2, HEAD_DIM, DIM_PAD,
                         True, MERGE_CHUNK)
    else:
        out_rows = seq.to(tl.int64) * stride_out_s + heads * stride_out_h  # [GROUP_PAD]
        tl.store(out_ptr + out_rows[:, None] + dims[None, :] * stride_out_d, o.to(out_ptr.dtype.element_ty),
                 mask=out_mask)


def _strides3(tensor: torch.Tensor) -> tuple[int, int, int]:
    """(sequence, head, dim) strides of `[num_seqs, heads, head_dim]` or of HF's `[num_seqs, heads, 1, head_dim]`."""
    stride = tensor.stride()
    return stride[0], stride[1], stride[-1]


def _out_strides(out: torch.Tensor) -> tuple[int, int, int]:
    """(sequence, head, dim) strides of `[num_seqs, num_heads, head_dim]` or HF's `[num_seqs, 1, heads, head_dim]`."""
    stride = out.stride()
    return stride[0], stride[-2], stride[-1]


def launch_constexprs(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, *,
                      use_window: bool, use_soft_cap: bool, is_split: bool, tuning: DecodeTuning) -> dict:
    """The kernel's constexprs and launch options for one shape (what a `BoundConfig` fixes)."""
    group = num_heads // num_kv_heads
    use_dot = group >= tuning.dot_min_group
    group_p2, dim_pad = merge_group_rows(group), triton.next_power_of_2(head_dim)
    return dict(GROUP=group, GROUP_PAD=group_padding(group, use_dot), GROUP_P2=group_p2, HEAD_DIM=head_dim,
                DIM_PAD=dim_pad, BLOCK_SIZE=block_size, BLOCK_N=tuning.block_n_for(head_dim), USE_DOT=use_dot,
                DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32", USE_WINDOW=use_window,
                USE_SOFT_CAP=use_soft_cap, IS_SPLIT=is_split, MERGE_CHUNK=merge_chunk(group_p2, dim_pad),
                num_warps=tuning.num_warps, num_stages=tuning.num_stages)


def _layer_scalars(scale: float, sliding_window: int | None, soft_cap: float | None) -> tuple[float, float, int]:
    """The kernel's first scalars (floats as floats: an int 1 would be compiled in as a constant)."""
    return float(scale if soft_cap is not None else scale * LOG2E), float(soft_cap or 1.0), int(sliding_window or 0)


def _step_scalars(num_splits: int, k_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor) -> tuple:
    """The kernel's last scalars: what a decode step's layers share."""
    return num_splits, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *block_tables.stride(), \
        seq_lens.stride(0)


def triton_decode_write_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                  k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                                  seq_lens: torch.Tensor, out: torch.Tensor, *, scale: float, num_splits: int,
                                  sliding_window: int | None, soft_cap: float | None, tuning: DecodeTuning,
                                  counters: torch.Tensor | None = None) -> torch.Tensor:
    """Write the new K/V and attend, in one launch into `out`; see `pagedkv.kernels.paged_decode_write_attention`.

    Triton's own launch (`DecodeWriteStep` is the bound one). `counters` (split steps only): at
    least `num_seqs * num_kv_heads` int32 zeros, left zero; allocated per call when None.
    """
    num_seqs, num_heads, head_dim = query.shape[0], query.shape[1], query.shape[-1]
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_seqs == 0:
        return out
    is_split = num_splits > 1
    if is_split:
        dim_pad = triton.next_power_of_2(head_dim)
        partial_out = torch.empty(num_seqs, num_heads, num_splits, dim_pad, dtype=torch.float32, device=query.device)
        partial_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
        if counters is None:
            counters = torch.zeros(num_seqs * num_kv_heads, dtype=torch.int32, device=query.device)
    else:
        partial_out = partial_lse = counters = out  # unused when IS_SPLIT is False
    constexprs = launch_constexprs(num_heads, num_kv_heads, head_dim, block_size, query.dtype,
                                   use_window=sliding_window is not None, use_soft_cap=soft_cap is not None,
                                   is_split=is_split, tuning=tuning)
    _decode_write_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, key, value, k_cache, v_cache, out, block_tables, seq_lens, partial_out, partial_lse, counters,
        *_layer_scalars(scale, sliding_window, soft_cap), *_strides3(query), *_strides3(key), *_strides3(value),
        *_out_strides(out), *_step_scalars(num_splits, k_cache, block_tables, seq_lens), **constexprs)
    return out


def reference_decode_write_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                     k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                                     seq_lens: torch.Tensor, *, scale: float, sliding_window: int | None = None,
                                     soft_cap: float | None = None, float64: bool = False) -> torch.Tensor:
    """The definition: write each sequence's new K/V at position seq_len - 1 (`reference_write_kv`), then decode."""
    block_size = k_cache.shape[1]
    lens = seq_lens.tolist()
    slots = [int(block_tables[b, (n - 1) // block_size]) * block_size + (n - 1) % block_size if n else -1
             for b, n in enumerate(lens)]
    reference_write_kv(key, value, k_cache, v_cache, torch.tensor(slots, dtype=torch.int64))
    return reference_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                      sliding_window=sliding_window, soft_cap=soft_cap, float64=float64)


class DecodeWriteKernel:
    """The fused kernel bound once for one KV pool; `step(...)` makes the launcher a decode step's layers call.

    Holds the `BoundKernel` (its compiled specializations outlive any one step) and the
    self-resetting split counters, grown as batches grow.
    """

    def __init__(self, pool: KVPool, tuning: DecodeTuning = DecodeTuning(), *, bindable: bool | None = None):
        self.pool = pool
        self.tuning = tuning
        self.kernel = BoundKernel(_decode_write_kernel, bindable=bindable)
        self._workspace: KernelWorkspace | None = None
        self._configs: dict[tuple, BoundConfig] = {}

    def counters(self, num_items: int) -> torch.Tensor:
        """`num_items` zero counters. A bigger buffer replaces a short one; launches still in flight keep the old
        one (the caching allocator hands freed memory out again in stream order)."""
        if self._workspace is None or self._workspace.max_items < num_items:
            self._workspace = KernelWorkspace(max(64, 2 * num_items), self.pool.device)
        return self._workspace.counters(num_items)

    def config(self, num_heads: int, dtype: torch.dtype, use_window: bool, use_soft_cap: bool,
               is_split: bool) -> BoundConfig:
        """The `BoundConfig` of one shape, made once."""
        key = (num_heads, dtype, use_window, use_soft_cap, is_split)
        config = self._configs.get(key)
        if config is None:
            pool = self.pool
            constexprs = launch_constexprs(num_heads, pool.num_kv_heads, pool.head_dim, pool.block_size, dtype,
                                           use_window=use_window, use_soft_cap=use_soft_cap, is_split=is_split,
                                           tuning=self.tuning)
            config = self._configs[key] = self.kernel.config(**constexprs)
        return config

    def step(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int) -> DecodeWriteStep:
        """The launcher of one decode step over `block_tables` `[num_seqs, width]` and `seq_lens` `[num_seqs]`.

        `max_seq_len` is a host-side bound of seq_lens (it sizes the split count, as in decode).
        """
        return DecodeWriteStep(self, block_tables, seq_lens, max_seq_len)


class DecodeWriteStep:
    """One decode step's fused launches: what every layer shares is fixed here, once.

    Per layer, `__call__` hands the layer's tensors and strides to the bound kernel and does
    nothing else: the grid, the split count, the split scratch, the constexprs, the metadata
    (as `FixedArgs`, keyed once) and the output buffer are the step's. The split count is
    rounded down to a power of two, so a growing sequence changes it (and with it the binding
    key) only a few times in a generation.
    """

    __slots__ = ("owner", "k_caches", "v_caches", "block_tables", "seq_lens", "num_seqs", "num_splits", "grid",
                 "_layers")

    def __init__(self, owner: DecodeWriteKernel, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 max_seq_len: int):
        pool = owner.pool
        self.owner = owner
        self.k_caches, self.v_caches = pool.k_caches, pool.v_caches
        self.block_tables = block_tables
        self.seq_lens = seq_lens
        self.num_seqs = num_seqs = seq_lens.shape[0]
        capacity = block_tables.shape[1] * pool.block_size
        splits = choose_num_splits(num_seqs, pool.num_kv_heads, min(max_seq_len, capacity), num_sms(pool.device),
                                   owner.tuning)
        self.num_splits = 1 << (splits.bit_length() - 1)
        self.grid = (num_seqs, pool.num_kv_heads, self.num_splits)
        # Per (num_heads, dtype, scale, window, soft cap): (config, fixed args, leading scalars, outputs).
        self._layers: dict[tuple, tuple] = {}

    def _prepare(self, layer_key: tuple, query: torch.Tensor) -> tuple:
        num_heads, dtype, scale, sliding_window, soft_cap = layer_key
        pool = self.owner.pool
        is_split = self.num_splits > 1
        config = self.owner.config(num_heads, dtype, sliding_window is not None, soft_cap is not None, is_split)
        if is_split:
            dim_pad = triton.next_power_of_2(pool.head_dim)
            partial_out = torch.empty(self.num_seqs, num_heads, self.num_splits, dim_pad, dtype=torch.float32,
                                      device=pool.device)
            partial_lse = torch.empty(self.num_seqs, num_heads, self.num_splits, dtype=torch.float32,
                                      device=pool.device)
            scratch = (partial_out, partial_lse, self.owner.counters(self.num_seqs * self.grid[1]))
        else:
            scratch = (self.seq_lens,) * 3  # unused by the kernel when IS_SPLIT is False
        fixed = config.fix((self.block_tables, self.seq_lens, *scratch),
                           _step_scalars(self.num_splits, self.k_caches[0], self.block_tables, self.seq_lens))
        # Every layer's output in one allocation: out[layer] is a layer's [num_seqs, 1, num_heads, head_dim].
        outputs = torch.empty(pool.num_layers, self.num_seqs, 1, num_heads, pool.head_dim, dtype=dtype,
                              device=pool.device)
        prepared = self._layers[layer_key] = (config, fixed, _layer_scalars(scale, sliding_window, soft_cap), outputs)
        return prepared

    def __call__(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                 sliding_window: int | None = None, soft_cap: float | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """Write layer `layer_idx`'s new K/V (`key`, `value`) into their slots and attend; returns the output.

        query `[num_seqs, num_heads, head_dim]` and key/value `[num_seqs, num_kv_heads, head_dim]`, or
        HF's `[num_seqs, heads, 1, head_dim]`: any strides (read per call), the pool's dtype. The
        output is `out` when given (`[num_seqs, num_heads, head_dim]` or `[num_seqs, 1, num_heads,
        head_dim]`), else the layer's `[num_seqs, 1, num_heads, head_dim]` slice of one buffer the
        step allocates for all layers.
        """
        layer_key = (query.shape[1], query.dtype, scale, sliding_window, soft_cap)
        config, fixed, head, outputs = self._layers.get(layer_key) or self._prepare(layer_key, query)
        if out is None:
            out = outputs[layer_idx]
        q, k, v, o = query.stride(), key.stride(), value.stride(), out.stride()
        config.launch(self.grid, (query, key, value, self.k_caches[layer_idx], self.v_caches[layer_idx], out),
                      head + (q[0], q[1], q[-1], k[0], k[1], k[-1], v[0], v[1], v[-1], o[0], o[-2], o[-1]), fixed)
        return out
