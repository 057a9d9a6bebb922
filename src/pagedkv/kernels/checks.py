"""Input checks shared by every kernel entry point: bad input becomes a `KernelInputError`.

Two tiers, so that the engine's hot path stays free of device->host reads:

- Metadata checks (shape, dtype, device, head counts) read only tensor attributes. They
  always run, cost nothing on the device, and are safe under CUDA-graph capture.
- Value checks (block-table entries inside the pool, sequence lengths inside their table's
  capacity, slots inside the pool) read tensor contents back to the host. They run only
  when the caller passes `validate=True`.

Every message names the bad value and the limit it broke, and every check runs before any
kernel launch, so a caught error leaves the caches unchanged. Strides are not checked,
except the caches' (contiguous, as KVPool hands them out): every kernel takes the other
tensors' strides, so views such as `block_tables[:, ::2]` are read where they lie.
"""

from __future__ import annotations

import torch

from pagedkv.errors import KernelInputError

#: Cache / query dtypes the kernels accept (fp32 is for CPU tests under the interpreter).
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Cache dtypes: the above, or FP8 bytes with per-head scales (the query stays in its own dtype).
CACHE_DTYPES = SUPPORTED_DTYPES + (torch.float8_e4m3fn, torch.float8_e5m2)
#: Head dims the Triton kernels are built and tested for (non powers of two are padded and masked).
TRITON_HEAD_DIMS = (64, 80, 96, 128, 256)
#: Block sizes (tokens per page) the Triton kernels accept.
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 8, 256
INDEX_DTYPES = (torch.int32, torch.int64)


def _fail(message: str) -> None:
    raise KernelInputError(message)


