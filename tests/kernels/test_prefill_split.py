"""The split prefill kernel (the chunk's K/V read from the step's QKV, only the prefix through pages) against float64.

On CPU it runs under the Triton interpreter, in fp16 at small shapes. Host tensor descriptors
(TMA) interpret there too (a tile past the tensor's end reads zeros, as on the GPU), so the
same kernel runs: both prefix paths (pages holding whole kv tiles go by descriptor, smaller
pages by the row gather) and the split-KV merge. What the interpreter cannot show is Hopper's
speed; the GPU-marked tests repeat the checks at Llama-3-8B size in bf16 on every pool page size.
Every pool is NaN outside the slots some sequence owns, and every `out` starts NaN.
"""

import logging

import pytest
import torch
from kernel_scenarios import (
    GPU_TOLERANCES,
    LLAMA3,
    GpuScenario,
    Scenario,
    assert_gpu_matches,
    assert_matches,
    cu_seqlens,
)

from pagedkv.errors import ConfigError, InvalidArgumentError, KernelInputError
from pagedkv.kernels import paged_prefill_attention, reference_prefill_attention
from pagedkv.kernels.tuning import SplitPrefillTuning

#: Whole prompts, chunks on ragged and page-aligned prefixes, a one-token chunk.
SEQ_LENS, Q_LENS = [5, 40, 37, 70, 33], [5, 17, 37, 30, 1]
SMALL = dict(block_m=32, block_n=16, num_warps=4, num_stages=2, min_query_tokens=1)  # interpreter-sized tiles


def chunk_step(scenario, seq_lens, q_lens, num_heads, seed=5):
    """(query, key, value, cu_seqlens_q): views of one QKV whose K/V rows hold what the pool holds for each chunk."""
    num_kv_heads, head_dim = scenario.k_cache.shape[2:]
    num_tokens = sum(q_lens)
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    qkv = qkv.to(scenario.k_cache.device, scenario.dtype)
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    query = qkv[:, :q_end].view(num_tokens, num_heads, head_dim)
    key = qkv[:, q_end:k_end].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, k_end:].view(num_tokens, num_kv_heads, head_dim)
    offset = row = 0
    for seq_len, q_len in zip(seq_lens, q_lens):  # scenario.keys: every sequence's positions, in order
        key[row:row + q_len] = scenario.keys[offset + seq_len - q_len:offset + seq_len]
        value[row:row + q_len] = scenario.values[offset + seq_len - q_len:offset + seq_len]
        offset, row = offset + seq_len, row + q_len
    return query, key, value, cu_seqlens(q_lens).to(scenario.k_cache.device)


def split_prefill(query, key, value, scenario, cu, tuning, **options):
    from pagedkv.kernels.triton_prefill_split import triton_split_prefill_attention

    out = torch.full_like(query, float("nan"))
    return triton_split_prefill_attention(query, key, value, scenario.k_cache, scenario.v_cache,
                                          scenario.block_tables, scenario.seq_lens, cu, out,
                                          scale=query.shape[2] ** -0.5, tuning=tuning, **options)


# A page of whole 16-token tiles (descriptor loads) in one pass; half-tile pages (the row gather) split three ways.
@pytest.mark.parametrize("block_size, num_splits", [(16, 1), (8, 3)])
def test_split_prefill_matches_reference(block_size, num_splits):
    scenario = Scenario(SEQ_LENS, block_size, 2, 64, torch.float16, seed=3)
    query, key, value, cu = chunk_step(scenario, SEQ_LENS, Q_LENS, 4)
    out = split_prefill(query, key, value, scenario, cu, SplitPrefillTuning(**SMALL, num_splits=num_splits),
                        max_seqlen_q=max(Q_LENS))
    expected = reference_prefill_attention(query, scenario.k_cache, scenario.v_cache, scenario.block_tables,
                                           scenario.seq_lens, cu, scale=64 ** -0.5, float64=True)
    assert_matches(out, expected, torch.float16)


