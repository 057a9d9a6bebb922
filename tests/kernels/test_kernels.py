"""pagedkv.kernels on CPU: Triton kernels (under TRITON_INTERPRET) and the torch path vs the float64 reference.

Every scenario poisons the whole pool with NaN, then writes only the slots some sequence
owns, through shuffled block tables whose padding entries point at poisoned blocks: a
kernel that reads one slot it should not comes out NaN. Shapes are small because the
interpreter runs every program in Python; each parameter value is covered, not their product.
"""

import pytest
import torch
from kernel_scenarios import (
    ENGINE_HEADS,
    LENGTHS,
    LLAMA3,
    SCHEDULES,
    GpuScenario,
    Scenario,
    assert_gpu_matches,
    assert_matches,
    seq_lens_for,
)

from pagedkv.core import ModelSpec
from pagedkv.errors import KernelInputError, PagedKVError
from pagedkv.kernels import (
    DecodeTuning,
    KernelWorkspace,
    KVPool,
    choose_num_splits,
    paged_attention,
    paged_decode_attention,
    paged_prefill_attention,
    reference_decode_attention,
    reference_prefill_attention,
    reference_write_kv,
    resolve_backend,
    write_kv,
)

DTYPES = [torch.float32, torch.float16]
HEAD_SIZES = [64, 80, 128]
BLOCK_SIZES = [8, 16, 128]
NUM_HEADS = [(4, 4), (6, 2), (8, 2), (7, 1), (16, 2)]  # (q heads, kv heads): GQA ratios 1, 3, 4, 7, 8
BACKENDS = ["triton", "torch"]

#: One case per line; together they cover every DTYPES / HEAD_SIZES / BLOCK_SIZES / NUM_HEADS value.
CASES = [
    # dtype, (q heads, kv heads), head_dim, block_size
    (torch.float32, (4, 4), 64, 16),
    (torch.float32, (6, 2), 80, 8),
    (torch.float16, (8, 2), 128, 16),
    (torch.float32, (7, 1), 64, 128),
    (torch.float16, (16, 2), 64, 8),
]
CASE_IDS = [f"{str(d)[6:]}-h{h}:{kv}-d{hd}-bs{bs}" for d, (h, kv), hd, bs in CASES]


# --------------------------------------------------------------------------- write_kv
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads, head_dim", [(2, 64), (1, 80), (3, 128)])
def test_write_kv_matches_reference(backend, dtype, num_kv_heads, head_dim):
    block_size, num_blocks, num_tokens = 16, 12, 23
    generator = torch.Generator().manual_seed(3)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[[2, 9, 17]] = -1  # padding tokens
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    reference_write_kv(key, value, k_expected, v_expected, slots)
    write_kv(key, value, k_cache, v_cache, slots, backend=backend)
    torch.testing.assert_close(k_cache, k_expected, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_expected, atol=0, rtol=0, equal_nan=True)


# --------------------------------------------------------------------------- decode
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, num_heads, head_dim, block_size", CASES, ids=CASE_IDS)
def test_decode_matches_reference(backend, dtype, num_heads, head_dim, block_size):
    num_q_heads, num_kv_heads = num_heads
    scenario = Scenario(seq_lens_for(block_size), block_size, num_kv_heads, head_dim, dtype)
    query = scenario.query(len(scenario.seq_lens), num_q_heads)
    scale = head_dim ** -0.5
    args = (query, scenario.k_cache, scenario.v_cache, scenario.block_tables, scenario.seq_lens)
    expected = reference_decode_attention(*args, scale=scale, float64=True)
    out = paged_decode_attention(*args, scale=scale, max_seq_len=int(scenario.seq_lens.max()), backend=backend)
    assert out.shape == query.shape and out.dtype == dtype
    assert_matches(out, expected, dtype)


