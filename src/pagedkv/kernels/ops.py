"""The three kernel entry points the rest of pagedkv calls: check the input, pick a backend, run.

Backends (the `backend` keyword):

    "auto"    CUDA tensors -> Triton; CPU tensors -> the fast torch path, unless the
              environment sets PAGEDKV_KERNEL_BACKEND=triton (or torch) to force one
    "triton"  the Triton kernels; on CPU this needs TRITON_INTERPRET=1 set before Triton is
              imported (the tests' conftest does that)
    "torch"   gather + SDPA (`torch_ops`), any device

NOTE: on CPU, "auto" deliberately ignores TRITON_INTERPRET. The test session sets it for the
whole process, and the interpreter is orders of magnitude slower than the torch path, so
letting it steer "auto" would push every engine test on CPU through the interpreter. Kernel
tests ask for `backend="triton"` explicitly instead.

Triton modules are imported on first use, so the torch path works where Triton is absent.
"""

from __future__ import annotations

import os

import torch

from pagedkv.errors import KernelInputError
from pagedkv.kernels import checks
from pagedkv.kernels.torch_ops import torch_decode_attention, torch_prefill_attention, torch_write_kv
from pagedkv.kernels.tuning import DecodeTuning, PrefillTuning, choose_num_splits, num_sms

BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that runs for `backend` on `device`: "triton" or "torch"."""
    if backend not in BACKENDS:
        raise KernelInputError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    if device.type == "cuda":
        return "triton"
    forced = os.environ.get("PAGEDKV_KERNEL_BACKEND", "")
    return forced if forced in ("triton", "torch") else "torch"


def _check_triton_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    checks.check_triton_shapes(k_cache)
    if k_cache.stride() != v_cache.stride():
        raise KernelInputError(f"the Triton kernels need k_cache and v_cache with the same strides, got "
                               f"{k_cache.stride()} and {v_cache.stride()}")


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, validate: bool = True, backend: str = "auto",
             has_padding: bool = True) -> None:
    """Store token i's `key[i]`/`value[i]` (`[num_kv_heads, head_dim]`) at pool slot `slot_mapping[i]`.

    slot = block_id * block_size + offset; a negative slot marks a padding token and is skipped.
    key/value `[num_tokens, num_kv_heads, head_dim]`, slot_mapping `[num_tokens]` int64.
    `validate=False` trusts the caller and skips every check (the engine's hot path: its
    metadata is correct by construction, and ~30 us of Python checks per call per layer
    would cost more than the kernel).

    `has_padding=False` promises every slot is >= 0. Then two `index_copy_` calls do the
    scatter on any device: on the H200 host a Triton launch cost 38 us of CPU against about
    10 us per `index_copy_`, and a decode step writes a few KB, so launch cost is all there is.
    """
    if not has_padding:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)
        return
    if not validate:
        if resolve_backend(backend, k_cache.device) == "torch":
            torch_write_kv(key, value, k_cache, v_cache, slot_mapping)
        else:
            from pagedkv.kernels.triton_write_kv import triton_write_kv

            triton_write_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    device = checks.check_cache_pair(k_cache, v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    for name, tensor in (("key", key), ("value", value)):
        checks.check_tensor(name, tensor, 3, (k_cache.dtype,), device)
        if tuple(tensor.shape[1:]) != (num_kv_heads, head_dim):
            raise KernelInputError(f"{name} is {tuple(tensor.shape)}; expected [num_tokens, {num_kv_heads}, "
                                   f"{head_dim}] to match the KV cache")
        if tensor.stride(-1) != 1:
            raise KernelInputError(f"{name} must be contiguous along head_dim (stride 1)")
    checks.check_tensor("slot_mapping", slot_mapping, 1, checks.INDEX_DTYPES, device)
    if not key.shape[0] == value.shape[0] == slot_mapping.shape[0]:
        raise KernelInputError(f"key, value and slot_mapping disagree on num_tokens: {key.shape[0]}, "
                               f"{value.shape[0]}, {slot_mapping.shape[0]}")
    if validate:
        checks.check_slot_values(slot_mapping, num_blocks * block_size)
    if resolve_backend(backend, device) == "torch":
        torch_write_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    _check_triton_layout(k_cache, v_cache)
    from pagedkv.kernels.triton_write_kv import triton_write_kv

    triton_write_kv(key, value, k_cache, v_cache, slot_mapping)


def _check_attention(query, k_cache, v_cache, block_tables, seq_lens, out, scale, sliding_window, soft_cap,
                     backend, num_seqs: int | None) -> tuple[torch.device, str]:
    """Metadata checks shared by decode and prefill; returns the device and the resolved backend."""
    device = checks.check_cache_pair(k_cache, v_cache)
    checks.check_query(query, k_cache, device)
    checks.check_tables(block_tables, seq_lens, num_seqs, device)
    checks.check_out(out, query)
    checks.check_options(scale, sliding_window, soft_cap)
    resolved = resolve_backend(backend, device)
    if resolved == "triton":
        _check_triton_layout(k_cache, v_cache)
    return device, resolved


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float,
                           max_seq_len: int | None = None, sliding_window: int | None = None,
                           soft_cap: float | None = None, num_splits: int | None = None,
                           out: torch.Tensor | None = None, validate: bool = True, backend: str = "auto",
                           tuning: DecodeTuning | None = None) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged K/V. Returns `[num_seqs, num_heads, head_dim]`.

    query `[num_seqs, num_heads, head_dim]`; block_tables `[num_seqs, max_blocks]` int32; seq_lens
    `[num_seqs]` int32, the kv length including the current token (whose K/V is already written).
    A row with seq_len 0 returns zeros. `max_seq_len` is a host-side upper bound of seq_lens used
    to choose the split-KV count without a device sync (default: the block tables' capacity);
    `num_splits` overrides the choice. `tuning` overrides the Triton launch parameters.
    `validate=False` trusts the caller and skips every check.
    """
    if not validate:
        return _decode_unchecked(query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len,
                                 sliding_window, soft_cap, num_splits, out, backend, tuning)
    device, resolved = _check_attention(query, k_cache, v_cache, block_tables, seq_lens, out, scale,
                                        sliding_window, soft_cap, backend,
                                        num_seqs=query.shape[0] if isinstance(query, torch.Tensor) else None)
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    capacity = block_tables.shape[1] * block_size
    if max_seq_len is None:
        max_seq_len = capacity
    elif isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 0:
        raise KernelInputError(f"max_seq_len must be a host int >= 0, got {max_seq_len!r}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 1):
        raise KernelInputError(f"num_splits must be an int >= 1, got {num_splits!r}")
    if validate:
        checks.check_table_values(block_tables, seq_lens, num_blocks, block_size, max_seq_len)
    if resolved == "torch":
        return torch_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                      sliding_window=sliding_window, soft_cap=soft_cap, out=out)
    from pagedkv.kernels.triton_decode import triton_decode_attention

    tuning = tuning or DecodeTuning()
    if num_splits is None:
        span = min(max_seq_len, capacity, sliding_window or capacity)
        num_splits = choose_num_splits(query.shape[0], num_kv_heads, span, num_sms(device), tuning)
    out = torch.empty_like(query) if out is None else out
    return triton_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, out, scale=scale,
                                   num_splits=num_splits, sliding_window=sliding_window, soft_cap=soft_cap,
                                   tuning=tuning)


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, *,
                            scale: float, max_seqlen_q: int, max_seq_len: int | None = None,
                            sliding_window: int | None = None, soft_cap: float | None = None,
                            out: torch.Tensor | None = None, validate: bool = True, backend: str = "auto",
                            tuning: PrefillTuning | None = None) -> torch.Tensor:
    """Causal varlen attention of each sequence's new tokens over its cached prefix plus themselves.

    query `[total_q_tokens, num_heads, head_dim]`; cu_seqlens_q `[num_seqs + 1]` int32; sequence b's
    queries sit at kv positions seq_lens[b] - q_len_b .. seq_lens[b] - 1 and see kv positions <= their
    own. Their K/V must already be in the cache (`write_kv` first). Returns `[total_q_tokens, num_heads,
    head_dim]`. `max_seqlen_q` is the host-side longest chunk, which sizes the launch grid.
    `validate=False` trusts the caller and skips every check.
    """
    if not validate:
        return _prefill_unchecked(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                                  max_seqlen_q, sliding_window, soft_cap, out, backend, tuning)
    device, resolved = _check_attention(query, k_cache, v_cache, block_tables, seq_lens, out, scale,
                                        sliding_window, soft_cap, backend, num_seqs=None)
    num_seqs = seq_lens.shape[0]
    checks.check_tensor("cu_seqlens_q", cu_seqlens_q, 1, checks.INDEX_DTYPES, device)
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        raise KernelInputError(f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries, expected num_seqs + 1 = "
                               f"{num_seqs + 1}")
    if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
        raise KernelInputError(f"max_seqlen_q must be a host int >= 0, got {max_seqlen_q!r}")
    if max_seqlen_q > query.shape[0]:
        raise KernelInputError(f"max_seqlen_q = {max_seqlen_q} exceeds the {query.shape[0]} query tokens")
    num_blocks, block_size, _, _ = k_cache.shape
    if validate:
        checks.check_table_values(block_tables, seq_lens, num_blocks, block_size, max_seq_len)
        checks.check_cu_seqlens_values(cu_seqlens_q, seq_lens, query.shape[0], max_seqlen_q)
    if resolved == "torch":
        return torch_prefill_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale=scale,
                                       sliding_window=sliding_window, soft_cap=soft_cap, out=out)
    from pagedkv.kernels.triton_prefill import triton_prefill_attention

    out = torch.empty_like(query) if out is None else out
    return triton_prefill_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out,
                                    scale=scale, max_seqlen_q=max_seqlen_q, sliding_window=sliding_window,
                                    soft_cap=soft_cap, tuning=tuning or PrefillTuning())


