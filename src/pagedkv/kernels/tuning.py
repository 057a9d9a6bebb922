"""Kernel tunables and the split-KV heuristic, kept free of Triton so any backend can import them.

Decode is memory bound: its time is the bytes of K/V it reads over the bandwidth it gets.
Getting the bandwidth needs enough programs in flight to cover every SM several times.
One program per (sequence, kv head) is plenty for a big batch, but batch 1 with 8 kv heads
is 8 programs on a 132-SM H200. Split-KV (flash-decoding) cuts each sequence's kv range
into `num_splits` pieces, handled by separate programs whose partial results a small kernel
merges by log-sum-exp:

    programs = num_seqs * num_kv_heads * num_splits  >=  target_waves * num_sms
    every split keeps at least min_split_tokens tokens (each split costs a partial write and
    a merge read of num_heads * head_dim fp32, so a split needs a few hundred tokens to pay)

The count comes from host-side ints only (batch, kv heads, the caller's `max_seq_len`, the
SM count), never from a device read, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pagedkv.errors import InvalidArgumentError, require_positive_int


@dataclass(frozen=True)
class DecodeTuning:
    """Launch parameters of the paged decode kernel. `None` picks the default for the head dim."""

    block_n: int | None = None  # kv tokens loaded per loop iteration (a power of 2, >= 16)
    num_warps: int = 4
    num_stages: int = 3  # H200, 2026-11-30: 3 stages beat 2 by 3-6% on every decode shape
    no_split_waves: float = 2.0  # a batch that already fills this many waves is not split at all ...
    target_waves: float = 4.0  # ... otherwise split until programs >= target_waves * num_sms ...
    min_split_tokens: int = 256  # ... but keep each split at least this long
    max_splits: int = 128
    dot_min_group: int = 1  # from this group size on, tl.dot (M padded to 16); below it a multiply-sum
    # (the multiply-sum ran at 0.4 TB/s on the H200 against 3.8-4.2 for tl.dot, so MHA uses tl.dot too)

    def __post_init__(self):
        if self.block_n is not None and (self.block_n < 16 or self.block_n & (self.block_n - 1)):
            raise InvalidArgumentError(f"block_n must be a power of 2 >= 16, got {self.block_n}")
        for name in ("num_warps", "num_stages", "min_split_tokens", "max_splits", "dot_min_group"):
            require_positive_int(name, getattr(self, name))
        if not self.target_waves > 0:
            raise InvalidArgumentError(f"target_waves must be > 0, got {self.target_waves}")

    def block_n_for(self, head_dim: int) -> int:
        """Tokens per iteration: 64 keeps a bf16 K tile at 16 KiB for head_dim 128; halve it for 256."""
        if self.block_n is not None:
            return self.block_n
        return 64 if head_dim <= 128 else 32


@dataclass(frozen=True)
class PrefillTuning:
    """Launch parameters of the paged prefill kernel (FlashAttention-2 style tiles)."""

    block_m: int | None = None  # query rows per program
    block_n: int | None = None  # kv tokens per loop iteration
    num_warps: int | None = None
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value is not None and (value < 16 or value & (value - 1)):
                raise InvalidArgumentError(f"{name} must be a power of 2 >= 16, got {value}")
        if self.num_warps is not None:
            require_positive_int("num_warps", self.num_warps)
        require_positive_int("num_stages", self.num_stages)

    def tiles_for(self, head_dim: int) -> tuple[int, int, int]:
        """(block_m, block_n, num_warps); smaller kv tiles for head_dim 256 to fit shared memory."""
        # H200, 8 x 2048 causal, head_dim 128: 64 x 64 tiles with 4 warps ran at 311 TFLOP/s,
        # against 260-293 for 128-row tiles.
        block_m = self.block_m or 64
        block_n = self.block_n or (64 if head_dim <= 128 else 32)
        num_warps = self.num_warps or (8 if block_m >= 128 else 4)
        return block_m, block_n, num_warps


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a few, for the CPU interpreter, so splits still happen)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, sm_count: int,
                      tuning: DecodeTuning = DecodeTuning()) -> int:
    """Split-KV count for a decode batch, from host ints only (see the module docstring)."""
    programs = num_seqs * num_kv_heads
    target = tuning.target_waves * sm_count
    # H200: B=64 x 8 kv heads (3.9 waves) ran at 4.16 TB/s unsplit against 3.80 with 2 splits.
    if programs == 0 or programs >= tuning.no_split_waves * sm_count:
        return 1
    by_length = max(1, max_seq_len // tuning.min_split_tokens)
    by_occupancy = -(-int(target) // programs)
    return max(1, min(by_occupancy, by_length, tuning.max_splits))
