"""HF's Cache contract, re-expressed against PagedCache with DynamicCache + sdpa as the oracle.

transformers 5.17 semantics: `crop(-n)` drops n tokens, `crop(0)` does nothing, a positive
argument is the legacy "keep this many", and generate passes 0-d tensors. `copy.deepcopy` is
the prompt-reuse recipe; `batch_repeat_interleave` / `batch_select_indices` / `reorder_cache`
reshape the batch; `len(cache)` is the number of layers.
"""

import copy

import pytest
import torch
from transformers import DynamicCache

from helpers import left_padded
from hf_oracle import CONTRACT_MODELS, assistant_of, forward, generate, model_of, paged_and_oracle, sdpa
from pagedkv import InvalidArgumentError, PagedKVError
from pagedkv.hf import PagedCache, PagePool


def _pool(model, num_blocks: int = 96) -> PagePool:
    return PagePool.for_model(model, num_blocks=num_blocks, block_size=4)


def _assert_logits_close(got: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor) -> None:
    real = mask[:, -got.shape[1]:].bool()  # pad rows' logits are not defined by either cache
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)


def test_len_is_the_number_of_layers():
    model = model_of("tiny-llama")
    cache = PagedCache(_pool(model))
    assert len(cache) == model.config.num_hidden_layers == 2


@pytest.mark.parametrize("name", CONTRACT_MODELS)
def test_crop_matches_dynamic_cache(name):
    model = model_of(name)
    ids, mask = left_padded([9, 13])
    pool = _pool(model)
    paged, dynamic = PagedCache(pool), DynamicCache()
    forward(model, ids, mask, paged)
    with sdpa(model):
        forward(model, ids, mask, dynamic)
    # remove 3, nothing, nothing (0-d tensor, as generate passes it), remove 2 (tensor), legacy keep-7,
    # legacy keep-100 (a no-op), remove 1
    for argument in (-3, 0, torch.tensor(0), torch.tensor(-2), 7, 100, -1):
        paged.crop(argument)
        dynamic.crop(argument)
        assert paged.get_seq_length() == dynamic.get_seq_length()
        assert type(paged.get_seq_length()) is int
    width = paged.get_seq_length()
    assert width == 6
    new_ids = torch.randint(3, 500, (2, 3), generator=torch.Generator().manual_seed(4))
    step_mask = torch.cat([mask[:, :width], torch.ones(2, 3, dtype=mask.dtype)], dim=1)
    got = forward(model, new_ids, step_mask, paged)
    with sdpa(model):
        expected = forward(model, new_ids, step_mask, dynamic)
    _assert_logits_close(got, expected, step_mask)
    paged.free()
    pool.check_integrity()


def test_crop_past_the_start_empties_the_cache_like_dynamic_cache():
    model = model_of("tiny-llama")
    ids, mask = left_padded([5])
    pool = _pool(model)
    paged, dynamic = PagedCache(pool), DynamicCache()
    forward(model, ids, mask, paged)
    with sdpa(model):
        forward(model, ids, mask, dynamic)
    paged.crop(-20)
    dynamic.crop(-20)
    assert paged.get_seq_length() == dynamic.get_seq_length() == 0
    assert pool.num_used_blocks == 0
    pool.check_integrity()


@pytest.mark.parametrize("name", CONTRACT_MODELS)
@pytest.mark.parametrize("seed", [0, 1], ids=["all-accepted", "some-rejected"])
def test_assisted_decoding_matches_greedy(name, seed):
    model, assistant = model_of(name), assistant_of(name, seed)
    ids, mask = left_padded([12], seed=3)
    pool = _pool(model)
    got, expected = paged_and_oracle(
        model, pool, lambda cache: generate(model, ids, mask, cache, 12, do_sample=False,
                                            assistant_model=assistant if isinstance(cache, PagedCache) else None))
    assert torch.equal(got, expected)  # assisted decoding through PagedCache == plain greedy through DynamicCache
    assert pool.num_used_blocks == 0
    pool.check_integrity()


