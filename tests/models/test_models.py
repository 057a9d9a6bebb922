"""pagedkv's own Llama-family decoder against HF's modules: logits, paths, and the engine on both (CPU; CUDA: `gpu`)."""

import pytest
import torch

from helpers import hf_greedy, max_logit_error_vs_hf, tiny, uncovered_model
from pagedkv import LLM, SamplingParams
from pagedkv.errors import ConfigError
from pagedkv.hf import random_model
from pagedkv.models import DecoderConfig, is_supported

FAMILIES = ["tiny-llama", "tiny-qwen3", "tiny-qwen2", "tiny-mistral"]


@pytest.mark.parametrize("name", FAMILIES)
def test_own_decoder_logits_match_hf(name):
    assert max_logit_error_vs_hf(tiny(name), (7, 13, 1)) <= 1e-4


def test_own_decoder_refuses_other_families():
    assert not is_supported(uncovered_model().config)
    with pytest.raises(ConfigError, match="gpt_neox"):
        DecoderConfig.from_hf(uncovered_model().config)


@pytest.mark.parametrize("impl", ["pagedkv", "hf"])
def test_engine_paths_equal_hf_generate(impl):
    llm = LLM(hf_model=tiny("tiny-qwen3"), block_size=4, num_blocks=256, model_impl=impl, max_num_batched_tokens=16,
              device="cpu")
    assert llm.engine.model_impl == impl
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (3, 21, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(tiny("tiny-qwen3"), p, 10) for p in prompts]
    assert llm.stats()["num_used_blocks"] == 0


def test_model_impl_pagedkv_on_an_uncovered_family_is_a_clear_error():
    with pytest.raises(ConfigError, match="not covered"):
        LLM(hf_model=uncovered_model(), block_size=4, num_blocks=64, model_impl="pagedkv", device="cpu")


# --------------------------------------------------------------------------- on CUDA
# The engine on CUDA through the Triton kernels: own decoder with graphs, own eager, HF's modules.
CUDA_FAMILIES = ["tiny-llama", "tiny-qwen3", "tiny-gpt2", "tiny-mistral", "tiny-qwen2", "tiny-gemma3", "tiny-gemma2",
                 "tiny-phi3"]
#: HF's sdpa attention has no soft cap: these families' oracle runs eager attention.
EAGER_ORACLE = ("tiny-gemma2",)
PATHS = [{}, {"enforce_eager": True}, {"model_impl": "hf"}]  # own decoder + graphs, own eager, HF modules


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS, ids=["own-graphs", "own-eager", "hf-modules"])
@pytest.mark.parametrize("name", CUDA_FAMILIES)
def test_engine_on_cuda_equals_hf_generate_fp32(name, path):
    model = random_model(name, torch.float32, "cuda")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (3, 40, 17, 64, 1, 100)]
    llm = LLM(hf_model=model, kv_cache_memory=64 * 2**20, max_model_len=256, max_num_batched_tokens=64,
              max_num_seqs=16, **path)
    expected_impl = "hf" if path.get("model_impl") == "hf" else "pagedkv"
    assert llm.engine.model_impl == expected_impl
    if expected_impl == "pagedkv" and not path:
        assert llm.engine.runner.graphs  # decode steps replay graphs
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    attn = "eager" if name in EAGER_ORACLE else "sdpa"
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 24, attn=attn) for p in prompts]
    assert llm.stats()["num_used_blocks"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_prefix_cache_and_n_are_output_invariant_with_graphs(mode):
    model = random_model("tiny-qwen3", torch.float32, "cuda")
    gen = torch.Generator().manual_seed(4)
    shared = torch.randint(3, 500, (40,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 9, 2, 30, 17, 11, 3, 8)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    big = LLM(hf_model=model, kv_cache_memory=64 * 2**20, max_model_len=256, max_num_seqs=16)
    reference = [o.outputs[0].token_ids for o in big.generate(prompts, params)]
    assert reference == [hf_greedy(model, p, 40) for p in prompts]
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


@pytest.mark.gpu
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