def check_tensor(name: str, tensor: object, ndim: int, dtypes: tuple[torch.dtype, ...], device: torch.device) -> None:
    """`tensor` is a torch.Tensor of rank `ndim`, one of `dtypes`, on `device`."""
    if not isinstance(tensor, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        _fail(f"{name} must have {ndim} dims, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        _fail(f"{name} has dtype {str(tensor.dtype).removeprefix('torch.')}; expected one of {allowed}")
    if tensor.device != device:
        _fail(f"{name} is on {tensor.device}, but the KV cache is on {device}")


def check_cache_pair(k_cache: object, v_cache: object) -> torch.device:
    """K and V caches are `[num_blocks, block_size, num_kv_heads, head_dim]` twins; returns their device."""
    if not isinstance(k_cache, torch.Tensor) or not isinstance(v_cache, torch.Tensor):
        _fail("k_cache and v_cache must be torch.Tensors")
    device = k_cache.device
    check_tensor("k_cache", k_cache, 4, CACHE_DTYPES, device)
    check_tensor("v_cache", v_cache, 4, CACHE_DTYPES, device)
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        _fail(f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache {tuple(v_cache.shape)} {v_cache.dtype} "
              "must match in shape and dtype")
    # Contiguous per layer (what KVPool hands out): a slot is then a row of a
    # [num_blocks * block_size, Hkv, D] view, which write_kv and the torch path rely on.
    if not k_cache.is_contiguous() or not v_cache.is_contiguous():
        _fail(f"k_cache and v_cache must be contiguous (as KVPool's per-layer views are), got strides "
              f"{k_cache.stride()} and {v_cache.stride()}")
    return device


def check_triton_shapes(k_cache: torch.Tensor) -> None:
    """Limits of the Triton kernels that the torch path does not have."""
    _, block_size, _, head_dim = k_cache.shape
    if head_dim not in TRITON_HEAD_DIMS:
        _fail(f"head_dim {head_dim} is not supported by the Triton kernels (supported: {TRITON_HEAD_DIMS})")
    if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
        _fail(f"block_size {block_size} is outside the Triton kernels' range [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]")


def check_query(query: object, k_cache: torch.Tensor, device: torch.device) -> int:
    """`query` is `[num_tokens, num_heads, head_dim]` in the cache's dtype (any, for FP8); returns the GQA group."""
    check_tensor("query", query, 3, SUPPORTED_DTYPES, device)
    _, _, num_kv_heads, head_dim = k_cache.shape
    if query.dtype != k_cache.dtype and k_cache.dtype in SUPPORTED_DTYPES:
        _fail(f"query dtype {query.dtype} differs from the KV cache dtype {k_cache.dtype}")
    if query.shape[2] != head_dim:
        _fail(f"query head_dim {query.shape[2]} differs from the KV cache head_dim {head_dim}")
    num_heads = query.shape[1]
    if num_heads == 0 or num_heads % num_kv_heads:
        _fail(f"num_heads {num_heads} is not a positive multiple of num_kv_heads {num_kv_heads}")
    return num_heads // num_kv_heads


def check_tables(block_tables: object, seq_lens: object, num_seqs: int | None, device: torch.device) -> None:
    """`block_tables` is `[num_seqs, max_blocks]` and `seq_lens` is `[num_seqs]`, both integer.

    `num_seqs=None` takes the count from `block_tables` (prefill, where the query is ragged).
    """
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES, device)
    check_tensor("seq_lens", seq_lens, 1, INDEX_DTYPES, device)
    num_seqs = block_tables.shape[0] if num_seqs is None else num_seqs
    if block_tables.shape[0] != num_seqs:
        _fail(f"block_tables has {block_tables.shape[0]} rows, expected num_seqs = {num_seqs}")
    if seq_lens.shape[0] != num_seqs:
        _fail(f"seq_lens has {seq_lens.shape[0]} entries, expected num_seqs = {num_seqs}")


def check_out(out: object, like: torch.Tensor) -> None:
    """A caller-supplied `out` has the result's shape, dtype and device."""
    if out is None:
        return
    if not isinstance(out, torch.Tensor) or out.shape != like.shape or out.dtype != like.dtype \
            or out.device != like.device:
        got = f"{tuple(out.shape)} {out.dtype} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
        _fail(f"out must be {tuple(like.shape)} {like.dtype} on {like.device}, got {got}")


def check_chunk_kv(query: torch.Tensor, key: object, value: object, k_cache: torch.Tensor) -> None:
    """The chunks' own `key`/`value`: `[num_tokens, num_kv_heads, head_dim]` like the query's rows, both given."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    for name, tensor in (("key", key), ("value", value)):
        check_tensor(name, tensor, 3, (query.dtype,), query.device)
        if tuple(tensor.shape) != (query.shape[0], num_kv_heads, head_dim):
            _fail(f"{name} is {tuple(tensor.shape)}; expected [num_tokens = {query.shape[0]}, {num_kv_heads}, "
                  f"{head_dim}] (the chunks' own K/V, one row per query token)")


def check_options(scale: object, sliding_window: object, soft_cap: object) -> None:
    """The softmax scale is a positive number; the window and soft cap are positive when given."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        _fail(f"scale must be a positive float, got {scale!r}")
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        _fail(f"sliding_window must be an int >= 1 or None, got {sliding_window!r}")
    if soft_cap is not None and (isinstance(soft_cap, bool) or not isinstance(soft_cap, (int, float))
                                 or not soft_cap > 0):
        _fail(f"soft_cap must be a positive float or None, got {soft_cap!r}")


# --------------------------------------------------------------------------- value checks (host reads)
def check_table_values(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int,
                       max_seq_len: int | None) -> None:
    """Sequence lengths fit their tables, and every block-table entry a sequence uses is inside the pool.

    Entries past a sequence's last used block are padding and are not checked.
    """
    capacity = block_tables.shape[1] * block_size
    lens = seq_lens.to("cpu", torch.int64)
    if lens.numel():
        low, high = int(lens.min()), int(lens.max())
        if low < 0:
            row = int(torch.argmin(lens))
            _fail(f"seq_lens[{row}] = {low} is negative")
        if high > capacity:
            row = int(torch.argmax(lens))
            _fail(f"seq_lens[{row}] = {high} exceeds the block table's capacity of {capacity} tokens "
                  f"({block_tables.shape[1]} blocks x {block_size})")
        if max_seq_len is not None and high > max_seq_len:
            _fail(f"seq_lens has {high}, over the max_seq_len = {max_seq_len} the caller promised")
    table = block_tables.to("cpu", torch.int64)
    num_used = (lens + block_size - 1) // block_size  # [num_seqs]
    used = torch.arange(table.shape[1])[None, :] < num_used[:, None]  # [num_seqs, max_blocks]
    bad = used & ((table < 0) | (table >= num_blocks))
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        _fail(f"block_tables[{row}, {col}] = {int(table[row, col])} is outside the pool of {num_blocks} blocks "
              f"(valid ids 0..{num_blocks - 1})")


def check_cu_seqlens_values(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int,
                            max_seqlen_q: int) -> None:
    """`cu_seqlens_q` starts at 0, never decreases, ends at `num_tokens`, and each chunk fits its sequence."""
    cu = cu_seqlens_q.to("cpu", torch.int64)
    if int(cu[0]) != 0 or int(cu[-1]) != num_tokens:
        _fail(f"cu_seqlens_q must run from 0 to the {num_tokens} query tokens, got {int(cu[0])} .. {int(cu[-1])}")
    q_lens = cu[1:] - cu[:-1]
    if q_lens.numel() == 0:
        return
    if int(q_lens.min()) < 0:
        row = int(torch.argmin(q_lens))
        _fail(f"cu_seqlens_q decreases at sequence {row} (query length {int(q_lens[row])})")
    if int(q_lens.max()) > max_seqlen_q:
        row = int(torch.argmax(q_lens))
        _fail(f"sequence {row} has {int(q_lens[row])} query tokens, over max_seqlen_q = {max_seqlen_q}")
    over = q_lens > seq_lens.to("cpu", torch.int64)
    if bool(over.any()):
        row = int(over.nonzero()[0])
        _fail(f"sequence {row} has {int(q_lens[row])} query tokens but seq_lens[{row}] = {int(seq_lens[row])}; "
              "the kv length must include the new tokens")


def check_slot_values(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Every non-negative slot is inside the pool's `num_blocks * block_size` token rows."""
    if slot_mapping.numel() == 0:
        return
    high = int(slot_mapping.max())
    if high >= num_slots:
        row = int(torch.argmax(slot_mapping))
        _fail(f"slot_mapping[{row}] = {high} is outside the pool of {num_slots} slots (valid 0..{num_slots - 1})")
