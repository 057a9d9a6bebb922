"""The fast torch path: what the kernels compute, for CPU tensors, as gather + SDPA.

The engine on CPU runs this path, so it is batched where the reference loops: decode gathers
each sequence's pages into a contiguous `[n, num_kv_heads, max_len, head_dim]` block (a few
sequences at a time, to bound the copy) and calls `scaled_dot_product_attention` with a
length mask; prefill gathers one sequence at a time, since its chunks are ragged; a mixed
step sends its one-token rows through decode and its chunks through prefill.

Slots past a sequence's length may hold anything, NaN included (a fresh block's tail, or a
padding entry of the block table that points at someone else's block). A masked score
alone does not neutralise a NaN value row (0 * NaN = NaN in P @ V), so decode gathers token
rows, not whole blocks, and points every position a query may not see at the sequence's
last token: the padding then holds finite, owned data that the mask removes.

The soft cap has no SDPA form; with a soft cap the scores are computed explicitly in fp32,
a chunk of queries at a time.

An FP8 cache (`k_scale` / `v_scale` given) is quantized on write with `fp8.quantize` and its
gathered rows are dequantized into the query's dtype before SDPA (`fp8.dequantize`): the
math of the reference, batched.

NOTE: rows are moved with `index_select` / `index_copy_` only, never `tensor[index]`: on a
small CPU machine, advanced indexing went through a thread-pool path measured at ~10 ms for
64 rows (2 cores, torch 2.13), against ~10 us for `index_select`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pagedkv.kernels.fp8 import as_bytes, dequantize, quantize

#: Bytes of gathered K (and as many of V) one decode chunk may hold.
_DECODE_CHUNK_BYTES = 16 * 2**20
#: Query rows per chunk of the explicit (soft-capped) prefill.
_PREFILL_CHUNK_ROWS = 256


def torch_write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None, has_padding: bool = True) -> None:
    """Scatter `key`/`value` `[num_tokens, Hkv, D]` into the caches at `slot_mapping`; negative slots skip.

    With scales (an FP8 cache) the tokens are quantized first. `has_padding=False` promises no
    negative slot (no host read to look for one).
    """
    num_kv_heads, head_dim = k_cache.shape[2:]
    slots = slot_mapping.to(torch.int64)
    if has_padding and bool((slots < 0).any()):
        keep = (slots >= 0).nonzero().squeeze(1)
        slots, key, value = slots.index_select(0, keep), key.index_select(0, keep), value.index_select(0, keep)
    if k_scale is not None:
        key, value = quantize(key, k_scale, k_cache.dtype), quantize(value, v_scale, v_cache.dtype)
    # [num_blocks * block_size, Hkv, D] views: a slot is a row index.
    as_bytes(k_cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slots, as_bytes(key))
    as_bytes(v_cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slots, as_bytes(value))


def _compute_rows(rows: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows `[..., Hkv, D]` in the compute dtype: dequantized when the cache is FP8."""
    return rows if scale is None else dequantize(rows, scale, dtype)


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
                        soft_cap: float | None) -> torch.Tensor:
    """Grouped attention with the scores in fp32.

    q `[n, Hkv, G, M, D]`, k/v `[n, Hkv, L, D]`, visible `[n, 1, 1, M, L]` -> `[n, Hkv, G, M, D]` (fp32).
    """
    scores = torch.matmul(q.float(), k.float().unsqueeze(2).transpose(-1, -2)) * scale  # [n, Hkv, G, M, L]
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.masked_fill(~visible, -math.inf)
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
    return torch.matmul(probs, v.float().unsqueeze(2))


