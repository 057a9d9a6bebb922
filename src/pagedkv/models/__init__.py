"""pagedkv's own model forwards (the engine's fast path); HF modules remain the fallback for the rest."""

from pagedkv.models.llama import SUPPORTED_MODEL_TYPES, DecoderConfig, LlamaFamilyModel


def is_supported(hf_config) -> bool:
    """Whether pagedkv's own decoder covers this HF config (family and activation)."""
    from pagedkv.errors import ConfigError

    try:
        DecoderConfig.from_hf(hf_config)
    except ConfigError:
        return False
    return True


__all__ = ["DecoderConfig", "LlamaFamilyModel", "SUPPORTED_MODEL_TYPES", "is_supported"]
