"""The fused decode + K/V write kernel on CPU (Triton under TRITON_INTERPRET, and the torch path).

Each scenario is the NaN-poisoned pool of `kernel_scenarios` with every sequence's last
token (position seq_len - 1) poisoned too: the kernel must store it from `key`/`value` and
attend to it. It is checked three ways: against the float64 reference (write, then decode),
against the unfused pair `write_kv` + `paged_decode_attention`, and the caches afterwards
must equal the fully written pool bit for bit (nothing but the new slots written).
"""

import pytest
import torch
from kernel_scenarios import Scenario, assert_matches

from pagedkv.errors import KernelInputError
from pagedkv.kernels import DecodeTuning, KVPool, paged_decode_attention, paged_decode_write_attention, write_kv
from pagedkv.kernels.ops import new_token_slots
from pagedkv.kernels.triton_decode_write import DecodeWriteKernel, reference_decode_write_attention

BACKENDS = ["triton", "torch"]
#: dtype, (q heads, kv heads), head_dim, block_size: MHA and GQA (3, 4), fp32 and fp16, small and large pages.
CASES = [
    (torch.float32, (4, 4), 64, 16),
    (torch.float16, (6, 2), 80, 8),
    (torch.float32, (8, 2), 64, 8),
    (torch.float16, (4, 1), 128, 16),
]
CASE_IDS = [f"{str(d)[6:]}-h{h}:{kv}-d{hd}-bs{bs}" for d, (h, kv), hd, bs in CASES]


def _boundary_lens(block_size: int) -> list[int]:
    """The new token first in the pool, last in a block, first in a block, mid-block, and in a later block."""
    return [1, block_size, block_size + 1, block_size + 5, 3 * block_size]


class NewTokenScenario:
    """A `Scenario` whose sequences' last tokens are not yet in the pool: they are this step's new K/V."""

    def __init__(self, seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=0):
        full = Scenario(seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=seed)
        self.full = full  # the pool as it must be after the step
        self.k_cache, self.v_cache = full.k_cache.clone(), full.v_cache.clone()
        self.block_tables, self.seq_lens = full.block_tables, full.seq_lens
        rows, last = [], 0
        for n in seq_lens:
            last += n
            rows.append(last - 1 if n else 0)
        self.key, self.value = full.keys[rows].clone(), full.values[rows].clone()
        for b, n in enumerate(seq_lens):
            if n:
                slot = full.slot(b, n - 1)
                self.k_cache.view(-1, num_kv_heads, head_dim)[slot] = float("nan")
                self.v_cache.view(-1, num_kv_heads, head_dim)[slot] = float("nan")
            else:
                self.key[b] = self.value[b] = float("nan")  # a padding row's K/V must never land anywhere

    def caches(self):
        return self.k_cache, self.v_cache, self.block_tables, self.seq_lens

    def assert_pool_written(self):
        torch.testing.assert_close(self.k_cache, self.full.k_cache, atol=0, rtol=0, equal_nan=True)
        torch.testing.assert_close(self.v_cache, self.full.v_cache, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, num_heads, head_dim, block_size", CASES, ids=CASE_IDS)
def test_fused_matches_reference_and_writes_only_the_new_slots(backend, dtype, num_heads, head_dim, block_size):
    num_q_heads, num_kv_heads = num_heads
    scenario = NewTokenScenario(_boundary_lens(block_size), block_size, num_kv_heads, head_dim, dtype)
    query = scenario.full.query(len(scenario.seq_lens), num_q_heads)
    expected = reference_decode_write_attention(query, scenario.key, scenario.value,
                                                *(t.clone() for t in scenario.caches()[:2]),
                                                scenario.block_tables, scenario.seq_lens, scale=head_dim ** -0.5,
                                                float64=True)
    out = paged_decode_write_attention(query, scenario.key, scenario.value, *scenario.caches(),
                                       scale=head_dim ** -0.5, backend=backend)
    assert out.shape == query.shape and out.dtype == dtype
    assert_matches(out, expected, dtype)
    scenario.assert_pool_written()


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("sliding_window, soft_cap", [(None, None), (5, None), (None, 2.0), (1, None)])
def test_fused_equals_write_kv_then_decode(num_splits, sliding_window, soft_cap):
    """Split in-kernel merges, windows and soft caps: the same numbers as the unfused pair, the same pool."""
    seq_lens = [70, 1, 17, 0, 33]
    fused = NewTokenScenario(seq_lens, 16, 2, 64, torch.float32, seed=3)
    unfused = NewTokenScenario(seq_lens, 16, 2, 64, torch.float32, seed=3)
    query = fused.full.query(len(seq_lens), 6) * 3  # large scores so the soft cap bites
    options = dict(scale=0.125, sliding_window=sliding_window, soft_cap=soft_cap, backend="triton")
    slots = new_token_slots(unfused.block_tables, unfused.seq_lens, 16)
    write_kv(unfused.key, unfused.value, unfused.k_cache, unfused.v_cache, slots, backend="triton")
    expected = paged_decode_attention(query, *unfused.caches(), num_splits=num_splits, **options)
    out = paged_decode_write_attention(query, fused.key, fused.value, *fused.caches(), num_splits=num_splits,
                                       **options)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-6)
    assert torch.equal(out[3], torch.zeros_like(out[3]))  # seq_len 0: zeros, nothing written
    fused.assert_pool_written()
    unfused.assert_pool_written()


