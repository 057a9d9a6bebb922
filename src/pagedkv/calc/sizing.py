"""KV sizing: what one token costs in a model's KV cache, read from a Hugging Face config.

A model's cache is a stack of attention layers. Each layer stores, per token:

    standard / GQA / MQA   K and V:  2 * num_kv_heads * head_dim * dtype_bytes
    MLA (DeepSeek)         one latent: (kv_lora_rank + qk_rope_head_dim) * dtype_bytes

Sliding-window layers attend to the last `sliding_window` tokens only, so a window-aware
cache keeps at most that many per sequence in those layers:

    | full layers:    every token of the sequence            |
    | sliding layers: min(num_tokens, sliding_window) tokens |

Config fields are read the way serving engines (vLLM) read them: `head_dim` missing or null
means hidden_size // num_attention_heads, missing KV heads means MHA, GPT-2 names
(n_layer, n_head, n_embd, n_positions) are aliases, and a multimodal config is sized from
its `text_config`. Nothing here imports torch or transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.core import ModelSpec, num_blocks_for
from pagedkv.core.kv_groups import KVLayout, group_layers
from pagedkv.errors import ConfigError, InvalidArgumentError, require_positive_int
from pagedkv.models.config import (
    DEFAULT_DTYPE_BYTES,
    DTYPE_BYTES,
    FULL_ATTENTION,
    HEAD_KEYS,
    LAYER_KEYS,
    MAX_POSITION_KEYS,
    SLIDING_ATTENTION,
    attention_shape,
    optional_int,
    required_int,
    text_part,
)
from pagedkv.models.shapes import MODEL_SHAPES, ModelShape


@dataclass(frozen=True)
class KVSizing:
    """The KV-cache shape of one model: layers, per-layer cost of a token, and window caps.

    For MLA models `is_mla` is True, `num_kv_heads` is 1 and `head_dim` is the latent width
    (kv_lora_rank + qk_rope_head_dim): one vector per token per layer, with no separate V.
    `notes` say how the numbers were read from the config (for people; not compared).
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    is_mla: bool = False
    num_sliding_layers: int = 0
    sliding_window_tokens: int | None = None
    max_position_embeddings: int | None = None
    notes: tuple[str, ...] = field(default=(), compare=False)
    layer_types: tuple[str, ...] = ()  # per layer; empty: the full layers first, then the sliding ones

    def __post_init__(self):
        require_positive_int("num_layers", self.num_layers)
        require_positive_int("num_kv_heads", self.num_kv_heads)
        require_positive_int("head_dim", self.head_dim)
        require_positive_int("dtype_bytes", self.dtype_bytes)
        require_positive_int("num_sliding_layers", self.num_sliding_layers, allow_zero=True)
        if self.num_sliding_layers > self.num_layers:
            raise InvalidArgumentError(
                f"num_sliding_layers {self.num_sliding_layers} is over num_layers {self.num_layers}")
        if self.num_sliding_layers:
            require_positive_int("sliding_window_tokens", self.sliding_window_tokens)
        elif self.sliding_window_tokens is not None:
            raise InvalidArgumentError("sliding_window_tokens is set but no layer slides (num_sliding_layers 0)")
        if self.max_position_embeddings is not None:
            require_positive_int("max_position_embeddings", self.max_position_embeddings)

    @property
    def kv_factor(self) -> int:
        """2 for separate K and V, 1 for an MLA latent."""
        return 1 if self.is_mla else 2

    @property
    def bytes_per_token_per_layer(self) -> int:
        """kv_factor * num_kv_heads * head_dim * dtype_bytes."""
        return self.kv_factor * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_token(self) -> int:
        """One token in every layer (a token inside every window): num_layers * bytes/token/layer."""
        return self.num_layers * self.bytes_per_token_per_layer

    @property
    def num_full_layers(self) -> int:
        """Layers that keep every token of a sequence."""
        return self.num_layers - self.num_sliding_layers

    def page_size_bytes(self, block_size: int) -> int:
        """Bytes of one block of `block_size` tokens across all layers."""
        require_positive_int("block_size", block_size)
        return block_size * self.bytes_per_token

    def window_blocks(self, block_size: int) -> int | None:
        """Most blocks a sliding layer holds per sequence (None without sliding layers).

        The window seldom starts on a block boundary, so it can touch one block more than
        ceil(window / B): ceil((window - 1) / B) + 1, as vLLM counts it.
        """
        require_positive_int("block_size", block_size)
        if not self.num_sliding_layers:
            return None
        return num_blocks_for(self.sliding_window_tokens - 1, block_size) + 1

    def seq_kv_bytes(self, num_tokens: int) -> int:
        """Contiguous KV bytes of one sequence of `num_tokens` (sliding layers hold a ring of the window)."""
        require_positive_int("num_tokens", num_tokens, allow_zero=True)
        sliding_tokens = min(num_tokens, self.sliding_window_tokens or 0)
        return (self.num_full_layers * num_tokens + self.num_sliding_layers * sliding_tokens) \
            * self.bytes_per_token_per_layer

    def paged_seq_kv_bytes(self, num_tokens: int, block_size: int) -> int:
        """Paged KV bytes of one sequence: whole blocks, sliding layers capped at `window_blocks`."""
        require_positive_int("num_tokens", num_tokens, allow_zero=True)
        num_blocks = num_blocks_for(num_tokens, block_size)
        sliding_blocks = min(num_blocks, self.window_blocks(block_size) or 0)
        return (self.num_full_layers * num_blocks + self.num_sliding_layers * sliding_blocks) \
            * block_size * self.bytes_per_token_per_layer

    def kv_layout(self) -> KVLayout:
        """The layer groups the engine would keep for this model (`pagedkv.core.kv_groups`)."""
        layer_types = self.layer_types or \
            (FULL_ATTENTION,) * self.num_full_layers + (SLIDING_ATTENTION,) * self.num_sliding_layers
        return group_layers(layer_types, self.sliding_window_tokens,
                            bytes_per_token_per_layer=self.bytes_per_token_per_layer)

    def to_model_spec(self) -> ModelSpec:
        """The core's `ModelSpec` (K and V in every layer, no window cap). MLA has none: raises ConfigError."""
        if self.is_mla:
            raise ConfigError(f"{self.name}: an MLA cache has no separate K and V, so no ModelSpec")
        return ModelSpec(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype_bytes, self.name)

    def bytes_per_token_formula(self) -> tuple[str, str]:
        """(symbolic, with numbers) for `bytes_per_token`."""
        if self.is_mla:
            return ("layers * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes",
                    f"{self.num_layers} * {self.head_dim} * {self.dtype_bytes}")
        return ("2 * layers * kv_heads * head_dim * dtype_bytes",
                f"2 * {self.num_layers} * {self.num_kv_heads} * {self.head_dim} * {self.dtype_bytes}")


