"""What every own decoder shares: embed, run the layers over the residual stream, final norm, LM head.

A family (Llama, Gemma, GPT-2) brings its layers, its norm and its rotary tables; this base runs
them over flat token batches the same way:

    hidden, residual = embed(ids, positions), None
    for layer:  hidden, residual = layer(hidden, residual, ...)   # hidden: the delta the next add takes
    logits = lm_head(norm(hidden + residual))   (only the rows of logits_indices)
    logits = cap * tanh(logits / cap)           (a final soft cap, Gemma)

Under tensor parallelism the embedding and the LM head are split by vocab rows, and the logits
are gathered before the soft cap. Nothing here reads a device value back to the host, so a decode
step captures in a CUDA graph.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.models.decoder_config import DecoderConfig
from pagedkv.models.layers import TensorShard, VocabParallelEmbedding


class OwnDecoder(nn.Module):
    """Embedding, layers, final norm and LM head; a family fills `layers`, `norm` and `rotary_of`."""

    def __init__(self, cfg: DecoderConfig, tp=None):
        super().__init__()
        self.cfg = cfg  # the whole model's shape; layers get this rank's shard of it
        self.tp = tp  # None, or the TensorParallel group this rank belongs to
        tp_size, tp_rank = (tp.size, tp.rank) if tp is not None else (1, 0)
        self.local_cfg = cfg.shard(tp_size)
        # Vocab-parallel embedding and LM head (the head's padded rows' logits are cut off after the gather).
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp_size, tp_rank)
        self.vocab_shard = self.embed.vocab_shard
        self.lm_head = nn.Linear(cfg.hidden_size, self.vocab_shard, bias=False)
        # The fused Triton kernels (pagedkv.kernels.layer_ops) run on CUDA; CPU runs their torch references.
        self.use_fused_kernels = True

    def rotary_of(self, layer: nn.Module):
        """The rotary table a layer uses (None for a family without rotary)."""
        raise NotImplementedError

    def embed_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The residual stream's start: [num_tokens, hidden]."""
        return self.embed(input_ids, self.tp)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [num_tokens]; `attn` is the step's attention context (see kernels.backend).

        Returns logits [len(logits_indices), vocab] (all tokens when None).
        """
        fused = self.use_fused_kernels and input_ids.is_cuda
        tp = self.tp
        hidden = self.embed_tokens(input_ids, positions)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, positions, self.rotary_of(layer), attn, fused, tp)
        hidden = hidden + residual  # the last layer's residual add (HF rounds it the same way)
        if logits_indices is not None:
            hidden = hidden.index_select(0, logits_indices)
        logits = self.lm_head(self.norm(hidden))
        if tp is not None:
            logits = tp.all_gather_last_dim(logits)[:, :self.cfg.vocab_size]
        cap = self.cfg.final_soft_cap
        if cap is not None:  # HF's order: divide, tanh, multiply, each in the model dtype
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ------------------------------------------------------------------ loading
    @classmethod
    def empty(cls, cfg: DecoderConfig, dtype: torch.dtype, device, tp=None, **kwargs) -> OwnDecoder:
        """The model built on the meta device, then given uninitialised storage on `device` in `dtype`."""
        with torch.device("meta"):
            model = cls(cfg, tp=tp, **kwargs)
        model = model.to_empty(device=device).to(dtype)
        model.tp = tp
        return model

    def shard_of(self) -> TensorShard:
        """Which part of each full weight this rank keeps."""
        return TensorShard(self.tp.rank, self.tp.size) if self.tp is not None else TensorShard()

    def load_vocab(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None) -> None:
        """Copy the embedding (and an untied LM head) in, this rank's vocab rows."""
        shard = self.shard_of()
        self.embed.weight.copy_(shard.vocab_rows(embed_weight, self.vocab_shard))
        if self.cfg.tie_word_embeddings or lm_head_weight is None:
            self.lm_head.weight = self.embed.weight
        else:
            self.lm_head.weight.copy_(shard.vocab_rows(lm_head_weight, self.vocab_shard))
