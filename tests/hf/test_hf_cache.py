"""PagedCache as a drop-in `past_key_values` for HF `generate` and `forward`, on CPU and (marked `gpu`) on CUDA."""

import copy

import pytest
import torch
from transformers import DynamicCache

from helpers import left_padded as _batch
from helpers import left_padded, smollm2, tiny
from hf_oracle import generate, paged_and_oracle, sdpa
from pagedkv import InvalidArgumentError, ModelMismatchError, PagedKVError
from pagedkv.hf import PagedCache, PagePool, random_model


def _generate(model, ids, mask, cache, steps):
    return model.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False,
                          past_key_values=cache, pad_token_id=0, eos_token_id=None)


def _dynamic(model, ids, mask, steps):
    model.set_attn_implementation("sdpa")
    try:
        return _generate(model, ids, mask, DynamicCache(), steps)
    finally:
        model.set_attn_implementation("pagedkv")


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-qwen3", "tiny-llama", "tiny-mistral", "tiny-qwen2"])
@pytest.mark.parametrize("lengths", [[7], [5, 9, 13, 2, 17, 1, 8, 11]], ids=["batch1", "padded8"])
def test_greedy_tokens_equal_dynamic_cache(name, lengths):
    model = tiny(name)
    ids, mask = _batch(lengths)
    pool = PagePool.for_model(model, num_blocks=128, block_size=4)
    with PagedCache(pool) as cache:
        paged = _generate(model, ids, mask, cache, 16)
    assert torch.equal(paged, _dynamic(model, ids, mask, 16))
    assert pool.num_used_blocks == 0
    pool.check_integrity()


def test_real_gpt2_shape_matches_dynamic_cache():
    model = random_model("gpt2", n_layer=2)  # GPT-2 124M widths and vocabulary, fewer layers for CPU time
    ids, mask = _batch([6, 11, 3], vocab=50257)
    pool = PagePool.for_model(model, num_blocks=64, block_size=16)
    with PagedCache(pool) as cache:
        paged = _generate(model, ids, mask, cache, 8)
    assert torch.equal(paged, _dynamic(model, ids, mask, 8))


@pytest.mark.slow
def test_embedded_smollm2_matches_dynamic_cache():
    model, tokenizer = smollm2()
    prompts = ["The capital of France is", "One, two, three,", "def fibonacci(n):"]
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.convert_ids_to_tokens(model.generation_config.pad_token_id)
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    pool = PagePool.for_model(model, num_blocks=64, block_size=16)
    with PagedCache(pool) as cache:
        paged = _generate(model, batch.input_ids, batch.attention_mask, cache, 12)
    assert torch.equal(paged, _dynamic(model, batch.input_ids, batch.attention_mask, 12))
    single = tokenizer(prompts[:1], return_tensors="pt")
    with PagedCache(pool) as cache:
        paged = _generate(model, single.input_ids, single.attention_mask, cache, 12)
    assert torch.equal(paged, _dynamic(model, single.input_ids, single.attention_mask, 12))