def test_new_token_slots_follow_the_block_table():
    scenario = Scenario([1, 8, 9, 0], 8, 1, 64, torch.float32)
    slots = new_token_slots(scenario.block_tables, scenario.seq_lens, 8).tolist()
    assert slots == [scenario.slot(0, 0), scenario.slot(1, 7), scenario.slot(2, 8), -1]


def test_fused_checks_the_new_kv_shape():
    scenario = NewTokenScenario([5, 9], 8, 2, 64, torch.float32)
    query = scenario.full.query(2, 4)
    with pytest.raises(KernelInputError, match="key is"):
        paged_decode_write_attention(query, scenario.key[:1], scenario.value, *scenario.caches(), scale=0.125)
    assert torch.isnan(scenario.k_cache.view(-1, 2, 64)[scenario.full.slot(0, 4)]).all()


# --------------------------------------------------------------------------- the per-step launcher
def _hf_views(batch, heads, head_dim, dtype, generator):
    """Query/key/value as HF hands them over: `[batch, heads, 1, head_dim]` views of one fused projection."""
    q_heads, kv_heads = heads
    fused = torch.randn(batch, 1, (q_heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    q, k, v = fused.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=2)
    return (t.view(batch, 1, -1, head_dim).transpose(1, 2) for t in (q, k, v))


@pytest.mark.parametrize("dtype, heads, min_split_tokens, num_splits", [(torch.float32, (4, 2), 8, 2),
                                                                        (torch.float16, (6, 6), 256, 1)])
def test_step_launcher_over_layers_equals_unfused(dtype, heads, min_split_tokens, num_splits):
    """`DecodeWriteStep` on HF's strided views, layer after layer, equals write_kv + decode per layer."""
    generator = torch.Generator().manual_seed(11)
    num_layers, block_size, head_dim = 2, 8, 64
    seq_lens = [9, 24, 1]
    block_tables = torch.tensor([[3, 7, 0, 0], [1, 2, 5, 0], [4, 0, 0, 0]], dtype=torch.int64)
    pools = [KVPool(num_layers, 8, block_size, heads[1], head_dim, dtype, "cpu") for _ in range(2)]
    for pool in pools:
        pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(5)).to(dtype))
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    kernel = DecodeWriteKernel(pools[0], DecodeTuning(min_split_tokens=min_split_tokens))
    fused = kernel.step(block_tables, lens, max_seq_len=max(seq_lens))
    assert fused.num_splits == num_splits
    for layer in range(num_layers):
        query, key, value = _hf_views(len(seq_lens), heads, head_dim, dtype, generator)
        out = fused(layer, query, key, value, 0.125)  # the step's own output buffer, HF's layout
        assert out.shape == (len(seq_lens), 1, heads[0], head_dim)
        k_cache, v_cache = pools[1].k_caches[layer], pools[1].v_caches[layer]
        write_kv(key.squeeze(2), value.squeeze(2), k_cache, v_cache, new_token_slots(block_tables, lens, block_size),
                 backend="triton")
        expected = paged_decode_attention(query.squeeze(2), k_cache, v_cache, block_tables, lens, scale=0.125,
                                          num_splits=fused.num_splits, backend="triton")
        atol = 2e-6 if dtype == torch.float32 else 1e-3
        torch.testing.assert_close(out.squeeze(1), expected, atol=atol, rtol=atol)
    torch.testing.assert_close(pools[0].kv, pools[1].kv, atol=0, rtol=0)
