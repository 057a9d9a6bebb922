"""The unified mixed-step kernel and the in-kernel merge decode on CPU against the float64 reference.

- `paged_attention` (one launch for decode rows and prefill chunks): decode-only, prefill-only
  and mixed batches, GQA ratios 1-4, head dims 64/128, pages of 8/16/32, windows, soft caps,
  empty chunks and sequences, 64-bit offsets, and the query-tile -> sequence search.
- `DecodeTuning(merge="in_kernel")`: the same answers as the reference and as the merge
  launch, with every arrival counter back at zero afterwards (what lets a CUDA graph replay them).

Shapes are small because the interpreter runs every program in Python.
"""

import pytest
import torch
from kernel_scenarios import (
    ENGINE_HEADS,
    LENGTHS,
    GpuScenario,
    Scenario,
    assert_gpu_matches,
    assert_matches,
    cu_seqlens,
    mixed_gpu_case,
)

from pagedkv.errors import InvalidArgumentError, KernelInputError
from pagedkv.kernels import (
    DecodeTuning,
    KernelWorkspace,
    UnifiedTuning,
    paged_attention,
    paged_decode_attention,
    reference_decode_attention,
    reference_paged_attention,
    write_kv,
)

DTYPES = [torch.float32, torch.float16]
HEAD_SIZES = [64, 128]
BLOCK_SIZES = [8, 16, 32]
NUM_HEADS = [(4, 4), (4, 2), (6, 2), (8, 2)]  # (q heads, kv heads): GQA ratios 1, 2, 3, 4
BACKENDS = ["triton", "torch"]

#: dtype, (q heads, kv heads), head_dim, block_size: together every value above.
CASES = [
    (torch.float32, (4, 4), 64, 16),
    (torch.float16, (4, 2), 128, 8),
    (torch.float32, (6, 2), 64, 32),
    (torch.float16, (8, 2), 64, 16),
]
CASE_IDS = [f"{str(d)[6:]}-h{h}:{kv}-d{hd}-bs{bs}" for d, (h, kv), hd, bs in CASES]

#: Batches as (seq_lens, q_lens): the step's shape is all that differs.
BATCHES = {
    "decode": ([1, 17, 40, 9, 33], [1, 1, 1, 1, 1]),
    "prefill": ([17, 40, 9], [17, 23, 9]),  # a whole prompt, a chunk after a cached prefix, a short prompt
    "mixed": ([1, 17, 40, 9, 33], [1, 1, 12, 9, 1]),
}
#: Small tiles so that the interpreter's few programs still cross tile, page and chunk edges.
SMALL = UnifiedTuning(block_m=16, block_n=16)
IN_KERNEL = DecodeTuning(merge="in_kernel", block_n=16)


def run_batch(case, batch, backend, tuning=SMALL, seed=0, **options):
    dtype, (num_q_heads, num_kv_heads), head_dim, block_size = case
    seq_lens, q_lens = BATCHES[batch] if isinstance(batch, str) else batch
    scenario = Scenario(seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=seed)
    cu = cu_seqlens(q_lens)
    query = scenario.query(int(cu[-1]), num_q_heads) * options.pop("query_gain", 1)
    args = (query, scenario.k_cache, scenario.v_cache, scenario.block_tables, scenario.seq_lens, cu)
    options.setdefault("scale", head_dim ** -0.5)
    expected = reference_paged_attention(*args, **options, float64=True)
    out = paged_attention(*args, **options, max_seqlen_q=max(q_lens), max_seq_len=max(seq_lens), backend=backend,
                          tuning=tuning)
    assert out.shape == query.shape and out.dtype == dtype
    return out, expected


# --------------------------------------------------------------------------- unified: shapes
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_unified_matches_reference(case, batch, backend):
    out, expected = run_batch(case, batch, backend)
    assert_matches(out, expected, case[0])


@pytest.mark.parametrize("decode", [DecodeTuning(), IN_KERNEL], ids=["split", "in_kernel"])
@pytest.mark.parametrize("route", [True, False])
def test_decode_only_batches_route_or_not(route, decode):
    """One-token rows go to the decode kernel (any schedule) or through the unified kernel: same answer."""
    tuning = UnifiedTuning(block_m=16, block_n=16, decode_route=route, decode=decode)
    out, expected = run_batch(CASES[3], "decode", "triton", tuning=tuning, seed=3)
    assert_matches(out, expected, torch.float16)


