"""pagedkv's own decoder for GPT-2: learned positions, LayerNorm, gelu_new, one fused c_attn.

GPT-2 has the decoder shape of the others (pre-norm attention and MLP over a residual stream),
with four differences:

    embedding   token embedding + a learned position embedding (wpe), no rotary
    norms       LayerNorm with bias (layer_norm_epsilon)
    MLP         c_fc -> gelu_new -> c_proj, not gated
    weights     HF's Conv1D stores [in, out]; they are transposed into nn.Linear's [out, in] once
                at load. c_attn is already q, k, v fused (MHA), with biases.

Attention goes through the step's attention backend with the layer index, like every own
decoder. The ops are torch's (one kernel each: LayerNorm, addmm, the gelu_new formula as HF
writes it), so bf16 rounds as HF does; there is no tensor-parallel split (`from_hf` raises
`ConfigError` under TP).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedkv.errors import ConfigError
from pagedkv.models.decoder import OwnDecoder
from pagedkv.models.decoder_config import DecoderConfig


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """OpenAI GPT's gelu, op for op as HF's NewGELUActivation computes it."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class Gpt2Layer(nn.Module):
    """ln_1 -> attention -> + residual -> ln_2 -> MLP; returns the MLP output as the next add's delta."""

    def __init__(self, cfg: DecoderConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.cfg = cfg
        self.sliding_window = cfg.sliding_windows[layer_idx]
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, rotary,
                attn, fused: bool, tp=None) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        num_tokens = hidden.shape[0]
        residual = hidden if residual is None else residual + hidden
        qkv = self.qkv_proj(self.ln_1(residual))  # [T, 3 H D]
        q, k, v = (t.view(num_tokens, -1, cfg.head_dim) for t in qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size],
                                                                           dim=-1))
        out = attn.forward(self.layer_idx, q, k, v, scale=cfg.scale, sliding_window=self.sliding_window)
        residual = residual + self.o_proj(out.reshape(num_tokens, cfg.q_size))
        return self.proj(gelu_new(self.fc(self.ln_2(residual)))), residual


class Gpt2Model(OwnDecoder):
    """GPT-2 over flat token batches (see `OwnDecoder`)."""

    def __init__(self, cfg: DecoderConfig, tp=None):
        if tp is not None:
            raise ConfigError("tensor parallelism is not available for GPT-2 in pagedkv's own decoder "
                              "(tensor_parallel_size must be 1)")
        super().__init__(cfg, tp)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.layers = nn.ModuleList(Gpt2Layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def rotary_of(self, layer: Gpt2Layer) -> None:
        return None

    def embed_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids) + self.wpe(positions)

    @classmethod
    @torch.no_grad()
    def from_hf(cls, hf_model: nn.Module, max_positions: int | None = None, tp=None) -> Gpt2Model:
        """Copy an HF GPT-2 model's weights in (Conv1D weights transposed). `max_positions` is unused: wpe is fixed.

        Raises `ConfigError` under tensor parallelism or for a config the decoder does not cover.
        """
        cfg = DecoderConfig.from_hf(hf_model.config)
        inner = hf_model.transformer
        weight = inner.wte.weight
        model = cls.empty(cfg, weight.dtype, weight.device, tp)
        model.wpe.weight.copy_(inner.wpe.weight)
        pairs = [(model.norm, inner.ln_f)]
        for layer, src in zip(model.layers, inner.h):
            pairs += [(layer.ln_1, src.ln_1), (layer.ln_2, src.ln_2)]
            for mine, conv in ((layer.qkv_proj, src.attn.c_attn), (layer.o_proj, src.attn.c_proj),
                               (layer.fc, src.mlp.c_fc), (layer.proj, src.mlp.c_proj)):
                mine.weight.copy_(conv.weight.t())
                mine.bias.copy_(conv.bias)
        for mine, theirs in pairs:
            mine.weight.copy_(theirs.weight)
            mine.bias.copy_(theirs.bias)
        model.load_vocab(weight, None if cfg.tie_word_embeddings else hf_model.lm_head.weight)
        return model.eval()
