"""DynamicCache with sdpa attention as the oracle for PagedCache tests, and the models those tests run on."""

import contextlib
import functools

import torch

from transformers import DynamicCache

from helpers import tiny
from pagedkv.hf import PagedCache, random_model

#: Tiny models of four families; "tiny-mistral-sw" slides a 6-token window over prompts longer than it.
CONTRACT_MODELS = ["tiny-llama", "tiny-qwen2", "tiny-gpt2", "tiny-mistral-sw"]


@functools.lru_cache(maxsize=None)
def _sliding_mistral():
    return random_model("tiny-mistral", sliding_window=6)


def model_of(name: str):
    """The pagedkv-attention model for a test id (tiny configs, plus the sliding-window Mistral)."""
    return _sliding_mistral() if name == "tiny-mistral-sw" else tiny(name)


@functools.lru_cache(maxsize=None)
def assistant_of(name: str, seed: int):
    """An sdpa model of the same shape as `model_of(name)`: seed 0 has the same weights, others differ."""
    settings = {"sliding_window": 6} if name == "tiny-mistral-sw" else {}
    base = "tiny-mistral" if name == "tiny-mistral-sw" else name
    return random_model(base, seed=seed, attn_implementation="sdpa", **settings)


@contextlib.contextmanager
def sdpa(model):
    """Run `model` with HF's sdpa attention inside the block (the oracle), pagedkv again after it."""
    model.set_attn_implementation("sdpa")
    try:
        yield model
    finally:
        model.set_attn_implementation("pagedkv")


@torch.no_grad()  # as in HF's prompt-reuse recipe; DynamicCache tensors with grad history cannot be deep-copied
def forward(model, ids, mask, cache) -> torch.Tensor:
    """One forward through `cache`; returns the logits."""
    return model(ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits


def generate(model, ids, mask, cache, steps: int, **kwargs):
    """`model.generate` with fixed lengths (no EOS stop) through `cache`."""
    return model.generate(ids, attention_mask=mask, max_new_tokens=steps, past_key_values=cache,
                          pad_token_id=0, eos_token_id=None, **kwargs)


def paged_and_oracle(model, pool, run, seed: int | None = None):
    """`run(cache)` through a fresh PagedCache on `pool`, then through DynamicCache with sdpa: (paged, oracle).

    With `seed`, torch's generator is seeded before each run, so sampled runs draw the same numbers.
    """
    if seed is not None:
        torch.manual_seed(seed)
    with PagedCache(pool) as cache:
        got = run(cache)
    if seed is not None:
        torch.manual_seed(seed)
    with sdpa(model):
        expected = run(DynamicCache())
    return got, expected
