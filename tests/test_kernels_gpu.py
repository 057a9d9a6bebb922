"""pagedkv.kernels on CUDA at full size: Llama-3-8B attention (32 q heads, 8 kv heads, head_dim 128), bf16.

The same checks as tests/test_kernels.py, test_kernels_unified.py and test_kernel_views.py
(NaN-poisoned pool, shuffled tables, lengths 1 / multiples of the block size / one more,
split-KV, zero-length rows, window, soft cap, chunked prefill, 64-bit offsets, strided
views, bad input), compiled for the GPU, plus the head dims the CPU run skips and CUDA-graph
captures of the decode hot path (every schedule) and of a mixed step (unified kernel).
"""

import math

import pytest
import torch

from pagedkv.errors import KernelInputError
from pagedkv.kernels import (
    DecodeTuning,
    KernelWorkspace,
    UnifiedTuning,
    paged_attention,
    paged_decode_attention,
    paged_prefill_attention,
    reference_decode_attention,
    reference_paged_attention,
    reference_prefill_attention,
    reference_write_kv,
    write_kv,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = [torch.bfloat16, torch.float16]
HEAD_SIZES = [64, 80, 96, 128, 256]
BLOCK_SIZES = [16, 128]
NUM_HEADS = [(32, 8), (32, 32), (28, 4), (14, 2)]  # Llama-3-8B, MHA, GQA 7 (Qwen2-7B), GQA 7 small
LLAMA3 = (32, 8, 128)
#: (atol, rtol) against the float64 reference.
TOLERANCES = {torch.bfloat16: (1.5e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}
LENGTHS = [1, 16, 17, 128, 129, 1000, 4095, 4096]
#: The decode schedules: the default split with a merge launch, and the in-kernel merge.
SCHEDULES = {"split": DecodeTuning(), "in_kernel": DecodeTuning(merge="in_kernel")}
#: Engine models' attention: Qwen3-0.6B, SmolLM2-135M, GPT-2 as (q heads, kv heads, head_dim).
ENGINE_HEADS = [(16, 8, 128), (9, 3, 64), (12, 12, 64)]


class GpuScenario:
    """A NaN-poisoned CUDA pool with sequences behind shuffled block tables (written in one scatter)."""

    def __init__(self, seq_lens, block_size, num_kv_heads, head_dim, dtype, *, extra_blocks=31, seed=0):
        generator = torch.Generator().manual_seed(seed)
        blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + extra_blocks
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size, self.dtype = block_size, dtype
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
        order = torch.randperm(num_blocks, generator=generator)
        owned, unowned = order[: sum(blocks_per_seq)], order[sum(blocks_per_seq):]
        table = unowned[torch.randint(len(unowned), (len(seq_lens), max(blocks_per_seq) + 3), generator=generator)]
        slots, start = [], 0
        for b, (n, num) in enumerate(zip(seq_lens, blocks_per_seq)):
            table[b, :num] = owned[start : start + num]
            start += num
            positions = torch.arange(n)
            slots.append(table[b, positions // block_size] * block_size + positions % block_size)
        self.block_tables = table.to(torch.int32).cuda()
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        self.slots = torch.cat(slots).cuda()
        self.keys = torch.randn(len(self.slots), num_kv_heads, head_dim, generator=generator).to("cuda", dtype)
        self.values = torch.randn(len(self.slots), num_kv_heads, head_dim, generator=generator).to("cuda", dtype)
        write_kv(self.keys, self.values, self.k_cache, self.v_cache, self.slots)

    def query(self, num_tokens, num_heads, seed=1):
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(num_tokens, num_heads, self.k_cache.shape[-1], generator=generator).to("cuda", self.dtype)

    @property
    def kv(self):
        return self.k_cache, self.v_cache, self.block_tables, self.seq_lens


def assert_matches(out, expected, dtype):
    atol, rtol = TOLERANCES[dtype]
    assert not out.isnan().any(), "NaN leaked from a poisoned slot"
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_reference(dtype):
    generator = torch.Generator().manual_seed(2)
    key = torch.randn(333, 8, 128, generator=generator).to("cuda", dtype)
    value = torch.randn(333, 8, 128, generator=generator).to("cuda", dtype)
    slots = torch.randperm(64 * 16, generator=generator)[:333].cuda()
    slots[::7] = -1
    k_cache = torch.full((64, 16, 8, 128), float("nan"), dtype=dtype, device="cuda")
    v_cache = k_cache.clone()
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    reference_write_kv(key, value, k_expected, v_expected, slots)
    write_kv(key, value, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, k_expected, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_expected, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_decode_llama3_matches_reference(block_size, num_splits):
    num_heads, num_kv_heads, head_dim = LLAMA3
    scenario = GpuScenario(LENGTHS, block_size, num_kv_heads, head_dim, torch.bfloat16)
    query = scenario.query(len(LENGTHS), num_heads)
    expected = reference_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5, float64=True)
    out = paged_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5, max_seq_len=max(LENGTHS),
                                 num_splits=num_splits)
    assert_matches(out, expected, torch.bfloat16)


def _check_decode(dtype, head_dim, num_q_heads, num_kv_heads, seed):
    scenario = GpuScenario([1, 16, 17, 700], 16, num_kv_heads, head_dim, dtype, seed=seed)
    query = scenario.query(4, num_q_heads)
    expected = reference_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5, float64=True)
    assert_matches(paged_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_SIZES)
def test_decode_head_dims(dtype, head_dim):
    _check_decode(dtype, head_dim, 32, 8, seed=3)


@pytest.mark.parametrize("num_heads", NUM_HEADS, ids=[f"{h}:{kv}" for h, kv in NUM_HEADS])
def test_decode_gqa_groups(num_heads):
    _check_decode(torch.bfloat16, 128, *num_heads, seed=13)


def test_long_single_sequence_splits():
    num_heads, num_kv_heads, head_dim = LLAMA3
    scenario = GpuScenario([32768], 16, num_kv_heads, head_dim, torch.bfloat16, seed=4)
    query = scenario.query(1, num_heads)
    expected = reference_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5, float64=True)
    auto = paged_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5, max_seq_len=32768)
    whole = paged_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5, num_splits=1)
    assert_matches(auto, expected, torch.bfloat16)
    torch.testing.assert_close(auto.float(), whole.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("num_splits", [1, 5])
def test_zero_length_rows_give_zeros(num_splits):
    scenario = GpuScenario([0, 300, 0, 17], 16, 8, 128, torch.bfloat16, seed=5)
    query = scenario.query(4, 32)
    out = paged_decode_attention(query, *scenario.kv, scale=0.088, num_splits=num_splits)
    assert torch.equal(out[[0, 2]], torch.zeros_like(out[[0, 2]]))
    assert_matches(out, reference_decode_attention(query, *scenario.kv, scale=0.088, float64=True), torch.bfloat16)


@pytest.mark.parametrize("sliding_window, soft_cap", [(256, None), (None, 30.0), (1000, 50.0), (1, None)])
def test_decode_window_and_soft_cap(sliding_window, soft_cap):
    scenario = GpuScenario(LENGTHS, 16, 8, 128, torch.bfloat16, seed=6)
    query = scenario.query(len(LENGTHS), 32) * 4
    options = {"scale": 0.088, "sliding_window": sliding_window, "soft_cap": soft_cap}
    expected = reference_decode_attention(query, *scenario.kv, **options, float64=True)
    assert_matches(paged_decode_attention(query, *scenario.kv, **options), expected, torch.bfloat16)


def _prefill_case(block_size, dtype, head_dim=128, num_heads=(32, 8), seed=7):
    seq_lens = [17, 1000, 4096, 2048, 129]
    q_lens = [17, 1, 4096, 512, 128]  # whole prompt, one token, a long prompt, chunks after a cached prefix
    scenario = GpuScenario(seq_lens, block_size, num_heads[1], head_dim, dtype, seed=seed)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return scenario, cu, max(q_lens), scenario.query(int(cu[-1]), num_heads[0])


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_prefill_llama3_matches_reference(block_size):
    scenario, cu, max_q, query = _prefill_case(block_size, torch.bfloat16)
    expected = reference_prefill_attention(query, *scenario.kv, cu, scale=0.088, float64=True)
    out = paged_prefill_attention(query, *scenario.kv, cu, scale=0.088, max_seqlen_q=max_q)
    assert_matches(out, expected, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_SIZES)
def test_prefill_head_dims(dtype, head_dim):
    seq_lens, q_lens = [300, 77], [300, 40]
    scenario = GpuScenario(seq_lens, 16, 2, head_dim, dtype, seed=8)
    cu = torch.tensor([0, 300, 340], dtype=torch.int32, device="cuda")
    query = scenario.query(340, 14)
    expected = reference_prefill_attention(query, *scenario.kv, cu, scale=head_dim ** -0.5, float64=True)
    out = paged_prefill_attention(query, *scenario.kv, cu, scale=head_dim ** -0.5, max_seqlen_q=max(q_lens))
    assert_matches(out, expected, dtype)


@pytest.mark.parametrize("sliding_window, soft_cap", [(300, None), (None, 30.0), (700, 50.0)])
def test_prefill_window_and_soft_cap(sliding_window, soft_cap):
    scenario, cu, max_q, query = _prefill_case(16, torch.bfloat16, seed=9)
    options = {"scale": 0.088, "sliding_window": sliding_window, "soft_cap": soft_cap}
    expected = reference_prefill_attention(query * 4, *scenario.kv, cu, **options, float64=True)
    assert_matches(paged_prefill_attention(query * 4, *scenario.kv, cu, **options, max_seqlen_q=max_q),
                   expected, torch.bfloat16)


def test_chunked_prefill_equals_one_shot():
    scenario = GpuScenario([4096], 16, 8, 128, torch.bfloat16, seed=10)
    query = scenario.query(4096, 32)
    whole = paged_prefill_attention(query, *scenario.kv, torch.tensor([0, 4096], dtype=torch.int32, device="cuda"),
                                    scale=0.088, max_seqlen_q=4096)
    tail = paged_prefill_attention(query[1500:].contiguous(), *scenario.kv,
                                   torch.tensor([0, 4096 - 1500], dtype=torch.int32, device="cuda"),
                                   scale=0.088, max_seqlen_q=4096 - 1500)
    torch.testing.assert_close(tail.float(), whole[1500:].float(), atol=1e-2, rtol=1e-2)


def test_block_offsets_past_2_to_the_31():
    block_size, num_kv_heads, head_dim = 16, 8, 128
    elements_per_block = block_size * num_kv_heads * head_dim
    num_blocks = 2**31 // elements_per_block + 64  # 4.3 GB per cache in bf16
    k_cache = torch.empty(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.empty_like(k_cache)
    block_table = torch.tensor([[num_blocks - 1, num_blocks - 40, 3, num_blocks // 2 + 1]], dtype=torch.int32,
                               device="cuda")
    seq_len = 60
    positions = torch.arange(seq_len, device="cuda")
    slots = block_table[0, positions // block_size].long() * block_size + positions % block_size
    key = torch.randn(seq_len, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[num_blocks - 1, 3], key[3])
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device="cuda")
    query = torch.randn(seq_len, 32, head_dim, device="cuda", dtype=torch.bfloat16)
    kv = (k_cache, v_cache, block_table, seq_lens)
    expected = reference_decode_attention(query[-1:], *kv, scale=0.088, float64=True)
    assert_matches(paged_decode_attention(query[-1:], *kv, scale=0.088, num_splits=3), expected, torch.bfloat16)
    cu = torch.tensor([0, seq_len], dtype=torch.int32, device="cuda")
    expected = reference_prefill_attention(query, *kv, cu, scale=0.088, float64=True)
    assert_matches(paged_prefill_attention(query, *kv, cu, scale=0.088, max_seqlen_q=seq_len), expected,
                   torch.bfloat16)
    # Round 2: the unified kernel and every decode schedule on the same far blocks.
    assert_matches(paged_attention(query, *kv, cu, scale=0.088, max_seqlen_q=seq_len), expected, torch.bfloat16)
    for tuning in SCHEDULES.values():
        assert_matches(paged_decode_attention(query[-1:], *kv, scale=0.088, num_splits=3, tuning=tuning),
                       expected[-1:], torch.bfloat16)
    del k_cache, v_cache
    torch.cuda.empty_cache()


def test_bad_input_raises_before_launch():
    scenario = GpuScenario([10, 40], 16, 8, 128, torch.bfloat16, seed=11)
    query = scenario.query(2, 32)
    before = scenario.k_cache.clone()
    table = scenario.block_tables.clone()
    table[1, 1] = scenario.k_cache.shape[0] + 5
    calls = [
        lambda: paged_decode_attention(query.cpu(), *scenario.kv, scale=0.1),  # device
        lambda: paged_decode_attention(query.float(), *scenario.kv, scale=0.1),  # dtype
        lambda: paged_decode_attention(query[:, :30], *scenario.kv, scale=0.1),  # heads not a multiple
        lambda: paged_decode_attention(query, scenario.k_cache, scenario.v_cache, table, scenario.seq_lens,
                                       scale=0.1),  # block id outside the pool
        lambda: paged_decode_attention(query, scenario.k_cache, scenario.v_cache, scenario.block_tables,
                                       scenario.seq_lens * 100, scale=0.1),  # over capacity
        lambda: write_kv(query[:, :8], query[:, :8], scenario.k_cache, scenario.v_cache,
                         torch.tensor([0, 10**9], device="cuda")),  # slot outside the pool
    ]
    for call in calls:
        with pytest.raises(KernelInputError):
            call()
    torch.testing.assert_close(scenario.k_cache, before, equal_nan=True, atol=0, rtol=0)


def test_decode_is_cuda_graph_capturable():
    """With validate=False and a host max_seq_len, a decode step has no host sync and can be captured."""
    scenario = GpuScenario([100, 3000, 17, 4096], 16, 8, 128, torch.bfloat16, seed=12)
    query = scenario.query(4, 32)
    out = torch.empty_like(query)
    options = {"scale": 0.088, "max_seq_len": 4096, "validate": False, "out": out}
    paged_decode_attention(query, *scenario.kv, **options)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(query, *scenario.kv, **options)
    query.copy_(scenario.query(4, 32, seed=99))
    graph.replay()
    torch.cuda.synchronize()
    expected = reference_decode_attention(query, *scenario.kv, scale=0.088, float64=True)
    assert_matches(out, expected, torch.bfloat16)


# --------------------------------------------------------------------------- decode schedules
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("schedule", ["in_kernel"])
def test_new_decode_schedules_llama3(schedule, block_size):
    num_heads, num_kv_heads, head_dim = LLAMA3
    scenario = GpuScenario(LENGTHS + [0], block_size, num_kv_heads, head_dim, torch.bfloat16, seed=20)
    query = scenario.query(len(LENGTHS) + 1, num_heads)
    workspace = KernelWorkspace((len(LENGTHS) + 1) * num_kv_heads, "cuda")
    expected = reference_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5, float64=True)
    for _ in range(2):  # the second call starts from the counters the first left behind
        out = paged_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5, max_seq_len=max(LENGTHS),
                                     tuning=SCHEDULES[schedule], workspace=workspace)
        assert_matches(out, expected, torch.bfloat16)
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))
        workspace.check_integrity()