def spy_packed(monkeypatch) -> list:
    """Count the GQA-packed program's launches (the split launch reaches it through its module)."""
    from pagedkv.kernels import triton_prefill_packed

    calls = []
    launch = triton_prefill_packed.triton_packed_prefill_attention
    monkeypatch.setattr(triton_prefill_packed, "triton_packed_prefill_attention",
                        lambda *args, **kwargs: calls.append(kwargs["launch"]) or launch(*args, **kwargs))
    return calls


def reference(query, scenario, cu, **options):
    return reference_prefill_attention(query, scenario.k_cache, scenario.v_cache, scenario.block_tables,
                                       scenario.seq_lens, cu, scale=query.shape[2] ** -0.5, float64=True, **options)


# GQA-packed rows: (query heads, kv heads, page, kv tile, splits, dtype). A query tile of 32 rows holds 8 tokens
# x 4 heads (fewer tokens than a 16- or 32-token kv tile) or 16 x 2; pages of 16 against 32-token tiles take the
# row gather, pages of 16 or 64 against 16-token tiles the page descriptors.
PACKED = [(8, 2, 16, 32, 1, torch.float16), (4, 2, 64, 16, 3, torch.float16), (8, 2, 16, 16, 2, torch.float32)]


@pytest.mark.parametrize("num_heads, num_kv_heads, block_size, block_n, num_splits, dtype", PACKED)
def test_gqa_packed_split_prefill_matches_reference(monkeypatch, num_heads, num_kv_heads, block_size, block_n,
                                                    num_splits, dtype):
    calls = spy_packed(monkeypatch)
    scenario = Scenario(SEQ_LENS, block_size, num_kv_heads, 64, dtype, seed=6)
    query, key, value, cu = chunk_step(scenario, SEQ_LENS, Q_LENS, num_heads)
    tuning = SplitPrefillTuning(**dict(SMALL, block_n=block_n), num_splits=num_splits, pack_gqa=True)
    out = split_prefill(query, key, value, scenario, cu, tuning, max_seqlen_q=max(Q_LENS))
    assert_matches(out, reference(query, scenario, cu), dtype)
    assert [launch[1] for launch in calls] == [block_n] and [launch[5] for launch in calls] == [num_splits]


@pytest.mark.parametrize("num_heads, num_kv_heads, why", [(2, 2, "GQA group 1"), (6, 2, "does not divide")])
def test_a_group_packing_does_not_cover_runs_unpacked_and_says_why_once(monkeypatch, caplog, num_heads,
                                                                         num_kv_heads, why):
    from pagedkv.kernels import triton_prefill_packed

    triton_prefill_packed.log_unpacked.cache_clear()  # "once" is per process: start this test's count at zero
    calls = spy_packed(monkeypatch)
    scenario = Scenario(SEQ_LENS[:3], 16, num_kv_heads, 64, torch.float16, seed=7)
    query, key, value, cu = chunk_step(scenario, SEQ_LENS[:3], Q_LENS[:3], num_heads)
    with caplog.at_level(logging.INFO, logger="pagedkv.kernels.triton_prefill_packed"):
        for _ in range(2):
            out = split_prefill(query, key, value, scenario, cu, SplitPrefillTuning(**SMALL, pack_gqa=True),
                                max_seqlen_q=max(Q_LENS[:3]))
            assert_matches(out, reference(query, scenario, cu), torch.float16)
    assert calls == []
    assert len([r for r in caplog.records if why in r.getMessage()]) == 1