@pytest.mark.parametrize("num_splits", [2, 3, 8, 20])
def test_split_kv_equals_no_split(num_splits):
    scenario = Scenario([300, 17, 64, 1], 16, 2, 64, torch.float32, seed=4)
    query = scenario.query(4, 8)
    args = (query, scenario.k_cache, scenario.v_cache, scenario.block_tables, scenario.seq_lens)
    whole = paged_decode_attention(*args, scale=0.125, num_splits=1, backend="triton")
    split = paged_decode_attention(*args, scale=0.125, num_splits=num_splits, backend="triton")
    torch.testing.assert_close(split, whole, atol=2e-6, rtol=2e-6)
    assert_matches(split, reference_decode_attention(*args, scale=0.125, float64=True), torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_zero_length_rows_give_zeros(backend, num_splits):
    scenario = Scenario([0, 40, 0, 9], 8, 2, 64, torch.float32, seed=5)
    query = scenario.query(4, 4)
    args = (query, scenario.k_cache, scenario.v_cache, scenario.block_tables, scenario.seq_lens)
    out = paged_decode_attention(*args, scale=0.125, num_splits=num_splits, backend=backend)
    assert torch.equal(out[[0, 2]], torch.zeros_like(out[[0, 2]]))
    assert_matches(out, reference_decode_attention(*args, scale=0.125, float64=True), torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sliding_window, soft_cap", [(5, None), (None, 2.0), (16, 5.0), (1, None)])
def test_decode_window_and_soft_cap(backend, sliding_window, soft_cap):
    scenario = Scenario([1, 8, 9, 50], 8, 2, 80, torch.float32, seed=6)
    query = scenario.query(4, 6) * 3  # large scores so the soft cap bites
    args = (query, scenario.k_cache, scenario.v_cache, scenario.block_tables, scenario.seq_lens)
    options = {"scale": 0.125, "sliding_window": sliding_window, "soft_cap": soft_cap}
    expected = reference_decode_attention(*args, **options, float64=True)
    out = paged_decode_attention(*args, **options, num_splits=3, backend=backend)
    assert_matches(out, expected, torch.float32)


def test_decode_writes_into_out():
    scenario = Scenario([20, 3], 8, 1, 64, torch.float32, seed=7)
    query = scenario.query(2, 4)
    args = (query, scenario.k_cache, scenario.v_cache, scenario.block_tables, scenario.seq_lens)
    out = torch.full_like(query, float("nan"))
    result = paged_decode_attention(*args, scale=0.125, out=out, backend="triton")
    assert result.data_ptr() == out.data_ptr()
    assert_matches(out, reference_decode_attention(*args, scale=0.125, float64=True), torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("soft_cap", [None, 4.0])
def test_strided_query(backend, soft_cap):
    """A query sliced out of a fused QKV projection (row stride > num_heads * head_dim) is read in place."""
    scenario = Scenario([33, 8], 8, 2, 64, torch.float32, seed=13)
    fused = scenario.query(2, 12)  # [num_seqs, q + k + v heads, D]
    query = fused[:, :8]
    assert not query.is_contiguous()
    args = (query, scenario.k_cache, scenario.v_cache, scenario.block_tables, scenario.seq_lens)
    expected = reference_decode_attention(*args, scale=0.125, soft_cap=soft_cap, float64=True)
    assert_matches(paged_decode_attention(*args, scale=0.125, soft_cap=soft_cap, backend=backend), expected,
                   torch.float32)


# --------------------------------------------------------------------------- prefill
def prefill_batch(scenario, q_lens):
    """cu_seqlens_q and a query for chunks of `q_lens` new tokens at the end of each sequence."""
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return cu, max(q_lens)


PREFILL_CASES = [CASES[0], CASES[1], CASES[2], CASES[4]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, num_heads, head_dim, block_size", PREFILL_CASES, ids=CASE_IDS[:3] + CASE_IDS[4:])
def test_prefill_matches_reference(backend, dtype, num_heads, head_dim, block_size):
    num_q_heads, num_kv_heads = num_heads
    seq_lens = seq_lens_for(block_size)
    # A whole prompt, a one-token chunk, a chunk after a cached prefix, a chunk of the block tail, ...
    q_lens = [1, block_size, 3, block_size + 1, 2 * block_size - 1][: len(seq_lens)]
    scenario = Scenario(seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=8)
    cu, max_q = prefill_batch(scenario, q_lens)
    query = scenario.query(int(cu[-1]), num_q_heads)
    args = (query, scenario.k_cache, scenario.v_cache, scenario.block_tables, scenario.seq_lens, cu)
    expected = reference_prefill_attention(*args, scale=head_dim ** -0.5, float64=True)
    out = paged_prefill_attention(*args, scale=head_dim ** -0.5, max_seqlen_q=max_q, backend=backend)
    assert_matches(out, expected, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_equals_one_shot(backend):
    """Prefill over a cached prefix gives what one causal pass over the whole sequence gives."""
    seq_lens = [45, 70]  # cached prefixes of 16 and 33 tokens below
    scenario = Scenario(seq_lens, 16, 2, 64, torch.float32, seed=9)
    query = scenario.query(sum(seq_lens), 8)
    kv = (scenario.k_cache, scenario.v_cache, scenario.block_tables, scenario.seq_lens)
    one_shot = paged_prefill_attention(query, *kv, torch.tensor([0, 45, 115], dtype=torch.int32), scale=0.125,
                                       max_seqlen_q=70, backend=backend)
    # The prefix's K/V are already in the cache: only each sequence's tail is computed now.
    tail_rows = torch.cat([torch.arange(16, 45), torch.arange(45 + 33, 115)])
    cu_tail = torch.tensor([0, 29, 29 + 37], dtype=torch.int32)
    tails = paged_prefill_attention(query[tail_rows].contiguous(), *kv, cu_tail, scale=0.125, max_seqlen_q=37,
                                    backend=backend)
    torch.testing.assert_close(tails, one_shot[tail_rows], atol=2e-6, rtol=2e-6)
    # The last token of each sequence is also what decode computes.
    last = paged_decode_attention(query[[44, 114]].contiguous(), *kv, scale=0.125, backend=backend)
    torch.testing.assert_close(last, one_shot[[44, 114]], atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sliding_window, soft_cap", [(6, None), (None, 3.0), (20, 2.0)])
def test_prefill_window_and_soft_cap(backend, sliding_window, soft_cap):
    scenario = Scenario([40, 9], 8, 1, 64, torch.float32, seed=10)
    cu, max_q = prefill_batch(scenario, [33, 9])
    query = scenario.query(int(cu[-1]), 3) * 3
    args = (query, scenario.k_cache, scenario.v_cache, scenario.block_tables, scenario.seq_lens, cu)
    options = {"scale": 0.125, "sliding_window": sliding_window, "soft_cap": soft_cap}
    expected = reference_prefill_attention(*args, **options, float64=True)
    out = paged_prefill_attention(*args, **options, max_seqlen_q=max_q, backend=backend)
    assert_matches(out, expected, torch.float32)


# --------------------------------------------------------------------------- 64-bit addressing
def test_block_offsets_past_2_to_the_31():
    """Block ids whose element offset passes 2**31 (a 4.3 GB fp16 pool) read and write the right slots.

    `torch.empty` maps the pool without touching it, and the interpreter hands CPU tensors
    to the kernel by pointer (no copy), so only the few written pages become resident.
    With 32-bit offsets the kernel would read or write ~4 GB away from the slot and crash
    or return garbage.
    """
    block_size, num_kv_heads, head_dim = 8, 1, 64
    elements_per_block = block_size * num_kv_heads * head_dim
    num_blocks = 2**31 // elements_per_block + 64
    k_cache = torch.empty(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float16)
    v_cache = torch.empty_like(k_cache)
    block_table = torch.tensor([[num_blocks - 1, num_blocks - 40, 3]], dtype=torch.int32)
    assert int(block_table.max()) * elements_per_block >= 2**31
    seq_len = 20
    positions = torch.arange(seq_len)
    slots = block_table[0, positions // block_size].long() * block_size + positions % block_size
    generator = torch.Generator().manual_seed(11)
    key = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).half()
    value = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).half()
    write_kv(key, value, k_cache, v_cache, slots, backend="triton")
    assert torch.equal(k_cache[num_blocks - 1, 3, 0], key[3, 0])
    assert torch.equal(v_cache[num_blocks - 40, 1, 0], value[9, 0])

    seq_lens = torch.tensor([seq_len], dtype=torch.int32)
    query = torch.randn(seq_len, 4, head_dim, generator=generator).half()
    kv = (k_cache, v_cache, block_table, seq_lens)
    expected = reference_decode_attention(query[-1:], *kv, scale=0.125, float64=True)
    assert_matches(paged_decode_attention(query[-1:], *kv, scale=0.125, num_splits=2, backend="triton"),
                   expected, torch.float16)
    cu = torch.tensor([0, seq_len], dtype=torch.int32)
    expected = reference_prefill_attention(query, *kv, cu, scale=0.125, float64=True)
    assert_matches(paged_prefill_attention(query, *kv, cu, scale=0.125, max_seqlen_q=seq_len, backend="triton"),
                   expected, torch.float16)


# --------------------------------------------------------------------------- bad input
def _bad_inputs():
    """(name, call) pairs; each call must raise KernelInputError before touching the caches."""
    scenario = Scenario([10, 17], 8, 2, 64, torch.float32, seed=12)
    k, v, table, lens = scenario.k_cache, scenario.v_cache, scenario.block_tables, scenario.seq_lens
    query = scenario.query(2, 4)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    prefill_query = scenario.query(5, 4)
    key = torch.randn(3, 2, 64)
    slots = torch.tensor([0, 1, 2])

    def decode(**overrides):
        args = {"query": query, "k_cache": k, "v_cache": v, "block_tables": table, "seq_lens": lens}
        args.update(overrides)
        return lambda backend: paged_decode_attention(**args, scale=0.125, backend=backend)

    def prefill(**overrides):
        args = {"query": prefill_query, "k_cache": k, "v_cache": v, "block_tables": table, "seq_lens": lens,
                "cu_seqlens_q": cu}
        max_q = overrides.pop("max_seqlen_q", 3)
        args.update(overrides)
        return lambda backend: paged_prefill_attention(**args, scale=0.125, max_seqlen_q=max_q, backend=backend)

    def write(**overrides):
        args = {"key": key, "value": key, "k_cache": k, "v_cache": v, "slot_mapping": slots}
        args.update(overrides)
        return lambda backend: write_kv(**args, backend=backend)

    out_of_pool = table.clone()
    out_of_pool[1, 2] = k.shape[0]
    negative_block = table.clone()
    negative_block[0, 0] = -3
    return scenario, {
        "query head_dim": decode(query=torch.randn(2, 4, 80)),
        "query dtype": decode(query=query.half()),
        "query device": decode(query=query.to("meta")),
        "query rank": decode(query=query[0]),
        "heads not a multiple": decode(query=torch.randn(2, 5, 64)),
        "v_cache shape": decode(v_cache=v[:, :4]),
        "non-contiguous cache": decode(k_cache=k.transpose(1, 2).contiguous().transpose(1, 2)),
        "block_tables rows": decode(block_tables=table[:1]),
        "block_tables dtype": decode(block_tables=table.float()),
        "seq_lens count": decode(seq_lens=lens[:1]),
        "block id outside pool": decode(block_tables=out_of_pool),
        "negative block id": decode(block_tables=negative_block),
        "seq_len over capacity": decode(seq_lens=torch.tensor([10, table.shape[1] * 8 + 1], dtype=torch.int32)),
        "negative seq_len": decode(seq_lens=torch.tensor([-1, 17], dtype=torch.int32)),
        "out shape": lambda backend: paged_decode_attention(query, k, v, table, lens, scale=0.125,
                                                            out=torch.empty(2, 4, 32), backend=backend),
        "bad scale": lambda backend: paged_decode_attention(query, k, v, table, lens, scale=-1.0, backend=backend),
        "max_seq_len too small": lambda backend: paged_decode_attention(query, k, v, table, lens, scale=0.125,
                                                                        max_seq_len=12, backend=backend),
        "prefill cu_seqlens length": prefill(cu_seqlens_q=cu[:2]),
        "prefill cu_seqlens total": prefill(cu_seqlens_q=torch.tensor([0, 3, 4], dtype=torch.int32)),
        "prefill max_seqlen_q": prefill(max_seqlen_q=2),
        "prefill chunk longer than seq": prefill(seq_lens=torch.tensor([10, 1], dtype=torch.int32)),
        "prefill block id outside pool": prefill(block_tables=out_of_pool),
        "write key shape": write(key=torch.randn(3, 2, 32), value=torch.randn(3, 2, 32)),
        "write token counts": write(slot_mapping=slots[:2]),
        "write slot outside pool": write(slot_mapping=torch.tensor([0, 1, k.shape[0] * 8])),
        "write dtype": write(key=key.half(), value=key.half()),
    }


BAD_INPUT_NAMES = list(_bad_inputs()[1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", BAD_INPUT_NAMES)
def test_bad_input_raises_kernel_input_error(name, backend):
    scenario, calls = _bad_inputs()
    before = scenario.k_cache.clone(), scenario.v_cache.clone()
    with pytest.raises(KernelInputError) as info:
        calls[name](backend)
    assert isinstance(info.value, PagedKVError) and str(info.value)
    torch.testing.assert_close(scenario.k_cache, before[0], equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(scenario.v_cache, before[1], equal_nan=True, atol=0, rtol=0)


def test_error_messages_name_value_and_limit():
    scenario = Scenario([10], 8, 2, 64, torch.float32)
    table = scenario.block_tables.clone()
    table[0, 1] = 999
    with pytest.raises(KernelInputError, match=r"block_tables\[0, 1\] = 999 .*pool of \d+ blocks"):
        paged_decode_attention(scenario.query(1, 4), scenario.k_cache, scenario.v_cache, table, scenario.seq_lens,
                               scale=0.1)
    with pytest.raises(KernelInputError, match=r"num_heads 6 .* num_kv_heads 4"):
        paged_decode_attention(torch.randn(1, 6, 64), torch.zeros(2, 8, 4, 64), torch.zeros(2, 8, 4, 64),
                               table, scenario.seq_lens, scale=0.1)
    with pytest.raises(KernelInputError, match="backend"):
        resolve_backend("cuda", torch.device("cpu"))


# --------------------------------------------------------------------------- the pool and the heuristic
def test_pool_layout_sizes_and_block_ops():
    spec = ModelSpec(num_layers=3, num_kv_heads=2, head_dim=16, dtype_bytes=2)
    pool = KVPool.from_spec(spec, num_blocks=10, block_size=8, dtype=torch.float16, device="cpu")
    assert len(pool.k_caches) == len(pool.v_caches) == 3
    assert pool.k_caches[1].shape == (10, 8, 2, 16) and pool.k_caches[1].is_contiguous()
    assert pool.bytes_per_block == spec.page_size_bytes(8) == 2 * 3 * 8 * 2 * 16 * 2
    assert pool.nbytes == 10 * pool.bytes_per_block
    assert KVPool.num_blocks_for_budget(spec, 5 * pool.bytes_per_block + 1, 8, torch.float16) == 5
    for layer in range(3):
        pool.k_caches[layer].copy_(torch.randn(10, 8, 2, 16))
        pool.v_caches[layer].copy_(torch.randn(10, 8, 2, 16))
    snapshot = pool.kv.clone()
    pool.copy_blocks(torch.tensor([2, 5]), torch.tensor([5, 7]))  # 5 is both a dst and a src
    for layer in range(3):
        assert torch.equal(pool.k_caches[layer][5], snapshot[0, layer, 2])
        assert torch.equal(pool.v_caches[layer][7], snapshot[1, layer, 5])
    k, v = pool.gather_blocks(torch.tensor([7, 0]))
    assert k.shape == (3, 2, 8, 2, 16)
    pool.scatter_blocks(torch.tensor([1, 9]), k, v)
    assert torch.equal(pool.k_caches[2][9], pool.k_caches[2][0])
    assert torch.equal(pool.v_caches[0][1], pool.v_caches[0][7])
    with pytest.raises(KernelInputError, match="outside the pool of 10 blocks"):
        pool.copy_blocks(torch.tensor([1]), torch.tensor([10]))
    with pytest.raises(KernelInputError, match="int64"):
        pool.gather_blocks(torch.tensor([1], dtype=torch.int32))
    with pytest.raises(KernelInputError):
        pool.scatter_blocks(torch.tensor([1]), k, v)


def test_pool_feeds_the_kernels():
    pool = KVPool(2, 6, 8, 2, 64, dtype=torch.float32, device="cpu")
    key, value = torch.randn(11, 2, 64), torch.randn(11, 2, 64)
    slots = torch.tensor([3 * 8 + i for i in range(8)] + [1 * 8 + i for i in range(3)])
    write_kv(key, value, pool.k_caches[1], pool.v_caches[1], slots, backend="triton")
    table, lens = torch.tensor([[3, 1]], dtype=torch.int32), torch.tensor([11], dtype=torch.int32)
    query = torch.randn(1, 4, 64)
    args = (query, pool.k_caches[1], pool.v_caches[1], table, lens)
    assert_matches(paged_decode_attention(*args, scale=0.125, backend="triton"),
                   reference_decode_attention(*args, scale=0.125, float64=True), torch.float32)
    assert pool.k_caches[0].abs().sum() == 0  # layer 0 untouched


def test_tuning_overrides_reach_the_kernels():
    """Launch parameters passed as `tuning` (what `bench kernel --variants` times) give the same answer."""
    from pagedkv.kernels import PrefillTuning

    scenario = Scenario([70, 9], 8, 2, 64, torch.float32, seed=14)
    query = scenario.query(2, 8)
    kv = (scenario.k_cache, scenario.v_cache, scenario.block_tables, scenario.seq_lens)
    expected = reference_decode_attention(query, *kv, scale=0.125, float64=True)
    for tuning in (DecodeTuning(block_n=16, num_warps=2, num_stages=1), DecodeTuning(dot_min_group=64),
                   DecodeTuning(min_split_tokens=16, target_waves=64)):
        assert_matches(paged_decode_attention(query, *kv, scale=0.125, backend="triton", tuning=tuning), expected,
                       torch.float32)
    cu = torch.tensor([0, 30, 39], dtype=torch.int32)
    prefill_query = scenario.query(39, 8)
    expected = reference_prefill_attention(prefill_query, *kv, cu, scale=0.125, float64=True)
    out = paged_prefill_attention(prefill_query, *kv, cu, scale=0.125, max_seqlen_q=30, backend="triton",
                                  tuning=PrefillTuning(block_m=16, block_n=16, num_warps=2))
    assert_matches(out, expected, torch.float32)


def test_split_heuristic():
    h200 = 132
    assert choose_num_splits(64, 8, 4096, h200) >= 1
    assert choose_num_splits(256, 8, 512, h200) == 1  # 2048 programs already cover the SMs
    long_single = choose_num_splits(1, 8, 32768, h200)
    assert 8 * long_single >= 2 * h200 and 32768 / long_single >= DecodeTuning().min_split_tokens
    assert choose_num_splits(1, 8, 100, h200) == 1  # too short to split
    assert choose_num_splits(1, 8, 10**6, h200, DecodeTuning(max_splits=16)) == 16


def test_auto_backend_on_cpu_is_torch(monkeypatch):
    monkeypatch.delenv("PAGEDKV_KERNEL_BACKEND", raising=False)
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("triton", torch.device("cpu")) == "triton"


# --------------------------------------------------------------------------- on CUDA, at full size
# Llama-3-8B attention (32 q heads, 8 kv heads, head_dim 128) in bf16, compiled for the GPU: the checks above,
# plus the head dims the CPU run skips and CUDA-graph captures of the decode hot path (every schedule).
GPU_DTYPES = [torch.bfloat16, torch.float16]
GPU_HEAD_SIZES = [64, 80, 96, 128, 256]
GPU_BLOCK_SIZES = [16, 128]
GPU_NUM_HEADS = [(32, 8), (32, 32), (28, 4), (14, 2)]  # Llama-3-8B, MHA, GQA 7 (Qwen2-7B), GQA 7 small
GPU_DTYPES = [torch.bfloat16, torch.float16]
GPU_HEAD_SIZES = [64, 80, 96, 128, 256]
GPU_BLOCK_SIZES = [16, 128]
GPU_NUM_HEADS = [(32, 8), (32, 32), (28, 4), (14, 2)]  # Llama-3-8B, MHA, GQA 7 (Qwen2-7B), GQA 7 small


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_write_kv_matches_reference_on_cuda(dtype):
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


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", GPU_BLOCK_SIZES)
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_decode_llama3_matches_reference(block_size, num_splits):
    num_heads, num_kv_heads, head_dim = LLAMA3
    scenario = GpuScenario(LENGTHS, block_size, num_kv_heads, head_dim, torch.bfloat16)
    query = scenario.query(len(LENGTHS), num_heads)
    expected = reference_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5, float64=True)
    out = paged_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5, max_seq_len=max(LENGTHS),
                                 num_splits=num_splits)
    assert_gpu_matches(out, expected, torch.bfloat16)


def _check_decode(dtype, head_dim, num_q_heads, num_kv_heads, seed):
    scenario = GpuScenario([1, 16, 17, 700], 16, num_kv_heads, head_dim, dtype, seed=seed)
    query = scenario.query(4, num_q_heads)
    expected = reference_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5, float64=True)
    assert_gpu_matches(paged_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5), expected, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("head_dim", GPU_HEAD_SIZES)
def test_decode_head_dims(dtype, head_dim):
    _check_decode(dtype, head_dim, 32, 8, seed=3)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", GPU_NUM_HEADS, ids=[f"{h}:{kv}" for h, kv in GPU_NUM_HEADS])
def test_decode_gqa_groups(num_heads):
    _check_decode(torch.bfloat16, 128, *num_heads, seed=13)


@pytest.mark.gpu
def test_long_single_sequence_splits():
    num_heads, num_kv_heads, head_dim = LLAMA3
    scenario = GpuScenario([32768], 16, num_kv_heads, head_dim, torch.bfloat16, seed=4)
    query = scenario.query(1, num_heads)
    expected = reference_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5, float64=True)
    auto = paged_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5, max_seq_len=32768)
    whole = paged_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5, num_splits=1)
    assert_gpu_matches(auto, expected, torch.bfloat16)
    torch.testing.assert_close(auto.float(), whole.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 5])
def test_zero_length_rows_give_zeros_on_cuda(num_splits):
    scenario = GpuScenario([0, 300, 0, 17], 16, 8, 128, torch.bfloat16, seed=5)
    query = scenario.query(4, 32)
    out = paged_decode_attention(query, *scenario.kv, scale=0.088, num_splits=num_splits)
    assert torch.equal(out[[0, 2]], torch.zeros_like(out[[0, 2]]))
    assert_gpu_matches(out, reference_decode_attention(query, *scenario.kv, scale=0.088, float64=True), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("sliding_window, soft_cap", [(256, None), (None, 30.0), (1000, 50.0), (1, None)])
def test_decode_window_and_soft_cap_on_cuda(sliding_window, soft_cap):
    scenario = GpuScenario(LENGTHS, 16, 8, 128, torch.bfloat16, seed=6)
    query = scenario.query(len(LENGTHS), 32) * 4
    options = {"scale": 0.088, "sliding_window": sliding_window, "soft_cap": soft_cap}
    expected = reference_decode_attention(query, *scenario.kv, **options, float64=True)
    assert_gpu_matches(paged_decode_attention(query, *scenario.kv, **options), expected, torch.bfloat16)


def _prefill_case(block_size, dtype, head_dim=128, num_heads=(32, 8), seed=7):
    seq_lens = [17, 1000, 4096, 2048, 129]
    q_lens = [17, 1, 4096, 512, 128]  # whole prompt, one token, a long prompt, chunks after a cached prefix
    scenario = GpuScenario(seq_lens, block_size, num_heads[1], head_dim, dtype, seed=seed)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return scenario, cu, max(q_lens), scenario.query(int(cu[-1]), num_heads[0])


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", GPU_BLOCK_SIZES)
def test_prefill_llama3_matches_reference(block_size):
    scenario, cu, max_q, query = _prefill_case(block_size, torch.bfloat16)
    expected = reference_prefill_attention(query, *scenario.kv, cu, scale=0.088, float64=True)
    out = paged_prefill_attention(query, *scenario.kv, cu, scale=0.088, max_seqlen_q=max_q)
    assert_gpu_matches(out, expected, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("head_dim", GPU_HEAD_SIZES)
def test_prefill_head_dims(dtype, head_dim):
    seq_lens, q_lens = [300, 77], [300, 40]
    scenario = GpuScenario(seq_lens, 16, 2, head_dim, dtype, seed=8)
    cu = torch.tensor([0, 300, 340], dtype=torch.int32, device="cuda")
    query = scenario.query(340, 14)
    expected = reference_prefill_attention(query, *scenario.kv, cu, scale=head_dim ** -0.5, float64=True)
    out = paged_prefill_attention(query, *scenario.kv, cu, scale=head_dim ** -0.5, max_seqlen_q=max(q_lens))
    assert_gpu_matches(out, expected, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("sliding_window, soft_cap", [(300, None), (None, 30.0), (700, 50.0)])
def test_prefill_window_and_soft_cap_on_cuda(sliding_window, soft_cap):
    scenario, cu, max_q, query = _prefill_case(16, torch.bfloat16, seed=9)
    options = {"scale": 0.088, "sliding_window": sliding_window, "soft_cap": soft_cap}
    expected = reference_prefill_attention(query * 4, *scenario.kv, cu, **options, float64=True)
    assert_gpu_matches(paged_prefill_attention(query * 4, *scenario.kv, cu, **options, max_seqlen_q=max_q),
                   expected, torch.bfloat16)


@pytest.mark.gpu
def test_chunked_prefill_equals_one_shot_on_cuda():
    scenario = GpuScenario([4096], 16, 8, 128, torch.bfloat16, seed=10)
    query = scenario.query(4096, 32)
    whole = paged_prefill_attention(query, *scenario.kv, torch.tensor([0, 4096], dtype=torch.int32, device="cuda"),
                                    scale=0.088, max_seqlen_q=4096)
    tail = paged_prefill_attention(query[1500:].contiguous(), *scenario.kv,
                                   torch.tensor([0, 4096 - 1500], dtype=torch.int32, device="cuda"),
                                   scale=0.088, max_seqlen_q=4096 - 1500)
    torch.testing.assert_close(tail.float(), whole[1500:].float(), atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
def test_block_offsets_past_2_to_the_31_on_cuda():
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
    assert_gpu_matches(paged_decode_attention(query[-1:], *kv, scale=0.088, num_splits=3), expected, torch.bfloat16)
    cu = torch.tensor([0, seq_len], dtype=torch.int32, device="cuda")
    expected = reference_prefill_attention(query, *kv, cu, scale=0.088, float64=True)
    assert_gpu_matches(paged_prefill_attention(query, *kv, cu, scale=0.088, max_seqlen_q=seq_len), expected,
                   torch.bfloat16)
    # The unified kernel and every decode schedule on the same far blocks.
    assert_gpu_matches(paged_attention(query, *kv, cu, scale=0.088, max_seqlen_q=seq_len), expected, torch.bfloat16)
    for tuning in SCHEDULES.values():
        assert_gpu_matches(paged_decode_attention(query[-1:], *kv, scale=0.088, num_splits=3, tuning=tuning),
                       expected[-1:], torch.bfloat16)
    del k_cache, v_cache
    torch.cuda.empty_cache()


@pytest.mark.gpu
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


@pytest.mark.gpu
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
    assert_gpu_matches(out, expected, torch.bfloat16)


# --------------------------------------------------------------------------- on CUDA: decode schedules
@pytest.mark.gpu
@pytest.mark.parametrize("block_size", GPU_BLOCK_SIZES)
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
        assert_gpu_matches(out, expected, torch.bfloat16)
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))
        workspace.check_integrity()


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["in_kernel"])
@pytest.mark.parametrize("heads", ENGINE_HEADS + [(28, 4, 128)], ids=["qwen3", "smollm2", "gpt2", "gqa7"])
def test_new_decode_schedules_engine_heads(schedule, heads):
    num_heads, num_kv_heads, head_dim = heads
    scenario = GpuScenario([1, 16, 17, 700, 2049], 16, num_kv_heads, head_dim, torch.bfloat16, seed=21)
    query = scenario.query(5, num_heads)
    expected = reference_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5, float64=True)
    assert_gpu_matches(paged_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5, max_seq_len=2049,
                                          tuning=SCHEDULES[schedule]), expected, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["in_kernel"])
