"""What the CPU kernel tests share: a NaN-poisoned pool behind shuffled block tables, and the tolerance check.

Every scenario poisons the whole pool with NaN, then writes only the slots some sequence
owns, through shuffled block tables whose padding entries point at poisoned blocks: a
kernel that reads one slot it should not comes out NaN.
"""

import math

import torch

from pagedkv.kernels import reference_write_kv

#: (atol, rtol) against the float64 reference. fp16: the output and the P @ V operand are rounded to fp16.
TOLERANCES = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3)}


def seq_lens_for(block_size: int) -> list[int]:
    """1, an exact multiple of the block size, one more than a multiple, and a longer one."""
    return [1, block_size, block_size + 1, 2 * block_size + 5, 3 * block_size]


class Scenario:
    """A NaN-poisoned pool holding a few sequences' K/V behind shuffled block tables."""

    def __init__(self, seq_lens, block_size, num_kv_heads, head_dim, dtype, *, extra_blocks=7, seed=0,
                 table_blocks=None):
        generator = torch.Generator().manual_seed(seed)
        self.block_size, self.dtype = block_size, dtype
        blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + extra_blocks
        table_blocks = table_blocks or max(blocks_per_seq + [1]) + 2
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
        order = torch.randperm(num_blocks, generator=generator)
        owned, unowned = order[: sum(blocks_per_seq)], order[sum(blocks_per_seq):]
        # Padding entries point at poisoned blocks no sequence owns.
        self.block_tables = unowned[torch.randint(len(unowned), (len(seq_lens), table_blocks),
                                                  generator=generator)].to(torch.int32)
        start = 0
        for b, n in enumerate(blocks_per_seq):
            self.block_tables[b, :n] = owned[start : start + n].to(torch.int32)
            start += n
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        slots = [self.slot(b, p) for b, n in enumerate(seq_lens) for p in range(n)]
        self.keys = torch.randn(len(slots), num_kv_heads, head_dim, generator=generator).to(dtype)
        self.values = torch.randn(len(slots), num_kv_heads, head_dim, generator=generator).to(dtype)
        reference_write_kv(self.keys, self.values, self.k_cache, self.v_cache, torch.tensor(slots))

    def slot(self, seq: int, position: int) -> int:
        return int(self.block_tables[seq, position // self.block_size]) * self.block_size + position % self.block_size

    def query(self, num_tokens, num_heads, seed=1):
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(num_tokens, num_heads, self.k_cache.shape[-1], generator=generator).to(self.dtype)


def assert_matches(out, expected, dtype):
    atol, rtol = TOLERANCES[dtype]
    assert not out.isnan().any(), "NaN leaked from a poisoned slot"
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)


def cu_seqlens(q_lens) -> torch.Tensor:
    """cu_seqlens_q (int32) for chunks of `q_lens` tokens."""
    return torch.tensor([0, *torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


class Fp8Pool:
    """A scenario's K/V stored again in an FP8 pool (NaN bytes where no sequence wrote), with per-head scales.

    The scales come from each head's absolute maximum (as calibration makes them), times a per-head
    factor in [1, 4) so that no two heads share a scale and a kernel that reads the wrong head's
    scale is caught.
    """

    def __init__(self, scenario: Scenario, cache_dtype: torch.dtype, seed: int = 0):
        from pagedkv.kernels.fp8 import fp8_max

        generator = torch.Generator().manual_seed(seed)
        num_kv_heads = scenario.k_cache.shape[2]
        self.cache_dtype = cache_dtype
        spread = 1 + 3 * torch.rand(2, num_kv_heads, generator=generator)
        k_amax = scenario.keys.float().abs().amax(dim=(0, 2))
        v_amax = scenario.values.float().abs().amax(dim=(0, 2))
        self.k_scale = (k_amax * spread[0] / fp8_max(cache_dtype)).float()
        self.v_scale = (v_amax * spread[1] / fp8_max(cache_dtype)).float()
        nan = torch.full(scenario.k_cache.shape, float("nan"))
        self.k_cache, self.v_cache = nan.to(cache_dtype), nan.to(cache_dtype)
        slots = torch.tensor([scenario.slot(b, p) for b, n in enumerate(scenario.seq_lens.tolist())
                              for p in range(n)], dtype=torch.int64)
        reference_write_kv(scenario.keys, scenario.values, self.k_cache, self.v_cache, slots, self.k_scale,
                           self.v_scale)

    @property
    def scales(self) -> dict:
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}