@pytest.mark.parametrize("schedule", ["in_kernel"])
@pytest.mark.parametrize("heads", ENGINE_HEADS + [(28, 4, 128)], ids=["qwen3", "smollm2", "gpt2", "gqa7"])
def test_new_decode_schedules_engine_heads(schedule, heads):
    num_heads, num_kv_heads, head_dim = heads
    scenario = GpuScenario([1, 16, 17, 700, 2049], 16, num_kv_heads, head_dim, torch.bfloat16, seed=21)
    query = scenario.query(5, num_heads)
    expected = reference_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5, float64=True)
    assert_matches(paged_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5, max_seq_len=2049,
                                          tuning=SCHEDULES[schedule]), expected, torch.bfloat16)


@pytest.mark.parametrize("schedule", ["in_kernel"])
def test_new_decode_schedules_long_single_sequence(schedule):
    num_heads, num_kv_heads, head_dim = LLAMA3
    scenario = GpuScenario([32768], 16, num_kv_heads, head_dim, torch.bfloat16, seed=22)
    query = scenario.query(1, num_heads)
    expected = reference_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5, float64=True)
    out = paged_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5, max_seq_len=32768,
                                 tuning=SCHEDULES[schedule])
    assert_matches(out, expected, torch.bfloat16)


@pytest.mark.parametrize("schedule", ["in_kernel"])
@pytest.mark.parametrize("sliding_window, soft_cap", [(256, None), (None, 30.0), (1000, 50.0), (1, None)])
def test_new_decode_schedules_window_and_soft_cap(schedule, sliding_window, soft_cap):
    scenario = GpuScenario(LENGTHS, 16, 8, 128, torch.bfloat16, seed=23)
    query = scenario.query(len(LENGTHS), 32) * 4
    options = {"scale": 0.088, "sliding_window": sliding_window, "soft_cap": soft_cap}
    expected = reference_decode_attention(query, *scenario.kv, **options, float64=True)
    assert_matches(paged_decode_attention(query, *scenario.kv, **options, tuning=SCHEDULES[schedule]), expected,
                   torch.bfloat16)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_decode_schedules_are_cuda_graph_capturable(schedule):
    """Captured once; replayed with new queries and new (shorter) lengths: the split follows the device data."""
    scenario = GpuScenario([100, 3000, 17, 4096, 0, 1], 16, 8, 128, torch.bfloat16, seed=24)
    query = scenario.query(6, 32)
    out = torch.empty_like(query)
    workspace = KernelWorkspace(6 * 8, "cuda")
    options = {"scale": 0.088, "max_seq_len": 4096, "validate": False, "out": out, "tuning": SCHEDULES[schedule],
               "workspace": workspace}
    paged_decode_attention(query, *scenario.kv, **options)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(query, *scenario.kv, **options)
    for seed, new_lens in ((99, None), (98, [50, 2999, 16, 1, 0, 1])):
        query.copy_(scenario.query(6, 32, seed=seed))
        if new_lens is not None:
            scenario.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, reference_decode_attention(query, *scenario.kv, scale=0.088, float64=True),
                       torch.bfloat16)
        workspace.check_integrity()


