"""pagedkv's own model forwards (the engine's fast path), the one HF-config reader and the model loader.

    config.py          reads HF configs (dict or PretrainedConfig) for calc, the KV pool and the decoders
    decoder_config.py  the shape of an own decoder (`DecoderConfig`), per family (pure Python)
    decoder.py         what every own decoder shares: embed, layers, final norm, LM head, soft cap
    llama.py           Llama, SmolLM2, Qwen2, Qwen3, Mistral, Phi-3: fused QKV and gate-up
    gemma.py           Gemma 2 and Gemma 3 text: sliding/global layers, sandwich norms, soft caps
    gpt2.py            GPT-2: learned positions, LayerNorm, gelu_new
    layers.py          the layers they are built from: parallel linear, vocab-parallel embedding, norm, rotary

Importing the package imports no torch: the models load on first use, so the calculator can read
configs through `pagedkv.models.config` alone.
"""

from __future__ import annotations

import importlib

_LAZY = {"DecoderConfig": "pagedkv.models.decoder_config", "SUPPORTED_MODEL_TYPES": "pagedkv.models.decoder_config",
         "LlamaFamilyModel": "pagedkv.models.llama", "GemmaModel": "pagedkv.models.gemma",
         "Gpt2Model": "pagedkv.models.gpt2"}
#: The own decoder class of each family (module, class name).
_FAMILY_MODELS = {"llama": ("pagedkv.models.llama", "LlamaFamilyModel"),
                  "gemma": ("pagedkv.models.gemma", "GemmaModel"),
                  "gpt2": ("pagedkv.models.gpt2", "Gpt2Model")}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedkv.models' has no attribute {name!r}")


def is_supported(hf_config) -> bool:
    """Whether pagedkv's own decoder covers this HF config (family, activation, RoPE variant)."""
    from pagedkv.errors import ConfigError
    from pagedkv.models.decoder_config import DecoderConfig

    try:
        DecoderConfig.from_hf(hf_config)
    except ConfigError:
        return False
    return True


def build_own_model(hf_model, max_positions: int | None = None, tp=None):
    """pagedkv's own decoder holding `hf_model`'s weights (this rank's shard under `tp`).

    `max_positions` sizes rotary tables. Raises `ConfigError` when no own decoder covers the
    model, or when its family has no tensor-parallel split.
    """
    from pagedkv.models.decoder_config import DecoderConfig

    family = DecoderConfig.from_hf(hf_model.config).family
    module, name = _FAMILY_MODELS[family]
    return getattr(importlib.import_module(module), name).from_hf(hf_model, max_positions=max_positions, tp=tp)


__all__ = ["DecoderConfig", "GemmaModel", "Gpt2Model", "LlamaFamilyModel", "SUPPORTED_MODEL_TYPES",
           "build_own_model", "is_supported"]