def test_logits_match_within_fp32_tolerance():
    model = tiny("tiny-qwen3")
    ids, mask = _batch([9, 4, 12])
    pool = PagePool.for_model(model, num_blocks=64, block_size=4)
    cache, reference = PagedCache(pool), DynamicCache()
    model.set_attn_implementation("sdpa")
    expected = [model(ids, attention_mask=mask, past_key_values=reference, use_cache=True).logits]
    model.set_attn_implementation("pagedkv")
    got = [model(ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits]
    next_ids = expected[0][:, -1].argmax(-1, keepdim=True)
    mask = torch.cat([mask, torch.ones_like(next_ids)], dim=1)
    model.set_attn_implementation("sdpa")
    expected.append(model(next_ids, attention_mask=mask, past_key_values=reference, use_cache=True).logits)
    model.set_attn_implementation("pagedkv")
    got.append(model(next_ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits)
    real = mask[:, :-1].bool()
    torch.testing.assert_close(got[0][real], expected[0][real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], expected[1], atol=1e-5, rtol=1e-5)
    cache.free()


def test_memory_accounting_by_hand():
    model = tiny("tiny-llama")  # 2 layers, 2 KV heads, head_dim 16, fp32: 2*2*2*16*4 = 512 B/token
    ids, mask = _batch([3, 9])  # width 9: row 0 has 6 pads
    pool = PagePool.for_model(model, num_blocks=32, block_size=4)
    cache = PagedCache(pool, max_cache_len=40)
    model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    memory = cache.memory()
    # row 0: 3 tokens -> 1 block; row 1: 9 tokens -> 3 blocks. Pads take no slots.
    assert memory.num_blocks == 4 and memory.num_tokens == 12
    assert memory.paged_bytes == 4 * 4 * 512
    assert memory.naive_bytes == 2 * 40 * 512
    assert memory.dynamic_cache_bytes == 2 * 9 * 512  # DynamicCache keeps the pads
    assert memory.utilization == pytest.approx(12 / 16)
    assert pool.num_used_blocks == 4
    cache.free()
    assert pool.num_used_blocks == 0


def test_two_batches_reuse_the_same_pages():
    model = tiny("tiny-llama")
    pool = PagePool.for_model(model, num_blocks=64, block_size=4)
    used = []
    for seed in (1, 2):
        ids, mask = _batch([5, 8, 3], seed=seed)
        with PagedCache(pool) as cache:
            _generate(model, ids, mask, cache, 6)
            used.append(sorted(b for t in cache.tables for b in t.block_ids))
        assert pool.num_used_blocks == 0
    assert used[1] == used[0]
    pool.check_integrity()


def test_misuse_errors():
    llama, qwen = tiny("tiny-llama"), tiny("tiny-qwen3")
    ids, mask = _batch([4, 4, 4])
    pool = PagePool.for_model(llama, num_blocks=16, block_size=4)
    with pytest.raises(ModelMismatchError, match="KV heads"):
        qwen(ids[:, :2], past_key_values=PagedCache(pool), use_cache=True)
    assert pool.num_used_blocks == 0
    with pytest.raises(InvalidArgumentError, match="max_batch_size 2"):
        llama(ids, attention_mask=mask, past_key_values=PagedCache(pool, max_batch_size=2), use_cache=True)
    assert pool.num_used_blocks == 0
    sdpa = tiny("tiny-llama", "sdpa")
    with pytest.raises(PagedKVError, match="attn_implementation"):
        sdpa(ids, past_key_values=PagedCache(pool), use_cache=True)
    with pytest.raises(InvalidArgumentError):
        PagedCache("not a pool")
    small = PagePool.for_model(llama, num_blocks=2, block_size=4)
    with pytest.raises(PagedKVError, match="Cannot allocate"):
        llama(ids, attention_mask=mask, past_key_values=PagedCache(small), use_cache=True)
    assert small.num_used_blocks == 0  # all rows or none
    small.check_integrity()


def test_step_metadata_starts_every_kernel_input_on_16_bytes():
    """Triton specializes pointer arguments on 16-byte alignment: a shifting offset would compile new variants."""
    model = tiny("tiny-llama")
    ids, mask = _batch([5, 9, 2])  # 16 real tokens of 27 columns: odd-length segments everywhere
    pool = PagePool.for_model(model, num_blocks=64, block_size=4)
    cache = PagedCache(pool)
    seen = []
    for step in range(4):
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        meta = cache._metadata
        seen += [meta.slot_mapping, meta.decode_seq_lens, meta.decode_block_tables, meta.prefill_seq_lens,
                 meta.prefill_block_tables, meta.cu_seqlens_q]
        cache.reorder_cache(torch.tensor([2, 0, 0]))  # forks: the next step copies a shared partial block
        ids, mask = torch.tensor([[7], [8], [9]]), torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], dim=1)
    tensors = [t for t in seen if t is not None]
    assert len(tensors) == 4 + 3 * 3 and all(t.data_ptr() % 16 == 0 for t in tensors)  # 1 prefill + 3 decodes
    cache.free()
    pool.check_integrity()


# --------------------------------------------------------------------------- on CUDA
# PagedCache's Cache contract on CUDA: pinned metadata staging, copy-on-write on the device, Triton kernels.
CUDA_FAMILIES = ["tiny-llama", "tiny-qwen3", "tiny-gpt2", "tiny-mistral", "tiny-qwen2"]


def _left_padded(lengths):
    ids, mask = left_padded(lengths)
    return ids.cuda(), mask.cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("name", CUDA_FAMILIES)
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


@pytest.mark.gpu
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
            model, pool, lambda cache: generate(model, run_ids, run_mask, cache, 20, **kwargs), seed=0)
        assert torch.equal(got, expected), kwargs
    assert pool.num_used_blocks == 0
    pool.check_integrity()


@pytest.mark.gpu
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
            outs.append(generate(model, ids, torch.ones_like(ids), copy.deepcopy(prompt_cache), 12, do_sample=False))
        return outs

    got = reuse(PagedCache(pool))
    with sdpa(model):
        expected = reuse(DynamicCache())
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert torch.equal(got[0], got[2])
