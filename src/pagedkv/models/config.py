"""The one reader of Hugging Face model configs: a `config.json` dict or a live `PretrainedConfig`.

The calculator (`pagedkv.calc`), the KV pool's shape (`kv_shape_of`, used by the engine and the
drop-in cache) and the own decoder (`DecoderConfig.from_hf`) all read configs through here, so
a field is interpreted one way everywhere. Fields are read the way serving engines (vLLM) read
them: `head_dim` missing or null means hidden_size // num_attention_heads, missing KV heads
means MHA, `multi_query` means one KV head, GPT-2 names (n_layer, n_head, n_embd, n_positions)
are aliases, and a multimodal config is read from its `text_config`. Which layers slide over a window
(`layer_types`, `sliding_window`) is read here too, from `layer_types` where the config lists them,
else from the older fields (Qwen2's use_sliding_window/max_window_layers, Gemma's alternation, a
bare `sliding_window`: every layer).

Pure Python: nothing here imports torch or transformers (a live config is read through its
`to_dict()`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.core.kv_groups import FULL_ATTENTION, SLIDING_ATTENTION  # the two layer types pagedkv sizes
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

#: Gemma-style alternation when the config does not spell out layer_types: every
#: `pattern`-th layer is full attention, the others slide.
GEMMA_SLIDING_PATTERNS = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6}


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


def layer_types_of(text: Mapping[str, Any], num_layers: int, prefix: str = "", source: str = "config") \
        -> tuple[str, ...]:
    """Each layer's attention type, as HF's `layer_types` names it ("full_attention", "sliding_attention", ...).

    From `layer_types` where the config lists them (HF 5 configs of Gemma 2/3, Qwen2/3, Mistral-like
    models), else derived: Qwen2/Qwen3's use_sliding_window + max_window_layers (the first layers
    full, the rest slide), Gemma's alternation (every pattern-th layer full), a bare
    `sliding_window` (Mistral v0.1, Phi-3: every layer slides), no window (every layer full).
    Other types in a `layer_types` list (e.g. linear attention) are returned as they are.
    """
    layer_types = text.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, (list, tuple)) or len(layer_types) != num_layers \
                or not all(isinstance(kind, str) for kind in layer_types):
            raise ConfigError(f"{source}: {prefix}layer_types must list one type name per layer "
                              f"({num_layers}), got {layer_types!r:.80}")
        return tuple(layer_types)
    if text.get("sliding_window") is None:
        return (FULL_ATTENTION,) * num_layers
    if "use_sliding_window" in text:
        if not text["use_sliding_window"]:
            return (FULL_ATTENTION,) * num_layers
        num_full = text.get("max_window_layers")
        num_full = 0 if num_full is None else positive_int(num_full, prefix + "max_window_layers", source)
        return tuple(FULL_ATTENTION if i < num_full else SLIDING_ATTENTION for i in range(num_layers))
    pattern = text.get("sliding_window_pattern", GEMMA_SLIDING_PATTERNS.get(text.get("model_type")))
    if pattern is not None:
        pattern = positive_int(pattern, prefix + "sliding_window_pattern", source)
        return tuple(FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(num_layers))
    return (SLIDING_ATTENTION,) * num_layers


@dataclass(frozen=True)
class AttentionShape:
    """Layers and heads of a standard (MHA / GQA / MQA) attention stack, with notes on how they were read.

    `layer_types[i]` is layer i's attention type (HF's names); `sliding_window` is the window of the
    "sliding_attention" layers, None when no layer slides. Window semantics are HF's: key position
    j is visible to query position i iff i - sliding_window < j <= i.
    """

    num_layers: int
    num_heads: int | None  # None when the config gives head_dim and the KV heads without it
    num_kv_heads: int
    head_dim: int
    notes: tuple[str, ...] = ()
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None

    def __post_init__(self):
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(f"{len(self.layer_types)} layer types for {self.num_layers} layers")
        if SLIDING_ATTENTION in self.layer_types and self.sliding_window is None:
            raise ConfigError("sliding_attention layers need a sliding_window")

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None for a layer that sees its whole sequence)."""
        return tuple(self.sliding_window if kind == SLIDING_ATTENTION else None for kind in self.layer_types)


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
    layer_types = layer_types_of(text, num_layers, prefix, source)
    window = None
    if SLIDING_ATTENTION in layer_types:
        window = positive_int(text.get("sliding_window"), prefix + "sliding_window", source)
    return AttentionShape(num_layers, num_heads, num_kv_heads, head_dim, tuple(notes), layer_types, window)


def kv_shape_of(config: Mapping[str, Any] | Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a config: what one token costs per layer in a KV pool."""
    shape = attention_shape(config)
    return shape.num_layers, shape.num_kv_heads, shape.head_dim


def max_positions(config: Mapping[str, Any] | Any) -> int | None:
    """The model's position limit (max_position_embeddings or an alias), or None if the config has none."""
    text, prefix = text_part(as_mapping(config))
    return optional_int(text, MAX_POSITION_KEYS, prefix, "config")
