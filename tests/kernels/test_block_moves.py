"""Whole-block gather and scatter (`pagedkv.kernels.block_moves`): the Triton kernel against the torch reference.

The kernel copies bytes, so every comparison is bit-exact, on bytes: the pools are filled
with random bytes (NaN patterns included, which a float comparison would not see equal).
The tests run on the GPU where there is one (the compiled kernel), else on CPU under
TRITON_INTERPRET=1 (tests/conftest.py). The interpreter has no bf16, but the kernel never loads
a bf16 value (it copies integer words), so bf16 runs there too.
"""

import pytest
import torch

from pagedkv.errors import KernelInputError
from pagedkv.kernels import block_moves
from pagedkv.kernels.block_moves import (
    TILE_BYTES,
    gather_blocks,
    gather_blocks_reference,
    scatter_blocks,
    scatter_blocks_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.uint8]  # FP8 pools: either dtype
DTYPE_IDS = [str(d).removeprefix("torch.") for d in DTYPES]
BACKENDS = ["triton", "torch"]

#: (num_layers, num_blocks, block_size, num_kv_heads, head_dim), each a path through the kernel.
SHAPES = [
    (3, 7, 4, 2, 8),  # chunk bytes a multiple of 8: int64 words, one tile
    (2, 5, 3, 1, 5),  # 15 elements a chunk: int16 or uint8 words, a masked tile
    (1, 4, 4, 2, TILE_BYTES // 32 + 2),  # fp32: a chunk of two tiles, the second mostly masked
]
SHAPE_IDS = ["int64-words", "odd-chunk", "two-tiles"]


def random_pool(shape, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A `[2, L, N, B, Hkv, D]` pool of random bytes viewed as `dtype`."""
    num_layers, num_blocks, block_size, num_kv_heads, head_dim = shape
    generator = torch.Generator().manual_seed(seed)
    size = (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim * dtype.itemsize)
    return torch.randint(0, 256, size, dtype=torch.uint8, generator=generator).to(DEVICE).view(dtype)


def random_staged(num_moves: int, shape, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    """`[n, 2, L, B, Hkv, D]` staged blocks of random bytes."""
    num_layers, _, block_size, num_kv_heads, head_dim = shape
    generator = torch.Generator().manual_seed(seed)
    size = (num_moves, 2, num_layers, block_size, num_kv_heads, head_dim * dtype.itemsize)
    return torch.randint(0, 256, size, dtype=torch.uint8, generator=generator).to(DEVICE).view(dtype)


def block_ids(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    same = actual.view(torch.uint8) == expected.view(torch.uint8)
    assert same.all(), f"{(~same).sum().item()} of {same.numel()} bytes differ"


def test_two_tiles_shape_spans_a_partial_second_tile():
    """Guards SHAPES: the last case must keep exercising a multi-tile chunk with a masked tail."""
    _, _, block_size, num_kv_heads, head_dim = SHAPES[2]
    chunk_bytes = block_size * num_kv_heads * head_dim * 4
    assert TILE_BYTES < chunk_bytes < 2 * TILE_BYTES and chunk_bytes % 8 == 0


# --------------------------------------------------------------------------- gather
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gather_matches_reference(dtype, shape):
    storage = random_pool(shape, dtype)
    num_blocks = shape[1]
    ids = block_ids([num_blocks - 1, 0, 2, num_blocks - 1, 1])  # unsorted, one repeated
    before = storage.clone()
    staged = gather_blocks(storage, ids, backend="triton")
    assert_same_bytes(staged, gather_blocks_reference(storage, ids))
    assert_same_bytes(storage, before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.uint8])
def test_gather_single_block(dtype):
    storage = random_pool(SHAPES[0], dtype)
    ids = block_ids([3])
    staged = gather_blocks(storage, ids, backend="triton")
    assert_same_bytes(staged[0], storage[:, :, 3])


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_fills_out(backend):
    storage = random_pool(SHAPES[0], torch.float32)
    ids = block_ids([4, 6, 0])
    out = torch.full((3, 2, *SHAPES[0][:1], *SHAPES[0][2:]), float("nan"), device=DEVICE)
    returned = gather_blocks(storage, ids, out, backend=backend)
    assert returned is out
    assert_same_bytes(out, gather_blocks_reference(storage, ids))


# --------------------------------------------------------------------------- scatter
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_scatter_matches_reference_and_leaves_other_blocks(dtype, shape):
    num_blocks = shape[1]
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(2))[:3].to(DEVICE)  # distinct, unsorted
    staged = random_staged(3, shape, dtype)
    storage = random_pool(shape, dtype)
    original = storage.clone()
    expected = storage.clone()
    scatter_blocks_reference(expected, ids, staged)
    scatter_blocks(storage, ids, staged, backend="triton")
    assert_same_bytes(storage, expected)
    untouched = [b for b in range(num_blocks) if b not in ids.tolist()]
    assert_same_bytes(storage[:, :, untouched], original[:, :, untouched])
    for i, block in enumerate(ids.tolist()):
        assert_same_bytes(storage[:, :, block], staged[i])


@pytest.mark.parametrize("dtype", [torch.float16, torch.uint8])
def test_scatter_single_block(dtype):
    storage = random_pool(SHAPES[0], dtype)
    original = storage.clone()
    staged = random_staged(1, SHAPES[0], dtype)
    scatter_blocks(storage, block_ids([5]), staged, backend="triton")
    assert_same_bytes(storage[:, :, 5], staged[0])
    others = [b for b in range(SHAPES[0][1]) if b != 5]
    assert_same_bytes(storage[:, :, others], original[:, :, others])


def test_gather_then_scatter_round_trips():
    """A block gathered from one place and scattered to another arrives whole (the offload's two halves)."""
    storage = random_pool(SHAPES[0], torch.float16)
    staged = gather_blocks(storage, block_ids([1, 2]), backend="triton")
    scatter_blocks(storage, block_ids([6, 0]), staged, backend="triton")
    assert_same_bytes(storage[:, :, 6], storage[:, :, 1])
    assert_same_bytes(storage[:, :, 0], storage[:, :, 2])


# --------------------------------------------------------------------------- empty moves, backends, errors
@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_ids_move_nothing(backend):
    storage = random_pool(SHAPES[0], torch.float16)
    original = storage.clone()
    ids = block_ids([])
    staged = gather_blocks(storage, ids, backend=backend)
    num_layers, _, block_size, num_kv_heads, head_dim = SHAPES[0]
    assert staged.shape == (0, 2, num_layers, block_size, num_kv_heads, head_dim)
    scatter_blocks(storage, ids, staged, backend=backend)
    assert_same_bytes(storage, original)


def test_auto_runs_the_reference_on_cpu_unless_triton_is_forced(monkeypatch):
    """"auto" on CPU ignores TRITON_INTERPRET (as every kernel entry point does); PAGEDKV_KERNEL_BACKEND decides."""
    launches = []
    monkeypatch.setattr(block_moves, "_launch", lambda *args, **kwargs: launches.append(kwargs["to_pool"]))
    storage = random_pool(SHAPES[0], torch.float16).cpu()
    ids = torch.tensor([1])
    monkeypatch.delenv("PAGEDKV_KERNEL_BACKEND", raising=False)
    scatter_blocks(storage, ids, gather_blocks(storage, ids))
    assert launches == []
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", "triton")
    scatter_blocks(storage, ids, gather_blocks(storage, ids))
    assert launches == [False, True]


def _bad_calls():
    """(name, call, words the message must hold): each call breaks one rule of the contract."""
    storage = random_pool(SHAPES[0], torch.float16)
    ids = block_ids([0, 1])
    staged = gather_blocks_reference(storage, ids)
    return [
        ("5-d storage", lambda: gather_blocks(storage[0], ids), r"\[2, L, N, B, Hkv, D\]"),
        ("strided storage", lambda: gather_blocks(storage[:, :, ::2], ids[:1]), "contiguous"),
        ("int32 ids", lambda: gather_blocks(storage, ids.int()), "int32"),
        ("strided ids", lambda: gather_blocks(storage, block_ids([0, 5, 1, 6])[::2]), "ids must be contiguous"),
        ("2-d ids", lambda: scatter_blocks(storage, ids[None], staged), r"\(1, 2\)"),
        ("ids elsewhere", lambda: gather_blocks(storage, ids.to("meta")), "meta"),
        ("staged of 3 blocks", lambda: scatter_blocks(storage, ids, torch.cat([staged, staged[:1]])), r"\(3, 2"),
        ("staged fp32", lambda: scatter_blocks(storage, ids, staged.float()), "float32"),
        ("out of another layout", lambda: gather_blocks(storage, ids, staged.transpose(1, 2).contiguous()), "out"),
        ("strided out", lambda: gather_blocks(storage, ids, torch.empty(2, 2, 3, 2, 4, 8, device=DEVICE).half().transpose(3, 4)),
         "contiguous"),
        ("id past the pool", lambda: gather_blocks(storage, block_ids([0, 7]), check_ids=True), "7 .* 7 blocks"),
        ("negative id", lambda: scatter_blocks(storage, block_ids([-1, 0]), staged, check_ids=True), "-1"),
        ("repeated scatter id", lambda: scatter_blocks(storage, block_ids([3, 3]), staged, check_ids=True),
         "3 is listed twice"),
    ]


BAD_CALLS = _bad_calls()


@pytest.mark.parametrize("name, call, match", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_kernel_input_error(name, call, match):
    with pytest.raises(KernelInputError, match=match):
        call()


def test_bad_input_leaves_storage_unchanged():
    storage = random_pool(SHAPES[0], torch.float16)
    original = storage.clone()
    staged = random_staged(2, SHAPES[0], torch.float16)
    with pytest.raises(KernelInputError):
        scatter_blocks(storage, block_ids([2, 2]), staged, check_ids=True, backend="triton")
    assert_same_bytes(storage, original)


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.uint8])
def test_block_moves_on_gpu(dtype):
    """Qwen3-0.6B's block (L=28, B=16, Hkv=8, D=128: 32 KiB chunks in bf16), 39 blocks each way."""
    shape = (28, 64, 16, 8, 128)
    storage = random_pool(shape, dtype)
    ids = torch.randperm(shape[1], generator=torch.Generator().manual_seed(3))[:39].to(DEVICE)
    assert_same_bytes(gather_blocks(storage, ids), gather_blocks_reference(storage, ids))
    staged = random_staged(39, shape, dtype)
    expected = storage.clone()
    scatter_blocks_reference(expected, ids, staged)
    scatter_blocks(storage, ids, staged)
    assert_same_bytes(storage, expected)
