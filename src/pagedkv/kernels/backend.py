"""The engine's attention backend: persistent step metadata on the device, and paged attention per layer.

One `AttentionBackend` lives as long as the engine. It owns every device buffer a step's
attention reads, allocated once at its largest size:

    table_rows     [num_table_rows + 1, max_blocks]  int32  persistent block tables, one row per running
                                                             sequence (the last row stays zero: padding)
    block_tables   [max_num_seqs, max_blocks]        int32  this step's rows, gathered from table_rows
    seq_lens       [max_num_seqs]                    int32  kv length of each sequence after this step
    cu_seqlens_q   [max_num_seqs + 1]                int32  where each prefill chunk's queries start

and the slot mapping, which is a view of the runner's staging buffer.

With layer groups (a model with sliding-window layers, `pagedkv.core.kv_groups`), `layer_groups`
maps every layer to its group, and each group has its own persistent tables (group g's rows at
`g * (num_table_rows + 1)` of `table_rows`), gathered tables and slot mapping. A step's metadata
then carries one `AttentionMetadata` per group (`group_metas`, sharing lengths and offsets), and
the bound attention hands each layer its group's. Three ways to fill them:

- `prepare(...)`: an eager step (any mix of decodes and prefill chunks); returns the step's
  `AttentionMetadata`, with the host ints the kernels' grids need.
- `prepare_for_capture(batch_size)`: the metadata of a decode-only step padded to
  `batch_size`, over fixed slices of the buffers, for capturing a CUDA graph once.
- `prepare_for_replay(batch_size)`: the device half of a decode step, the part captured
  inside the graph (int64 staging -> int32 lengths, the block-table gather).

`forward(layer, q, k, v)` writes the new K/V into the pool (slot mapping) and runs paged decode
attention over the decode rows and paged prefill attention over the rest. The model gets the
backend bound to a step's metadata (`bind`) as an explicit argument: no globals, no tags.
With an FP8 pool the write quantizes (`write_kv`'s fused kernel on CUDA) and attention gets
the layer's `k_scale` / `v_scale`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pagedkv.kernels.ops import paged_attention, paged_decode_attention, paged_prefill_attention, write_kv
from pagedkv.kernels.pool import KVPool
from pagedkv.kernels.tuning import choose_num_splits, num_sms


@dataclass
class AttentionMetadata:
    """One step's attention inputs (device views) and the host ints that size kernel grids.

    token layout:  | decode tokens (1 per seq) | prefill tokens (ragged; cu_seqlens_q) |
                   0                   num_decode_tokens                     num_tokens
    """

    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64, every slot >= 0 (padding rows write a scratch slot)
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks] int32
    decode_seq_lens: torch.Tensor | None  # [num_decode] int32 (0 for a padding row: reads nothing)
    decode_num_splits: int
    max_decode_seq_len: int
    prefill_block_tables: torch.Tensor | None  # [num_prefill, max_blocks] int32
    prefill_seq_lens: torch.Tensor | None  # [num_prefill] int32
    cu_seqlens_q: torch.Tensor | None  # [num_prefill + 1] int32
    max_seqlen_q: int
    max_prefill_seq_len: int
    group_metas: list[AttentionMetadata] | None = None  # per layer group (group 0 is this one); None: one group


class BoundAttention:
    """The backend bound to one step's metadata: what the model's layers call."""

    __slots__ = ("backend", "meta", "layer_metas")

    def __init__(self, backend: AttentionBackend, meta: AttentionMetadata,
                 layer_metas: list[AttentionMetadata] | None = None):
        self.backend = backend
        self.meta = meta
        self.layer_metas = layer_metas  # each layer's group's metadata (None: one group, `meta` for all)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, *,
                scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                written_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Layer `layer_idx`'s paged attention (see `AttentionBackend.forward`)."""
        meta = self.meta if self.layer_metas is None else self.layer_metas[layer_idx]
        return self.backend.forward(meta, layer_idx, q, k, v, scale=scale, sliding_window=sliding_window,
                                    soft_cap=soft_cap, written_kv=written_kv)

    def slot_mapping_for(self, layer_idx: int) -> torch.Tensor:
        """The slots layer `layer_idx` writes this step's K/V into (its group's)."""
        return (self.meta if self.layer_metas is None else self.layer_metas[layer_idx]).slot_mapping

    def kv_cache(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's (k_cache, v_cache), for a fused kernel that writes K/V itself."""
        return self.backend.pool.k_caches[layer_idx], self.backend.pool.v_caches[layer_idx]

    def kv_scales(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The layer's FP8 (k_scale, v_scale), `[num_kv_heads]` each; (None, None) unless the pool is FP8."""
        return self.backend.pool.kv_scales(layer_idx)

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.meta.slot_mapping


class AttentionBackend:
    """Persistent attention metadata buffers plus the per-layer paged attention call."""

    def __init__(self, pool: KVPool, *, max_num_seqs: int, max_blocks_per_seq: int, num_table_rows: int,
                 max_model_len: int, layer_groups: tuple[int, ...] | None = None):
        device = pool.device
        self.pool = pool
        self.device = device
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.num_table_rows = num_table_rows
        self.padding_row = num_table_rows  # all zeros, never written: padded graph rows point here
        self.layer_groups = layer_groups
        self.num_groups = max(layer_groups) + 1 if layer_groups else 1
        num_groups, stride = self.num_groups, num_table_rows + 1
        self.table_rows = torch.zeros(num_groups * stride, max_blocks_per_seq, dtype=torch.int32, device=device)
        all_tables = torch.zeros(num_groups, max_num_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.group_table_rows = [self.table_rows[g * stride:(g + 1) * stride] for g in range(num_groups)]
        self.group_block_tables = list(all_tables)
        self.block_tables = self.group_block_tables[0]
        self.seq_lens = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=device)
        self._sms = num_sms(device)

    # ------------------------------------------------------------------ persistent tables
    def update_tables(self, flat_index: torch.Tensor, block_ids: torch.Tensor) -> None:
        """table_rows.view(-1)[flat_index] = block_ids (both int64 device tensors: the rows that changed)."""
        self.table_rows.view(-1).index_copy_(0, flat_index, block_ids.to(torch.int32))

    # ------------------------------------------------------------------ filling a step
    def _gather(self, rows: torch.Tensor, seq_lens: torch.Tensor, num_seqs: int) -> None:
        for table_rows, block_tables in zip(self.group_table_rows, self.group_block_tables):
            torch.index_select(table_rows, 0, rows, out=block_tables[:num_seqs])
        self.seq_lens[:num_seqs].copy_(seq_lens)

    def _with_groups(self, meta: AttentionMetadata, group_slot_mappings, num_decode: int,
                     num_seqs: int) -> AttentionMetadata:
        """`meta` (group 0's) with every group's metadata: the same lengths, the group's tables and slots."""
        if self.num_groups == 1:
            return meta
        metas = [meta]
        for g in range(1, self.num_groups):
            tables = self.group_block_tables[g]
            metas.append(replace(
                meta, slot_mapping=group_slot_mappings[g - 1][:meta.num_tokens],
                decode_block_tables=tables[:num_decode] if meta.decode_block_tables is not None else None,
                prefill_block_tables=tables[num_decode:num_seqs] if meta.prefill_block_tables is not None else None))
        meta.group_metas = metas
        return meta

    def decode_splits(self, num_seqs: int, max_seq_len: int) -> int:
        return choose_num_splits(num_seqs, self.pool.num_kv_heads, max_seq_len, self._sms)

    def prepare(self, slot_mapping: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                cu_seqlens_q: torch.Tensor, *, num_decode: int, host_seq_lens: list[int],
                host_query_lens: list[int], group_slot_mappings=()) -> AttentionMetadata:
        """An eager step. Device inputs are int64 views of the runner's staging buffer; host lists size the grids.

        `cu_seqlens_q` holds the prefill chunks' offsets, starting at 0 with the first chunk;
        `group_slot_mappings` the slots of layer groups 1.. (none without groups).
        """
        num_seqs = len(host_seq_lens)
        self._gather(rows, seq_lens, num_seqs)
        num_prefill = num_seqs - num_decode
        if num_prefill:
            self.cu_seqlens_q[:num_prefill + 1].copy_(cu_seqlens_q)
        max_decode = max(host_seq_lens[:num_decode]) if num_decode else 0
        meta = AttentionMetadata(
            num_tokens=slot_mapping.shape[0],
            slot_mapping=slot_mapping,
            num_decode_tokens=num_decode,
            decode_block_tables=self.block_tables[:num_decode] if num_decode else None,
            decode_seq_lens=self.seq_lens[:num_decode] if num_decode else None,
            decode_num_splits=self.decode_splits(num_decode, max_decode) if num_decode else 1,
            max_decode_seq_len=max_decode,
            prefill_block_tables=self.block_tables[num_decode:num_seqs] if num_prefill else None,
            prefill_seq_lens=self.seq_lens[num_decode:num_seqs] if num_prefill else None,
            cu_seqlens_q=self.cu_seqlens_q[:num_prefill + 1] if num_prefill else None,
            max_seqlen_q=max(host_query_lens[num_decode:]) if num_prefill else 0,
            max_prefill_seq_len=max(host_seq_lens[num_decode:]) if num_prefill else 0,
        )
        return self._with_groups(meta, group_slot_mappings, num_decode, num_seqs)

    def prepare_for_capture(self, batch_size: int, slot_mapping: torch.Tensor,
                            group_slot_mappings=()) -> AttentionMetadata:
        """Metadata of a decode step padded to `batch_size`, over fixed buffer slices (captured once).

        The split count is fixed per graph from `max_model_len`: the kernel divides each
        sequence's actual length among the splits on the device, so a short sequence's
        surplus splits exit at once.
        """
        meta = AttentionMetadata(
            num_tokens=batch_size,
            slot_mapping=slot_mapping[:batch_size],
            num_decode_tokens=batch_size,
            decode_block_tables=self.block_tables[:batch_size],
            decode_seq_lens=self.seq_lens[:batch_size],
            decode_num_splits=self.decode_splits(batch_size, self.max_model_len),
            max_decode_seq_len=self.max_model_len,
            prefill_block_tables=None, prefill_seq_lens=None, cu_seqlens_q=None, max_seqlen_q=0,
            max_prefill_seq_len=0,
        )
        return self._with_groups(meta, group_slot_mappings, batch_size, batch_size)

    def prepare_for_replay(self, rows: torch.Tensor, seq_lens: torch.Tensor, batch_size: int) -> None:
        """The device half of a decode step (captured in the graph): gather its table rows and lengths."""
        self._gather(rows[:batch_size], seq_lens[:batch_size], batch_size)

    def prepare_for_mixed_capture(self, num_tokens: int, num_seqs: int, slot_mapping: torch.Tensor,
                                  group_slot_mappings=()) -> AttentionMetadata:
        """Metadata of any step padded to `num_tokens` tokens and `num_seqs` sequences, every sequence a chunk
        (a decode row is a chunk of one token), over fixed buffer slices: what a captured mixed step reads.

        Padding sequences have no query tokens and length 0; padding tokens belong to no sequence.
        With layer groups, each group's metadata reads its own gathered tables and slots.
        """
        meta = AttentionMetadata(
            num_tokens=num_tokens, slot_mapping=slot_mapping[:num_tokens], num_decode_tokens=0,
            decode_block_tables=None, decode_seq_lens=None, decode_num_splits=1, max_decode_seq_len=0,
            prefill_block_tables=self.block_tables[:num_seqs], prefill_seq_lens=self.seq_lens[:num_seqs],
            cu_seqlens_q=self.cu_seqlens_q[:num_seqs + 1], max_seqlen_q=num_tokens,
            max_prefill_seq_len=self.max_model_len)
        return self._with_groups(meta, group_slot_mappings, 0, num_seqs)

    def prepare_for_mixed_replay(self, rows: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                 num_seqs: int) -> None:
        """The device half of a captured mixed step: its table rows, lengths and query offsets (all sequences)."""
        self._gather(rows[:num_seqs], seq_lens[:num_seqs], num_seqs)
        self.cu_seqlens_q[:num_seqs + 1].copy_(cu_seqlens_q[:num_seqs + 1])

    def layer_meta(self, meta: AttentionMetadata, layer_idx: int) -> AttentionMetadata:
        """The metadata layer `layer_idx` reads: its layer group's (`meta` itself without groups)."""
        if meta.group_metas is None:
            return meta
        return meta.group_metas[self.layer_groups[layer_idx]]

    def bind(self, meta: AttentionMetadata) -> BoundAttention:
        """The attention the model's layers call for this step (each layer reads its group's tables)."""
        if meta.group_metas is None:
            return BoundAttention(self, meta)
        return BoundAttention(self, meta, [meta.group_metas[g] for g in self.layer_groups])

    # ------------------------------------------------------------------ per layer
    def forward(self, meta: AttentionMetadata, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None,
                v: torch.Tensor | None, *, scale: float, sliding_window: int | None = None,
                soft_cap: float | None = None, out: torch.Tensor | None = None,
                written_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Write this step's K/V (unless k is None: a fused kernel already did), then attend.

        q [T, H, D], k/v [T, Hkv, D] -> [T, H, D] (into `out` when given: a piecewise graph's static
        buffer). `sliding_window` and `soft_cap` are the layer's (HF's window semantics; scores
        capped as cap * tanh(score / cap) before the mask). `written_kv`: with k None, the step's
        K/V that the fused kernel already stored (views of its QKV). Prefill chunks read their own
        K/V from k/v or these (the split prefill kernel) rather than from the pool.
        """
        k_cache, v_cache, k_scale, v_scale = self._write(meta, layer_idx, k, v)
        if out is None:
            out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            paged_decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens,
                                   scale=scale, max_seq_len=meta.max_decode_seq_len, sliding_window=sliding_window,
                                   soft_cap=soft_cap, num_splits=meta.decode_num_splits if q.is_cuda else None,
                                   out=out[:nd], validate=False, k_scale=k_scale, v_scale=v_scale)
        if nd < meta.num_tokens:
            chunk_k, chunk_v = (k, v) if k is not None else written_kv or (None, None)
            paged_prefill_attention(q[nd:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_seq_lens,
                                    meta.cu_seqlens_q, scale=scale, max_seqlen_q=meta.max_seqlen_q,
                                    max_seq_len=meta.max_prefill_seq_len, sliding_window=sliding_window,
                                    soft_cap=soft_cap, out=out[nd:], validate=False, k_scale=k_scale, v_scale=v_scale,
                                    key=chunk_k[nd:] if chunk_k is not None else None,
                                    value=chunk_v[nd:] if chunk_v is not None else None)
        return out

    def forward_unified(self, meta: AttentionMetadata, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None,
                        v: torch.Tensor | None, *, scale: float, sliding_window: int | None = None,
                        soft_cap: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """`forward` in one launch of the unified kernel over all rows (`prepare_for_mixed_capture`'s metadata):
        its grid depends on host ints fixed per captured shape only, so the whole step captures."""
        k_cache, v_cache, k_scale, v_scale = self._write(meta, layer_idx, k, v)
        return paged_attention(q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_seq_lens,
                               meta.cu_seqlens_q, scale=scale, max_seqlen_q=meta.max_seqlen_q,
                               sliding_window=sliding_window, soft_cap=soft_cap, out=out, validate=False,
                               k_scale=k_scale, v_scale=v_scale)

    def _write(self, meta: AttentionMetadata, layer_idx: int, k: torch.Tensor | None, v: torch.Tensor | None):
        """Store this step's K/V (unless k is None: a fused kernel already did); the layer's caches and scales."""
        pool = self.pool
        k_cache, v_cache = pool.k_caches[layer_idx], pool.v_caches[layer_idx]
        k_scale, v_scale = pool.kv_scales(layer_idx)
        if k is not None:
            if k_scale is None:
                num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
                k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
                v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
            else:
                write_kv(k, v, k_cache, v_cache, meta.slot_mapping, validate=False, has_padding=False,
                         k_scale=k_scale, v_scale=v_scale)
        return k_cache, v_cache, k_scale, v_scale