def custom_sizing(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = DEFAULT_DTYPE_BYTES,
                  name: str = "custom") -> KVSizing:
    """Sizing from the four numbers alone (every layer full attention, K and V)."""
    return KVSizing(name=name, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    dtype_bytes=dtype_bytes)


# ---------------------------------------------------------------------- config reading
def _dtype_bytes(text: Mapping[str, Any], outer: Mapping[str, Any], source: str,
                 notes: list[str]) -> int:
    """Bytes per element from `dtype` / `torch_dtype` (text config first, then the outer config)."""
    for config in (text, outer):
        for key in ("dtype", "torch_dtype"):
            value = config.get(key)
            if value is None:
                continue
            # str() also reads a torch.dtype from a live config's to_dict() ("torch.bfloat16").
            name = str(value).removeprefix("torch.")
            if name not in DTYPE_BYTES:
                raise ConfigError(f"{source}: {key} {value!r} is not a dtype calc knows "
                                  f"({', '.join(sorted(DTYPE_BYTES))})")
            num_bytes = DTYPE_BYTES[name]
            if num_bytes == 4:
                notes.append(f"{key} {name} gives 4 bytes per value; vLLM's dtype=auto serves float32 "
                             "checkpoints in 16-bit, which --dtype-bytes 2 models")
            return num_bytes
    notes.append(f"no dtype/torch_dtype in the config (a float32 checkpoint): assuming {DEFAULT_DTYPE_BYTES} "
                 "bytes, as vLLM's dtype=auto serves it in float16")
    return DEFAULT_DTYPE_BYTES


