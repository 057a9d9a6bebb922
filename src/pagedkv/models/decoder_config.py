"""The shape of an own decoder, read from an HF config: one frozen dataclass for every family pagedkv runs itself.

    family "llama"  Llama, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3 / Phi-3.5   (models/llama.py)
    family "gemma"  Gemma 2, Gemma 3 text (and the text part of Gemma 3)      (models/gemma.py)
    family "gpt2"   GPT-2                                                     (models/gpt2.py)

Each family's reader says, with a `ConfigError`, what it does not cover (an activation, a RoPE
variant, bidirectional attention...), so such a model runs on HF's modules instead. The layer
types and the sliding window come from the one config reader (`models.config.attention_shape`).
Pure Python: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagedkv.errors import ConfigError
from pagedkv.models.config import as_mapping, attention_shape, max_positions

#: `config.model_type` -> the own decoder family that covers it; everything else runs on HF's modules.
FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama", "phi3": "llama",
            "gemma2": "gemma", "gemma3_text": "gemma", "gpt2": "gpt2"}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
#: The MLP activation each family's kernels compute.
ACTIVATIONS = {"llama": ("silu",), "gemma": ("gelu_pytorch_tanh",), "gpt2": ("gelu_new",)}


@dataclass(frozen=True)
class DecoderConfig:
    """The shape of an own decoder, read from an HF config (`from_hf`)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float  # the norms' epsilon (GPT-2's LayerNorm too)
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases (Qwen2, GPT-2, some Llama fine-tunes); o_proj bias follows `o_bias`
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3, Gemma 3: RMSNorm over head_dim on q and k before rotary
    sliding_windows: tuple[int | None, ...]  # per layer
    max_position_embeddings: int
    layer_types: tuple[str, ...] = ()  # HF's per-layer types (Gemma 3 picks its rotary base by type)
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_soft_cap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_soft_cap: float | None = None  # Gemma 2/3: logits -> cap * tanh(logits / cap)
    hidden_act: str = "silu"

    def __post_init__(self):
        if self.model_type not in FAMILIES:
            raise ConfigError(f"model_type {self.model_type!r} is not covered by pagedkv's own decoder "
                              f"(covered: {', '.join(SUPPORTED_MODEL_TYPES)})")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if len(self.sliding_windows) != self.num_layers:
            raise ConfigError(f"{len(self.sliding_windows)} sliding windows for {self.num_layers} layers")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(f"{len(self.layer_types)} layer types for {self.num_layers} layers")
        if self.hidden_act not in ACTIVATIONS[self.family]:
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not covered by pagedkv's own {self.model_type} "
                              f"decoder (only {', '.join(ACTIVATIONS[self.family])})")
        for name in ("attn_soft_cap", "final_soft_cap", "attn_scale"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be positive or None, got {value!r}")

    @property
    def family(self) -> str:
        return FAMILIES[self.model_type]

    @property
    def scale(self) -> float:
        """The attention softmax scale."""
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def shard(self, tp_size: int) -> DecoderConfig:
        """This config as one of `tp_size` tensor-parallel ranks sees it (heads and MLP width split).

        Raises `ConfigError` naming the count that does not divide.
        """
        if tp_size == 1:
            return self
        for name, count in (("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_kv_heads),
                            ("intermediate_size", self.intermediate_size)):
            if count % tp_size:
                raise ConfigError(f"{name} = {count} does not divide by tensor_parallel_size = {tp_size}")
        return replace(self, num_heads=self.num_heads // tp_size, num_kv_heads=self.num_kv_heads // tp_size,
                       intermediate_size=self.intermediate_size // tp_size)

    @classmethod
    def from_hf(cls, config) -> DecoderConfig:
        """Read an HF `PretrainedConfig` (or its dict) of a covered family; `ConfigError` names what is not covered."""
        top = as_mapping(config)
        text = as_mapping(config.get_text_config() if hasattr(config, "get_text_config") else config)
        model_type = text.get("model_type")
        if model_type not in FAMILIES:
            raise ConfigError(f"model_type {model_type!r} is not covered by pagedkv's own decoder "
                              f"(covered: {', '.join(SUPPORTED_MODEL_TYPES)})")
        shape = attention_shape(text)
        common = dict(model_type=model_type, vocab_size=text["vocab_size"], num_layers=shape.num_layers,
                      num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                      sliding_windows=shape.layer_windows, layer_types=shape.layer_types,
                      max_position_embeddings=max_positions(text) or 0,
                      tie_word_embeddings=bool(top.get("tie_word_embeddings", text.get("tie_word_embeddings"))))
        family = FAMILIES[model_type]
        if family == "gpt2":
            return cls(**common, **_gpt2_fields(text))
        if family == "gemma":
            return cls(**common, **_gemma_fields(text))
        return cls(**common, **_llama_fields(text))


def _llama_fields(text) -> dict:
    model_type = text["model_type"]
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if model_type == "phi3" and float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor") or 1.0)) != 1:
        raise ConfigError("partial_rotary_factor < 1 (Phi-4-mini) is not covered by pagedkv's own decoder")
    attention_bias = bool(text.get("attention_bias", model_type == "qwen2"))
    return dict(hidden_size=text["hidden_size"], intermediate_size=text["intermediate_size"],
                rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
                attention_bias=attention_bias or model_type == "qwen2",
                o_bias=attention_bias and model_type != "qwen2",  # Qwen2 has q/k/v biases but none on o_proj
                mlp_bias=bool(text.get("mlp_bias", False)), qk_norm=model_type == "qwen3",
                hidden_act=text.get("hidden_act", "silu"))


def _gemma_fields(text) -> dict:
    if text.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention (EmbeddingGemma) is not covered by pagedkv's own decoder")
    attention_bias = bool(text.get("attention_bias", False))
    is_gemma2 = text["model_type"] == "gemma2"
    return dict(hidden_size=text["hidden_size"], intermediate_size=text["intermediate_size"],
                rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)), attention_bias=attention_bias,
                o_bias=attention_bias, mlp_bias=False, qk_norm=not is_gemma2,
                attn_scale=float(text.get("query_pre_attn_scalar") or text["head_dim"]) ** -0.5,
                # Gemma 3 keeps attn_logit_softcapping in its config but HF's attention does not apply it.
                attn_soft_cap=_optional_float(text.get("attn_logit_softcapping")) if is_gemma2 else None,
                final_soft_cap=_optional_float(text.get("final_logit_softcapping")),
                hidden_act=text.get("hidden_activation") or text.get("hidden_act") or "gelu_pytorch_tanh")


def _gpt2_fields(text) -> dict:
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if text.get(flag):
            raise ConfigError(f"GPT-2's {flag} is not covered by pagedkv's own decoder")
    hidden = text.get("n_embd") or text["hidden_size"]
    head_dim = hidden // (text.get("n_head") or text["num_attention_heads"])
    return dict(hidden_size=hidden, intermediate_size=text.get("n_inner") or 4 * hidden,
                rms_norm_eps=float(text.get("layer_norm_epsilon", 1e-5)), attention_bias=True, o_bias=True,
                mlp_bias=True, qk_norm=False, attn_scale=head_dim ** -0.5 if text.get("scale_attn_weights", True)
                else 1.0, hidden_act=text.get("activation_function", "gelu_new"))


def _optional_float(value) -> float | None:
    return None if value is None else float(value)