def torch_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Paged decode attention by gathering pages and calling SDPA. Returns `[num_seqs, num_heads, head_dim]`."""
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query) if out is None else out.zero_()
    lens = seq_lens.tolist()
    max_len = max(lens, default=0)
    if max_len == 0:
        return out
    num_table_blocks = -(-max_len // block_size)
    table = block_tables[:, :num_table_blocks].to(torch.int64)
    positions = torch.arange(max_len, device=query.device)
    row_bytes = max(k_cache.element_size(), query.element_size() if k_scale is not None else 0)
    chunk = max(1, _DECODE_CHUNK_BYTES // (max_len * num_kv_heads * head_dim * row_bytes))
    chunk = min(chunk, num_seqs)
    # Reused across chunks: [chunk * max_len, Hkv, D] token rows.
    k_buffer = k_cache.new_empty((chunk * max_len, num_kv_heads, head_dim))
    v_buffer = torch.empty_like(k_buffer)
    k_rows, v_rows = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    for start in range(0, num_seqs, chunk):
        stop = min(num_seqs, start + chunk)
        n, rows = stop - start, slice(start, stop)
        chunk_lens = seq_lens[rows].to(torch.int64)
        visible = positions[None, :] < chunk_lens[:, None]  # [n, max_len]
        if sliding_window is not None:
            visible &= positions[None, :] >= chunk_lens[:, None] - sliding_window
        # Hidden positions read the last token instead (owned, finite); a seq_len-0 row reads
        # position 0 of its table, whatever it holds, and is replaced by zeros below.
        last = (chunk_lens - 1).clamp(min=0)[:, None]
        safe_positions = torch.where(visible, positions[None, :], last)  # [n, max_len]
        block_ids = table[rows].gather(1, safe_positions // block_size).clamp(0, num_blocks - 1)
        slots = (block_ids * block_size + safe_positions % block_size).view(-1)
        k = torch.index_select(k_rows, 0, slots, out=k_buffer[: slots.numel()])
        v = torch.index_select(v_rows, 0, slots, out=v_buffer[: slots.numel()])
        k = _compute_rows(k, k_scale, query.dtype).view(n, max_len, num_kv_heads, -1)
        v = _compute_rows(v, v_scale, query.dtype).view(n, max_len, num_kv_heads, -1)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [n, Hkv, max_len, D]
        if soft_cap is None:
            q = query[rows].unsqueeze(2)  # [n, H, 1, D]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None, None, :], scale=scale,
                                               enable_gqa=True).squeeze(2)  # [n, H, D]
        else:
            q = query[rows].reshape(n, num_kv_heads, group, 1, head_dim)
            o = _explicit_attention(q, k, v, visible[:, None, None, None, :], scale, soft_cap)
            o = o.view(n, num_heads, head_dim)
        # A seq_len-0 row (padding of a static batch) sees nothing: zeros, not SDPA's NaN.
        out[rows] = torch.where((chunk_lens > 0)[:, None, None], o.to(out.dtype), 0)
    return out


def _prefill_sequences(query, k_cache, v_cache, block_tables, seq_lens, cu, seqs, scale, sliding_window, soft_cap,
                       out, k_scale=None, v_scale=None) -> None:
    """Causal attention of sequences `seqs`' chunks (rows cu[b] .. cu[b+1]-1) into `out`, one at a time, via SDPA."""
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    lens = seq_lens.tolist()
    for b in seqs:
        seq_len, start, end = lens[b], cu[b], cu[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        # With a window, blocks wholly before the first query's window are neither gathered nor read
        # from the table (a sliding layer's table may hold anything there).
        first_block = 0 if sliding_window is None else max(0, seq_len - q_len - sliding_window + 1) // block_size
        first_pos = first_block * block_size
        table = block_tables[b, first_block: -(-seq_len // block_size)].to(torch.int64)
        # Only this sequence's own slots first_pos .. seq_len-1 are gathered, so no NaN can enter.
        k = k_cache.index_select(0, table).view(-1, num_kv_heads, head_dim)[:seq_len - first_pos]
        v = v_cache.index_select(0, table).view(-1, num_kv_heads, head_dim)[:seq_len - first_pos]
        k = _compute_rows(k, k_scale, query.dtype).transpose(0, 1)  # [Hkv, S, D]
        v = _compute_rows(v, v_scale, query.dtype).transpose(0, 1)
        pos_q = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]  # [M, 1]
        pos_k = torch.arange(first_pos, seq_len, device=query.device)[None, :]  # [1, S]
        visible = pos_k <= pos_q  # [M, S]
        if sliding_window is not None:
            visible &= pos_k > pos_q - sliding_window
        q = query[start:end].transpose(0, 1)  # [H, M, D]
        if soft_cap is None:
            o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=visible, scale=scale,
                                               enable_gqa=True)[0]  # [H, M, D]
            out[start:end] = o.transpose(0, 1)
            continue
        q = q.reshape(num_kv_heads, group, q_len, head_dim)
        for row in range(0, q_len, _PREFILL_CHUNK_ROWS):
            rows = slice(row, min(q_len, row + _PREFILL_CHUNK_ROWS))
            o = _explicit_attention(q[None, :, :, rows], k[None], v[None], visible[None, None, None, rows],
                                    scale, soft_cap)[0]  # [Hkv, G, m, D]
            out[start + rows.start : start + rows.stop] = o.reshape(num_heads, -1, head_dim).transpose(0, 1)


def torch_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, *,
                            scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                            out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal varlen attention over cached prefix + new tokens, one sequence at a time, via SDPA."""
    out = torch.zeros_like(query) if out is None else out
    _prefill_sequences(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q.tolist(),
                       range(seq_lens.shape[0]), scale, sliding_window, soft_cap, out, k_scale, v_scale)
    return out


def torch_paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, *,
                          scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                          out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """A mixed step: one-token rows batched through the decode path, longer chunks one by one."""
    out = torch.zeros_like(query) if out is None else out
    cu = cu_seqlens_q.tolist()
    decode = [b for b in range(len(cu) - 1) if cu[b + 1] - cu[b] == 1]
    if decode:
        seqs = torch.tensor(decode, device=query.device)
        rows = torch.tensor([cu[b] for b in decode], device=query.device)
        o = torch_decode_attention(query.index_select(0, rows), k_cache, v_cache, block_tables.index_select(0, seqs),
                                   seq_lens.index_select(0, seqs), scale=scale, sliding_window=sliding_window,
                                   soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale)
        out.index_copy_(0, rows, o)
    chunks = [b for b in range(len(cu) - 1) if cu[b + 1] - cu[b] > 1]
    _prefill_sequences(query, k_cache, v_cache, block_tables, seq_lens, cu, chunks, scale, sliding_window, soft_cap,
                       out, k_scale, v_scale)
    return out
