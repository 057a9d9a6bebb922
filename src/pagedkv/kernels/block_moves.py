"""Whole-block moves between the paged pool and a contiguous staging tensor, for the KV tiers.

    storage  [2, L, N, B, Hkv, D]   the pool (K then V), contiguous
    staged   [n, 2, L, B, Hkv, D]   block i of the move is staged[i], contiguous

    gather_blocks    staged[i] = storage[:, :, ids[i]]    (device -> host: before the host copy)
    scatter_blocks   storage[:, :, ids[i]] = staged[i]    (host -> device: after the host copy)

A block is 2L chunks of C = B * Hkv * D elements, one per (K/V, layer) row, each contiguous in
both tensors: in the views storage [2L, N, C] and staged [n, 2L, C], chunk (i, r) sits at
storage[r, ids[i]] and staged[i, r]. So a move is n * 2L independent copies of C elements,
which is all the Triton kernel does, one tile of a chunk per program.

Why a kernel: torch's gather (`index_select` then `permute(...).contiguous()`) passes over the
data twice, and its scatter (`index_copy_` through a permuted view) walks a strided view. On an
H200 (`benchmarks/tools/block_moves_bench.py`, benchmarks/results/kv_tiers_block_moves_7aaf22a: block
bytes moved per second of device time, Qwen3-0.6B's 1.84 MB bf16 blocks, median of 25):

    blocks   Triton gather   torch gather   Triton scatter   torch scatter   copy_ of the same bytes
      39       1.03 TB/s       0.31 TB/s      0.97 TB/s        0.52 TB/s       1.58 TB/s
     512       1.91 TB/s       0.36 TB/s      1.85 TB/s        0.63 TB/s       2.09 TB/s

A call costs 27-50 us of host time there (the metadata checks and a bound launch,
`pagedkv.kernels.launch`), about as much as torch's.

The kernel copies bytes, not values: both tensors are reinterpreted as the widest integer
(int64, int32, int16, uint8) whose size divides a chunk's bytes and both base addresses. An
int64 chunk (C * itemsize % 8 == 0, 32 KiB for B=16, Hkv=8, D=128 in bf16) lets every thread
move 16 bytes per access whatever the pool's dtype (bf16, fp16, fp32, FP8 bytes), and the
interpreter, which has no bf16, copies a bf16 pool as int64 all the same. Offsets are int64:
one row of the pool, N * C elements, passes 2**31 in a pool of a few GiB.

Backends follow `pagedkv.kernels.ops.resolve_backend`: "auto" runs Triton on CUDA and the torch
reference on CPU (PAGEDKV_KERNEL_BACKEND=triton forces Triton there, under TRITON_INTERPRET=1);
tests ask for backend="triton" explicitly. Triton is imported if present, so the torch path
runs without it.
"""

from __future__ import annotations

import torch

from pagedkv.errors import KernelInputError
from pagedkv.kernels.ops import resolve_backend

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is Linux-only (pyproject): the torch references still run
    triton = None

#: Bytes one program copies, and its warps (a 32 KiB chunk is 8 programs). On the H200, tiles of 4-32 KiB
#: with 4 or 8 warps all ran within 3% of each other, this one the fastest; 16 warps on 4 KiB lost 15%.
TILE_BYTES = 4096
NUM_WARPS = 4
#: Integer dtypes a chunk's bytes are copied as, widest first.
WORD_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


