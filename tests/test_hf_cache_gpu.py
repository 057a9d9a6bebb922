"""PagedCache's Cache contract on CUDA: pinned metadata staging, copy-on-write on the device, Triton kernels."""

import copy

import pytest
import torch
from transformers import DynamicCache

from helpers import left_padded
from hf_oracle import paged_and_oracle, sdpa
from pagedkv.hf import PagedCache, PagePool, random_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _generate(model, ids, mask, cache, steps, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=steps, past_key_values=cache, pad_token_id=0,
                          eos_token_id=None, **kwargs)


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_beams_samples_and_assisted_decoding_on_cuda_equal_dynamic_cache(name):
    model = random_model(name, torch.float32, "cuda")
    assistant = random_model(name, torch.float32, "cuda", seed=1, attn_implementation="sdpa")
    ids, mask = (t.cuda() for t in left_padded([6, 11]))
    pool = PagePool.for_model(model, num_blocks=256, block_size=16)
    runs = {
        "beams": ((ids, mask), dict(num_beams=4, num_return_sequences=2, do_sample=False)),
        "samples": ((ids, mask), dict(do_sample=True, num_return_sequences=4)),
        "assisted": ((ids[1:], mask[1:]), dict(do_sample=False, assistant_model=assistant)),
        "lookup": ((ids[1:], mask[1:]), dict(do_sample=False, prompt_lookup_num_tokens=3)),
    }
    for (run_ids, run_mask), kwargs in runs.values():
        got, expected = paged_and_oracle(
            model, pool, lambda cache: _generate(model, run_ids, run_mask, cache, 20, **kwargs), seed=0)
        assert torch.equal(got, expected), kwargs
    assert pool.num_used_blocks == 0
    pool.check_integrity()


def test_deepcopy_prompt_reuse_on_cuda():
    model = random_model("tiny-llama", torch.float32, "cuda")
    prompt = left_padded([21], seed=5)[0].cuda()  # a partial last block, shared by every copy
    pool = PagePool.for_model(model, num_blocks=64, block_size=16)

    def reuse(prompt_cache):
        with torch.no_grad():
            model(prompt, past_key_values=prompt_cache, use_cache=True)
        outs = []
        for suffix in ([[7, 8]], [[9]], [[7, 8]]):
            ids = torch.cat([prompt, torch.tensor(suffix, device="cuda")], dim=1)
            outs.append(_generate(model, ids, torch.ones_like(ids), copy.deepcopy(prompt_cache), 12, do_sample=False))
        return outs

    got = reuse(PagedCache(pool))
    with sdpa(model):
        expected = reuse(DynamicCache())
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert torch.equal(got[0], got[2])
