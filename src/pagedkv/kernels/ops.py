"""The kernel entry points the rest of pagedkv calls: check the input, pick a backend, run.

    write_kv                  scatter new tokens' K/V into their slots
    paged_decode_attention    one query token per sequence
    paged_prefill_attention   causal chunks over a cached prefix, one program per query head
    paged_attention           a mixed step (decode rows and prefill chunks) in one launch
    paged_decode_write_attention   write_kv of each sequence's new token + decode, in one launch

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
Every tensor but the caches may be a strided view: the kernels take each tensor's strides.

FP8 caches (float8_e4m3fn / float8_e5m2) take `k_scale` and `v_scale`, each `[num_kv_heads]`
float32 (one layer's row of `KVPool.k_scale`): `write_kv` quantizes inside its one pass, and
attention dequantizes in registers (see `pagedkv.kernels.fp8`). Queries and outputs stay in
the model's dtype.
"""

from __future__ import annotations

import torch

from pagedkv.env import env_choice
from pagedkv.errors import KernelInputError
from pagedkv.kernels import checks
from pagedkv.kernels.fp8 import check_scales
from pagedkv.kernels.torch_ops import (
    torch_decode_attention,
    torch_paged_attention,
    torch_prefill_attention,
    torch_write_kv,
)
from pagedkv.kernels.tuning import (
    DECODE_SCHEDULES,
    DecodeTuning,
    PrefillTuning,
    SplitPrefillTuning,
    UnifiedTuning,
    choose_num_splits,
    num_sms,
)
from pagedkv.kernels.workspace import KernelWorkspace

BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that runs for `backend` on `device`: "triton" or "torch"."""
    if backend not in BACKENDS:
        raise KernelInputError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    if device.type == "cuda":
        return "triton"
    return env_choice("PAGEDKV_KERNEL_BACKEND", ("triton", "torch")) or "torch"


def _check_triton_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    checks.check_triton_shapes(k_cache)
    if k_cache.stride() != v_cache.stride():
        raise KernelInputError(f"the Triton kernels need k_cache and v_cache with the same strides, got "
                               f"{k_cache.stride()} and {v_cache.stride()}")


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, validate: bool = True, backend: str = "auto",
             has_padding: bool = True, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Store token i's `key[i]`/`value[i]` (`[num_kv_heads, head_dim]`) at pool slot `slot_mapping[i]`.

    slot = block_id * block_size + offset; a negative slot marks a padding token and is skipped.
    key/value `[num_tokens, num_kv_heads, head_dim]`, slot_mapping `[num_tokens]` int64.
    `validate=False` trusts the caller and skips every check (the engine's hot path: its
    metadata is correct by construction, and ~30 us of Python checks per call per layer
    would cost more than the kernel).

    `has_padding=False` promises every slot is >= 0. Then two `index_copy_` calls do the
    scatter on any device: on the H200 host a Triton launch cost 38 us of CPU against about
    10 us per `index_copy_`, and a decode step writes a few KB, so launch cost is all there is.
    An FP8 cache (`k_scale`/`v_scale` given) quantizes, so it takes the Triton kernel on CUDA
    (the quantization fused into the one write) and the torch path elsewhere.
    """
    is_fp8 = k_scale is not None
    if not has_padding and not is_fp8:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)
        return
    if not validate:
        if resolve_backend(backend, k_cache.device) == "torch":
            torch_write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, has_padding)
        else:
            from pagedkv.kernels.triton_write_kv import triton_write_kv

            triton_write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
        return
    device = checks.check_cache_pair(k_cache, v_cache)
    check_scales(k_cache, k_scale, v_scale)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    key_dtypes = checks.SUPPORTED_DTYPES if k_cache.dtype not in checks.SUPPORTED_DTYPES else (k_cache.dtype,)
    for name, tensor in (("key", key), ("value", value)):
        checks.check_tensor(name, tensor, 3, key_dtypes, device)
        if tuple(tensor.shape[1:]) != (num_kv_heads, head_dim):
            raise KernelInputError(f"{name} is {tuple(tensor.shape)}; expected [num_tokens, {num_kv_heads}, "
                                   f"{head_dim}] to match the KV cache")
    checks.check_tensor("slot_mapping", slot_mapping, 1, checks.INDEX_DTYPES, device)
    if not key.shape[0] == value.shape[0] == slot_mapping.shape[0]:
        raise KernelInputError(f"key, value and slot_mapping disagree on num_tokens: {key.shape[0]}, "
                               f"{value.shape[0]}, {slot_mapping.shape[0]}")
    if key.dtype != value.dtype:
        raise KernelInputError(f"key is {key.dtype} but value is {value.dtype}")
    checks.check_slot_values(slot_mapping, num_blocks * block_size)
    if resolve_backend(backend, device) == "torch":
        torch_write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    _check_triton_layout(k_cache, v_cache)
    from pagedkv.kernels.triton_write_kv import triton_write_kv

    triton_write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)


