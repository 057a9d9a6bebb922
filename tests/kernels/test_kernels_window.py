"""Sliding windows never read a block wholly before the window, in every attention path (CPU and `gpu`).

A sliding-window layer's block table may hold anything before the window's first block (a
window-aware cache frees those blocks, or points them at a null block). So in these scenarios
every table entry wholly before a query's window points at a NaN-poisoned block: a path that
dereferences one of them comes out NaN. The expected output is the float64 reference over the
clean table (the same K/V the window sees). Paths: decode (split, in-kernel merge, tiles with
each table read mode), the fused write + decode, prefill, the unified mixed step, FP8 caches,
and the torch path of each, with and without a soft cap.
"""

import pytest
import torch
from kernel_scenarios import Fp8Pool, Scenario, assert_gpu_matches, assert_matches, cu_seqlens

from pagedkv.kernels import (
    DecodeTuning,
    KernelWorkspace,
    UnifiedTuning,
    paged_attention,
    paged_decode_attention,
    paged_decode_write_attention,
    paged_prefill_attention,
    reference_decode_attention,
    reference_paged_attention,
)
from pagedkv.kernels.ops import new_token_slots

BACKENDS = ["triton", "torch"]
#: dtype, window, soft cap: a window shorter than a page, and one of a few pages with a soft cap.
CASES = [(torch.float32, 3, None), (torch.float16, 12, 2.0)]
CASE_IDS = [f"{str(d)[6:]}-w{w}-cap{c}" for d, w, c in CASES]
DECODE_TUNINGS = {
    "split": DecodeTuning(block_n=16),
    "in_kernel": DecodeTuning(block_n=16, merge="in_kernel"),
    "tiles-gather": DecodeTuning(schedule="tiles", block_n=16, min_split_tokens=16, programs_per_sm=8),
    "tiles-inline": DecodeTuning(schedule="tiles", block_n=16, min_split_tokens=16, table="inline"),
    "tiles-select": DecodeTuning(schedule="tiles", block_n=16, min_split_tokens=16, table="select",
                                 table_chunk=4),
}
SMALL_UNIFIED = UnifiedTuning(block_m=16, block_n=16)
#: (seq_lens, q_lens) of a mixed step: decode rows, a chunk after a long cached prefix, a whole prompt.
MIXED = ([41, 1, 60, 12, 37], [1, 1, 7, 12, 1])
BLOCK_SIZE = 8


