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


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: bool = False) -> list[int]:
    """HF generate with DynamicCache and sdpa attention, one prompt: the reference output."""
    from transformers import DynamicCache

    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, past_key_values=DynamicCache(),
                             eos_token_id=model.generation_config.eos_token_id if eos else None,
                             pad_token_id=0)
    finally:
        model.set_attn_implementation(previous)
    return out[0, len(prompt):].tolist()


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
