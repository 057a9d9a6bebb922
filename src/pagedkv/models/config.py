"""The one reader of Hugging Face model configs: a `config.json` dict or a live `PretrainedConfig`.

The calculator (`pagedkv.calc`), the KV pool's shape (`kv_shape_of`, used by the engine and the
drop-in cache) and the own decoder (`DecoderConfig.from_hf`) all read configs through here, so
a field is interpreted one way everywhere. Fields are read the way serving engines (vLLM) read
them: `head_dim` missing or null means hidden_size // num_attention_heads, missing KV heads
means MHA, `multi_query` means one KV head, GPT-2 names (n_layer, n_head, n_embd, n_positions)
are aliases, and a multimodal config is read from its `text_config`.

Pure Python: nothing here imports torch or transformers (a live config is read through its
`to_dict()`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.errors import ConfigError

#: Config names of one quantity, first match wins (vLLM's and transformers' aliases).
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads", "num_heads")
KV_HEAD_KEYS = ("num_key_value_heads", "n_head_kv", "num_kv_heads", "multi_query_group_num")
HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
MAX_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")

#: dtype name in a config -> bytes per element.
DTYPE_BYTES = {
    "float16": 2, "half": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
    "float32": 4, "float": 4, "fp32": 4,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
}
DEFAULT_DTYPE_BYTES = 2


def as_mapping(config: Mapping[str, Any] | Any) -> Mapping[str, Any]:
    """A config as a mapping: a dict as it is, a `PretrainedConfig` through `to_dict()`."""
    if isinstance(config, Mapping):
        return config
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise ConfigError(f"expected a config dict or a PretrainedConfig, got {type(config).__name__}")


def text_part(config: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """(the language model's config, the prefix its field names carry in messages)."""
    if isinstance(config.get("text_config"), Mapping):
        return config["text_config"], "text_config."
    return config, ""


def field_value(config: Mapping[str, Any], keys: Sequence[str]) -> tuple[str, Any]:
    """(key, value) of the first key present with a non-null value, else (keys[0], None)."""
    for key in keys:
        if config.get(key) is not None:
            return key, config[key]
    return keys[0], None


def positive_int(value: Any, field_name: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{source}: {field_name} must be a positive int, got {value!r}")
    return value


def optional_int(config: Mapping[str, Any], keys: Sequence[str], prefix: str, source: str) -> int | None:
    key, value = field_value(config, keys)
    return None if value is None else positive_int(value, prefix + key, source)


def required_int(config: Mapping[str, Any], keys: Sequence[str], prefix: str, source: str, why: str = "") -> int:
    key, value = field_value(config, keys)
    if value is None:
        aliases = f" (looked for {', '.join(keys)})" if len(keys) > 1 else ""
        raise ConfigError(f"{source}: missing {prefix}{keys[0]}{aliases}{why}")
    return positive_int(value, prefix + key, source)


@dataclass(frozen=True)
class AttentionShape:
    """Layers and heads of a standard (MHA / GQA / MQA) attention stack, with notes on how they were read."""

    num_layers: int
    num_heads: int | None  # None when the config gives head_dim and the KV heads without it
    num_kv_heads: int
    head_dim: int
    notes: tuple[str, ...] = ()


def attention_shape(config: Mapping[str, Any] | Any, source: str = "config") -> AttentionShape:
    """The attention stack of a config (its text part); `ConfigError` naming a missing or bad field."""
    text, prefix = text_part(as_mapping(config))
    notes: list[str] = []
    num_layers = required_int(text, LAYER_KEYS, prefix, source)
    num_heads = optional_int(text, HEAD_KEYS, prefix, source)

    def heads() -> int:  # needed only where head_dim or the KV heads are not given
        return required_int(text, HEAD_KEYS, prefix, source)

    head_dim = optional_int(text, ("head_dim",), prefix, source)
    if head_dim is None:
        hidden_size = required_int(text, HIDDEN_KEYS, prefix, source, why=" (needed because head_dim is not set)")
        if hidden_size % heads():
            raise ConfigError(f"{source}: {prefix}hidden_size {hidden_size} is not divisible by "
                              f"num_attention_heads {heads()}, and head_dim is not set")
        head_dim = hidden_size // heads()
        notes.append(f"head_dim not set: hidden_size // num_attention_heads = {hidden_size} // {heads()} = "
                     f"{head_dim}")
    is_new_falcon = text.get("model_type") in ("falcon", "RefinedWeb", "RefinedWebModel") \
        and text.get("new_decoder_architecture")
    if text.get("multi_query") and not is_new_falcon:
        num_kv_heads = 1
        notes.append("multi_query: one KV head shared by all query heads (MQA)")
    else:
        num_kv_heads = optional_int(text, KV_HEAD_KEYS, prefix, source)
        if num_kv_heads is None:
            num_kv_heads = heads()
            notes.append(f"num_key_value_heads not set: MHA, one KV head per attention head ({num_kv_heads})")
    return AttentionShape(num_layers, num_heads, num_kv_heads, head_dim, tuple(notes))


def kv_shape_of(config: Mapping[str, Any] | Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a config: what one token costs per layer in a KV pool."""
    shape = attention_shape(config)
    return shape.num_layers, shape.num_kv_heads, shape.head_dim


def max_positions(config: Mapping[str, Any] | Any) -> int | None:
    """The model's position limit (max_position_embeddings or an alias), or None if the config has none."""
    text, prefix = text_part(as_mapping(config))
    return optional_int(text, MAX_POSITION_KEYS, prefix, "config")