def spec_from_hf_config(config: Mapping[str, Any], *, name: str | None = None, dtype_bytes: int | None = None,
                        dtype_origin: str = "dtype_bytes", source: str = "config") -> KVSizing:
    """Read a Hugging Face `config.json` (as a dict) into a `KVSizing`, with notes on how.

    `dtype_bytes` overrides the config's dtype (an fp8 KV cache is 1); `dtype_origin` names
    where that override came from, for the note. `source` prefixes every error message.
    Raises `ConfigError` naming the field that is missing or bad.
    """
    if not isinstance(config, Mapping):
        raise ConfigError(f"{source}: expected a JSON object, got {type(config).__name__}")
    notes: list[str] = []
    text, prefix = text_part(config)
    if prefix:
        notes.append("multimodal config: sized the language model from text_config "
                     "(the vision encoder keeps no KV cache)")
    num_layers = required_int(text, LAYER_KEYS, prefix, source)
    num_heads = optional_int(text, HEAD_KEYS, prefix, source)
    if dtype_bytes is None:
        dtype_bytes = _dtype_bytes(text, config, source, notes)
    else:
        require_positive_int("dtype_bytes", dtype_bytes)
        notes.append(f"{dtype_origin} gives {dtype_bytes} B per KV value (the config's dtype is not used for "
                     "the cache)")
    max_positions = optional_int(text, MAX_POSITION_KEYS, prefix, source)
    name = name or str(config.get("_name_or_path") or text.get("model_type") or config.get("model_type") or source)

    kv_lora_rank = optional_int(text, ("kv_lora_rank",), prefix, source)
    if kv_lora_rank is not None:
        rope_dim = required_int(text, ("qk_rope_head_dim",), prefix, source, why=" (an MLA config has kv_lora_rank)")
        latent_dim = kv_lora_rank + rope_dim
        note = (f"MLA: each layer caches one latent of kv_lora_rank + qk_rope_head_dim = {kv_lora_rank} + "
                f"{rope_dim} = {latent_dim} values per token, shared by every head, instead of K and V")
        nope_dim = optional_int(text, ("qk_nope_head_dim",), prefix, source)
        v_dim = optional_int(text, ("v_head_dim",), prefix, source)
        if num_heads and nope_dim and v_dim:
            full_dim = num_heads * (nope_dim + rope_dim + v_dim)
            note += (f"; a plain cache of per-head K and V would hold {num_heads} * ({nope_dim} + {rope_dim} + "
                     f"{v_dim}) = {full_dim:,} values ({full_dim / latent_dim:.1f}x more)")
        notes.append(note)
        return KVSizing(name=name, num_layers=num_layers, num_kv_heads=1, head_dim=latent_dim,
                        dtype_bytes=dtype_bytes, is_mla=True, max_position_embeddings=max_positions,
                        notes=tuple(notes))

    shape = attention_shape(config, source)
    notes.extend(shape.notes)
    head_dim, num_kv_heads = shape.head_dim, shape.num_kv_heads

    for layer_type in shape.layer_types:
        if layer_type not in (FULL_ATTENTION, SLIDING_ATTENTION):
            raise ConfigError(f"{source}: {prefix}layer_types has {layer_type!r}; calc sizes "
                              "full_attention and sliding_attention layers only")
    num_sliding = shape.layer_types.count(SLIDING_ATTENTION)
    window = shape.sliding_window
    if num_sliding:
        notes.append(f"sliding window: {num_sliding} of {num_layers} layers attend to the last {window:,} tokens "
                     f"only; a window-aware cache keeps at most that many per sequence there, so sequence "
                     f"costs below are capped (bytes/token counts a token inside every window)")
    return KVSizing(name=name, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    dtype_bytes=dtype_bytes, num_sliding_layers=num_sliding, sliding_window_tokens=window,
                    max_position_embeddings=max_positions, notes=tuple(notes), layer_types=shape.layer_types)


def load_hf_config(path: str | Path) -> dict[str, Any]:
    """Read a `config.json` (or a model folder holding one). Raises `ConfigError` with one clear line."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"config file {path}: no such file")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"config file {path}: cannot read it ({error.__class__.__name__})") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"config file {path}: not valid JSON ({error.msg} at line {error.lineno}, "
                          f"column {error.colno})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"config file {path}: expected a JSON object, got {type(config).__name__}")
    return config


def spec_from_config_file(path: str | Path, *, dtype_bytes: int | None = None,
                          dtype_origin: str = "dtype_bytes") -> KVSizing:
    """`load_hf_config` then `spec_from_hf_config`, with errors naming the file."""
    config = load_hf_config(path)
    model_type = config.get("model_type")
    name = config.get("_name_or_path") or (f"{path} ({model_type})" if model_type else str(path))
    return spec_from_hf_config(config, name=name, dtype_bytes=dtype_bytes, dtype_origin=dtype_origin,
                               source=f"config file {path}")


# ---------------------------------------------------------------------- presets
#: A published model: its name, Hugging Face id, and its config.json fields (`pagedkv.models.shapes`).
Preset = ModelShape

#: The named shapes calc knows: every published model of the one shapes table.
PRESETS: Mapping[str, Preset] = {name: shape for name, shape in MODEL_SHAPES.items() if shape.hf_id}


def preset_sizing(name: str, *, dtype_bytes: int | None = None, dtype_origin: str = "dtype_bytes") -> KVSizing:
    """Sizing of a named preset (`PRESETS`), read through the same path as any config.json."""
    preset = PRESETS.get(name)
    if preset is None:
        raise ConfigError(f"unknown model preset {name!r} (choose from {', '.join(PRESETS)}, custom)")
    return spec_from_hf_config(preset.config, name=f"{preset.display_name} ({preset.hf_id})",
                               dtype_bytes=dtype_bytes, dtype_origin=dtype_origin, source=f"preset {name}")
