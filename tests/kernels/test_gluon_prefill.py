"""The Hopper prefill kernel in Gluon (`kernels.gluon_prefill`) against float64, and its route.

Gluon has no interpreter, so on CPU only the route is tested: asked for (PAGEDKV_PREFILL_KERNEL=
gluon) where it cannot run, the split kernel answers and the reason is logged once. The
GPU-marked tests run it on an sm_90 device at the engine's head shapes and every page size it
covers. Its pools hold 1e4 (not NaN) in the slots nobody wrote: a masked key's V row enters its
PV product times 0, so stale slots must be finite (the engine's pool is allocated zeroed);
1e4 in any unmasked score or V row would show in the output.
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
