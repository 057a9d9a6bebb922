"""Models shared by the HF-cache, engine and server tests, loaded once per test process."""

import functools

import pytest
import torch

from pagedkv.hf import load_model, load_tokenizer, random_model

#: For the `gpu` tests that spread over two devices (data and tensor parallel).
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


@functools.lru_cache(maxsize=None)
def smollm2():
    """The embedded SmolLM2-135M-Instruct (fp32, CPU) and its tokenizer; converted once, then cached on disk."""
    return load_model(None, torch.float32, "cpu"), load_tokenizer(None)


@functools.lru_cache(maxsize=None)
def tiny(name: str, attn: str = "pagedkv"):
    """A random-weight tiny model of a real family (see pagedkv.models.loader.RANDOM_CONFIGS)."""
    return random_model(name, attn_implementation=attn)


@functools.lru_cache(maxsize=None)
def uncovered_model():
    """A tiny random GPT-NeoX: a family pagedkv's own decoder does not cover (it runs on HF's modules)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt_neox", num_hidden_layers=1, num_attention_heads=4, hidden_size=64,
                                  intermediate_size=128, vocab_size=512, max_position_embeddings=512)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def own_prefill_logits(hf_model, prompts: list[list[int]], block_size: int = 4) -> list[torch.Tensor]:
    """Run pagedkv's own decoder for `hf_model` over `prompts` as one flat prefill step through the paged backend."""
    from pagedkv.kernels import KVPool
    from pagedkv.kernels.backend import AttentionBackend
    from pagedkv.models import build_own_model

    own = build_own_model(hf_model)
    cfg = own.cfg
    pool = KVPool(cfg.num_layers, 64, block_size, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    backend = AttentionBackend(pool, max_num_seqs=len(prompts), max_blocks_per_seq=16, num_table_rows=len(prompts),
                               max_model_len=64)
    ids, positions, slots, lens = [], [], [], []
    next_block = 0
    for row, prompt in enumerate(prompts):
        blocks = list(range(next_block, next_block + -(-len(prompt) // block_size)))
        next_block += len(blocks)
        backend.table_rows[row, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        ids += prompt
        positions += range(len(prompt))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(len(prompt))]
        lens.append(len(prompt))
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)))
    meta = backend.prepare(torch.tensor(slots), torch.arange(len(prompts)), torch.tensor(lens), cu, num_decode=0,
                           host_seq_lens=lens, host_query_lens=lens)
    logits = own(torch.tensor(ids), torch.tensor(positions), backend.bind(meta))
    return list(logits.split(lens))


def max_logit_error_vs_hf(model, prompt_lens, attn: str = "sdpa", seed: int = 0) -> float:
    """Largest |own decoder's prefill logit - HF's| over random prompts of `prompt_lens` (HF with `attn`)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in prompt_lens]
    own = own_prefill_logits(model, prompts)
    previous = model.config._attn_implementation
    model.set_attn_implementation(attn)
    try:
        with torch.no_grad():
            return max((logits - model(torch.tensor([prompt])).logits[0]).abs().max().item()
                       for prompt, logits in zip(prompts, own))
    finally:
        model.set_attn_implementation(previous)


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: bool = False, attn: str = "sdpa") -> list[int]:
    """HF generate with DynamicCache and `attn` attention (sdpa; eager where sdpa lacks a soft cap), one prompt."""
    from transformers import DynamicCache

    previous = model.config._attn_implementation
    model.set_attn_implementation(attn)
    try:
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, past_key_values=DynamicCache(),
                             eos_token_id=model.generation_config.eos_token_id if eos else None,
                             pad_token_id=0)
    finally:
        model.set_attn_implementation(previous)
    return out[0, len(prompt):].tolist()


def random_prompts(count: int, vocab: int = 500, seed: int = 0, lengths=(5, 17, 1, 33, 8, 16, 24)) -> list[list[int]]:
    """`count` seeded prompts of token ids in [3, vocab), their lengths cycling through `lengths`."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=gen).tolist() for i in range(count)]


def output_token_ids(outputs) -> list[list[int]]:
    """The first completion's token ids of every `RequestOutput`."""
    return [o.outputs[0].token_ids for o in outputs]


def assert_preempts_and_matches(small_llm, prompts, params, expected: list[list[int]], mode: str) -> None:
    """Generate on a pool too small for `prompts`: it must preempt (and, for swap, bring back every swapped
    sequence), give `expected`'s tokens, and end with no block in use and its accounting intact."""
    outputs = small_llm.generate(prompts, params)
    stats = small_llm.stats()
    assert stats["num_preemptions"] > 0
    if mode == "swap":
        assert stats["num_swap_outs"] > 0 and stats["num_swap_ins"] == stats["num_swap_outs"]
    assert output_token_ids(outputs) == expected
    assert stats["num_used_blocks"] == 0
    small_llm.engine.check_integrity()


def left_padded(lengths, vocab: int = 500, seed: int = 0):
    """A left-padded batch of random prompts with the given lengths: (input_ids, attention_mask) on CPU."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, vocab, (n,), generator=gen)
        mask[row, width - n:] = 1
    return ids, mask