def windowed_table(scenario: Scenario, q_lens: list[int], window: int | None) -> torch.Tensor:
    """The scenario's block tables with every entry wholly before a sequence's first window -> a NaN block."""
    table = scenario.block_tables.clone()
    if window is None:
        return table
    owned = {int(block) for b, seq_len in enumerate(scenario.seq_lens.tolist())
             for block in table[b, :-(-seq_len // scenario.block_size)]}
    poisoned = next(b for b in range(scenario.k_cache.shape[0]) if b not in owned)
    assert scenario.k_cache[poisoned].isnan().all()
    for b, (seq_len, q_len) in enumerate(zip(scenario.seq_lens.tolist(), q_lens)):
        first_visible = max(0, seq_len - q_len - window + 1)
        table[b, :first_visible // scenario.block_size] = poisoned
    return table


def mixed_case(dtype, seed=0, heads=(6, 2), head_dim=64, q_lens=None):
    seq_lens, default_q_lens = MIXED
    q_lens = q_lens or default_q_lens
    scenario = Scenario(seq_lens, BLOCK_SIZE, heads[1], head_dim, dtype, seed=seed)
    query = scenario.query(sum(q_lens), heads[0]) * 3  # large scores so the soft cap bites
    return scenario, query, q_lens


# --------------------------------------------------------------------------- decode
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, window, soft_cap", CASES, ids=CASE_IDS)
def test_decode_skips_blocks_before_the_window(dtype, window, soft_cap, backend):
    seq_lens = MIXED[0]
    scenario = Scenario(seq_lens, BLOCK_SIZE, 2, 64, dtype, seed=1)
    query = scenario.query(len(seq_lens), 6) * 3
    options = dict(scale=0.125, sliding_window=window, soft_cap=soft_cap)
    expected = reference_decode_attention(query, scenario.k_cache, scenario.v_cache, scenario.block_tables,
                                          scenario.seq_lens, **options, float64=True)
    table = windowed_table(scenario, [1] * len(seq_lens), window)
    tunings = DECODE_TUNINGS if backend == "triton" else {"torch": None}
    if dtype != torch.float32:  # every schedule once (fp32); fp16 through the default one
        tunings = {name: tunings[name] for name in list(tunings)[:1]}
    for name, tuning in tunings.items():
        out = paged_decode_attention(query, scenario.k_cache, scenario.v_cache, table, scenario.seq_lens, **options,
                                     backend=backend, tuning=tuning, workspace=KernelWorkspace(64, "cpu"))
        assert_matches(out, expected, dtype), name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window, soft_cap", [(12, 2.0)])
def test_fused_write_decode_skips_blocks_before_the_window(window, soft_cap, backend):
    seq_lens = MIXED[0]
    scenario = Scenario(seq_lens, BLOCK_SIZE, 2, 64, torch.float32, seed=2)
    query = scenario.query(len(seq_lens), 4) * 3
    generator = torch.Generator().manual_seed(9)
    key, value = (torch.randn(len(seq_lens), 2, 64, generator=generator) for _ in range(2))
    # The reference: the new token's K/V written through the clean table, then decode.
    k_ref, v_ref = scenario.k_cache.clone(), scenario.v_cache.clone()
    slots = new_token_slots(scenario.block_tables, scenario.seq_lens, BLOCK_SIZE)
    k_ref.view(-1, 2, 64)[slots], v_ref.view(-1, 2, 64)[slots] = key, value
    options = dict(scale=0.125, sliding_window=window, soft_cap=soft_cap)
    expected = reference_decode_attention(query, k_ref, v_ref, scenario.block_tables, scenario.seq_lens, **options,
                                          float64=True)
    table = windowed_table(scenario, [1] * len(seq_lens), window)
    out = paged_decode_write_attention(query, key, value, scenario.k_cache, scenario.v_cache, table,
                                       scenario.seq_lens, **options, num_splits=3, backend=backend)
    assert_matches(out, expected, torch.float32)


# --------------------------------------------------------------------------- prefill and mixed steps
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, window, soft_cap", CASES, ids=CASE_IDS)
def test_prefill_and_mixed_skip_blocks_before_the_window(dtype, window, soft_cap, backend):
    scenario, query, q_lens = mixed_case(dtype, seed=3)
    cu = cu_seqlens(q_lens)
    options = dict(scale=0.125, sliding_window=window, soft_cap=soft_cap, max_seqlen_q=max(q_lens))
    expected = reference_paged_attention(query, scenario.k_cache, scenario.v_cache, scenario.block_tables,
                                         scenario.seq_lens, cu, scale=0.125, sliding_window=window,
                                         soft_cap=soft_cap, float64=True)
    table = windowed_table(scenario, q_lens, window)
    args = (query, scenario.k_cache, scenario.v_cache, table, scenario.seq_lens, cu)
    assert_matches(paged_attention(*args, **options, backend=backend, tuning=SMALL_UNIFIED), expected, dtype)
    assert_matches(paged_prefill_attention(*args, **options, backend=backend), expected, dtype)


# --------------------------------------------------------------------------- FP8 caches
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window, soft_cap", [(12, 2.0)])
def test_fp8_paths_skip_blocks_before_the_window(window, soft_cap, backend):
    scenario, query, q_lens = mixed_case(torch.float32, seed=4)
    fp8 = Fp8Pool(scenario, torch.float8_e4m3fn)
    cu = cu_seqlens(q_lens)
    options = dict(scale=0.125, sliding_window=window, soft_cap=soft_cap, **fp8.scales)
    expected = reference_paged_attention(query, fp8.k_cache, fp8.v_cache, scenario.block_tables, scenario.seq_lens,
                                         cu, **options, float64=True)
    table = windowed_table(scenario, q_lens, window)
    out = paged_attention(query, fp8.k_cache, fp8.v_cache, table, scenario.seq_lens, cu, **options,
                          max_seqlen_q=max(q_lens), backend=backend, tuning=SMALL_UNIFIED)
    assert_matches(out, expected, torch.float32)
    decode_rows = [0, 1, 4]
    rows = [int(cu[b]) for b in decode_rows]
    decode_expected = reference_decode_attention(query[rows], fp8.k_cache, fp8.v_cache,
                                                 scenario.block_tables[decode_rows],
                                                 scenario.seq_lens[decode_rows], **options, float64=True)
    for tuning in (None, DECODE_TUNINGS["split"]):  # FP8's default schedule (tiles), the split kernel
        out = paged_decode_attention(query[rows], fp8.k_cache, fp8.v_cache, table[decode_rows],
                                     scenario.seq_lens[decode_rows], **options, backend=backend, tuning=tuning)
        assert_matches(out, decode_expected, torch.float32)


# --------------------------------------------------------------------------- on CUDA
GPU_WINDOWS = [(1024, None), (4096, 50.0), (700, 30.0)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window, soft_cap", GPU_WINDOWS)
def test_windowed_paths_on_cuda_against_float64(window, soft_cap, dtype):
    """Engine-sized windows over 16-token pages: decode (each schedule), prefill and mixed steps, FP8."""
    seq_lens, q_lens = [5000, 1, 1500, 3000, 9000, 700], [1, 1, 300, 1, 1, 700]
    scenario = Scenario(seq_lens, 16, 8, 128, torch.float32, seed=5)
    cpu_query = scenario.query(sum(q_lens), 32)
    cu = cu_seqlens(q_lens)
    expected = reference_paged_attention(cpu_query, scenario.k_cache, scenario.v_cache, scenario.block_tables,
                                         scenario.seq_lens, cu, scale=0.088, sliding_window=window,
                                         soft_cap=soft_cap, float64=True)
    table = windowed_table(scenario, q_lens, window).cuda()
    query = cpu_query.to(dtype).cuda()
    k_cache, v_cache = scenario.k_cache.to(dtype).cuda(), scenario.v_cache.to(dtype).cuda()
    seq = scenario.seq_lens.cuda()
    options = dict(scale=0.088, sliding_window=window, soft_cap=soft_cap)
    out = paged_attention(query, k_cache, v_cache, table, seq, cu.cuda(), **options, max_seqlen_q=max(q_lens))
    assert_gpu_matches(out, expected.cuda(), dtype)
    out = paged_prefill_attention(query, k_cache, v_cache, table, seq, cu.cuda(), **options,
                                  max_seqlen_q=max(q_lens))
    assert_gpu_matches(out, expected.cuda(), dtype)
    decode_rows = [0, 1, 3, 4]
    rows = [int(cu[b]) for b in decode_rows]
    for tuning in (DecodeTuning(), DecodeTuning(merge="in_kernel"), DecodeTuning(schedule="tiles")):
        out = paged_decode_attention(query[rows], k_cache, v_cache, table[decode_rows], seq[decode_rows], **options,
                                     tuning=tuning)
        assert_gpu_matches(out, expected[rows].cuda(), dtype)