def test_paged_prefill_attention_takes_the_split_kernel_given_chunk_kv(monkeypatch):
    from pagedkv.kernels import triton_prefill_split

    calls = []
    launch = triton_prefill_split.triton_split_prefill_attention
    monkeypatch.setattr(triton_prefill_split, "triton_split_prefill_attention",
                        lambda *args, **kwargs: calls.append(kwargs["tuning"]) or launch(*args, **kwargs))
    scenario = Scenario(SEQ_LENS[:3], 16, 2, 64, torch.float16, seed=4)
    query, key, value, cu = chunk_step(scenario, SEQ_LENS[:3], Q_LENS[:3], 4)
    kv = (scenario.k_cache, scenario.v_cache, scenario.block_tables, scenario.seq_lens)
    expected = reference_prefill_attention(query, *kv, cu, scale=0.125, float64=True)
    options = {"scale": 0.125, "max_seqlen_q": max(Q_LENS[:3]), "backend": "triton",
               "split_tuning": SplitPrefillTuning(**SMALL)}
    assert_matches(paged_prefill_attention(query, *kv, cu, key=key, value=value, **options), expected, torch.float16)
    assert len(calls) == 1
    packed = spy_packed(monkeypatch)
    monkeypatch.setenv("PAGEDKV_PREFILL_PACK_GQA", "on")  # the packing switch: the packed program, same answer
    assert_matches(paged_prefill_attention(query, *kv, cu, key=key, value=value, **options), expected, torch.float16)
    assert len(calls) == 2 and calls[-1].pack_gqa and len(packed) == 1
    monkeypatch.setenv("PAGEDKV_PREFILL_PACK_GQA", "yes")
    with pytest.raises(ConfigError, match="PAGEDKV_PREFILL_PACK_GQA"):
        paged_prefill_attention(query, *kv, cu, key=key, value=value, **options)
    monkeypatch.delenv("PAGEDKV_PREFILL_PACK_GQA")
    monkeypatch.setenv("PAGEDKV_PREFILL_KERNEL", "paged")  # the A/B switch: the all-paged kernel, same answer
    assert_matches(paged_prefill_attention(query, *kv, cu, key=key, value=value, **options), expected, torch.float16)
    assert len(calls) == 2 and len(packed) == 1


def test_a_shape_the_split_kernel_does_not_cover_falls_back_and_says_why_once(caplog):
    from pagedkv.kernels import triton_prefill_split

    triton_prefill_split._log_fallback.cache_clear()  # "once" is per process: start this test's count at zero
    scenario = Scenario(SEQ_LENS[:3], 16, 2, 64, torch.float16, seed=4)
    query, key, value, cu = chunk_step(scenario, SEQ_LENS[:3], Q_LENS[:3], 4)
    kv = (scenario.k_cache, scenario.v_cache, scenario.block_tables, scenario.seq_lens)
    options = {"scale": 0.125, "max_seqlen_q": max(Q_LENS[:3]), "sliding_window": 9, "backend": "triton",
               "split_tuning": SplitPrefillTuning(**SMALL)}
    expected = reference_prefill_attention(query, *kv, cu, scale=0.125, sliding_window=9, float64=True)
    with caplog.at_level(logging.INFO, logger="pagedkv.kernels.triton_prefill_split"):
        for _ in range(2):
            assert_matches(paged_prefill_attention(query, *kv, cu, key=key, value=value, **options), expected,
                           torch.float16)
    said = [r.getMessage() for r in caplog.records if "sliding window" in r.getMessage()]
    assert len(said) == 1


def test_chunk_kv_of_the_wrong_shape_is_refused():
    scenario = Scenario(SEQ_LENS[:2], 16, 2, 64, torch.float16, seed=4)
    query, key, value, cu = chunk_step(scenario, SEQ_LENS[:2], Q_LENS[:2], 4)
    kv = (scenario.k_cache, scenario.v_cache, scenario.block_tables, scenario.seq_lens)
    with pytest.raises(KernelInputError, match=r"key is \(22, 1, 64\)"):
        paged_prefill_attention(query, *kv, cu, scale=0.125, max_seqlen_q=17, backend="triton", key=key[:, :1],
                                value=value)


