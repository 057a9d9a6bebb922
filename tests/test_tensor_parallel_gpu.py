"""Tensor parallelism on two GPUs (NCCL, CUDA graphs): fp32 greedy tokens equal one GPU's and HF's."""

import pytest
import torch

from pagedkv import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs 2 CUDA GPUs")]


@pytest.mark.parametrize("all_reduce", ["nccl", "symm_mem"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_tp2_with_graphs_equals_tp1_fp32(name, all_reduce, monkeypatch):
    monkeypatch.setenv("PAGEDKV_TP_ALL_REDUCE", all_reduce)  # spawned workers inherit it
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (3, 40, 17, 64, 1, 100)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    options = dict(dtype="float32", kv_cache_memory=64 * 2**20, max_model_len=256, max_num_seqs=16)
    single = [o.outputs[0].token_ids for o in LLM(f"random:{name}", **options).generate(prompts, params)]
    llm = LLM(f"random:{name}", tensor_parallel_size=2, **options)
    try:
        assert llm.engine.runner.graphs and llm.engine.tp.all_reduce_mode == all_reduce
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == single
    finally:
        llm.engine.shutdown()


def test_tp2_seeded_sampling_equals_tp1_fp32():
    """Rank 0 samples and broadcasts the tokens on the device; the workers' next inputs are those tokens."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 33, 12, 70)]
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=20, ignore_eos=True) for i in range(3)]
    params.append(SamplingParams(temperature=1.0, seed=9, n=2, max_tokens=16, ignore_eos=True))
    options = dict(dtype="float32", kv_cache_memory=64 * 2**20, max_model_len=256, max_num_seqs=16)

    def tokens(llm):
        return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]

    single = tokens(LLM("random:tiny-llama", **options))
    llm = LLM("random:tiny-llama", tensor_parallel_size=2, **options)
    try:
        assert tokens(llm) == single
    finally:
        llm.engine.shutdown()
