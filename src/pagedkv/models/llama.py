"""pagedkv's own decoder for the Llama family: Llama, SmolLM2, Qwen2, Qwen3, Mistral and Phi-3 / Phi-3.5.

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
reads the checkpoint, and this module fuses and keeps the tensors. Phi-3 checkpoints carry
qkv_proj and gate_up_proj already fused; under TP they are split into q, k, v (gate, up) first.
Phi-3's longrope uses its short factors below original_max_position_embeddings and its long
ones from there on, position by position (see `rotary_of_hf`). The model dtype's rounding
follows HF's step for step (RMSNorm in fp32 then cast, rotary tables in fp32 then cast), which
is what makes fp32 logits agree and bf16 greedy decoding agree up to ties.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.kernels import layer_ops
from pagedkv.models.decoder import OwnDecoder
from pagedkv.models.decoder_config import SUPPORTED_MODEL_TYPES, DecoderConfig
from pagedkv.models.layers import RMSNorm, Rotary, row_parallel_reduce, written_kv_rows

__all__ = ["SUPPORTED_MODEL_TYPES", "DecoderConfig", "DecoderLayer", "LlamaFamilyModel", "rotary_of_hf"]


class DecoderLayer(nn.Module):
    """Pre-norm attention and gated MLP, with the projections fused."""

    def __init__(self, cfg: DecoderConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.cfg = cfg
        self.sliding_window = cfg.sliding_windows[layer_idx]
        self.scale = cfg.scale
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
                self.k_norm.weight if cfg.qk_norm else None, cfg.rms_norm_eps, k_cache, v_cache,
                attn.slot_mapping_for(self.layer_idx),
                num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, k_scale=k_scale,
                v_scale=v_scale)
            k = v = None
            written_kv = written_kv_rows(qkv, cfg)  # K rotated in place: prefill reads the step's K/V there
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


def rotary_of_hf(rotary_emb: nn.Module, config, max_positions: int, device) -> Rotary:
    """The rotary table of an HF rotary module, its own inv_freq and scaling (so any RoPE scaling it carries).

    Longrope (Phi-3): HF switches from the short to the long factors once a sequence is longer
    than original_max_position_embeddings. The table here holds the short factors' rows below
    that position and the long ones from it on: what HF computes for each new token during
    generation. (HF also recomputes the earlier tokens' keys with the long factors when a
    sequence first crosses that length; a paged cache keeps them.)
    """
    inv_freq = getattr(rotary_emb, "original_inv_freq", rotary_emb.inv_freq)
    scaling = float(rotary_emb.attention_scaling)
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") != "longrope":
        return Rotary(inv_freq.to(device), scaling, max_positions)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    switch = int(rope.get("original_max_position_embeddings") or config.original_max_position_embeddings)
    long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, device, seq_len=switch + 1)
    return Rotary(inv_freq.to(device), scaling, max_positions, long_inv_freq=long_inv_freq.to(device),
                  long_from=switch)


class LlamaFamilyModel(OwnDecoder):
    """Embedding, decoder layers, final norm and LM head over flat token batches (see `OwnDecoder`)."""

    def __init__(self, cfg: DecoderConfig, tp=None):
        super().__init__(cfg, tp)
        self.layers = nn.ModuleList(DecoderLayer(self.local_cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rotary = Rotary(torch.zeros(cfg.head_dim // 2), 1.0, 1)  # replaced by the checkpoint's in from_hf

    def rotary_of(self, layer: nn.Module) -> Rotary:
        return self.rotary

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
        model = cls.empty(cfg, weight.dtype, device, tp)
        local = model.local_cfg
        model.rotary = rotary_of_hf(inner.rotary_emb, hf_model.config,
                                    max_positions or cfg.max_position_embeddings or 4096, device)
        shard = model.shard_of()
        rows, cols = shard.rows, shard.cols
        q_rows, kv_rows, mlp_rows = local.q_size, local.kv_size, local.intermediate_size
        for layer, src in zip(model.layers, inner.layers):
            attn, mlp = src.self_attn, src.mlp
            layer.input_norm.weight.copy_(src.input_layernorm.weight)
            layer.post_norm.weight.copy_(src.post_attention_layernorm.weight)
            if hasattr(attn, "qkv_proj"):  # Phi-3: fused in the checkpoint
                q, k, v = attn.qkv_proj.weight.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
                gate, up = mlp.gate_up_proj.weight.chunk(2)
            else:
                q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
                gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
            layer.qkv_proj.weight.copy_(torch.cat([rows(q, q_rows), rows(k, kv_rows), rows(v, kv_rows)]))
            if cfg.attention_bias:
                layer.qkv_proj.bias.copy_(torch.cat([rows(attn.q_proj.bias, q_rows), rows(attn.k_proj.bias, kv_rows),
                                                     rows(attn.v_proj.bias, kv_rows)]))
            layer.o_proj.weight.copy_(cols(attn.o_proj.weight, q_rows))
            if cfg.o_bias:
                layer.o_bias.copy_(attn.o_proj.bias)
            if cfg.qk_norm:
                layer.q_norm.weight.copy_(attn.q_norm.weight)
                layer.k_norm.weight.copy_(attn.k_norm.weight)
            layer.gate_up_proj.weight.copy_(torch.cat([rows(gate, mlp_rows), rows(up, mlp_rows)]))
            layer.down_proj.weight.copy_(cols(mlp.down_proj.weight, mlp_rows))
            if cfg.mlp_bias:
                layer.gate_up_proj.bias.copy_(torch.cat([rows(mlp.gate_proj.bias, mlp_rows),
                                                         rows(mlp.up_proj.bias, mlp_rows)]))
                layer.down_bias.copy_(mlp.down_proj.bias)
        model.norm.weight.copy_(inner.norm.weight)
        model.load_vocab(weight, None if cfg.tie_word_embeddings else hf_model.lm_head.weight)
        return model.eval()