# --------------------------------------------------------------------------- torch references
def gather_blocks_reference(storage: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """staged[i] = storage[:, :, ids[i]] with torch ops: the semantics `gather_blocks` must match.

    Returns `[n, 2, L, B, Hkv, D]` (`out`, filled, when given).
    """
    staged = storage.index_select(2, ids).permute(2, 0, 1, 3, 4, 5).contiguous()  # [n, 2, L, B, Hkv, D]
    if out is None:
        return staged
    out.copy_(staged)
    return out


def scatter_blocks_reference(storage: torch.Tensor, ids: torch.Tensor, staged: torch.Tensor) -> None:
    """storage[:, :, ids[i]] = staged[i] with torch ops: the semantics `scatter_blocks` must match."""
    if storage.element_size() == 1:  # CUDA's index_copy_ has no float8: copy an FP8 pool's bytes
        storage, staged = storage.view(torch.uint8), staged.view(torch.uint8)
    storage.index_copy_(2, ids, staged.permute(1, 2, 0, 3, 4, 5))  # [2, L, n, B, Hkv, D]


# --------------------------------------------------------------------------- Triton kernel
if triton is not None:

    @triton.jit
    def _copy_blocks_kernel(
        pool_ptr, staged_ptr, ids_ptr, pool_row_stride,
        NUM_ROWS: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr, NUM_TILES: tl.constexpr,
        EVEN: tl.constexpr, TO_POOL: tl.constexpr,
    ):
        # One flat grid, tiles fastest: consecutive programs walk the staged tensor in order, and
        # the grid's size is bounded by 2**31 programs rather than 65535 on the outer axes.
        pid = tl.program_id(0)
        tile = pid % NUM_TILES
        move = pid // NUM_TILES // NUM_ROWS
        row = (pid // NUM_TILES % NUM_ROWS).to(tl.int64)
        block = tl.load(ids_ptr + move).to(tl.int64)
        cols = tile * TILE + tl.arange(0, TILE)  # [TILE] words of the chunk
        pool_offs = row * pool_row_stride + block * CHUNK + cols
        staged_offs = (move.to(tl.int64) * NUM_ROWS + row) * CHUNK + cols
        if TO_POOL:
            src, dst = staged_ptr + staged_offs, pool_ptr + pool_offs
        else:
            src, dst = pool_ptr + pool_offs, staged_ptr + staged_offs
        if EVEN:
            tl.store(dst, tl.load(src))
        else:
            mask = cols < CHUNK
            tl.store(dst, tl.load(src, mask=mask), mask=mask)


def word_dtype(chunk_bytes: int, *tensors: torch.Tensor) -> torch.dtype:
    """The widest integer dtype whose size divides `chunk_bytes` and every tensor's base address."""
    for dtype in WORD_DTYPES:
        size = dtype.itemsize
        if chunk_bytes % size == 0 and all(t.data_ptr() % size == 0 for t in tensors):
            return dtype
    return torch.uint8


def _launch(storage: torch.Tensor, ids: torch.Tensor, staged: torch.Tensor, *, to_pool: bool,
            tile_bytes: int = TILE_BYTES, num_warps: int = NUM_WARPS) -> None:
    """Copy every (block, row) chunk between `storage` and `staged` (checked already; n > 0)."""
    from pagedkv.kernels.launch import bound

    _, num_layers, num_blocks, block_size, num_kv_heads, head_dim = storage.shape
    num_rows = 2 * num_layers
    chunk_elements = block_size * num_kv_heads * head_dim
    chunk_bytes = chunk_elements * storage.element_size()
    word = word_dtype(chunk_bytes, storage, staged)
    chunk = chunk_bytes // word.itemsize  # words per chunk
    pool = storage.view(num_rows, num_blocks, chunk_elements).view(torch.uint8).view(word)  # [2L, N, chunk]
    staged_words = staged.view(-1, num_rows, chunk_elements).view(torch.uint8).view(word)  # [n, 2L, chunk]
    tile = min(max(tile_bytes // word.itemsize, 1), triton.next_power_of_2(chunk))
    num_tiles = triton.cdiv(chunk, tile)
    bound(_copy_blocks_kernel).config(
        NUM_ROWS=num_rows, CHUNK=chunk, TILE=tile, NUM_TILES=num_tiles, EVEN=chunk % tile == 0,
        TO_POOL=to_pool, num_warps=num_warps,
    ).launch((ids.shape[0] * num_rows * num_tiles, 1, 1), (pool, staged_words, ids), (pool.stride(0),))


# --------------------------------------------------------------------------- checks and entry points
def _check(storage: object, ids: object, staged: object | None, staged_name: str) -> None:
    """Metadata checks only (no device reads): safe on the hot path and under graph capture."""
    if not isinstance(storage, torch.Tensor) or storage.dim() != 6 or storage.shape[0] != 2:
        shape = tuple(storage.shape) if isinstance(storage, torch.Tensor) else type(storage).__name__
        raise KernelInputError(f"storage must be a [2, L, N, B, Hkv, D] tensor, got {shape}")
    if not storage.is_contiguous():
        raise KernelInputError(f"storage must be contiguous (the pool's layout), got strides {storage.stride()}")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype != torch.int64:
        what = f"{ids.dtype} of shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise KernelInputError(f"ids must be a 1-D int64 tensor, got {what}")
    if not ids.is_contiguous():
        raise KernelInputError(f"ids must be contiguous (the kernel reads them in order), got stride {ids.stride()}")
    if ids.device != storage.device:
        raise KernelInputError(f"ids are on {ids.device}, but storage is on {storage.device}")
    if staged is None:
        return
    _, num_layers, _, block_size, num_kv_heads, head_dim = storage.shape
    expected = (ids.shape[0], 2, num_layers, block_size, num_kv_heads, head_dim)
    if not isinstance(staged, torch.Tensor) or tuple(staged.shape) != expected:
        shape = tuple(staged.shape) if isinstance(staged, torch.Tensor) else type(staged).__name__
        raise KernelInputError(f"{staged_name} must be [n, 2, L, B, Hkv, D] = {list(expected)} for {ids.shape[0]} "
                               f"ids and this storage, got {shape}")
    if staged.dtype != storage.dtype:
        raise KernelInputError(f"{staged_name} is {staged.dtype}, but storage is {storage.dtype}")
    if staged.device != storage.device:
        raise KernelInputError(f"{staged_name} is on {staged.device}, but storage is on {storage.device}")
    if not staged.is_contiguous():
        raise KernelInputError(f"{staged_name} must be contiguous, got strides {staged.stride()}")


def _check_id_values(ids: torch.Tensor, num_blocks: int, distinct: bool) -> None:
    """Every id inside the pool (and, for a scatter, no id twice). Reads ids back to the host."""
    values = ids.tolist()
    bad = [i for i in values if not 0 <= i < num_blocks]
    if bad:
        raise KernelInputError(f"block id {bad[0]} is outside the pool of {num_blocks} blocks")
    if distinct:
        seen: set[int] = set()
        for block in values:
            if block in seen:
                raise KernelInputError(f"block id {block} is listed twice: a scatter's ids must be distinct")
            seen.add(block)


def _use_triton(backend: str, device: torch.device) -> bool:
    if resolve_backend(backend, device) == "torch":
        return False
    if triton is None:
        raise KernelInputError("backend 'triton' needs Triton, which is not installed")
    return True


def gather_blocks(storage: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None = None, *,
                  backend: str = "auto", check_ids: bool = False) -> torch.Tensor:
    """staged[i] = storage[:, :, ids[i]]: the pool's blocks `ids` as one contiguous `[n, 2, L, B, Hkv, D]` tensor.

    storage `[2, L, N, B, Hkv, D]` contiguous, any dtype; ids `[n]` int64 on its device; `out`
    (optional) contiguous `[n, 2, L, B, Hkv, D]` of storage's dtype, filled and returned.
    Ids may repeat and come in any order. `check_ids=True` reads them back to the host and
    raises `KernelInputError` for one outside the pool (a sync: off on the hot path, where an
    out-of-pool id reads memory it should not).
    """
    _check(storage, ids, out, "out")
    if check_ids:
        _check_id_values(ids, storage.shape[2], distinct=False)
    if out is None:
        _, num_layers, _, block_size, num_kv_heads, head_dim = storage.shape
        out = torch.empty((ids.shape[0], 2, num_layers, block_size, num_kv_heads, head_dim), dtype=storage.dtype,
                          device=storage.device)
    if ids.shape[0] == 0:
        return out
    if not _use_triton(backend, storage.device):
        return gather_blocks_reference(storage, ids, out)
    _launch(storage, ids, out, to_pool=False)
    return out


def scatter_blocks(storage: torch.Tensor, ids: torch.Tensor, staged: torch.Tensor, *, backend: str = "auto",
                   check_ids: bool = False) -> None:
    """storage[:, :, ids[i]] = staged[i]: write `[n, 2, L, B, Hkv, D]` staged blocks into the pool's blocks `ids`.

    storage `[2, L, N, B, Hkv, D]` contiguous, any dtype; ids `[n]` int64 on its device, distinct
    (a repeated id leaves that block holding one of its rows' writes, in no set order);
    staged contiguous, storage's dtype. Blocks not in `ids` are not touched. `check_ids=True`
    reads ids back to the host and raises `KernelInputError` for one outside the pool or
    listed twice (a sync: off on the hot path).
    """
    _check(storage, ids, staged, "staged")
    if check_ids:
        _check_id_values(ids, storage.shape[2], distinct=True)
    if ids.shape[0] == 0:
        return
    if not _use_triton(backend, storage.device):
        scatter_blocks_reference(storage, ids, staged)
        return
    _launch(storage, ids, staged, to_pool=True)