# --------------------------------------------------------------------------- round 2: unified kernel
def _mixed_case(block_size, heads=LLAMA3, dtype=torch.bfloat16, seed=30):
    """Decode rows (q_len 1) of every LENGTHS value, then prefill chunks: whole prompts and chunks on a prefix."""
    seq_lens = LENGTHS + [17, 1000, 4096, 2048, 129]
    q_lens = [1] * len(LENGTHS) + [17, 1, 1000, 512, 128]
    scenario = GpuScenario(seq_lens, block_size, heads[1], heads[2], dtype, seed=seed)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return scenario, cu, max(q_lens), scenario.query(int(cu[-1]), heads[0])


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("block_m", [None, 16, 128])
def test_unified_llama3_mixed_step(block_size, block_m):
    scenario, cu, max_q, query = _mixed_case(block_size)
    expected = reference_paged_attention(query, *scenario.kv, cu, scale=0.088, float64=True)
    out = paged_attention(query, *scenario.kv, cu, scale=0.088, max_seqlen_q=max_q,
                          tuning=UnifiedTuning(block_m=block_m))
    assert_matches(out, expected, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_SIZES)
def test_unified_head_dims(dtype, head_dim):
    seq_lens, q_lens = [300, 77, 40, 1], [300, 40, 1, 1]
    scenario = GpuScenario(seq_lens, 16, 2, head_dim, dtype, seed=31)
    cu = torch.tensor([0, 300, 340, 341, 342], dtype=torch.int32, device="cuda")
    query = scenario.query(342, 14)
    expected = reference_paged_attention(query, *scenario.kv, cu, scale=head_dim ** -0.5, float64=True)
    assert_matches(paged_attention(query, *scenario.kv, cu, scale=head_dim ** -0.5, max_seqlen_q=300), expected,
                   dtype)