def _decode_unchecked(query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, sliding_window,
                      soft_cap, num_splits, out, backend, tuning):
    if resolve_backend(backend, query.device) == "torch":
        return torch_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                      sliding_window=sliding_window, soft_cap=soft_cap, out=out)
    from pagedkv.kernels.triton_decode import triton_decode_attention

    tuning = tuning or _DEFAULT_DECODE
    if num_splits is None:
        capacity = block_tables.shape[1] * k_cache.shape[1]
        span = min(max_seq_len if max_seq_len is not None else capacity, capacity, sliding_window or capacity)
        num_splits = choose_num_splits(query.shape[0], k_cache.shape[2], span, num_sms(query.device), tuning)
    out = torch.empty_like(query) if out is None else out
    return triton_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, out, scale=scale,
                                   num_splits=num_splits, sliding_window=sliding_window, soft_cap=soft_cap,
                                   tuning=tuning)


def _prefill_unchecked(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, max_seqlen_q,
                       sliding_window, soft_cap, out, backend, tuning):
    if resolve_backend(backend, query.device) == "torch":
        return torch_prefill_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale=scale,
                                       sliding_window=sliding_window, soft_cap=soft_cap, out=out)
    from pagedkv.kernels.triton_prefill import triton_prefill_attention

    out = torch.empty_like(query) if out is None else out
    return triton_prefill_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out,
                                    scale=scale, max_seqlen_q=max_seqlen_q, sliding_window=sliding_window,
                                    soft_cap=soft_cap, tuning=tuning or _DEFAULT_PREFILL)


_DEFAULT_DECODE = DecodeTuning()
_DEFAULT_PREFILL = PrefillTuning()