@pytest.mark.parametrize("name", CONTRACT_MODELS)
@pytest.mark.parametrize("repeats", [True, False], ids=["ngram-hits", "no-ngram-match"])
def test_prompt_lookup_decoding_matches_greedy(name, repeats):
    model = model_of(name)
    if repeats:
        ids = torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6]])
    else:
        ids, _ = left_padded([11], seed=7)
    mask = torch.ones_like(ids)
    pool = _pool(model)
    got, expected = paged_and_oracle(
        model, pool, lambda cache: generate(model, ids, mask, cache, 12, do_sample=False,
                                            prompt_lookup_num_tokens=3 if isinstance(cache, PagedCache) else None))
    assert torch.equal(got, expected)  # prompt lookup through PagedCache == plain greedy through DynamicCache
    pool.check_integrity()


@pytest.mark.parametrize("name", CONTRACT_MODELS)
def test_continue_from_a_returned_cache(name):
    model = model_of(name)
    ids, mask = left_padded([7, 12], seed=2)
    follow_up = torch.randint(3, 500, (2, 3), generator=torch.Generator().manual_seed(9))

    def two_turns(cache):
        first = generate(model, ids, mask, cache, 5, do_sample=False, return_dict_in_generate=True)
        turn_ids = torch.cat([first.sequences, follow_up], dim=1)
        turn_mask = torch.cat([mask, torch.ones(2, turn_ids.shape[1] - ids.shape[1], dtype=mask.dtype)], dim=1)
        return generate(model, turn_ids, turn_mask, first.past_key_values, 6, do_sample=False)

    pool = _pool(model)
    with PagedCache(pool) as cache:
        got = two_turns(cache)
    with sdpa(model):
        expected = two_turns(DynamicCache())
    assert torch.equal(got, expected)
    pool.check_integrity()


@pytest.mark.parametrize("name", CONTRACT_MODELS)
def test_deepcopy_prompt_reuse(name):
    """HF's recipe: fill a cache with a shared prompt once, deepcopy it per request."""
    model = model_of(name)
    prompt, _ = left_padded([10], seed=5)
    suffixes = [torch.tensor([[11, 12, 13]]), torch.tensor([[40, 41]])]

    def reuse(prompt_cache, make_copy):
        forward(model, prompt, torch.ones_like(prompt), prompt_cache)
        outputs = []
        for suffix in suffixes:
            ids = torch.cat([prompt, suffix], dim=1)
            outputs.append(generate(model, ids, torch.ones_like(ids), make_copy(prompt_cache), 6, do_sample=False))
        # the prompt cache itself is untouched by its copies' writes
        ids = torch.cat([prompt, suffixes[0]], dim=1)
        outputs.append(generate(model, ids, torch.ones_like(ids), prompt_cache, 6, do_sample=False))
        return outputs

    pool = _pool(model)
    held = []

    def paged_copy(cache):
        before = pool.num_used_blocks
        child = copy.deepcopy(cache)
        assert pool.num_used_blocks == before  # a fork shares every block; nothing is duplicated
        assert child.page_pool is cache.page_pool and child.get_seq_length() == cache.get_seq_length()
        held.append(child)
        return child

    got = reuse(PagedCache(pool), paged_copy)
    with sdpa(model):
        expected = reuse(DynamicCache(), copy.deepcopy)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    for child in held:
        child.free()
    pool.check_integrity()


def test_deepcopy_of_an_empty_cache_is_an_empty_cache_on_the_same_pool():
    model = model_of("tiny-llama")
    pool = _pool(model)
    cache = PagedCache(pool, max_cache_len=64)
    twin = copy.deepcopy(cache)
    assert twin is not cache and twin.page_pool is pool and twin.get_seq_length() == 0
    assert twin.max_cache_len == 64 and twin.batch_size == -1


