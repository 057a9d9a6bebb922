"""The layers the own decoders are built from: norm, rotary, and the tensor-parallel pieces.

    RMSNorm                 HF's RMSNorm (fp32 normalise, cast, scale; Gemma's 1 + weight); the fused path
                            calls the Triton kernel with its weight instead of `forward`
    Rotary                  rotate-half rotary embedding from a cos/sin table indexed by position
    VocabParallelEmbedding  the embedding split by vocab rows over the TP ranks (all-reduced)
    row_parallel_reduce     the sum of a row-parallel projection's partial outputs, bias added once
    TensorShard             which rows and columns of a full weight this rank keeps

Column-parallel projections (q/k/v, gate/up) are plain `nn.Linear`s holding their rank's rows,
and row-parallel ones (o, down) hold their columns: the shard decides what is copied in, and
`row_parallel_reduce` completes the row-parallel product. Without TP every piece is the plain one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedkv.kernels import layer_ops


class RMSNorm(nn.Module):
    """RMSNorm with HF's rounding; `offset=True` is Gemma's, which scales by (1 + weight)."""

    def __init__(self, size: int, eps: float, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_ops.rms_norm_reference(x, self.weight, self.eps, self.offset)


class Rotary(nn.Module):
    """Rotary position embedding from a cos/sin table indexed by position (HF's rotate-half convention).

    The table is computed once in fp32 from the model's own `inv_freq` and attention scaling
    (which carry any RoPE scaling the checkpoint asks for, e.g. Llama 3's) and cast to the model
    dtype per step exactly where HF casts it. With `long_inv_freq`, rows from position
    `long_from` on use it instead (Phi-3's longrope).
    """

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, max_positions: int,
                 long_inv_freq: torch.Tensor | None = None, long_from: int | None = None):
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
        freqs = positions[:, None] * inv_freq.float()[None, :]  # [P, D/2]
        if long_inv_freq is not None:  # longrope: positions >= long_from take the long factors' rows
            long_freqs = positions[:, None] * long_inv_freq.float()[None, :]
            freqs = torch.where(positions[:, None] >= long_from, long_freqs, freqs)
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, Hkv, D] -> rotated copies."""
        cos = self.cos.index_select(0, positions).to(q.dtype)[:, None, :]  # [T, 1, D]
        sin = self.sin.index_select(0, positions).to(q.dtype)[:, None, :]
        return q * cos + layer_ops.rotate_half(q) * sin, k * cos + layer_ops.rotate_half(k) * sin


class VocabParallelEmbedding(nn.Module):
    """Rank r holds vocab rows [r * shard, (r + 1) * shard), the last shard padded with zero rows that no
    id reaches (an LM head tied to it has their logits cut off after the gather)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp_size: int = 1, tp_rank: int = 0):
        super().__init__()
        self.vocab_shard = -(-vocab_size // tp_size)
        self.vocab_start = tp_rank * self.vocab_shard
        self.weight = nn.Parameter(torch.empty(self.vocab_shard, hidden_size))

    def forward(self, input_ids: torch.Tensor, tp=None) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]; under TP each rank embeds the ids in its shard, zeros elsewhere, summed."""
        if tp is None:
            return nn.functional.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_shard)
        return tp.all_reduce(nn.functional.embedding(local.clamp(0, self.vocab_shard - 1), self.weight)
                             * inside[:, None])


def written_kv_rows(qkv: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's K and V as views of the fused qkv rows, [T, Hkv, D] each.

    After the fused norm/rotary/store kernel rotated K in place there, prefill reads the step's own
    K/V from these rows instead of gathering them back from the pool's pages.
    """
    kv_shape = (qkv.shape[0], cfg.num_kv_heads, cfg.head_dim)
    return (qkv[:, cfg.q_size:cfg.q_size + cfg.kv_size].view(kv_shape),
            qkv[:, cfg.q_size + cfg.kv_size:].view(kv_shape))


def row_parallel_reduce(x: torch.Tensor, bias: torch.Tensor | None, tp) -> torch.Tensor:
    """A row-parallel projection's output: the ranks' partial sums all-reduced, then the bias added once."""
    if tp is not None:
        x = tp.all_reduce(x)
    return x if bias is None else x + bias


@dataclass(frozen=True)
class TensorShard:
    """This rank's part of a full (HF) weight: column-parallel rows, row-parallel columns, vocab rows."""

    rank: int = 0
    size: int = 1

    def rows(self, t: torch.Tensor, per_rank: int) -> torch.Tensor:
        """This rank's block of output rows (column-parallel weights and biases)."""
        return t[self.rank * per_rank:(self.rank + 1) * per_rank]

    def cols(self, t: torch.Tensor, per_rank: int) -> torch.Tensor:
        """This rank's block of input columns (row-parallel weights)."""
        return t[:, self.rank * per_rank:(self.rank + 1) * per_rank]

    def vocab_rows(self, t: torch.Tensor, shard: int) -> torch.Tensor:
        """This rank's `shard` vocab rows, zero-padded past the vocabulary's end."""
        out = torch.zeros(shard, t.shape[1], dtype=t.dtype, device=t.device)
        part = t[self.rank * shard:(self.rank + 1) * shard]
        out[:part.shape[0]] = part
        return out
