"""Beam search and parallel sampling through PagedCache: DynamicCache's tokens, with shared blocks.

Beam reordering is a block-table fork per surviving beam: beams share their common prefix
blocks by reference count, and a write into a shared partial block copies it first.
"""

import pytest
import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

from helpers import left_padded, smollm2, tiny
from hf_oracle import forward, generate, paged_and_oracle, sdpa
from pagedkv.hf import PagedCache, PagePool

BEAM_MODELS = ["tiny-gpt2", "tiny-llama"]


class _PoolProbe(StoppingCriteria):
    """Records the pool's used blocks after every forward of a generate call (never stops it)."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.used: list[int] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.used.append(self.pool.num_used_blocks)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _sample(model, ids, mask, cache, steps: int, n: int, seed: int):
    torch.manual_seed(seed)
    return generate(model, ids, mask, cache, steps, do_sample=True, num_return_sequences=n, temperature=1.0)


@pytest.mark.parametrize("name", BEAM_MODELS)
@pytest.mark.parametrize("lengths", [[9], [6, 11]], ids=["batch1", "padded2"])
def test_beam_search_matches_dynamic_cache(name, lengths):
    model = tiny(name)
    ids, mask = left_padded(lengths)
    pool = PagePool.for_model(model, num_blocks=128, block_size=4)
    kwargs = dict(num_beams=4, num_return_sequences=2, do_sample=False, return_dict_in_generate=True,
                  output_scores=True)
    got, expected = paged_and_oracle(model, pool, lambda cache: generate(model, ids, mask, cache, 10, **kwargs))
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(got.sequences_scores, expected.sequences_scores, atol=1e-5, rtol=1e-5)
    assert pool.num_used_blocks == 0
    pool.check_integrity()


@pytest.mark.parametrize("name", BEAM_MODELS)
@pytest.mark.parametrize("lengths", [[9], [6, 11]], ids=["batch1", "padded2"])
def test_seeded_parallel_sampling_matches_dynamic_cache(name, lengths):
    model = tiny(name)
    ids, mask = left_padded(lengths, seed=4)
    pool = PagePool.for_model(model, num_blocks=128, block_size=4)
    got, expected = paged_and_oracle(model, pool, lambda cache: _sample(model, ids, mask, cache, 10, n=4, seed=11))
    assert torch.equal(got, expected)
    assert len({tuple(row) for row in got[:4, -10:].tolist()}) > 1  # the four samples are not all the same
    pool.check_integrity()


def test_beam_sampling_matches_dynamic_cache():
    model = tiny("tiny-llama")
    ids, mask = left_padded([8])
    pool = PagePool.for_model(model, num_blocks=128, block_size=4)
    got, expected = paged_and_oracle(
        model, pool, lambda cache: generate(model, ids, mask, cache, 8, num_beams=3, do_sample=True), seed=5)
    assert torch.equal(got, expected)


def test_beams_share_their_prompt_blocks():
    model = tiny("tiny-gpt2")
    ids, mask = left_padded([24], seed=2)  # 6 full blocks of 4
    pool = PagePool.for_model(model, num_blocks=256, block_size=4)
    probe = _PoolProbe(pool)
    cache = PagedCache(pool)
    generate(model, ids, mask, cache, 12, num_beams=4, do_sample=False, stopping_criteria=StoppingCriteriaList([probe]))
    # Every beam descends from beam 0 after the first step (HF starts the others at -1e9), so the
    # four block tables point at the same six prompt blocks.
    prompt_blocks = {tuple(table.block_ids[:6]) for table in cache.tables}
    assert len(prompt_blocks) == 1
    tokens = cache.tables[0].num_tokens
    unshared = 4 * -(-tokens // 4)  # four private copies, what DynamicCache holds
    assert pool.num_used_blocks <= 6 + 4 * -(-(tokens - 24) // 4)
    assert cache.memory().num_blocks == pool.num_used_blocks < unshared
    # prefill wrote four copies of the prompt (generate expands input_ids); the first reorder dropped three
    assert probe.used[0] == 4 * 6 and probe.used[1] < probe.used[0]
    cache.free()
    assert pool.num_used_blocks == 0
    pool.check_integrity()


@pytest.mark.parametrize("name", BEAM_MODELS)
def test_parallel_sampling_from_one_shared_prefill(name):
    """Prefill the prompt once, fork it n ways (batch_repeat_interleave), sample n continuations."""
    model = tiny(name)
    ids, mask = left_padded([13], seed=8)
    n = 3

    def shared_prefill(cache):
        forward(model, ids[:, :-1], mask[:, :-1], cache)  # generate feeds the last prompt token itself
        cache.batch_repeat_interleave(n)
        return _sample(model, ids, mask, cache, 8, n=n, seed=3)

    pool = PagePool.for_model(model, num_blocks=64, block_size=4)
    cache = PagedCache(pool)
    got = shared_prefill(cache)
    with sdpa(model):
        expected = shared_prefill(DynamicCache())
    assert torch.equal(got, expected)
    # 12 prompt tokens = 3 full blocks, held once; each sample holds its own 2-3 blocks after them
    assert all(table.block_ids[:3] == cache.tables[0].block_ids[:3] for table in cache.tables)
    assert pool.num_used_blocks == 3 + sum(table.num_blocks - 3 for table in cache.tables)
    cache.free()
    pool.check_integrity()


@pytest.mark.slow
def test_embedded_smollm2_beams_and_samples_match_dynamic_cache():
    model, tokenizer = smollm2()
    batch = tokenizer(["The capital of France is"], return_tensors="pt")
    ids, mask = batch.input_ids, batch.attention_mask
    pool = PagePool.for_model(model, num_blocks=64, block_size=16)
    with PagedCache(pool) as cache:
        beams = generate(model, ids, mask, cache, 5, num_beams=4, num_return_sequences=2, do_sample=False)
    with PagedCache(pool) as cache:
        samples = _sample(model, ids, mask, cache, 5, n=3, seed=0)
    with sdpa(model):
        assert torch.equal(beams, generate(model, ids, mask, DynamicCache(), 5, num_beams=4,
                                           num_return_sequences=2, do_sample=False))
        assert torch.equal(samples, _sample(model, ids, mask, DynamicCache(), 5, n=3, seed=0))
    pool.check_integrity()
