"""Data-parallel replicas on two GPUs: each replica on its own device, fp32 greedy tokens equal one engine's."""

import pytest
import torch

from pagedkv import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs 2 CUDA GPUs")]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])  # own decoder with graphs; HF's modules
def test_two_replicas_on_two_gpus_equal_one_engine_fp32(name):
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (1, 9, 30, 64, 5, 17)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    options = dict(dtype="float32", kv_cache_memory=64 * 2**20, max_model_len=256, max_num_seqs=16)
    single = [o.outputs[0].token_ids for o in LLM(f"random:{name}", **options).generate(prompts, params)]
    llm = LLM(f"random:{name}", data_parallel_size=2, **options)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == single
        health = llm.engine.health()
        assert [(h["alive"], h["device"]) for h in health] == [(True, "cuda:0"), (True, "cuda:1")]
        assert all(n > 0 for n in llm.engine.router.stats.num_per_replica)  # distinct prompts: spread by load
        assert llm.stats()["num_used_blocks"] == 0
    finally:
        llm.engine.shutdown()
