"""Plain-torch references for the three kernels: the definition every kernel is tested against.

They loop over sequences and block tables token by token, exactly as the semantics read,
with no batching tricks. They are slow on purpose; `float64=True` computes (and returns) in
float64 so a test can measure a kernel's error against something more precise than itself.

Semantics, shared by every backend:

    slot(p)        = block_tables[b, p // block_size] * block_size + p % block_size
    kv head of h   = h // (num_heads // num_kv_heads)                         (GQA)
    score(p, j)    = scale * q_p . k_j ;  soft cap: cap * tanh(score / cap)
    visible(p, j)  = j <= p  and  (no window  or  p - window < j)             (HF sliding window)

Decode: the one query of sequence b sits at position seq_lens[b] - 1. Prefill: sequence b's
q_len new queries sit at positions seq_lens[b] - q_len .. seq_lens[b] - 1. A mixed step
(`paged_attention`) is prefill where some chunks are one token long.

An FP8 cache stores `fp8.quantize(x, scale)` and reads back `float(stored) * scale` per KV
head (`k_scale`, `v_scale`, each `[num_kv_heads]`): here that dequantization is spelled out
before the attention math, where the kernels fold it into the softmax scale and the output.
"""

from __future__ import annotations

import math

import torch

from pagedkv.kernels.fp8 import dequantize, quantize


def reference_write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None) -> None:
    """Store token i's K/V `[num_kv_heads, head_dim]` at slot `slot_mapping[i]`; negative slots are skipped.

    With scales (an FP8 cache) each token is stored as `quantize(x, scale)`.
    """
    block_size = k_cache.shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k, v = key[i], value[i]
        if k_scale is not None:
            k, v = quantize(k, k_scale, k_cache.dtype), quantize(v, v_scale, v_cache.dtype)
        k_cache[slot // block_size, slot % block_size] = k
        v_cache[slot // block_size, slot % block_size] = v


def _gather_sequence(cache: torch.Tensor, block_table: list[int], seq_len: int, dtype: torch.dtype,
                     scale: torch.Tensor | None = None, first_visible: int = 0) -> torch.Tensor:
    """Token rows 0 .. seq_len-1 of one sequence, block by block: `[seq_len, num_kv_heads, head_dim]`.

    Blocks wholly before `first_visible` (the earliest key any query sees) are not read: their
    table entries may hold anything, and their rows come back as zeros. With a scale (an FP8
    cache) the rows are dequantized.
    """
    block_size = cache.shape[1]
    pieces = []
    for logical, start in enumerate(range(0, seq_len, block_size)):
        num_tokens = min(block_size, seq_len - start)  # the last block may be partly filled
        if start + num_tokens <= first_visible:
            pieces.append(torch.zeros((num_tokens, *cache.shape[2:]), dtype=cache.dtype, device=cache.device))
            continue
        pieces.append(cache[block_table[logical], :num_tokens])
    if not pieces:
        return torch.zeros((0, *cache.shape[2:]), dtype=dtype, device=cache.device)
    rows = torch.cat(pieces)
    return rows.to(dtype) if scale is None else dequantize(rows, scale, dtype)


def _first_visible(first_query_pos: int, sliding_window: int | None) -> int:
    """The earliest key position a query at `first_query_pos` or later can see."""
    return 0 if sliding_window is None else max(0, first_query_pos - sliding_window + 1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int], scale: float,
            sliding_window: int | None, soft_cap: float | None) -> torch.Tensor:
    """Queries `[q_len, H, D]` at `positions` over keys/values `[kv_len, Hkv, D]` at 0 .. kv_len-1."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)  # [kv_len, H, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [H, q_len, kv_len]
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    pos_q = torch.tensor(positions)[:, None]  # [q_len, 1]
    pos_k = torch.arange(k.shape[0])[None, :]  # [1, kv_len]
    visible = pos_k <= pos_q
    if sliding_window is not None:
        visible &= pos_k > pos_q - sliding_window
    scores = scores.masked_fill(~visible.to(scores.device), -math.inf)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees nothing gives zeros
    return torch.einsum("hqk,khd->qhd", probs, v)


def reference_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float,
                               sliding_window: int | None = None, soft_cap: float | None = None,
                               float64: bool = False, k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence over its cached K/V: `[num_seqs, num_heads, head_dim]`; seq_len 0 gives zeros."""
    dtype = torch.float64 if float64 else torch.float32
    out = torch.zeros(query.shape, dtype=dtype, device=query.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        table = block_tables[b].tolist()
        first = _first_visible(seq_len - 1, sliding_window)
        k = _gather_sequence(k_cache, table, seq_len, dtype, k_scale, first)
        v = _gather_sequence(v_cache, table, seq_len, dtype, v_scale, first)
        out[b] = _attend(query[b : b + 1].to(dtype), k, v, [seq_len - 1], scale, sliding_window, soft_cap)[0]
    return out if float64 else out.to(query.dtype)


def reference_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, *,
                                scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                                float64: bool = False, k_scale: torch.Tensor | None = None,
                                v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached prefix and itself.

    Returns `[total_q_tokens, num_heads, head_dim]`.
    """
    dtype = torch.float64 if float64 else torch.float32
    out = torch.zeros(query.shape, dtype=dtype, device=query.device)
    cu = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        if end == start:
            continue
        table = block_tables[b].tolist()
        first = _first_visible(seq_len - (end - start), sliding_window)
        k = _gather_sequence(k_cache, table, seq_len, dtype, k_scale, first)
        v = _gather_sequence(v_cache, table, seq_len, dtype, v_scale, first)
        positions = list(range(seq_len - (end - start), seq_len))
        out[start:end] = _attend(query[start:end].to(dtype), k, v, positions, scale, sliding_window, soft_cap)
    return out if float64 else out.to(query.dtype)


def reference_paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, *,
                              scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                              float64: bool = False, k_scale: torch.Tensor | None = None,
                              v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """A mixed step of decode rows and prefill chunks: prefill's semantics, a decode row being a one-token chunk."""
    return reference_prefill_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale=scale,
                                       sliding_window=sliding_window, soft_cap=soft_cap, float64=float64,
                                       k_scale=k_scale, v_scale=v_scale)
