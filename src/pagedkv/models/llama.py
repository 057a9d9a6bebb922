"""pagedkv's own decoder for the Llama family: Llama, SmolLM2, Qwen2, Qwen3 and Mistral.

The engine's hot path. It computes what HF's modules compute (the test suite holds it to HF's
logits within 1e-4 in fp32), but in the layout a serving engine wants:

    hidden      [num_tokens, hidden_size]          every scheduled token, flat, no padding, no batch dim
    qkv         [num_tokens, (H + 2 * Hkv) * D]    one fused projection (q, k, v weights concatenated)
    q / k / v   [num_tokens, H or Hkv, D]          views of qkv; rotary applied in place of a copy
    gate_up     [num_tokens, 2 * intermediate]     one fused projection, then silu(gate) * up

Attention is not a module here: each layer hands q, k, v to the step's attention backend
(`pagedkv.kernels.backend`), which writes K/V into the paged pool and reads them through the
block tables. Nothing in `forward` reads a device value back to the host, so a decode step
can be captured in a CUDA graph.

The weights come from an HF model object (`from_hf`), so every source the engine accepts
(HF id or directory, the embedded GGUF, `random:NAME`) loads through one path: transformers
reads the checkpoint, and this module fuses and keeps the tensors. The model dtype's rounding
follows HF's step for step (RMSNorm in fp32 then cast, rotary tables in fp32 then cast), which
is what makes fp32 logits agree and bf16 greedy decoding agree up to ties.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from pagedkv.errors import ConfigError
from pagedkv.kernels import layer_ops
from pagedkv.models.config import as_mapping, attention_shape, max_positions
from pagedkv.models.layers import RMSNorm, Rotary, TensorShard, VocabParallelEmbedding, row_parallel_reduce

#: `config.model_type` values this decoder covers; everything else runs on HF's modules.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class DecoderConfig:
    """The shape of a Llama-family decoder, read from an HF config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases (Qwen2, some Llama fine-tunes); o_proj bias follows `o_bias`
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before rotary
    sliding_windows: tuple[int | None, ...]  # per layer
    max_position_embeddings: int

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if len(self.sliding_windows) != self.num_layers:
            raise ConfigError(f"{len(self.sliding_windows)} sliding windows for {self.num_layers} layers")

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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, config) -> DecoderConfig:
        """Read an HF `PretrainedConfig` of a covered family; `ConfigError` names what is not covered."""
        text = as_mapping(config.get_text_config() if hasattr(config, "get_text_config") else config)
        model_type = text.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type {model_type!r} is not covered by pagedkv's own decoder "
                              f"(covered: {', '.join(SUPPORTED_MODEL_TYPES)})")
        act = text.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not covered by pagedkv's own decoder (only silu)")
        shape = attention_shape(text)
        attention_bias = bool(text.get("attention_bias", model_type == "qwen2"))
        return cls(
            model_type=model_type,
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            intermediate_size=text["intermediate_size"],
            num_layers=shape.num_layers,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(as_mapping(config).get("tie_word_embeddings", False)),
            attention_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias and model_type != "qwen2",  # Qwen2 has q/k/v biases but none on o_proj
            mlp_bias=bool(text.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_windows=shape.layer_windows,
            max_position_embeddings=max_positions(text) or 0,
        )


class DecoderLayer(nn.Module):
    """Pre-norm attention and gated MLP, with the projections fused."""

    def __init__(self, cfg: DecoderConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.cfg = cfg
        self.sliding_window = cfg.sliding_windows[layer_idx]
        self.scale = cfg.head_dim ** -0.5
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        # Row-parallel layers reduce partial sums across ranks; a bias is added once, after the reduce.
        self.o_bias = nn.Parameter(torch.zeros(cfg.hidden_size)) if cfg.o_bias else None
        self.down_bias = nn.Parameter(torch.zeros(cfg.hidden_size)) if cfg.mlp_bias else None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, rotary: Rotary,
                attn, fused: bool, tp=None) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer over the residual stream: returns (this layer's MLP output, the residual before it)."""
        cfg = self.cfg
        num_tokens = hidden.shape[0]
        add_norm = layer_ops.add_rms_norm if fused else layer_ops.add_rms_norm_reference
        normed, residual = add_norm(hidden, residual, self.input_norm.weight, cfg.rms_norm_eps)
        qkv = self.qkv_proj(normed)  # [T, (H + 2 Hkv) D]
        if fused:  # q/k norm, rotary and the K/V store in one kernel; q is rotated in place in qkv
            k_cache, v_cache = attn.kv_cache(self.layer_idx)
            k_scale, v_scale = attn.kv_scales(self.layer_idx)  # FP8 pools: the store quantizes
            q = layer_ops.qk_norm_rope_write_kv(
                qkv, positions, rotary.cos, rotary.sin, self.q_norm.weight if cfg.qk_norm else None,
                self.k_norm.weight if cfg.qk_norm else None, cfg.rms_norm_eps, k_cache, v_cache, attn.slot_mapping,
                num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, k_scale=k_scale,
                v_scale=v_scale)
            k = v = None
            # The kernel rotated K in place: the step's K/V stay readable as rows of qkv (prefill reads them there).
            kv_shape = (num_tokens, cfg.num_kv_heads, cfg.head_dim)
            written_kv = (qkv[:, cfg.q_size:cfg.q_size + cfg.kv_size].view(kv_shape),
                          qkv[:, cfg.q_size + cfg.kv_size:].view(kv_shape))
        else:
            written_kv = None
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = q.view(num_tokens, cfg.num_heads, cfg.head_dim)
            k = k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rotary(positions, q, k)
        out = attn.forward(self.layer_idx, q, k, v, scale=self.scale, sliding_window=self.sliding_window,
                           written_kv=written_kv)
        hidden = row_parallel_reduce(self.o_proj(out.view(num_tokens, cfg.q_size)), self.o_bias, tp)
        normed, residual = add_norm(hidden, residual, self.post_norm.weight, cfg.rms_norm_eps)
        gate_up = self.gate_up_proj(normed)
        act = layer_ops.silu_mul(gate_up) if fused else layer_ops.silu_mul_reference(gate_up)
        return row_parallel_reduce(self.down_proj(act), self.down_bias, tp), residual


class LlamaFamilyModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head over flat token batches."""

    def __init__(self, cfg: DecoderConfig, inv_freq: torch.Tensor, attention_scaling: float, max_positions: int,
                 tp=None):
        super().__init__()
        self.cfg = cfg  # the whole model's shape; layers get this rank's shard of it
        self.tp = tp  # None, or the TensorParallel group this rank belongs to
        tp_size, tp_rank = (tp.size, tp.rank) if tp is not None else (1, 0)
        local = cfg.shard(tp_size)
        self.local_cfg = local
        # Vocab-parallel embedding and LM head (the head's padded rows' logits are cut off after the gather).
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp_size, tp_rank)
        self.vocab_shard = self.embed.vocab_shard
        self.layers = nn.ModuleList(DecoderLayer(local, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, self.vocab_shard, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rotary = Rotary(inv_freq, attention_scaling, max_positions)
        # The fused Triton kernels (pagedkv.kernels.layer_ops) run on CUDA; CPU runs their torch references.
        self.use_fused_kernels = True

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [num_tokens]; `attn` is the step's attention context (see kernels.backend).

        Returns logits [len(logits_indices), vocab] (all tokens when None).
        """
        fused = self.use_fused_kernels and input_ids.is_cuda
        tp = self.tp
        hidden = self.embed(input_ids, tp)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, positions, self.rotary, attn, fused, tp)
        hidden = hidden + residual  # the last layer's residual add (HF rounds it the same way)
        if logits_indices is not None:
            hidden = hidden.index_select(0, logits_indices)
        logits = self.lm_head(self.norm(hidden))
        if tp is not None:
            logits = tp.all_gather_last_dim(logits)[:, :self.cfg.vocab_size]
        return logits

    # ------------------------------------------------------------------ loading
    @classmethod
    @torch.no_grad()
    def from_hf(cls, hf_model: nn.Module, max_positions: int | None = None, tp=None) -> LlamaFamilyModel:
        """Fuse an HF Llama-family model's weights into this layout (same dtype; `tp`'s device, or the HF model's).

        With `tp` (a `TensorParallel`), keep only this rank's shard: q/k/v heads and gate/up rows
        column-parallel, o and down columns row-parallel, embedding and LM head by vocab rows.
        `max_positions` sizes the rotary table (default: the config's max_position_embeddings).
        Raises `ConfigError` when the model is not a covered family or does not divide by the TP size.
        """
        cfg = DecoderConfig.from_hf(hf_model.config)
        inner = hf_model.model
        weight = inner.embed_tokens.weight
        device = tp.device if tp is not None else weight.device
        tp_size, rank = (tp.size, tp.rank) if tp is not None else (1, 0)
        local = cfg.shard(tp_size)
        rotary = inner.rotary_emb
        positions = max_positions or cfg.max_position_embeddings or 4096
        with torch.device("meta"):
            model = cls(cfg, torch.zeros(cfg.head_dim // 2), 1.0, 1, tp=tp)
        model = model.to_empty(device=device).to(weight.dtype)
        model.tp = tp
        model.rotary = Rotary(rotary.inv_freq.to(device), float(rotary.attention_scaling), positions)

        shard = TensorShard(rank, tp_size)
        rows, cols = shard.rows, shard.cols

        def vocab_rows(t: torch.Tensor) -> torch.Tensor:
            return shard.vocab_rows(t, model.vocab_shard)

        q_rows, kv_rows, mlp_rows = local.q_size, local.kv_size, local.intermediate_size
        model.embed.weight.copy_(vocab_rows(weight))
        for layer, src in zip(model.layers, inner.layers):
            attn, mlp = src.self_attn, src.mlp
            layer.input_norm.weight.copy_(src.input_layernorm.weight)
            layer.post_norm.weight.copy_(src.post_attention_layernorm.weight)
            layer.qkv_proj.weight.copy_(torch.cat([rows(attn.q_proj.weight, q_rows), rows(attn.k_proj.weight, kv_rows),
                                                   rows(attn.v_proj.weight, kv_rows)]))
            if cfg.attention_bias:
                layer.qkv_proj.bias.copy_(torch.cat([rows(attn.q_proj.bias, q_rows), rows(attn.k_proj.bias, kv_rows),
                                                     rows(attn.v_proj.bias, kv_rows)]))
            layer.o_proj.weight.copy_(cols(attn.o_proj.weight, q_rows))
            if cfg.o_bias:
                layer.o_bias.copy_(attn.o_proj.bias)
            if cfg.qk_norm:
                layer.q_norm.weight.copy_(attn.q_norm.weight)
                layer.k_norm.weight.copy_(attn.k_norm.weight)
            layer.gate_up_proj.weight.copy_(torch.cat([rows(mlp.gate_proj.weight, mlp_rows),
                                                       rows(mlp.up_proj.weight, mlp_rows)]))
            layer.down_proj.weight.copy_(cols(mlp.down_proj.weight, mlp_rows))
            if cfg.mlp_bias:
                layer.gate_up_proj.bias.copy_(torch.cat([rows(mlp.gate_proj.bias, mlp_rows),
                                                         rows(mlp.up_proj.bias, mlp_rows)]))
                layer.down_bias.copy_(mlp.down_proj.bias)
        model.norm.weight.copy_(inner.norm.weight)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed.weight
        else:
            model.lm_head.weight.copy_(vocab_rows(hf_model.lm_head.weight))
        return model.eval()