def test_new_decode_schedules_long_single_sequence(schedule):
    num_heads, num_kv_heads, head_dim = LLAMA3
    scenario = GpuScenario([32768], 16, num_kv_heads, head_dim, torch.bfloat16, seed=22)
    query = scenario.query(1, num_heads)
    expected = reference_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5, float64=True)
    out = paged_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5, max_seq_len=32768,
                                 tuning=SCHEDULES[schedule])
    assert_gpu_matches(out, expected, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["in_kernel"])
@pytest.mark.parametrize("sliding_window, soft_cap", [(256, None), (None, 30.0), (1000, 50.0), (1, None)])
def test_new_decode_schedules_window_and_soft_cap(schedule, sliding_window, soft_cap):
    scenario = GpuScenario(LENGTHS, 16, 8, 128, torch.bfloat16, seed=23)
    query = scenario.query(len(LENGTHS), 32) * 4
    options = {"scale": 0.088, "sliding_window": sliding_window, "soft_cap": soft_cap}
    expected = reference_decode_attention(query, *scenario.kv, **options, float64=True)
    assert_gpu_matches(paged_decode_attention(query, *scenario.kv, **options, tuning=SCHEDULES[schedule]), expected,
                   torch.bfloat16)


@pytest.mark.gpu
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
        assert_gpu_matches(out, reference_decode_attention(query, *scenario.kv, scale=0.088, float64=True),
                       torch.bfloat16)
        workspace.check_integrity()
