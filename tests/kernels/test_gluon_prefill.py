"""The Hopper prefill kernel in Gluon (`kernels.gluon_prefill`) against float64, and its route.

Gluon has no interpreter, so on CPU only the route is tested: asked for (PAGEDKV_PREFILL_KERNEL=
gluon) where it cannot run, the split kernel answers and the reason is logged once; and which
calls the default route keeps on the split kernel. The GPU-marked tests run it on an sm_90 device
at the engine's head shapes and every page size it covers, on NaN-poisoned pools (a masked key's
V row enters its PV product times 0: the kernel zeroes the stale rows of a prefix's last page and
the neighbour's rows past a chunk; without that, these tests fail).
"""

import logging

import pytest
import torch
from kernel_scenarios import GpuScenario, Scenario, assert_gpu_matches, assert_matches
from test_prefill_split import GPU_Q_LENS, GPU_SEQ_LENS, LLAMA3, Q_LENS, QWEN3, SEQ_LENS, SMALL, SMOLLM2, chunk_step

from pagedkv.kernels import paged_prefill_attention, reference_prefill_attention
from pagedkv.kernels.tuning import SplitPrefillTuning


def test_asked_for_where_it_cannot_run_the_split_kernel_answers_and_says_why_once(monkeypatch, caplog):
    from pagedkv.kernels import triton_prefill_split

    triton_prefill_split._log_gluon_fallback.cache_clear()
    calls = []
    launch = triton_prefill_split.triton_split_prefill_attention
    monkeypatch.setattr(triton_prefill_split, "triton_split_prefill_attention",
                        lambda *args, **kwargs: calls.append(1) or launch(*args, **kwargs))
    scenario = Scenario(SEQ_LENS[:3], 16, 2, 64, torch.float16, seed=4)
    query, key, value, cu = chunk_step(scenario, SEQ_LENS[:3], Q_LENS[:3], 4)
    kv = (scenario.k_cache, scenario.v_cache, scenario.block_tables, scenario.seq_lens)
    expected = reference_prefill_attention(query, *kv, cu, scale=0.125, float64=True)
    options = {"scale": 0.125, "max_seqlen_q": max(Q_LENS[:3]), "backend": "triton",
               "split_tuning": SplitPrefillTuning(**SMALL)}
    monkeypatch.setenv("PAGEDKV_PREFILL_KERNEL", "gluon")
    with caplog.at_level(logging.INFO, logger="pagedkv.kernels.triton_prefill_split"):
        for _ in range(2):
            assert_matches(paged_prefill_attention(query, *kv, cu, key=key, value=value, **options), expected,
                           torch.float16)
    assert len(calls) == 2
    said = [r.getMessage() for r in caplog.records if "Gluon kernel does not cover" in r.getMessage()]
    assert len(said) == 1 and "sm_90" in said[0]


def test_the_default_route_keeps_the_split_kernel_for_few_items_on_long_keys_or_explicit_settings(monkeypatch):
    """The Gluon kernel runs one (query tile, sequence, head) item per SM and never splits the keys."""
    from pagedkv.kernels import triton_prefill_split as route

    monkeypatch.setattr(route, "_is_hopper", lambda device: True)
    monkeypatch.setattr(route, "num_sms", lambda device: 132)
    tables, cache = torch.zeros(1, 1100, dtype=torch.int32), torch.zeros(1, 16, 8, 128)

    def keeps_split(chunk, num_seqs, max_seq_len, tuning=SplitPrefillTuning()):
        query = torch.zeros(chunk * num_seqs, 32, 128)
        return route._auto_keeps_split(query, torch.zeros(num_seqs), chunk, max_seq_len, tables, cache, tuning)

    assert keeps_split(64, 1, 16384) == "32 work items for 132 SMs on 16384 keys"  # a tail chunk on a long prompt
    assert keeps_split(512, 1, 4608) is None  # 128 items: the Gluon kernel fills the SMs
    assert keeps_split(64, 2, 16384) == "64 work items for 132 SMs on 16384 keys"  # at most half the SMs
    assert keeps_split(64, 3, 16384) is None  # 96 items: the Gluon kernel
    assert keeps_split(64, 1, 2047) is None  # short keys: a split would not pay
    assert keeps_split(512, 1, 4608, SplitPrefillTuning(num_splits=2)) == "explicit split-kernel settings"


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not hopper(), reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("block_size, heads, dtype", [
    (16, LLAMA3, torch.bfloat16), (32, LLAMA3, torch.bfloat16), (64, LLAMA3, torch.bfloat16),
    (128, LLAMA3, torch.bfloat16), (256, LLAMA3, torch.bfloat16), (16, QWEN3, torch.bfloat16),
    (64, QWEN3, torch.float16), (16, SMOLLM2, torch.bfloat16), (64, SMOLLM2, torch.float16)])