def _check_attention(query, k_cache, v_cache, block_tables, seq_lens, out, scale, sliding_window, soft_cap,
                     backend, num_seqs: int | None, k_scale=None, v_scale=None) -> tuple[torch.device, str]:
    """Metadata checks shared by every attention entry point; returns the device and the resolved backend."""
    device = checks.check_cache_pair(k_cache, v_cache)
    check_scales(k_cache, k_scale, v_scale)
    checks.check_query(query, k_cache, device)
    checks.check_tables(block_tables, seq_lens, num_seqs, device)
    checks.check_out(out, query)
    checks.check_options(scale, sliding_window, soft_cap)
    resolved = resolve_backend(backend, device)
    if resolved == "triton":
        _check_triton_layout(k_cache, v_cache)
    return device, resolved


def _check_host_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise KernelInputError(f"{name} must be a host int >= {minimum}, got {value!r}")


def _varlen_backend(validate: bool, query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale,
                    max_seqlen_q, max_seq_len, sliding_window, soft_cap, backend, k_scale, v_scale) -> str:
    """The backend for a ragged batch (prefill or mixed), after every check, values included, when `validate`."""
    if not validate:
        return resolve_backend(backend, query.device)
    device, resolved = _check_attention(query, k_cache, v_cache, block_tables, seq_lens, out, scale,
                                        sliding_window, soft_cap, backend, None, k_scale, v_scale)
    num_seqs = seq_lens.shape[0]
    checks.check_tensor("cu_seqlens_q", cu_seqlens_q, 1, checks.INDEX_DTYPES, device)
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        raise KernelInputError(f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries, expected num_seqs + 1 = "
                               f"{num_seqs + 1}")
    _check_host_int("max_seqlen_q", max_seqlen_q, 0)
    if max_seqlen_q > query.shape[0]:
        raise KernelInputError(f"max_seqlen_q = {max_seqlen_q} exceeds the {query.shape[0]} query tokens")
    if max_seq_len is not None:
        _check_host_int("max_seq_len", max_seq_len, 0)
    num_blocks, block_size, _, _ = k_cache.shape
    checks.check_table_values(block_tables, seq_lens, num_blocks, block_size, max_seq_len)
    checks.check_cu_seqlens_values(cu_seqlens_q, seq_lens, query.shape[0], max_seqlen_q)
    return resolved


def _counters(workspace: KernelWorkspace | None, num_items: int) -> torch.Tensor | None:
    return None if workspace is None else workspace.counters(num_items)


def _triton_decode(query, k_cache, v_cache, block_tables, seq_lens, out, scale, max_seq_len, sliding_window,
                   soft_cap, num_splits, tuning: DecodeTuning, workspace: KernelWorkspace | None,
                   k_scale=None, v_scale=None) -> torch.Tensor:
    """The Triton decode schedule `tuning` names, from host ints only (see `tuning`)."""
    num_seqs, _, _ = query.shape
    num_kv_heads = k_cache.shape[2]
    capacity = block_tables.shape[1] * k_cache.shape[1]
    span = min(max_seq_len if max_seq_len is not None else capacity, capacity, sliding_window or capacity)
    out = torch.empty_like(query) if out is None else out
    if tuning.schedule == "tiles" and not tuning.runs_tiles(num_seqs * num_kv_heads, num_sms(query.device)):
        tuning = _SPLIT_DECODE  # a big batch: the split kernel is at copy speed there
    if tuning.schedule == "tiles":
        from pagedkv.kernels.triton_decode_tiles import triton_tiles_decode

        counters = _counters(workspace, num_seqs * num_kv_heads) if tuning.merge == "in_kernel" else None
        return triton_tiles_decode(query, k_cache, v_cache, block_tables, seq_lens, out, scale=scale,
                                   max_seq_len=span, sliding_window=sliding_window, soft_cap=soft_cap,
                                   tuning=tuning, sm_count=num_sms(query.device), counters=counters,
                                   k_scale=k_scale, v_scale=v_scale)
    from pagedkv.kernels.triton_decode import triton_decode_attention

    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, span, num_sms(query.device), tuning)
    counters = _counters(workspace, num_seqs * num_kv_heads) if tuning.merge == "in_kernel" else None
    return triton_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, out, scale=scale,
                                   num_splits=num_splits, sliding_window=sliding_window, soft_cap=soft_cap,
                                   tuning=tuning, counters=counters, k_scale=k_scale, v_scale=v_scale)


