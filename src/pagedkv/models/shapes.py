"""The one table of named model shapes: published config.json fields, by a short name.

`pagedkv calc --model NAME` sizes a model's KV cache from its entry, and `random:NAME`
builds a random-weight model of that architecture (benchmarks, and tests where the
checkpoint is not at hand). So both read the same numbers. Entries without a Hugging Face
id are small shapes of real families for CPU tests; calc does not list them.

Pure Python (no torch, no transformers).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple


class ModelShape(NamedTuple):
    """A model by name: how to show it, where it is published, and its config.json fields."""

    display_name: str
    hf_id: str | None  # None: a small test shape of a real family, not a published model
    config: Mapping[str, Any]


def _gemma3(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, window: int,
            max_positions: int, vocab: int, query_pre_attn_scalar: int) -> dict[str, Any]:
    """A Gemma 3 text config: 5 local (sliding) layers to 1 global, rotary base 10k local and 1M global."""
    return dict(model_type="gemma3_text", num_hidden_layers=layers, hidden_size=hidden,
                intermediate_size=intermediate, num_attention_heads=heads, num_key_value_heads=kv_heads,
                head_dim=head_dim, sliding_window=window, sliding_window_pattern=6,
                max_position_embeddings=max_positions, vocab_size=vocab, rope_theta=1_000_000.0,
                rope_local_base_freq=10_000.0, query_pre_attn_scalar=query_pre_attn_scalar, rms_norm_eps=1e-6,
                hidden_activation="gelu_pytorch_tanh", torch_dtype="bfloat16")


def _gemma2(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
            query_pre_attn_scalar: int) -> dict[str, Any]:
    """A Gemma 2 config: sliding (4,096) and global layers alternate; attention and final logits soft-capped."""
    return dict(model_type="gemma2", num_hidden_layers=layers, hidden_size=hidden, intermediate_size=intermediate,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, sliding_window=4096,
                max_position_embeddings=8192, vocab_size=256000, rope_theta=10000.0,
                query_pre_attn_scalar=query_pre_attn_scalar, attn_logit_softcapping=50.0,
                final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                torch_dtype="bfloat16")


def _phi3(max_positions: int, window: int, **extra: Any) -> dict[str, Any]:
    """A Phi-3-mini config (3.8B): MHA, 32 layers; HF applies `sliding_window` to every layer."""
    return dict(model_type="phi3", num_hidden_layers=32, hidden_size=3072, intermediate_size=8192,
                num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=max_positions,
                sliding_window=window, vocab_size=32064, rope_theta=10000.0, rms_norm_eps=1e-5,
                torch_dtype="bfloat16", **extra)


MODEL_SHAPES: dict[str, ModelShape] = {
    "llama2-7b": ModelShape("Llama-2-7B", "meta-llama/Llama-2-7b-hf", dict(
        model_type="llama", num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, hidden_size=4096,
        intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096, torch_dtype="float16")),
    "llama3-8b": ModelShape("Llama-3-8B", "meta-llama/Meta-Llama-3-8B", dict(
        model_type="llama", num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
        intermediate_size=14336, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
        rope_theta=500000.0, torch_dtype="bfloat16")),
    "llama3-70b": ModelShape("Llama-3-70B", "meta-llama/Meta-Llama-3-70B", dict(
        model_type="llama", num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, hidden_size=8192,
        intermediate_size=28672, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
        torch_dtype="bfloat16")),
    "llama3.2-1b": ModelShape("Llama-3.2-1B", "meta-llama/Llama-3.2-1B", dict(
        model_type="llama", num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, hidden_size=2048,
        intermediate_size=8192, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500000.0, tie_word_embeddings=True, torch_dtype="bfloat16")),
    "qwen3-0.6b": ModelShape("Qwen3-0.6B", "Qwen/Qwen3-0.6B", dict(
        model_type="qwen3", num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, hidden_size=1024,
        intermediate_size=3072, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rope_theta=1000000.0, tie_word_embeddings=True, rms_norm_eps=1e-6, sliding_window=None,
        use_sliding_window=False, max_window_layers=28, torch_dtype="bfloat16")),
    "gpt2": ModelShape("GPT-2", "openai-community/gpt2", dict(
        model_type="gpt2", n_layer=12, n_head=12, n_embd=768, n_positions=1024, vocab_size=50257)),
    "smollm2-135m": ModelShape("SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M", dict(
        model_type="llama", num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
        intermediate_size=1536, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
        rope_theta=100000.0, tie_word_embeddings=True, torch_dtype="bfloat16")),
    "mistral-7b": ModelShape("Mistral-7B-v0.1", "mistralai/Mistral-7B-v0.1", dict(
        model_type="mistral", num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        hidden_size=4096, intermediate_size=14336, vocab_size=32000, max_position_embeddings=32768,
        sliding_window=4096, rope_theta=10000.0, rms_norm_eps=1e-5, torch_dtype="bfloat16")),
    "gemma3-1b": ModelShape("Gemma-3-1B", "google/gemma-3-1b-pt", _gemma3(
        26, 1152, 6912, 4, 1, 256, 512, 32768, 262144, 256)),
    "gemma3-4b": ModelShape("Gemma-3-4B (text)", "google/gemma-3-4b-pt", _gemma3(
        34, 2560, 10240, 8, 4, 256, 1024, 131072, 262208, 256)),
    "gemma3-12b": ModelShape("Gemma-3-12B (text)", "google/gemma-3-12b-pt", _gemma3(
        48, 3840, 15360, 16, 8, 256, 1024, 131072, 262208, 256)),
    "gemma3-27b": ModelShape("Gemma-3-27B (text)", "google/gemma-3-27b-pt", _gemma3(
        62, 5376, 21504, 32, 16, 128, 1024, 131072, 262208, 168)),
    "gemma2-2b": ModelShape("Gemma-2-2B", "google/gemma-2-2b", _gemma2(26, 2304, 9216, 8, 4, 256, 256)),
    "gemma2-9b": ModelShape("Gemma-2-9B", "google/gemma-2-9b", _gemma2(42, 3584, 14336, 16, 8, 256, 256)),
    "gemma2-27b": ModelShape("Gemma-2-27B", "google/gemma-2-27b", _gemma2(46, 4608, 36864, 32, 16, 128, 144)),
    "phi3-mini": ModelShape("Phi-3-mini-4k", "microsoft/Phi-3-mini-4k-instruct", _phi3(4096, 2047)),
    "phi3.5-mini": ModelShape("Phi-3.5-mini", "microsoft/Phi-3.5-mini-instruct", _phi3(
        131072, 262144, original_max_position_embeddings=4096)),
    # Small models of the same families, for CPU tests (GQA ratios 1, 2, 3 and 4).
    "tiny-llama": ModelShape("tiny Llama", None, dict(
        model_type="llama", num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, hidden_size=96,
        intermediate_size=192, head_dim=16, vocab_size=512, max_position_embeddings=512, bos_token_id=1,
        eos_token_id=2)),
    "tiny-qwen3": ModelShape("tiny Qwen3", None, dict(
        model_type="qwen3", num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, hidden_size=64,
        intermediate_size=128, head_dim=32, vocab_size=512, max_position_embeddings=512, bos_token_id=1,
        eos_token_id=2)),
    "tiny-qwen2": ModelShape("tiny Qwen2", None, dict(
        model_type="qwen2", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
        intermediate_size=128, vocab_size=512, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)),
    "tiny-mistral": ModelShape("tiny Mistral", None, dict(
        model_type="mistral", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, hidden_size=64,
        intermediate_size=128, vocab_size=512, max_position_embeddings=512, sliding_window=None, bos_token_id=1,
        eos_token_id=2)),
    "tiny-gpt2": ModelShape("tiny GPT-2", None, dict(
        model_type="gpt2", n_layer=2, n_head=4, n_embd=64, n_positions=512, vocab_size=512, bos_token_id=1,
        eos_token_id=2)),
    # Windows of 8 tokens, so that short CPU tests run past them; soft caps small enough to bite.
    "tiny-gemma3": ModelShape("tiny Gemma 3", None, dict(
        model_type="gemma3_text", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
        intermediate_size=128, head_dim=16, vocab_size=512, max_position_embeddings=512, sliding_window=8,
        query_pre_attn_scalar=16, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], bos_token_id=1, eos_token_id=2,
        pad_token_id=0)),
    "tiny-gemma2": ModelShape("tiny Gemma 2", None, dict(
        model_type="gemma2", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
        intermediate_size=128, head_dim=16, vocab_size=512, max_position_embeddings=512, sliding_window=8,
        query_pre_attn_scalar=16, attn_logit_softcapping=0.5, final_logit_softcapping=0.3, bos_token_id=1,
        eos_token_id=2, pad_token_id=0)),
    "tiny-phi3": ModelShape("tiny Phi-3", None, dict(
        model_type="phi3", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
        intermediate_size=128, vocab_size=512, max_position_embeddings=512, original_max_position_embeddings=128,
        sliding_window=8, rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 16 for i in range(8)],
                                        "long_factor": [2.0 + i / 4 for i in range(8)]},
        bos_token_id=1, eos_token_id=2, pad_token_id=0)),
}