def test_gluon_prefill_on_cuda(block_size, heads, dtype):
    from pagedkv.kernels.gluon_prefill import gluon_prefill_attention, unsupported_reason

    scenario = GpuScenario(GPU_SEQ_LENS, block_size, heads[1], heads[2], dtype, seed=24)
    query, key, value, cu = chunk_step(scenario, GPU_SEQ_LENS, GPU_Q_LENS, heads[0])
    assert unsupported_reason(query, scenario.k_cache) is None
    expected = reference_prefill_attention(query, *scenario.kv, cu, scale=heads[2] ** -0.5, float64=True)
    out = torch.full_like(query, float("nan"))
    gluon_prefill_attention(query, key, value, *scenario.kv, cu, out, scale=heads[2] ** -0.5,
                            max_seqlen_q=max(GPU_Q_LENS))
    assert_gpu_matches(out, expected, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not hopper(), reason="the Gluon kernel runs on sm_90 only")
def test_gluon_prefill_takes_int64_metadata():
    from pagedkv.kernels.gluon_prefill import gluon_prefill_attention

    scenario = GpuScenario(GPU_SEQ_LENS, 16, 8, 128, torch.bfloat16, seed=26)
    query, key, value, cu = chunk_step(scenario, GPU_SEQ_LENS, GPU_Q_LENS, 32)
    expected = reference_prefill_attention(query, *scenario.kv, cu, scale=128 ** -0.5, float64=True)
    out = torch.full_like(query, float("nan"))
    gluon_prefill_attention(query, key, value, scenario.k_cache, scenario.v_cache, scenario.block_tables.long(),
                            scenario.seq_lens.long(), cu.long(), out, scale=128 ** -0.5, max_seqlen_q=max(GPU_Q_LENS))
    assert_gpu_matches(out, expected, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not hopper(), reason="the Gluon kernel runs on sm_90 only")
def test_a_bad_neighbour_does_not_reach_a_sequence_through_its_diagonal_tile():
    """A chunk of 100 tokens reads the next sequence's first 28 K/V rows on its diagonal tile, masked: NaN there
    (a request whose activations overflowed) must not reach it. The neighbour's own rows may be NaN."""
    from pagedkv.kernels.gluon_prefill import gluon_prefill_attention

    seq_lens, q_lens = [300, 200], [100, 200]
    scenario = GpuScenario(seq_lens, 16, 8, 128, torch.bfloat16, seed=27)
    query, key, value, cu = chunk_step(scenario, seq_lens, q_lens, 32)
    expected = reference_prefill_attention(query, *scenario.kv, cu, scale=128 ** -0.5, float64=True)
    value[100:140] = float("nan")
    key[100:140] = float("nan")
    out = torch.full_like(query, float("nan"))
    gluon_prefill_attention(query, key, value, *scenario.kv, cu, out, scale=128 ** -0.5, max_seqlen_q=200)
    assert_gpu_matches(out[:100], expected[:100], torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not hopper(), reason="the Gluon kernel runs on sm_90 only")
def test_the_route_takes_the_gluon_kernel_on_hopper(monkeypatch):
    from pagedkv.kernels import gluon_prefill

    calls = []
    launch = gluon_prefill.gluon_prefill_attention
    monkeypatch.setattr(gluon_prefill, "gluon_prefill_attention",
                        lambda *args, **kwargs: calls.append(1) or launch(*args, **kwargs))
    monkeypatch.setenv("PAGEDKV_PREFILL_KERNEL", "gluon")
    scenario = GpuScenario(GPU_SEQ_LENS, 16, 8, 128, torch.bfloat16, seed=25)
    query, key, value, cu = chunk_step(scenario, GPU_SEQ_LENS, GPU_Q_LENS, 32)
    expected = reference_prefill_attention(query, *scenario.kv, cu, scale=128 ** -0.5, float64=True)
    out = paged_prefill_attention(query, *scenario.kv, cu, scale=128 ** -0.5, max_seqlen_q=max(GPU_Q_LENS), key=key,
                                  value=value)
    assert_gpu_matches(out, expected, torch.bfloat16)
    assert calls == [1]
