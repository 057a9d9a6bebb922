"""What the kernel tests share: a NaN-poisoned pool behind shuffled block tables, and the tolerance check.

Every scenario poisons the whole pool with NaN, then writes only the slots some sequence
owns, through shuffled block tables whose padding entries point at poisoned blocks: a
kernel that reads one slot it should not comes out NaN.
"""

import math

import torch

from pagedkv.bench.kernel_common import shuffled_layout
from pagedkv.kernels import DecodeTuning, reference_write_kv, write_kv

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


def assert_gpu_matches(out, expected, dtype):
    """`assert_matches` with the CUDA tolerances (full-size shapes, bf16)."""
    atol, rtol = GPU_TOLERANCES[dtype]
    assert not out.isnan().any(), "NaN leaked from a poisoned slot"
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)


def interleave(tensor: torch.Tensor, poison, dim: int = 0) -> torch.Tensor:
    """A view of `tensor` with stride 2 along `dim`, over storage whose odd entries hold `poison`."""
    shape = list(tensor.shape)
    shape[dim] *= 2
    wide = torch.full(shape, poison, dtype=tensor.dtype, device=tensor.device)
    view = wide.narrow(dim, 0, shape[dim]).unflatten(dim, (tensor.shape[dim], 2)).select(dim + 1, 0)
    view.copy_(tensor)
    assert view.stride(dim) == 2 * tensor.contiguous().stride(dim)
    return view


def poisoned_views(scenario: Scenario):
    """block_tables[:, ::2] over poisoned block ids, seq_lens[::2] over huge lengths."""
    poison_block = int(scenario.block_tables[0, -1])  # a padding entry: a NaN block no sequence owns
    return (interleave(scenario.block_tables, poison_block, dim=1), interleave(scenario.seq_lens, 10**6))


def strided_out(like: torch.Tensor) -> torch.Tensor:
    """An `out` whose head_dim stride is 2, over NaN storage."""
    return interleave(torch.empty_like(like), float("nan"), dim=2)


# --------------------------------------------------------------------------- on CUDA, at full size
#: (atol, rtol) against the float64 reference on CUDA.
GPU_TOLERANCES = {torch.bfloat16: (1.5e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}
#: Llama-3-8B attention: (q heads, kv heads, head_dim).
LLAMA3 = (32, 8, 128)
LENGTHS = [1, 16, 17, 128, 129, 1000, 4095, 4096]
#: The decode schedules: the default split with a merge launch, and the in-kernel merge.
SCHEDULES = {"split": DecodeTuning(), "in_kernel": DecodeTuning(merge="in_kernel")}
#: Engine models' attention: Qwen3-0.6B, SmolLM2-135M, GPT-2 as (q heads, kv heads, head_dim).
ENGINE_HEADS = [(16, 8, 128), (9, 3, 64), (12, 12, 64)]


class GpuScenario:
    """A NaN-poisoned CUDA pool with sequences behind shuffled block tables (written in one scatter)."""

    def __init__(self, seq_lens, block_size, num_kv_heads, head_dim, dtype, *, extra_blocks=31, seed=0):
        generator = torch.Generator().manual_seed(seed)
        num_blocks, self.block_tables, self.slots = shuffled_layout(seq_lens, block_size, generator, extra_blocks)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size, self.dtype = block_size, dtype
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        self.keys = torch.randn(len(self.slots), num_kv_heads, head_dim, generator=generator).to("cuda", dtype)
        self.values = torch.randn(len(self.slots), num_kv_heads, head_dim, generator=generator).to("cuda", dtype)
        write_kv(self.keys, self.values, self.k_cache, self.v_cache, self.slots)

    def query(self, num_tokens, num_heads, seed=1):
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(num_tokens, num_heads, self.k_cache.shape[-1], generator=generator).to("cuda", self.dtype)

    @property
    def kv(self):
        return self.k_cache, self.v_cache, self.block_tables, self.seq_lens


def mixed_gpu_case(block_size, heads=LLAMA3, dtype=torch.bfloat16, seed=30):
    """Decode rows (q_len 1) of every LENGTHS value, then prefill chunks: whole prompts and chunks on a prefix."""
    seq_lens = LENGTHS + [17, 1000, 4096, 2048, 129]
    q_lens = [1] * len(LENGTHS) + [17, 1, 1000, 512, 128]
    scenario = GpuScenario(seq_lens, block_size, heads[1], heads[2], dtype, seed=seed)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return scenario, cu, max(q_lens), scenario.query(int(cu[-1]), heads[0])