def _check_decode(query, key, value, k_cache, v_cache, block_tables, seq_lens, out, scale, max_seq_len,
                  sliding_window, soft_cap, num_splits, backend, k_scale=None, v_scale=None) -> tuple[str, int]:
    """Every check of a decode call, values included; `key`/`value` (the new token's K/V) when not None.

    Returns the backend and `max_seq_len` (the tables' capacity when None).
    """
    device, resolved = _check_attention(query, k_cache, v_cache, block_tables, seq_lens, out, scale, sliding_window,
                                        soft_cap, backend,
                                        query.shape[0] if isinstance(query, torch.Tensor) else None, k_scale, v_scale)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    for name, tensor in (("key", key), ("value", value)):
        if tensor is None:
            continue
        checks.check_tensor(name, tensor, 3, (k_cache.dtype,), device)
        if tuple(tensor.shape) != (query.shape[0], num_kv_heads, head_dim):
            raise KernelInputError(f"{name} is {tuple(tensor.shape)}; expected [num_seqs = {query.shape[0]}, "
                                   f"{num_kv_heads}, {head_dim}] (the new token's K/V of each sequence)")
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    _check_host_int("max_seq_len", max_seq_len, 0)
    if num_splits is not None:
        _check_host_int("num_splits", num_splits, 1)
    checks.check_table_values(block_tables, seq_lens, num_blocks, block_size, max_seq_len)
    return resolved, max_seq_len


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float,
                           max_seq_len: int | None = None, sliding_window: int | None = None,
                           soft_cap: float | None = None, num_splits: int | None = None,
                           out: torch.Tensor | None = None, validate: bool = True, backend: str = "auto",
                           tuning: DecodeTuning | None = None, workspace: KernelWorkspace | None = None,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged K/V. Returns `[num_seqs, num_heads, head_dim]`.

    query `[num_seqs, num_heads, head_dim]`; block_tables `[num_seqs, max_blocks]` int32; seq_lens
    `[num_seqs]` int32, the kv length including the current token (whose K/V is already written).
    A row with seq_len 0 returns zeros. `max_seq_len` is a host-side upper bound of seq_lens used
    to choose the split-KV count without a device sync (default: the block tables' capacity);
    `num_splits` overrides the choice (split schedule only; the tiles schedule plans its own).
    `tuning` overrides the Triton launch parameters and picks the schedule; without one, model-dtype
    caches run the split schedule and FP8 caches the tiles schedule (PAGEDKV_DECODE_SCHEDULE sets
    both; see `_DEFAULT_FP8_DECODE`). `workspace` holds the self-resetting counters of the in-kernel merge
    (allocated per call when None). `k_scale`/`v_scale`: an FP8 cache's `[num_kv_heads]` scales.
    `validate=False` trusts the caller and skips every check.
    """
    if validate:
        resolved, max_seq_len = _check_decode(query, None, None, k_cache, v_cache, block_tables, seq_lens, out, scale,
                                              max_seq_len, sliding_window, soft_cap, num_splits, backend,
                                              k_scale, v_scale)
    else:
        resolved = resolve_backend(backend, query.device)
    if resolved == "torch":
        return torch_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                      sliding_window=sliding_window, soft_cap=soft_cap, out=out, k_scale=k_scale,
                                      v_scale=v_scale)
    return _triton_decode(query, k_cache, v_cache, block_tables, seq_lens, out, scale, max_seq_len, sliding_window,
                          soft_cap, num_splits, tuning or _default_decode(k_scale), workspace, k_scale, v_scale)


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, *,
                            scale: float, max_seqlen_q: int, max_seq_len: int | None = None,
                            sliding_window: int | None = None, soft_cap: float | None = None,
                            out: torch.Tensor | None = None, validate: bool = True, backend: str = "auto",
                            tuning: PrefillTuning | None = None, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None, key: torch.Tensor | None = None,
                            value: torch.Tensor | None = None,
                            split_tuning: SplitPrefillTuning | None = None) -> torch.Tensor:
    """Causal varlen attention of each sequence's new tokens over its cached prefix plus themselves.

    query `[total_q_tokens, num_heads, head_dim]`; cu_seqlens_q `[num_seqs + 1]` int32; sequence b's
    queries sit at kv positions seq_lens[b] - q_len_b .. seq_lens[b] - 1 and see kv positions <= their
    own. Their K/V must already be in the cache (`write_kv` first). Returns `[total_q_tokens, num_heads,
    head_dim]`. `max_seqlen_q` is the host-side longest chunk, which sizes the launch grid.
    `k_scale`/`v_scale`: an FP8 cache's scales. `validate=False` trusts the caller and skips every check.
    `key`/`value` `[total_q_tokens, num_kv_heads, head_dim]`, the chunks' own K/V as written, let Triton run
    the split kernel (`triton_prefill_split`, `split_tuning`) where it covers the call.
    """
    resolved = _varlen_backend(validate, query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale,
                               max_seqlen_q, max_seq_len, sliding_window, soft_cap, backend, k_scale, v_scale)
    if key is not None and validate:
        checks.check_chunk_kv(query, key, value, k_cache)
    if resolved == "torch":
        return torch_prefill_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale=scale,
                                       sliding_window=sliding_window, soft_cap=soft_cap, out=out, k_scale=k_scale,
                                       v_scale=v_scale)
    from pagedkv.kernels.triton_prefill_split import triton_prefill

    out = torch.empty_like(query) if out is None else out
    return triton_prefill(query, key, value, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale=scale,
                          max_seqlen_q=max_seqlen_q, sliding_window=sliding_window, soft_cap=soft_cap,
                          tuning=tuning or _DEFAULT_PREFILL, split_tuning=split_tuning or SplitPrefillTuning(),
                          k_scale=k_scale, v_scale=v_scale, max_seq_len=max_seq_len)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, *, scale: float, max_seqlen_q: int,
                    max_seq_len: int | None = None, sliding_window: int | None = None,
                    soft_cap: float | None = None, out: torch.Tensor | None = None, validate: bool = True,
                    backend: str = "auto", tuning: UnifiedTuning | None = None,
                    workspace: KernelWorkspace | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """A mixed step in one launch: decode rows (1 query token) and prefill chunks (many) of any sequences.

    The contract of `paged_prefill_attention` (a decode row is a chunk of one token): query
    `[num_tokens, num_heads, head_dim]`, cu_seqlens_q `[num_seqs + 1]`, sequence b's q_len_b
    queries at kv positions seq_lens[b] - q_len_b .. seq_lens[b] - 1, their K/V already written.
    Returns `[num_tokens, num_heads, head_dim]`.

    Everything that shapes the launch is a host int (`num_tokens`, `num_seqs`, `max_seqlen_q`,
    `max_seq_len`), so a step of fixed shape captures in a CUDA graph. A batch of one-token rows
    only (`max_seqlen_q == 1` and `num_tokens == num_seqs`, so cu_seqlens_q is 0, 1, .., num_seqs)
    runs the decode kernel of `tuning.decode` (without a tuning: `paged_decode_attention`'s default
    schedule for the cache) unless `tuning.decode_route` is off; `max_seq_len`
    (default: the tables' capacity) sizes its split, and `workspace` holds its counters.
    `k_scale`/`v_scale`: an FP8 cache's scales. `validate=False` trusts the caller and skips every check.
    """
    resolved = _varlen_backend(validate, query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale,
                               max_seqlen_q, max_seq_len, sliding_window, soft_cap, backend, k_scale, v_scale)
    if resolved == "torch":
        return torch_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale=scale,
                                     sliding_window=sliding_window, soft_cap=soft_cap, out=out, k_scale=k_scale,
                                     v_scale=v_scale)
    # Without a tuning, the decode route takes paged_decode_attention's defaults (tiles over FP8 caches).
    decode_tuning = tuning.decode if tuning is not None else _default_decode(k_scale)
    tuning = tuning or _DEFAULT_UNIFIED
    if tuning.decode_route and max_seqlen_q == 1 and query.shape[0] == seq_lens.shape[0]:
        return _triton_decode(query, k_cache, v_cache, block_tables, seq_lens, out, scale, max_seq_len,
                              sliding_window, soft_cap, None, decode_tuning, workspace, k_scale, v_scale)
    from pagedkv.kernels.triton_unified import triton_unified_attention

    out = torch.empty_like(query) if out is None else out
    return triton_unified_attention(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale=scale,
                                    max_seqlen_q=max_seqlen_q, sliding_window=sliding_window, soft_cap=soft_cap,
                                    tuning=tuning, k_scale=k_scale, v_scale=v_scale)


def new_token_slots(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each sequence's slot of position seq_len - 1 through its block table (-1 where seq_len is 0), on the device."""
    positions = seq_lens.to(torch.int64) - 1
    blocks = block_tables.gather(1, positions.clamp(min=0).div(block_size, rounding_mode="floor")[:, None])[:, 0]
    return torch.where(positions >= 0, blocks.to(torch.int64) * block_size + positions % block_size, -1)


def paged_decode_write_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                                 seq_lens: torch.Tensor, *, scale: float, max_seq_len: int | None = None,
                                 sliding_window: int | None = None, soft_cap: float | None = None,
                                 num_splits: int | None = None, out: torch.Tensor | None = None,
                                 validate: bool = True, backend: str = "auto", tuning: DecodeTuning | None = None,
                                 workspace: KernelWorkspace | None = None) -> torch.Tensor:
    """A decode step's layer in one launch: store each sequence's new K/V, then `paged_decode_attention`.

    key/value `[num_seqs, num_kv_heads, head_dim]` are the new token's; it sits at position
    seq_lens[b] - 1 (seq_lens count it), so its slot comes from the block table, which must
    already hold that block. A row with seq_len 0 writes nothing and returns zeros. The rest
    is `paged_decode_attention`'s contract (splits always merge in the launch; `workspace`
    holds their counters). `validate=False` trusts the caller and skips every check.
    """
    if validate:
        resolved, max_seq_len = _check_decode(query, key, value, k_cache, v_cache, block_tables, seq_lens, out, scale,
                                              max_seq_len, sliding_window, soft_cap, num_splits, backend)
    else:
        resolved = resolve_backend(backend, query.device)
    if resolved == "torch":
        torch_write_kv(key, value, k_cache, v_cache, new_token_slots(block_tables, seq_lens, k_cache.shape[1]))
        return torch_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                      sliding_window=sliding_window, soft_cap=soft_cap, out=out)
    from pagedkv.kernels.triton_decode_write import triton_decode_write_attention

    tuning = tuning or _SPLIT_DECODE  # the fused write+decode kernel has the split schedule only
    num_seqs, num_kv_heads = query.shape[0], k_cache.shape[2]
    if num_splits is None:
        capacity = block_tables.shape[1] * k_cache.shape[1]
        span = min(max_seq_len if max_seq_len is not None else capacity, capacity, sliding_window or capacity)
        num_splits = choose_num_splits(num_seqs, num_kv_heads, span, num_sms(query.device), tuning)
    return triton_decode_write_attention(query, key, value, k_cache, v_cache, block_tables, seq_lens,
                                         torch.empty_like(query) if out is None else out, scale=scale,
                                         num_splits=num_splits, sliding_window=sliding_window, soft_cap=soft_cap,
                                         tuning=tuning, counters=_counters(workspace, num_seqs * num_kv_heads))


#: The decode launch when the caller passes no `tuning`: the split schedule over model-dtype caches, the tiles
#: schedule over FP8 caches (H200: 0.70x bf16's time at B=64 x 4096 against split's 0.77x, and
#: 26,805 against 24,030 tok/s on nano-vllm's engine workload). PAGEDKV_DECODE_SCHEDULE=split|tiles
#: sets one schedule for both (the engine and the HF attention function take these defaults; read on import); an
#: unknown name raises ConfigError on import, naming the variable, the value and the choices.
_SCHEDULE = env_choice("PAGEDKV_DECODE_SCHEDULE", DECODE_SCHEDULES)
_DEFAULT_DECODE = DecodeTuning(schedule=_SCHEDULE or "split")
_DEFAULT_FP8_DECODE = DecodeTuning(schedule=_SCHEDULE or "tiles")
_SPLIT_DECODE = DecodeTuning()


def _default_decode(k_scale: torch.Tensor | None) -> DecodeTuning:
    return _DEFAULT_DECODE if k_scale is None else _DEFAULT_FP8_DECODE
_DEFAULT_PREFILL = PrefillTuning()
_DEFAULT_UNIFIED = UnifiedTuning()