@pytest.mark.parametrize("name", CONTRACT_MODELS)
def test_batch_operations_match_dynamic_cache(name):
    model = model_of(name)
    ids, mask = left_padded([6, 11], seed=1)
    pool = _pool(model)
    paged, dynamic = PagedCache(pool), DynamicCache()
    forward(model, ids, mask, paged)
    with sdpa(model):
        forward(model, ids, mask, dynamic)
    used = pool.num_used_blocks
    rows = torch.arange(2)
    gen = torch.Generator().manual_seed(6)

    def step(num_new):
        nonlocal mask
        new_ids = torch.randint(3, 500, (len(rows), num_new), generator=gen)
        mask = torch.cat([mask, torch.ones(len(rows), num_new, dtype=mask.dtype)], dim=1)
        got = forward(model, new_ids, mask, paged)
        with sdpa(model):
            expected = forward(model, new_ids, mask, dynamic)
        _assert_logits_close(got, expected, mask)

    for cache in (paged, dynamic):
        cache.batch_repeat_interleave(3)
    rows, mask = rows.repeat_interleave(3), mask.repeat_interleave(3, dim=0)
    assert paged.batch_size == 6 and pool.num_used_blocks == used  # the copies share every block
    select = torch.tensor([5, 0, 2, 2])  # rows 2 and 2 share a partial last block: the next write copies it
    for cache in (paged, dynamic):
        cache.batch_select_indices(select)
    rows, mask = rows[select], mask[select]
    step(2)
    keep = torch.tensor([True, False, True, True])
    for cache in (paged, dynamic):
        cache.batch_select_indices(keep)
    rows, mask = rows[keep], mask[keep]
    step(1)
    beam_idx = torch.tensor([2, 2, 0])
    for cache in (paged, dynamic):
        cache.reorder_cache(beam_idx)
    rows, mask = rows[beam_idx], mask[beam_idx]
    step(1)
    paged.free()
    assert pool.num_used_blocks == 0
    pool.check_integrity()


def test_batch_operations_on_an_empty_cache_do_nothing():
    cache = PagedCache(_pool(model_of("tiny-llama")))
    cache.batch_repeat_interleave(4)
    cache.batch_select_indices(torch.tensor([0]))
    cache.reorder_cache(torch.tensor([0]))
    assert cache.batch_size == -1 and cache.get_seq_length() == 0


def test_bad_batch_indices_raise_and_change_nothing():
    model = model_of("tiny-llama")
    ids, mask = left_padded([5, 7])
    pool = _pool(model)
    cache = PagedCache(pool)
    forward(model, ids, mask, cache)
    tables = [list(t.block_ids) for t in cache.tables]
    with pytest.raises(InvalidArgumentError, match="index 2"):
        cache.batch_select_indices(torch.tensor([0, 2]))
    with pytest.raises(InvalidArgumentError, match="3 entries"):
        cache.batch_select_indices(torch.tensor([True, False, True]))
    with pytest.raises(InvalidArgumentError, match="repeats"):
        cache.batch_repeat_interleave(0)
    assert [list(t.block_ids) for t in cache.tables] == tables
    cache.free()
    pool.check_integrity()


def test_a_failed_step_after_a_fork_rolls_back_with_its_copy_filled():
    """Out of blocks mid-step: rows already moved onto private copies keep them, filled, and nothing else changes."""
    model = model_of("tiny-llama")
    ids, mask = left_padded([6], seed=3)  # 2 blocks of 4, the last one partial
    pool = PagePool.for_model(model, num_blocks=4, block_size=4)
    paged, dynamic = PagedCache(pool), DynamicCache()
    forward(model, ids, mask, paged)
    with sdpa(model):
        forward(model, ids, mask, dynamic)
    for cache in (paged, dynamic):
        cache.batch_repeat_interleave(3)
    three = torch.randint(3, 500, (3, 3), generator=torch.Generator().manual_seed(1))
    # row 0 copies the shared partial block and claims one more (2 free -> 0); row 1 finds none
    with pytest.raises(PagedKVError, match="Cannot allocate"):
        forward(model, three, torch.ones(3, 9, dtype=mask.dtype), paged)
    assert paged.get_seq_length() == 6 and [t.num_tokens for t in paged.tables] == [6, 6, 6]
    pool.check_integrity()
    for cache in (paged, dynamic):
        cache.batch_select_indices(torch.tensor([0]))
    one, step_mask = torch.tensor([[17]]), torch.ones(1, 7, dtype=mask.dtype)
    got = forward(model, one, step_mask, paged)
    with sdpa(model):
        expected = forward(model, one, step_mask, dynamic)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    paged.free()
    pool.check_integrity()


def test_crop_after_pads_right_of_real_tokens_raises():
    model = model_of("tiny-llama")
    pool = _pool(model)
    cache = PagedCache(pool)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])  # right padding: row 0's last column holds nothing
    assert cache.is_croppable
    forward(model, ids, mask, cache)
    assert not cache.is_croppable
    cache.crop(0)
    with pytest.raises(InvalidArgumentError, match="pads on its left"):
        cache.crop(-1)
    assert cache.get_seq_length() == 4 and [t.num_tokens for t in cache.tables] == [3, 4]
    cache.free()
    pool.check_integrity()
