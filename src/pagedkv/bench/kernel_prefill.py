"""The compute-bound and write sections of `pagedkv bench kernel`: paged prefill TFLOP/s and write_kv bandwidth.

Prefill is compute bound: TFLOP/s of causal attention, 2 * 2 * H * D * L^2 / 2 per sequence,
against torch's contiguous causal SDPA (flash) on the same data. write_kv scatters tokens to
random slots and is reported as (bytes read + written) / time.
"""

from __future__ import annotations

import functools

from pagedkv.bench.kernel_common import (
    HEAD_DIM,
    NUM_HEADS,
    NUM_KV_HEADS,
    chunk_kv,
    make_paged,
    sdpa_flash_causal,
    tbps,
    try_time,
)


def write_kv_bandwidth(device, dtype, backend: str, num_tokens: int) -> dict:
    """write_kv of `num_tokens` tokens to random slots: (bytes read + written) / time."""
    import torch

    from pagedkv.kernels import write_kv

    page = 16
    num_blocks = 2 * num_tokens // page
    k_cache = torch.empty(num_blocks, page, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    v_cache = torch.empty_like(k_cache)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * page, device=device)[:num_tokens]
    ms, error = try_time(lambda: write_kv(key, value, k_cache, v_cache, slots, validate=False, backend=backend),
                         device)
    num_bytes = 2 * 2 * key.numel() * key.element_size()  # K and V, read and written
    return {"num_tokens": num_tokens, "ms": ms, "error": error, "tbps": tbps(num_bytes, ms)}


def prefill_throughput(device, dtype, backend: str, batch: int, seq_len: int, tuning=None, kernel: str = "prefill",
                       with_sdpa: bool = True) -> dict:
    """Paged causal prefill of `batch` fresh prompts of `seq_len` tokens, against contiguous causal SDPA (flash).

    `kernel` is "prefill" (`paged_prefill_attention`, the all-paged kernel), "split" (the same call given the
    prompts' own K/V, as the engine makes it: the split kernel) or "unified" (`paged_attention`).
    """
    import torch

    from pagedkv.kernels import paged_attention, paged_prefill_attention

    page = 16
    _, k_cache, v_cache, table, lens = make_paged(batch, seq_len, page, True, device, dtype, seed=3)
    query = torch.randn(batch * seq_len, NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
    cu = torch.arange(0, batch * seq_len + 1, seq_len, dtype=torch.int32, device=device)
    flops = batch * 2 * 2 * NUM_HEADS * HEAD_DIM * seq_len**2 / 2
    call = paged_attention if kernel == "unified" else paged_prefill_attention
    extra = {}
    if kernel == "split":
        extra = dict(zip(("key", "value"), chunk_kv(k_cache, v_cache, table, [seq_len] * batch, [seq_len] * batch)))
    ms, error = try_time(functools.partial(
        call, query, k_cache, v_cache, table, lens, cu, scale=HEAD_DIM ** -0.5,
        max_seqlen_q=seq_len, validate=False, backend=backend, tuning=tuning, **extra), device)
    row = {"batch": batch, "seq_len": seq_len, "kernel": kernel, "ms": ms, "error": error,
           "tflops": flops / (ms * 1e-3) / 1e12 if ms else None}
    if with_sdpa:
        q = query.view(batch, seq_len, NUM_HEADS, HEAD_DIM).transpose(1, 2)
        k = k_cache[table.long()].view(batch, seq_len, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        v = v_cache[table.long()].view(batch, seq_len, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        sdpa, sdpa_backend = sdpa_flash_causal(q, k, v)
        sdpa_ms, _ = try_time(sdpa, device)
        row.update(sdpa_causal_tflops=flops / (sdpa_ms * 1e-3) / 1e12 if sdpa_ms else None, sdpa_backend=sdpa_backend)
        row["vs_sdpa"] = sdpa_ms / ms if ms and sdpa_ms else None
    return row