@pytest.mark.parametrize("heads", ENGINE_HEADS + [(32, 32, 128), (28, 4, 128)],
                         ids=["qwen3", "smollm2", "gpt2", "mha", "gqa7"])
def test_unified_gqa_groups(heads):
    scenario, cu, max_q, query = _mixed_case(16, heads=heads, seed=32)
    scale = heads[2] ** -0.5
    expected = reference_paged_attention(query, *scenario.kv, cu, scale=scale, float64=True)
    assert_matches(paged_attention(query, *scenario.kv, cu, scale=scale, max_seqlen_q=max_q), expected,
                   torch.bfloat16)


@pytest.mark.parametrize("sliding_window, soft_cap", [(300, None), (None, 30.0), (700, 50.0)])
def test_unified_window_and_soft_cap(sliding_window, soft_cap):
    scenario, cu, max_q, query = _mixed_case(16, seed=33)
    options = {"scale": 0.088, "sliding_window": sliding_window, "soft_cap": soft_cap}
    expected = reference_paged_attention(query * 4, *scenario.kv, cu, **options, float64=True)
    assert_matches(paged_attention(query * 4, *scenario.kv, cu, **options, max_seqlen_q=max_q), expected,
                   torch.bfloat16)


def test_unified_mixed_step_is_cuda_graph_capturable():
    """Captured once; replayed after the step's contents change (other chunk split, other lengths, same shape)."""
    scenario, cu, max_q, query = _mixed_case(16, seed=34)
    out = torch.empty_like(query)
    options = {"scale": 0.088, "max_seqlen_q": max_q, "max_seq_len": 4096, "validate": False, "out": out}
    paged_attention(query, *scenario.kv, cu, **options)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(query, *scenario.kv, cu, **options)
    num_decode = len(LENGTHS)
    # Same token count: 100 of the 1000-token chunk's tokens move to the one-token chunk before it.
    q_lens = [1] * num_decode + [17, 101, 900, 512, 128]
    seq_lens = LENGTHS + [17, 1000, 4000, 2048, 129]
    for new_q_lens, new_seq_lens in ((None, None), (q_lens, seq_lens)):
        if new_q_lens is not None:
            cu.copy_(torch.tensor([0, *torch.tensor(new_q_lens).cumsum(0).tolist()], dtype=torch.int32))
            scenario.seq_lens.copy_(torch.tensor(new_seq_lens, dtype=torch.int32))
        query.copy_(torch.randn_like(query))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, reference_paged_attention(query, *scenario.kv, cu, scale=0.088, float64=True),
                       torch.bfloat16)


