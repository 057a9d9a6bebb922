"""Strided views as kernel inputs: every backend reads and writes through the strides it is given.

Round 1's Triton kernels assumed unit strides for the index tensors and `out`, and silently
read or wrote the wrong memory for `block_tables[:, ::2]`, `seq_lens[::2]`,
`cu_seqlens_q[::2]` or an `out` sliced along head_dim. Each view here interleaves the real
entries with poison (block ids of NaN blocks, huge lengths, out-of-range offsets), so a
kernel that steps over the stride reads NaN, runs past the pool, or fails the comparison.
"""

import pytest
import torch
from kernel_scenarios import (
    LENGTHS,
    SCHEDULES,
    Scenario,
    assert_gpu_matches,
    assert_matches,
    cu_seqlens,
    interleave,
    mixed_gpu_case,
    poisoned_views,
    strided_out,
)

from pagedkv.kernels import (
    DecodeTuning,
    UnifiedTuning,
    paged_attention,
    paged_decode_attention,
    paged_prefill_attention,
    reference_decode_attention,
    reference_paged_attention,
    reference_prefill_attention,
    reference_write_kv,
    write_kv,
)

BACKENDS = ["triton", "torch"]
SCALE = 0.125


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_reads_strided_tables_lengths_query_and_writes_strided_out(backend):
    scenario = Scenario([1, 17, 40, 9], 8, 2, 64, torch.float32, seed=21)
    tables, lens = poisoned_views(scenario)
    query = interleave(scenario.query(4, 8), float("nan"), dim=2)  # head_dim stride 2
    out = strided_out(query)
    expected = reference_decode_attention(query.contiguous(), scenario.k_cache, scenario.v_cache,
                                          scenario.block_tables, scenario.seq_lens, scale=SCALE, float64=True)
    for num_splits in (1, 3):
        result = paged_decode_attention(query, scenario.k_cache, scenario.v_cache, tables, lens, scale=SCALE,
                                        max_seq_len=40, num_splits=num_splits, out=out, backend=backend)
        assert result.data_ptr() == out.data_ptr()
        assert_matches(out, expected, torch.float32)
        assert out._base[..., 1::2].isnan().all(), "wrote between the strided out's elements"


@pytest.mark.parametrize("tuning", [DecodeTuning(merge="in_kernel", block_n=16)], ids=["in_kernel"])
def test_new_decode_schedules_read_strided_views(tuning):
    scenario = Scenario([1, 17, 40, 9], 8, 2, 64, torch.float32, seed=22)
    tables, lens = poisoned_views(scenario)
    query = interleave(scenario.query(4, 8), float("nan"), dim=2)
    out = strided_out(query)
    expected = reference_decode_attention(query.contiguous(), scenario.k_cache, scenario.v_cache,
                                          scenario.block_tables, scenario.seq_lens, scale=SCALE, float64=True)
    paged_decode_attention(query, scenario.k_cache, scenario.v_cache, tables, lens, scale=SCALE, max_seq_len=40,
                           num_splits=3, out=out, backend="triton", tuning=tuning)
    assert_matches(out, expected, torch.float32)


def _prefill_inputs(seed):
    scenario = Scenario([20, 33, 9], 8, 2, 64, torch.float32, seed=seed)
    q_lens = [20, 5, 9]
    cu = cu_seqlens(q_lens)
    query = scenario.query(int(cu[-1]), 4)
    expected = reference_prefill_attention(query, scenario.k_cache, scenario.v_cache, scenario.block_tables,
                                           scenario.seq_lens, cu, scale=SCALE, float64=True)
    # Poison between the cu_seqlens entries: chunk bounds far outside the query.
    return scenario, cu, interleave(cu, 10**7), query, max(q_lens), expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_reads_strided_cu_seqlens_tables_lengths_and_writes_strided_out(backend):
    scenario, _, cu_view, query, max_q, expected = _prefill_inputs(seed=23)
    tables, lens = poisoned_views(scenario)
    out = strided_out(query)
    paged_prefill_attention(interleave(query, float("nan"), dim=2), scenario.k_cache, scenario.v_cache, tables,
                            lens, cu_view, scale=SCALE, max_seqlen_q=max_q, out=out, backend=backend)
    assert_matches(out, expected, torch.float32)
    assert out._base[..., 1::2].isnan().all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_unified_reads_strided_views(backend):
    scenario, _, cu_view, query, max_q, expected = _prefill_inputs(seed=24)
    tables, lens = poisoned_views(scenario)
    out = strided_out(query)
    paged_attention(interleave(query, float("nan"), dim=2), scenario.k_cache, scenario.v_cache, tables, lens,
                    cu_view, scale=SCALE, max_seqlen_q=max_q, out=out, backend=backend,
                    tuning=UnifiedTuning(block_m=16, block_n=16))
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("has_padding", [True, False])
def test_write_kv_reads_strided_slots_and_keys(backend, has_padding):
    block_size, num_blocks, num_tokens = 8, 6, 11
    generator = torch.Generator().manual_seed(25)
    key = torch.randn(num_tokens, 2, 64, generator=generator)
    value = torch.randn(num_tokens, 2, 64, generator=generator)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    if has_padding:
        slots[[1, 6]] = -1
    k_cache = torch.full((num_blocks, block_size, 2, 64), float("nan"))
    v_cache = k_cache.clone()
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    reference_write_kv(key, value, k_expected, v_expected, slots)
    # Poison between the slots: a slot the real mapping never names.
    slot_view = interleave(slots, int(torch.tensor([s for s in range(48) if s not in slots.tolist()][0])))
    write_kv(interleave(key, float("nan"), dim=2), interleave(value, float("nan"), dim=2), k_cache, v_cache,
             slot_view, backend=backend, has_padding=has_padding)
    torch.testing.assert_close(k_cache, k_expected, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_expected, atol=0, rtol=0, equal_nan=True)


# --------------------------------------------------------------------------- on CUDA
@pytest.mark.gpu
def test_strided_views_on_gpu():
    scenario, cu, max_q, query = mixed_gpu_case(16, seed=35)
    poison_block = int(scenario.block_tables[0, -1])
    tables = interleave(scenario.block_tables, poison_block, dim=1)
    lens = interleave(scenario.seq_lens, 10**6)
    cu_view = interleave(cu, 10**7)
    strided_query = interleave(query, float("nan"), dim=2)
    kv = (scenario.k_cache, scenario.v_cache, tables, lens)
    expected = reference_paged_attention(query, *scenario.kv, cu, scale=0.088, float64=True)
    out = interleave(torch.empty_like(query), float("nan"), dim=2)
    paged_attention(strided_query, *kv, cu_view, scale=0.088, max_seqlen_q=max_q, out=out)
    assert_gpu_matches(out, expected, torch.bfloat16)
    paged_prefill_attention(strided_query, *kv, cu_view, scale=0.088, max_seqlen_q=max_q, out=out)
    assert_gpu_matches(out, expected, torch.bfloat16)
    rows = torch.arange(len(LENGTHS), device="cuda")  # the decode rows: token i is sequence i's only query
    decode_kv = (scenario.k_cache, scenario.v_cache, tables[: len(LENGTHS)], lens[: len(LENGTHS)])
    for tuning in SCHEDULES.values():
        decode_out = interleave(torch.empty_like(query[rows]), float("nan"), dim=2)
        paged_decode_attention(strided_query[: len(LENGTHS)], *decode_kv, scale=0.088, max_seq_len=4096,
                               out=decode_out, tuning=tuning)
        assert_gpu_matches(decode_out, expected[rows], torch.bfloat16)
