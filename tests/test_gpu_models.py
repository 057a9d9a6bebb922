"""The drop-in cache and the engine on CUDA, through the Triton kernels (run on the H200)."""

import pytest
import torch
from transformers import DynamicCache

from helpers import left_padded
from pagedkv import LLM, SamplingParams
from pagedkv.hf import PagedCache, PagePool, random_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FAMILIES = ["tiny-llama", "tiny-qwen3", "tiny-gpt2", "tiny-mistral", "tiny-qwen2"]


def _left_padded(lengths):
    ids, mask = left_padded(lengths)
    return ids.cuda(), mask.cuda()


@pytest.mark.parametrize("name", FAMILIES)
def test_paged_cache_on_cuda_equals_dynamic_cache_fp32(name):
    model = random_model(name, torch.float32, "cuda")
    ids, mask = _left_padded([5, 9, 13, 2, 17, 1, 8, 11])
    pool = PagePool.for_model(model, num_blocks=256, block_size=16)
    with PagedCache(pool) as cache:
        paged = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, past_key_values=cache,
                               pad_token_id=0, eos_token_id=None)
    model.set_attn_implementation("sdpa")
    dynamic = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                             past_key_values=DynamicCache(), pad_token_id=0, eos_token_id=None)
    assert torch.equal(paged, dynamic)
    assert pool.num_used_blocks == 0


PATHS = [{}, {"enforce_eager": True}, {"model_impl": "hf"}]  # own decoder + graphs, own eager, HF modules


def _hf_reference(model, prompts, num_tokens):
    model.set_attn_implementation("sdpa")
    try:
        refs = []
        for prompt in prompts:
            ids = torch.tensor([prompt], device="cuda")
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens,
                                 do_sample=False, past_key_values=DynamicCache(), pad_token_id=0, eos_token_id=None)
            refs.append(ref[0, len(prompt):].tolist())
        return refs
    finally:
        model.set_attn_implementation("pagedkv")


@pytest.mark.parametrize("path", PATHS, ids=["own-graphs", "own-eager", "hf-modules"])
@pytest.mark.parametrize("name", FAMILIES)
def test_engine_on_cuda_equals_hf_generate_fp32(name, path):
    model = random_model(name, torch.float32, "cuda")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (3, 40, 17, 64, 1, 100)]
    llm = LLM(hf_model=model, kv_cache_memory=64 * 2**20, max_model_len=256, max_num_batched_tokens=64,
              max_num_seqs=16, **path)
    expected_impl = "hf" if name == "tiny-gpt2" or path.get("model_impl") == "hf" else "pagedkv"
    assert llm.engine.model_impl == expected_impl
    if expected_impl == "pagedkv" and not path:
        assert llm.engine.runner.graphs  # decode steps replay graphs
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == _hf_reference(model, prompts, 24)
    assert llm.stats()["num_used_blocks"] == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_prefix_cache_and_n_are_output_invariant_with_graphs(mode):
    model = random_model("tiny-qwen3", torch.float32, "cuda")
    gen = torch.Generator().manual_seed(4)
    shared = torch.randint(3, 500, (40,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 9, 2, 30, 17, 11, 3, 8)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    big = LLM(hf_model=model, kv_cache_memory=64 * 2**20, max_model_len=256, max_num_seqs=16)
    reference = [o.outputs[0].token_ids for o in big.generate(prompts, params)]
    assert reference == _hf_reference(model, prompts, 40)
    small = LLM(hf_model=model, num_blocks=14, block_size=16, max_model_len=200, watermark=0.0, max_num_seqs=16,
                preemption_mode=mode, swap_space=2**20)
    assert small.engine.runner.graphs
    outs = small.generate(prompts, params)
    stats = small.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert stats["num_used_blocks"] == 0
    sampled = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    first = big.generate(prompts[:3], sampled)
    again = small.generate(prompts[:3], sampled)  # another pool, preemptions, graphs: the same streams
    assert [[c.token_ids for c in o.outputs] for o in first] == [[c.token_ids for c in o.outputs] for o in again]


def test_engine_preemption_swap_on_cuda():
    model = random_model("tiny-llama", torch.float32, "cuda")
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (20,), generator=gen).tolist() for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    big = LLM(hf_model=model, kv_cache_memory=64 * 2**20, max_model_len=128).generate(prompts, params)
    small_llm = LLM(hf_model=model, num_blocks=12, block_size=16, max_model_len=128, watermark=0.0,
                    preemption_mode="swap", swap_space=2**20)
    small = small_llm.generate(prompts, params)
    assert small_llm.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in small] == [o.outputs[0].token_ids for o in big]