# --------------------------------------------------------------------------- round 2: strided views
def _interleave(tensor, poison, dim=0):
    """A stride-2 view of `tensor` along `dim` whose gaps hold `poison` (as in test_kernel_views.py)."""
    shape = list(tensor.shape)
    shape[dim] *= 2
    wide = torch.full(shape, poison, dtype=tensor.dtype, device=tensor.device)
    view = wide.unflatten(dim, (tensor.shape[dim], 2)).select(dim + 1, 0)
    view.copy_(tensor)
    return view


def test_strided_views_on_gpu():
    scenario, cu, max_q, query = _mixed_case(16, seed=35)
    poison_block = int(scenario.block_tables[0, -1])
    tables = _interleave(scenario.block_tables, poison_block, dim=1)
    lens = _interleave(scenario.seq_lens, 10**6)
    cu_view = _interleave(cu, 10**7)
    strided_query = _interleave(query, float("nan"), dim=2)
    kv = (scenario.k_cache, scenario.v_cache, tables, lens)
    expected = reference_paged_attention(query, *scenario.kv, cu, scale=0.088, float64=True)
    out = _interleave(torch.empty_like(query), float("nan"), dim=2)
    paged_attention(strided_query, *kv, cu_view, scale=0.088, max_seqlen_q=max_q, out=out)
    assert_matches(out, expected, torch.bfloat16)
    paged_prefill_attention(strided_query, *kv, cu_view, scale=0.088, max_seqlen_q=max_q, out=out)
    assert_matches(out, expected, torch.bfloat16)
    rows = torch.arange(len(LENGTHS), device="cuda")  # the decode rows: token i is sequence i's only query
    decode_kv = (scenario.k_cache, scenario.v_cache, tables[: len(LENGTHS)], lens[: len(LENGTHS)])
    for tuning in SCHEDULES.values():
        decode_out = _interleave(torch.empty_like(query[rows]), float("nan"), dim=2)
        paged_decode_attention(strided_query[: len(LENGTHS)], *decode_kv, scale=0.088, max_seq_len=4096,
                               out=decode_out, tuning=tuning)
        assert_matches(decode_out, expected[rows], torch.bfloat16)

