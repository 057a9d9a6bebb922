"""pagedkv's own decoder for Gemma 2 and Gemma 3 text models: local/global layers, sandwich norms, soft caps.

A Gemma layer differs from a Llama layer in five ways, each kept here as HF computes it:

    norms          RMSNorm scaling by (1 + weight) in fp32, rounded once (`offset=True` in layer_ops)
    sandwich       input norm -> attention -> post-attention norm -> + residual
                   -> pre-feedforward norm -> MLP -> post-feedforward norm -> + residual
    MLP            gelu_pytorch_tanh(gate) * up (the fused gate-up kernel with GELU_TANH)
    attention      scale query_pre_attn_scalar ** -0.5; sliding layers see the last `sliding_window`
                   keys, global layers all; Gemma 2 caps scores at attn_logit_softcapping
    Gemma 3 only   q/k norm over head_dim; a rotary base per layer type (rope_local_base_freq for
                   sliding layers, rope_theta with its scaling for global ones)

and the model scales the embedding by sqrt(hidden_size) (rounded to the model dtype, as HF's
buffer is) and caps the final logits (final_logit_softcapping, Gemma 2). Gemma checkpoints tie
the LM head to the embedding. Each layer passes its window and soft cap to the step's attention with its
layer index, so a per-layer-group block table (a sliding group) is the backend's choice.
Tensor parallelism splits heads and MLP like the Llama decoder.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.kernels import layer_ops
from pagedkv.models.config import FULL_ATTENTION
from pagedkv.models.decoder import OwnDecoder
from pagedkv.models.decoder_config import DecoderConfig
from pagedkv.models.layers import RMSNorm, Rotary, row_parallel_reduce, written_kv_rows


class GemmaDecoderLayer(nn.Module):
    """Sandwich-normed attention and gelu-tanh gated MLP, with the projections fused."""

    def __init__(self, cfg: DecoderConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.cfg = cfg
        self.layer_type = cfg.layer_types[layer_idx] if cfg.layer_types else FULL_ATTENTION
        self.sliding_window = cfg.sliding_windows[layer_idx]
        eps = cfg.rms_norm_eps
        self.input_norm = RMSNorm(cfg.hidden_size, eps, offset=True)
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.o_bias = nn.Parameter(torch.zeros(cfg.hidden_size)) if cfg.o_bias else None  # added after the reduce
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, eps, offset=True)
            self.k_norm = RMSNorm(cfg.head_dim, eps, offset=True)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, eps, offset=True)
        self.pre_ff_norm = RMSNorm(cfg.hidden_size, eps, offset=True)
        self.post_ff_norm = RMSNorm(cfg.hidden_size, eps, offset=True)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, rotary: Rotary,
                attn, fused: bool, tp=None) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer: returns (the post-feedforward-normed MLP output, the residual before it)."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        num_tokens = hidden.shape[0]
        add_norm = layer_ops.add_rms_norm if fused else layer_ops.add_rms_norm_reference
        normed, residual = add_norm(hidden, residual, self.input_norm.weight, eps, offset=True)
        qkv = self.qkv_proj(normed)  # [T, (H + 2 Hkv) D]
        q_norm = self.q_norm.weight if cfg.qk_norm else None
        k_norm = self.k_norm.weight if cfg.qk_norm else None
        if fused:  # q/k norm, rotary and the K/V store in one kernel; q is rotated in place in qkv
            k_cache, v_cache = attn.kv_cache(self.layer_idx)
            k_scale, v_scale = attn.kv_scales(self.layer_idx)
            q = layer_ops.qk_norm_rope_write_kv(
                qkv, positions, rotary.cos, rotary.sin, q_norm, k_norm, eps, k_cache, v_cache,
                attn.slot_mapping_for(self.layer_idx), num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim, k_scale=k_scale, v_scale=v_scale, offset=True)
            k = v = None
            written_kv = written_kv_rows(qkv, cfg)  # K rotated in place: prefill reads the step's K/V there
        else:
            written_kv = None
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q, k = layer_ops.qk_norm_rope_reference(
                q.reshape(num_tokens, cfg.num_heads, cfg.head_dim), k.reshape(num_tokens, cfg.num_kv_heads,
                                                                              cfg.head_dim),
                positions, rotary.cos, rotary.sin, q_norm, k_norm, eps, offset=True)
            v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        out = attn.forward(self.layer_idx, q, k, v, scale=cfg.scale, sliding_window=self.sliding_window,
                           soft_cap=cfg.attn_soft_cap, written_kv=written_kv)
        hidden = row_parallel_reduce(self.o_proj(out.view(num_tokens, cfg.q_size)), self.o_bias, tp)
        hidden, _ = add_norm(hidden, None, self.post_attn_norm.weight, eps, offset=True)
        normed, residual = add_norm(hidden, residual, self.pre_ff_norm.weight, eps, offset=True)
        gate_up = self.gate_up_proj(normed)
        act = layer_ops.silu_mul(gate_up, gelu_tanh=True) if fused else layer_ops.gelu_tanh_mul_reference(gate_up)
        hidden = row_parallel_reduce(self.down_proj(act), None, tp)
        hidden, _ = add_norm(hidden, None, self.post_ff_norm.weight, eps, offset=True)
        return hidden, residual


class GemmaModel(OwnDecoder):
    """Gemma 2 / Gemma 3 text over flat token batches (see `OwnDecoder`)."""

    def __init__(self, cfg: DecoderConfig, tp=None):
        super().__init__(cfg, tp)
        self.layers = nn.ModuleList(GemmaDecoderLayer(self.local_cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=True)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5), persistent=False)
        self.rotaries = nn.ModuleDict()  # layer type -> Rotary, filled from the checkpoint in from_hf

    def rotary_of(self, layer: GemmaDecoderLayer) -> Rotary:
        return self.rotaries[layer.layer_type]

    def embed_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # HF multiplies by its sqrt(hidden) buffer cast to the weight dtype.
        return self.embed(input_ids, self.tp) * self.embed_scale.to(self.embed.weight.dtype)

    # ------------------------------------------------------------------ loading
    @classmethod
    @torch.no_grad()
    def from_hf(cls, hf_model: nn.Module, max_positions: int | None = None, tp=None) -> GemmaModel:
        """Fuse an HF Gemma 2 / Gemma 3 (text) model's weights into this layout; `tp` keeps this rank's shard.

        A Gemma 3 checkpoint with a vision tower gives its language model (text only).
        `max_positions` sizes the rotary tables (default: the config's max_position_embeddings).
        Raises `ConfigError` when the model is not covered or does not divide by the TP size.
        """
        cfg = DecoderConfig.from_hf(hf_model.config)
        inner = getattr(hf_model.model, "language_model", hf_model.model)
        weight = inner.embed_tokens.weight
        device = tp.device if tp is not None else weight.device
        model = cls.empty(cfg, weight.dtype, device, tp)
        model.embed_scale = torch.tensor(cfg.hidden_size ** 0.5, device=device)
        positions = max_positions or cfg.max_position_embeddings or 4096
        rotary = inner.rotary_emb
        for layer_type in sorted(set(cfg.layer_types or (FULL_ATTENTION,))):
            prefix = f"{layer_type}_" if hasattr(rotary, f"{layer_type}_original_inv_freq") else ""  # Gemma 3
            inv_freq = getattr(rotary, f"{prefix}original_inv_freq")
            scaling = float(getattr(rotary, f"{prefix}attention_scaling"))
            model.rotaries[layer_type] = Rotary(inv_freq.to(device), scaling, positions)
        shard = model.shard_of()
        rows, cols = shard.rows, shard.cols
        local = model.local_cfg
        q_rows, kv_rows, mlp_rows = local.q_size, local.kv_size, local.intermediate_size
        for layer, src in zip(model.layers, inner.layers):
            attn, mlp = src.self_attn, src.mlp
            for mine, theirs in ((layer.input_norm, src.input_layernorm), (layer.post_attn_norm,
                                 src.post_attention_layernorm), (layer.pre_ff_norm, src.pre_feedforward_layernorm),
                                 (layer.post_ff_norm, src.post_feedforward_layernorm)):
                mine.weight.copy_(theirs.weight)
            layer.qkv_proj.weight.copy_(torch.cat([rows(attn.q_proj.weight, q_rows), rows(attn.k_proj.weight, kv_rows),
                                                   rows(attn.v_proj.weight, kv_rows)]))
            if cfg.attention_bias:
                layer.qkv_proj.bias.copy_(torch.cat([rows(attn.q_proj.bias, q_rows), rows(attn.k_proj.bias, kv_rows),
                                                     rows(attn.v_proj.bias, kv_rows)]))
                layer.o_bias.copy_(attn.o_proj.bias)
            layer.o_proj.weight.copy_(cols(attn.o_proj.weight, q_rows))
            if cfg.qk_norm:
                layer.q_norm.weight.copy_(attn.q_norm.weight)
                layer.k_norm.weight.copy_(attn.k_norm.weight)
            layer.gate_up_proj.weight.copy_(torch.cat([rows(mlp.gate_proj.weight, mlp_rows),
                                                       rows(mlp.up_proj.weight, mlp_rows)]))
            layer.down_proj.weight.copy_(cols(mlp.down_proj.weight, mlp_rows))
        model.norm.weight.copy_(inner.norm.weight)
        model.load_vocab(weight, None if cfg.tie_word_embeddings else hf_model.lm_head.weight)
        return model.eval()