def test_split_prefill_tuning_follows_the_step_shape():
    tuning = SplitPrefillTuning()
    # Many programs (8 x 2048 tokens, 32 heads, 132 SMs): two 128 x 64 programs per SM, no split.
    assert tuning.resolve(128, 32, 8, 2048, 2048, 132) == (128, 64, 8, 2, 128, 1)
    # One 512-token chunk on a 4,096 prefix: 128 programs split 2 ways, then two per SM.
    assert tuning.resolve(128, 32, 1, 512, 4608, 132) == (128, 64, 8, 2, 128, 2)
    # A short step on short keys: no split; one deep program per SM, tiles no taller than the chunk.
    assert tuning.resolve(128, 32, 1, 100, 300, 132) == (128, 128, 8, 3, None, 1)
    assert tuning.resolve(128, 8, 1, 20, 300, 132) == (32, 32, 4, 3, None, 1)
    with pytest.raises(InvalidArgumentError, match="multiple of block_n"):
        SplitPrefillTuning(block_m=32, block_n=64)
    with pytest.raises(InvalidArgumentError, match="maxnreg"):
        SplitPrefillTuning(maxnreg=-1)
    # GQA-packed (group 4): rows are tokens x 4 heads, so the same steps have the same program counts.
    assert tuning.resolve(128, 32, 8, 2048, 2048, 132, group=4) == (128, 64, 8, 2, 128, 1)
    assert tuning.resolve(128, 32, 1, 512, 4608, 132, group=4) == (128, 64, 8, 2, 128, 2)
    assert tuning.resolve(128, 8, 1, 20, 300, 132, group=4) == (128, 128, 8, 3, None, 1)  # 80 rows: one tile
    with pytest.raises(InvalidArgumentError, match="pack_gqa must be a bool"):
        SplitPrefillTuning(pack_gqa=1)


# --------------------------------------------------------------------------- on CUDA, at full size
GPU_SEQ_LENS, GPU_Q_LENS = [17, 1000, 4608, 2048, 129, 300], [17, 1000, 512, 2048, 64, 1]


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 64, 128])
@pytest.mark.parametrize("num_splits", [None, 1, 2, 3])
def test_split_prefill_llama3_on_cuda(block_size, num_splits):
    scenario = GpuScenario(GPU_SEQ_LENS, block_size, 8, 128, torch.bfloat16, seed=21)
    query, key, value, cu = chunk_step(scenario, GPU_SEQ_LENS, GPU_Q_LENS, 32)
    expected = reference_prefill_attention(query, *scenario.kv, cu, scale=128 ** -0.5, float64=True)
    out = split_prefill(query, key, value, scenario, cu, SplitPrefillTuning(num_splits=num_splits),
                        max_seqlen_q=max(GPU_Q_LENS), max_seq_len=max(GPU_SEQ_LENS))
    assert_gpu_matches(out, expected, torch.bfloat16)


QWEN3, SMOLLM2 = (16, 8, 128), (9, 3, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size, num_splits, heads", [
    (16, None, LLAMA3), (64, None, LLAMA3), (128, None, LLAMA3), (16, 2, LLAMA3), (64, 1, LLAMA3),
    (16, None, QWEN3), (64, 2, QWEN3), (16, None, SMOLLM2)])  # SmolLM2's group of 3 runs unpacked
def test_gqa_packed_split_prefill_on_cuda(block_size, num_splits, heads):
    scenario = GpuScenario(GPU_SEQ_LENS, block_size, heads[1], heads[2], torch.bfloat16, seed=23)
    query, key, value, cu = chunk_step(scenario, GPU_SEQ_LENS, GPU_Q_LENS, heads[0])
    expected = reference_prefill_attention(query, *scenario.kv, cu, scale=heads[2] ** -0.5, float64=True)
    out = split_prefill(query, key, value, scenario, cu, SplitPrefillTuning(num_splits=num_splits, pack_gqa=True),
                        max_seqlen_q=max(GPU_Q_LENS), max_seq_len=max(GPU_SEQ_LENS))
    assert_gpu_matches(out, expected, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(GPU_TOLERANCES))
@pytest.mark.parametrize("heads", [(16, 8, 128), (9, 3, 64), (12, 12, 64)])
def test_split_prefill_engine_heads_on_cuda(dtype, heads):
    scenario = GpuScenario(GPU_SEQ_LENS, 16, heads[1], heads[2], dtype, seed=22)
    query, key, value, cu = chunk_step(scenario, GPU_SEQ_LENS, GPU_Q_LENS, heads[0])
    kv = (*scenario.kv, cu)
    expected = reference_prefill_attention(query, *kv, scale=heads[2] ** -0.5, float64=True)
    out = paged_prefill_attention(query, *kv, scale=heads[2] ** -0.5, max_seqlen_q=max(GPU_Q_LENS), key=key,
                                  value=value)
    assert_gpu_matches(out, expected, dtype)
