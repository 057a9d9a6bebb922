"""pagedkv's own model forwards (the engine's fast path), the one HF-config reader and the model loader.

    config.py   reads HF configs (dict or PretrainedConfig) for calc, the KV pool and the decoder (pure Python)
    llama.py    the Llama-family decoder (Llama, SmolLM2, Qwen2, Qwen3, Mistral): fused QKV and gate-up
    layers.py   the layers it is built from: parallel linear, vocab-parallel embedding, norm, rotary

Importing the package imports no torch: `LlamaFamilyModel` and friends load on first use, so
the calculator can read configs through `pagedkv.models.config` alone.
"""

from __future__ import annotations

import importlib

_LAZY = {"DecoderConfig": "pagedkv.models.llama", "LlamaFamilyModel": "pagedkv.models.llama",
         "SUPPORTED_MODEL_TYPES": "pagedkv.models.llama"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedkv.models' has no attribute {name!r}")


def is_supported(hf_config) -> bool:
    """Whether pagedkv's own decoder covers this HF config (family and activation)."""
    from pagedkv.errors import ConfigError
    from pagedkv.models.llama import DecoderConfig

    try:
        DecoderConfig.from_hf(hf_config)
    except ConfigError:
        return False
    return True


__all__ = ["DecoderConfig", "LlamaFamilyModel", "SUPPORTED_MODEL_TYPES", "is_supported"]