@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_unified_tile_sizes(block_m):
    """Taller row tiles pack more tokens of a chunk: BLOCK_Q = block_m // group = 8, 16, 32 for group 2."""
    out, expected = run_batch(CASES[1], "mixed", "triton", tuning=UnifiedTuning(block_m=block_m, block_n=32))
    assert_matches(out, expected, torch.float16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sliding_window, soft_cap", [(6, None), (None, 3.0), (20, 2.0), (1, None)])
def test_unified_window_and_soft_cap(backend, sliding_window, soft_cap):
    out, expected = run_batch(CASES[2], "mixed", backend, sliding_window=sliding_window, soft_cap=soft_cap,
                              query_gain=3, seed=4)
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unified_empty_chunks_and_sequences(backend):
    """Sequences with no new tokens (q_len 0) and a zero-length sequence sit between real ones."""
    batch = ([0, 20, 9, 0, 30, 5], [0, 0, 9, 0, 1, 5])
    out, expected = run_batch(CASES[0], batch, backend, seed=5)
    assert_matches(out, expected, torch.float32)


# --------------------------------------------------------------------------- unified: split kv
#: A few query tokens over long cached prefixes (the warm turn of a chat: a short message on a long restored
#: prefix), beside decode rows and a short whole prompt: the split path's keys per split vary per tile.
LONG_CONTEXT = ([1, 150, 140, 90, 33, 12], [1, 1, 12, 9, 1, 12])


@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_unified_split_kv_matches_reference(case, num_splits):
    """Each (query tile, kv head) split `num_splits` ways (16-key splits: a tile's split count follows its own
    keys, so short ones use fewer), merged by the last split to arrive: the reference's answer."""
    tuning = UnifiedTuning(block_m=16, block_n=16, num_splits=num_splits, min_split_tokens=16)
    out, expected = run_batch(case, LONG_CONTEXT, "triton", tuning=tuning, seed=7)
    assert_matches(out, expected, case[0])


@pytest.mark.parametrize("sliding_window, soft_cap", [(None, 3.0), (20, None)])
def test_unified_split_kv_soft_cap_and_window(sliding_window, soft_cap):
    """A soft cap splits like any score; a window runs unsplit (its tiles start at the window)."""
    tuning = UnifiedTuning(block_m=16, block_n=16, num_splits=4, min_split_tokens=16)
    out, expected = run_batch(CASES[2], LONG_CONTEXT, "triton", tuning=tuning, sliding_window=sliding_window,
                              soft_cap=soft_cap, query_gain=3, seed=8)
    assert_matches(out, expected, torch.float32)


def test_unified_splits_follow_the_grid():
    """A grid of few programs splits up to `max_splits`, one already filling the SMs does not; forced counts win."""
    tuning = UnifiedTuning()
    assert tuning.splits_for(40, 132) == 13  # a 80-token step of one sequence, 8 kv heads: 5 tiles x 8
    assert tuning.splits_for(10, 132) == 16  # capped
    assert tuning.splits_for(2176, 132) == 1  # a 512-token bucket padded for 256 sequences
    assert UnifiedTuning(num_splits=1).splits_for(10, 132) == 1
    with pytest.raises(InvalidArgumentError):
        UnifiedTuning(max_splits=0)


def test_tile_to_sequence_search_on_ragged_batches():
    """Chunks of every length around BLOCK_Q (8 tokens for block_m 16, group 2), in a non-power-of-2 batch.

    A tile found in the wrong sequence reads the wrong table (NaN) or the wrong query rows.
    """
    q_lens = [8, 1, 7, 9, 16, 0, 15, 17, 1, 2, 24]
    seq_lens = [n + extra for n, extra in zip(q_lens, [0, 5, 3, 0, 10, 4, 0, 2, 30, 1, 0])]
    out, expected = run_batch(CASES[1], (seq_lens, q_lens), "triton", seed=6)
    assert_matches(out, expected, torch.float16)


def test_unified_metadata_checks():
    scenario = Scenario([10, 17], 8, 2, 64, torch.float32, seed=7)
    query = scenario.query(5, 4)
    kv = (scenario.k_cache, scenario.v_cache, scenario.block_tables, scenario.seq_lens)
    with pytest.raises(KernelInputError, match="cu_seqlens_q has 2 entries"):
        paged_attention(query, *kv, cu_seqlens([5]), scale=0.1, max_seqlen_q=5, backend="triton")
    with pytest.raises(KernelInputError, match="max_seqlen_q = 2"):
        paged_attention(query, *kv, cu_seqlens([3, 2]), scale=0.1, max_seqlen_q=2, backend="triton")
    with pytest.raises(KernelInputError, match="max_seq_len"):
        paged_attention(query, *kv, cu_seqlens([3, 2]), scale=0.1, max_seqlen_q=3, max_seq_len=-1)


# --------------------------------------------------------------------------- decode schedules
@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_in_kernel_merge_equals_merge_launch(num_splits):
    scenario = Scenario([300, 17, 0, 64, 1], 16, 2, 64, torch.float32, seed=9)
    query = scenario.query(5, 8)
    args = (query, scenario.k_cache, scenario.v_cache, scenario.block_tables, scenario.seq_lens)
    workspace = KernelWorkspace(10, "cpu")
    launch = paged_decode_attention(*args, scale=0.125, num_splits=num_splits, backend="triton")
    in_kernel = paged_decode_attention(*args, scale=0.125, num_splits=num_splits, backend="triton",
                                       tuning=DecodeTuning(merge="in_kernel"), workspace=workspace)
    torch.testing.assert_close(in_kernel, launch, atol=2e-6, rtol=2e-6)
    assert torch.equal(in_kernel[2], torch.zeros_like(in_kernel[2]))
    assert_matches(in_kernel, reference_decode_attention(*args, scale=0.125, float64=True), torch.float32)
    workspace.check_integrity()


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_in_kernel_merge_matches_reference(case):
    tuning = IN_KERNEL
    dtype, (num_q_heads, num_kv_heads), head_dim, block_size = case
    seq_lens = [1, block_size, block_size + 1, 2 * block_size + 5, 3 * block_size]
    scenario = Scenario(seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=10)
    query = scenario.query(len(seq_lens), num_q_heads)
    args = (query, scenario.k_cache, scenario.v_cache, scenario.block_tables, scenario.seq_lens)
    expected = reference_decode_attention(*args, scale=head_dim ** -0.5, float64=True)
    out = paged_decode_attention(*args, scale=head_dim ** -0.5, max_seq_len=max(seq_lens), num_splits=3,
                                 backend="triton", tuning=tuning)
    assert_matches(out, expected, dtype)


@pytest.mark.parametrize("sliding_window, soft_cap", [(5, None), (None, 2.0), (16, 5.0), (1, None)])
def test_in_kernel_merge_window_and_soft_cap(sliding_window, soft_cap):
    tuning = IN_KERNEL
    scenario = Scenario([1, 8, 9, 50], 8, 2, 64, torch.float32, seed=11)
    query = scenario.query(4, 6) * 3
    args = (query, scenario.k_cache, scenario.v_cache, scenario.block_tables, scenario.seq_lens)
    options = {"scale": 0.125, "sliding_window": sliding_window, "soft_cap": soft_cap}
    expected = reference_decode_attention(*args, **options, float64=True)
    out = paged_decode_attention(*args, **options, num_splits=3, backend="triton", tuning=tuning)
    assert_matches(out, expected, torch.float32)


def test_workspace_capacity_is_checked():
    scenario = Scenario([20, 3], 8, 2, 64, torch.float32, seed=12)
    args = (scenario.query(2, 4), scenario.k_cache, scenario.v_cache, scenario.block_tables, scenario.seq_lens)
    with pytest.raises(KernelInputError, match="max_items = 3"):
        paged_decode_attention(*args, scale=0.1, backend="triton", tuning=IN_KERNEL,
                               workspace=KernelWorkspace(3, "cpu"))


# --------------------------------------------------------------------------- 64-bit addressing
def test_new_kernels_address_past_2_to_the_31():
    """Block ids whose element offset passes 2**31: the unified and in-kernel-merge decode kernels read the right slots.

    As in test_kernels.py, `torch.empty` maps the pool without touching it, so only the written
    pages become resident.
    """
    block_size, num_kv_heads, head_dim = 8, 1, 64
    num_blocks = 2**31 // (block_size * num_kv_heads * head_dim) + 64
    k_cache = torch.empty(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float16)
    v_cache = torch.empty_like(k_cache)
    block_table = torch.tensor([[num_blocks - 1, num_blocks - 40, 3]], dtype=torch.int32)
    seq_len = 20
    positions = torch.arange(seq_len)
    slots = block_table[0, positions // block_size].long() * block_size + positions % block_size
    generator = torch.Generator().manual_seed(13)
    key = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).half()
    write_kv(key, torch.randn_like(key), k_cache, v_cache, slots, backend="triton")
    kv = (k_cache, v_cache, block_table, torch.tensor([seq_len], dtype=torch.int32))
    query = torch.randn(seq_len, 2, head_dim, generator=generator).half()
    cu = cu_seqlens([seq_len])
    expected = reference_paged_attention(query, *kv, cu, scale=0.125, float64=True)
    assert_matches(paged_attention(query, *kv, cu, scale=0.125, max_seqlen_q=seq_len, backend="triton",
                                   tuning=SMALL), expected, torch.float16)
    assert_matches(paged_decode_attention(query[-1:], *kv, scale=0.125, backend="triton", tuning=IN_KERNEL),
                   expected[-1:], torch.float16)


# --------------------------------------------------------------------------- on CUDA, at full size
# Mixed steps of Llama-3-8B attention in bf16, compiled for the GPU, and a CUDA-graph capture of one.
GPU_DTYPES = [torch.bfloat16, torch.float16]
GPU_HEAD_SIZES = [64, 80, 96, 128, 256]
GPU_BLOCK_SIZES = [16, 128]
@pytest.mark.gpu
@pytest.mark.parametrize("block_size", GPU_BLOCK_SIZES)
@pytest.mark.parametrize("block_m", [None, 16, 128])
def test_unified_llama3_mixed_step(block_size, block_m):
    scenario, cu, max_q, query = mixed_gpu_case(block_size)
    expected = reference_paged_attention(query, *scenario.kv, cu, scale=0.088, float64=True)
    out = paged_attention(query, *scenario.kv, cu, scale=0.088, max_seqlen_q=max_q,
                          tuning=UnifiedTuning(block_m=block_m))
    assert_gpu_matches(out, expected, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("head_dim", GPU_HEAD_SIZES)
def test_unified_head_dims(dtype, head_dim):
    seq_lens, q_lens = [300, 77, 40, 1], [300, 40, 1, 1]
    scenario = GpuScenario(seq_lens, 16, 2, head_dim, dtype, seed=31)
    cu = torch.tensor([0, 300, 340, 341, 342], dtype=torch.int32, device="cuda")
    query = scenario.query(342, 14)
    expected = reference_paged_attention(query, *scenario.kv, cu, scale=head_dim ** -0.5, float64=True)
    assert_gpu_matches(paged_attention(query, *scenario.kv, cu, scale=head_dim ** -0.5, max_seqlen_q=300), expected,
                   dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", ENGINE_HEADS + [(32, 32, 128), (28, 4, 128)],
                         ids=["qwen3", "smollm2", "gpt2", "mha", "gqa7"])
def test_unified_gqa_groups(heads):
    scenario, cu, max_q, query = mixed_gpu_case(16, heads=heads, seed=32)
    scale = heads[2] ** -0.5
    expected = reference_paged_attention(query, *scenario.kv, cu, scale=scale, float64=True)
    assert_gpu_matches(paged_attention(query, *scenario.kv, cu, scale=scale, max_seqlen_q=max_q), expected,
                   torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("sliding_window, soft_cap", [(300, None), (None, 30.0), (700, 50.0)])
def test_unified_window_and_soft_cap_on_cuda(sliding_window, soft_cap):
    scenario, cu, max_q, query = mixed_gpu_case(16, seed=33)
    options = {"scale": 0.088, "sliding_window": sliding_window, "soft_cap": soft_cap}
    expected = reference_paged_attention(query * 4, *scenario.kv, cu, **options, float64=True)
    assert_gpu_matches(paged_attention(query * 4, *scenario.kv, cu, **options, max_seqlen_q=max_q), expected,
                   torch.bfloat16)


@pytest.mark.gpu
def test_unified_mixed_step_is_cuda_graph_capturable():
    """Captured once; replayed after the step's contents change (other chunk split, other lengths, same shape)."""
    scenario, cu, max_q, query = mixed_gpu_case(16, seed=34)
    out = torch.empty_like(query)
    options = {"scale": 0.088, "max_seqlen_q": max_q, "max_seq_len": 4096, "validate": False, "out": out}
    paged_attention(query, *scenario.kv, cu, **options)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(query, *scenario.kv, cu, **options)
    num_decode = len(LENGTHS)
    # Same token count: 100 of the 1000-token chunk's tokens move to the one-token chunk before it.
    q_lens = [1] * num_decode + [17, 101, 900, 512, 128]
    seq_lens = LENGTHS + [17, 1000, 4000, 2048, 129]
    for new_q_lens, new_seq_lens in ((None, None), (q_lens, seq_lens)):
        if new_q_lens is not None:
            cu.copy_(torch.tensor([0, *torch.tensor(new_q_lens).cumsum(0).tolist()], dtype=torch.int32))
            scenario.seq_lens.copy_(torch.tensor(new_seq_lens, dtype=torch.int32))
        query.copy_(torch.randn_like(query))
        graph.replay()
        torch.cuda.synchronize()
        assert_gpu_matches(out, reference_paged_attention(query, *scenario.kv, cu, scale=0.088, float64=True),
                       torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", ENGINE_HEADS[:2], ids=["qwen3", "smollm2"])
def test_unified_split_kv_long_prefix_on_cuda(heads):
    """A warm chat turn: 80 new tokens on a 16K-token cached prefix, beside a decode row and a short prompt; the
    default tuning splits this small grid's keys (asserted, so the test covers the split path)."""
    from pagedkv.kernels.triton_unified import unified_splits

    num_heads, num_kv_heads, head_dim = heads
    seq_lens, q_lens = [16464, 2000, 50], [80, 1, 50]
    scenario = GpuScenario(seq_lens, 16, num_kv_heads, head_dim, torch.bfloat16, seed=35)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    query = scenario.query(sum(q_lens), num_heads)
    tuning = UnifiedTuning()
    block_m, _, _ = tuning.tiles_for(head_dim, num_heads // num_kv_heads, 80)
    grid = (sum(q_lens) // (block_m // (num_heads // num_kv_heads)) + len(q_lens)) * num_kv_heads
    assert unified_splits(tuning, grid, query, query, None) > 1
    expected = reference_paged_attention(query, *scenario.kv, cu, scale=head_dim ** -0.5, float64=True)
    out = paged_attention(query, *scenario.kv, cu, scale=head_dim ** -0.5, max_seqlen_q=80, tuning=tuning)
    assert_gpu_matches(out, expected, torch.bfloat16)


@pytest.mark.gpu
def test_unified_split_kv_is_cuda_graph_capturable():
    """Captured with its splits; replayed three times over other lengths: the arrival counters reset in the
    graph, so every replay's merge sees exactly its own splits."""
    num_heads, num_kv_heads, head_dim = ENGINE_HEADS[0]
    seq_lens, q_lens = [9000, 300], [80, 1]
    scenario = GpuScenario([9000, 9000], 16, num_kv_heads, head_dim, torch.bfloat16, seed=36)
    scenario.seq_lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
    cu = torch.tensor([0, 80, 81], dtype=torch.int32, device="cuda")
    query = scenario.query(81, num_heads)
    out = torch.empty_like(query)
    options = {"scale": 0.088, "max_seqlen_q": 80, "max_seq_len": 9000, "validate": False, "out": out}
    paged_attention(query, *scenario.kv, cu, **options)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(query, *scenario.kv, cu, **options)
    for new_seq_lens, new_cu in (([9000, 300], [0, 80, 81]), ([4000, 9000], [0, 40, 81]), ([700, 300], [0, 1, 81])):
        scenario.seq_lens.copy_(torch.tensor(new_seq_lens, dtype=torch.int32))
        cu.copy_(torch.tensor(new_cu, dtype=torch.int32))
        query.copy_(torch.randn_like(query))
        graph.replay()
        torch.cuda.synchronize()
        assert_gpu_matches(out, reference_paged_attention(query, *scenario.kv, cu, scale=0.088, float64=True),
                           torch.bfloat16)
