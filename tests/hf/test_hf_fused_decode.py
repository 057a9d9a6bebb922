"""PagedCache's decode steps through the fused K/V write + attention kernel (Triton, under the interpreter on CPU).

On CPU `PagedCache` takes the torch path unless PAGEDKV_KERNEL_BACKEND=triton; these tests
set it, so decode steps run `DecodeWriteStep` (one launch per layer) while prefill runs the
unfused Triton kernels, and compare with DynamicCache + sdpa token for token. Beam search
makes copy-on-write copies inside the decode step's metadata.
"""

import pytest
import torch

from helpers import left_padded, tiny
from hf_oracle import forward, generate, paged_and_oracle, sdpa
from pagedkv.hf import PagedCache, PagePool
from pagedkv.kernels.triton_decode_write import DecodeWriteStep


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", "triton")


@pytest.mark.parametrize("name, kwargs", [("tiny-llama", {}), ("tiny-gpt2", dict(num_beams=2))],
                         ids=["greedy-gqa", "beams-mha"])
def test_fused_decode_matches_dynamic_cache(name, kwargs):
    model = tiny(name)
    ids, mask = left_padded([5, 9, 3])
    pool = PagePool.for_model(model, num_blocks=64, block_size=8)
    pool.fused_decode = True
    got, expected = paged_and_oracle(model, pool, lambda cache: generate(model, ids, mask, cache, 6, do_sample=False,
                                                                         **kwargs))
    assert torch.equal(got, expected)
    assert pool.num_used_blocks == 0
    pool.check_integrity()


def test_decode_metadata_width_grows_by_powers_of_two_and_matches_dynamic_cache():
    """A prompt past 16 blocks widens the block table to 32 columns; the decode step reads it right."""
    from transformers import DynamicCache

    model = tiny("tiny-llama")
    ids, prompt_mask = left_padded([70, 12])
    pool = PagePool.for_model(model, num_blocks=64, block_size=4)  # 71 tokens in 4-token pages: 18 blocks
    pool.fused_decode = True
    cache = PagedCache(pool)
    prefill = forward(model, ids, prompt_mask, cache)
    next_ids = prefill[:, -1:].argmax(-1)
    mask = torch.cat([prompt_mask, torch.ones_like(next_ids)], dim=1)
    decode = forward(model, next_ids, mask, cache)
    meta = cache._metadata
    assert isinstance(meta.decode_step, DecodeWriteStep) and meta.slot_mapping is None
    assert tuple(meta.decode_block_tables.shape) == (2, 32) and meta.decode_seq_lens.tolist() == [71, 13]
    oracle = DynamicCache()
    with sdpa(model):
        expected_prefill = forward(model, ids, prompt_mask, oracle)
        expected_decode = forward(model, next_ids, mask, oracle)
    real = prompt_mask.bool()
    torch.testing.assert_close(prefill[real], expected_prefill[real], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(decode, expected_decode, atol=2e-4, rtol=2e-4)
    cache.free()
    assert pool.num_used_blocks == 0
