"""FP8 KV caches on CPU: quantization bytes, and every attention kernel against the float64 reference.

The Triton kernels run under TRITON_INTERPRET=1, which loads FP8 and converts it up exactly;
its fp32 -> fp8 cast rounds wrongly, which is why the kernels round explicitly
(`triton_fp8.round_to_fp8`) and why `write_kv` is held to the torch bytes exactly here.
Attention is held to the reference that dequantizes explicitly (`stored * scale`), with the
tolerance of the query's dtype: folding the scales into the softmax scale and the output is
exact arithmetic, so FP8 adds no error of its own beyond the stored values.

Every pool is poisoned with FP8 NaN bytes and every block table points its padding entries at
poisoned blocks, as in `test_kernels.py`.
"""

import pytest
import torch
import triton
import triton.language as tl
from kernel_scenarios import (
    GPU_TOLERANCES,
    LENGTHS,
    LLAMA3,
    SCHEDULES,
    Fp8Pool,
    Scenario,
    assert_matches,
    cu_seqlens,
    seq_lens_for,
    shuffled_layout,
)

from pagedkv import LLM, SamplingParams
from pagedkv.errors import ConfigError, KernelInputError
from pagedkv.hf import random_model
from pagedkv.kernels import (
    DecodeTuning,
    KernelWorkspace,
    KVPool,
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
from pagedkv.kernels.triton_fp8 import fp8_bits_to_f16
from pagedkv.kernels.fp8 import DEFAULT_HEADROOM, KVScales, dequantize, fp8_max, quantize, resolve_kv_cache_dtype

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
BACKENDS = ["triton", "torch"]
#: dtype of the query/model, (q heads, kv heads), head_dim, block_size, cache dtype: each value at least once.
CASES = [
    (torch.float32, (4, 4), 64, 16, torch.float8_e4m3fn),
    (torch.float16, (6, 2), 128, 8, torch.float8_e4m3fn),
    (torch.float32, (8, 2), 64, 8, torch.float8_e5m2),
    (torch.float16, (7, 1), 80, 16, torch.float8_e5m2),
]
CASE_IDS = [f"{str(d)[6:]}-h{h}:{kv}-d{hd}-bs{bs}-{str(c)[11:]}" for d, (h, kv), hd, bs, c in CASES]
#: Relative error of one stored value at most half an ulp: 2**-4 for e4m3, 2**-3 for e5m2 (normal range).
RELATIVE_STEP = {torch.float8_e4m3fn: 2.0 ** -4, torch.float8_e5m2: 2.0 ** -3}


def _fp8_case(case, seq_lens, seed=0):
    dtype, (num_q_heads, num_kv_heads), head_dim, block_size, cache_dtype = case
    scenario = Scenario(seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=seed)
    return scenario, Fp8Pool(scenario, cache_dtype, seed=seed), num_q_heads


# --------------------------------------------------------------------------- quantization
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
def test_quantize_rounds_to_nearest_and_saturates(cache_dtype):
    scale = torch.tensor([0.5, 2.0])
    x = torch.tensor([[[1.0, -3.0, 1e9, -1e9]], [[0.0, 7.0, 3e6, 1e-9]]]).expand(2, 2, 4).transpose(0, 1)
    stored = quantize(x, scale, cache_dtype)
    assert stored.dtype == cache_dtype and not stored.float().isnan().any()
    limit = fp8_max(cache_dtype)
    assert float(stored[0, 0, 2].float()) == limit and float(stored[0, 0, 3].float()) == -limit  # saturated
    back = dequantize(stored, scale)
    inside = (x / scale[:, None]).abs() < limit
    rel = ((back - x).abs() / x.abs().clamp(min=1e-30))[inside & (x.abs() > 1e-3)]
    assert float(rel.max()) <= RELATIVE_STEP[cache_dtype]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_quantizes_to_the_reference_bytes(backend, cache_dtype, dtype):
    """The fused quantizing write stores exactly the reference's bytes (ties, subnormals, saturation, padding)."""
    num_tokens, num_kv_heads, head_dim, block_size, num_blocks = 23, 3, 64, 16, 12
    generator = torch.Generator().manual_seed(1)
    key = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator) * 4).to(dtype)
    value = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator) / 64).to(dtype)
    key[0, 0, :4] = torch.tensor([6e4, -6e4, 0.0, -0.0]).to(dtype)  # saturate both ways, and signed zeros
    k_scale = torch.tensor([0.02, 0.5, 1.0])
    v_scale = torch.tensor([1e-4, 3e-3, 0.25])
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[[2, 9, 17]] = -1
    nan = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan")).to(cache_dtype)
    k_cache, v_cache, k_expected, v_expected = nan.clone(), nan.clone(), nan.clone(), nan.clone()
    reference_write_kv(key, value, k_expected, v_expected, slots, k_scale, v_scale)
    write_kv(key, value, k_cache, v_cache, slots, backend=backend, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(k_cache.view(torch.uint8), k_expected.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_expected.view(torch.uint8))
    assert not k_cache.view(-1, num_kv_heads, head_dim)[slots[slots >= 0]].float().isnan().any()


def test_quantization_error_is_within_half_a_step():
    """Stored K read back is within the format's half-ulp of the model's K wherever it is not subnormal."""
    scenario = Scenario(seq_lens_for(16), 16, 2, 64, torch.float32, seed=2)
    pool = Fp8Pool(scenario, torch.float8_e4m3fn)
    slots = torch.tensor([scenario.slot(b, p) for b, n in enumerate(scenario.seq_lens.tolist()) for p in range(n)])
    back = dequantize(pool.k_cache.view(-1, 2, 64)[slots], pool.k_scale)
    normal = (scenario.keys / pool.k_scale[:, None]).abs() >= 2.0 ** -6
    rel = (back - scenario.keys).abs() / scenario.keys.abs()
    assert float(rel[normal].max()) <= RELATIVE_STEP[torch.float8_e4m3fn]


# --------------------------------------------------------------------------- attention
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_decode_matches_reference(backend, case):
    scenario, fp8, num_q_heads = _fp8_case(case, seq_lens_for(case[3]), seed=3)
    query = scenario.query(len(scenario.seq_lens), num_q_heads)
    args = (query, fp8.k_cache, fp8.v_cache, scenario.block_tables, scenario.seq_lens)
    expected = reference_decode_attention(*args, scale=case[2] ** -0.5, float64=True, **fp8.scales)
    # The default launch (FP8: the tiles schedule, which plans its own splits), then the split kernel unsplit
    # and split three ways.
    for tuning, num_splits in ((None, None), (DecodeTuning(), 1), (DecodeTuning(), 3)):
        out = paged_decode_attention(*args, scale=case[2] ** -0.5, num_splits=num_splits, backend=backend,
                                     tuning=tuning, **fp8.scales)
        assert out.dtype == query.dtype
        assert_matches(out, expected, case[0])


@pytest.mark.parametrize("tuning", [DecodeTuning(merge="in_kernel", block_n=16)], ids=["in_kernel"])
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
def test_decode_schedules_match_reference(tuning, cache_dtype):
    """Every (sequence, kv head) item reads its own head's scales, whichever program merges it."""
    case = (torch.float32, (6, 3), 64, 16, cache_dtype)
    scenario, fp8, num_q_heads = _fp8_case(case, [30, 64, 0, 100, 1], seed=4)
    query = scenario.query(5, num_q_heads)
    args = (query, fp8.k_cache, fp8.v_cache, scenario.block_tables, scenario.seq_lens)
    workspace = KernelWorkspace(16, "cpu")
    expected = reference_decode_attention(*args, scale=0.125, float64=True, **fp8.scales)
    out = paged_decode_attention(*args, scale=0.125, num_splits=3, max_seq_len=100, backend="triton", tuning=tuning,
                                 workspace=workspace, **fp8.scales)
    assert_matches(out, expected, torch.float32)
    workspace.check_integrity()


@triton.jit
def _convert_bits(src, dst, n: tl.constexpr):
    """n FP8 values to fp16 through `fp8_bits_to_f16`."""
    offsets = tl.arange(0, n)
    tl.store(dst + offsets, fp8_bits_to_f16(tl.load(src + offsets)))


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
def test_bits_route_builds_the_same_fp16_tiles(cache_dtype, monkeypatch):
    """PAGEDKV_FP8_CONVERT=bits: fp16 tiles from integer operations, bit for bit the converted ones.

    Every finite byte value goes through both routes (e4m3's NaN codes become +-480: pools never
    hold them); then a decode over a pool holding
    them matches the fp32 route exactly and the float64 reference.
    """
    from pagedkv.kernels import triton_fp8

    convert = _convert_bits
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(cache_dtype)
    finite = ~codes.float().isnan()
    got = torch.empty(256, dtype=torch.float16)
    convert[(1,)](codes, got, 256)
    assert torch.equal(got[finite], codes.float()[finite].half())

    case = (torch.float16, (8, 2), 64, 16, cache_dtype)
    scenario, fp8, num_q_heads = _fp8_case(case, [30, 64, 0, 100, 1], seed=8)
    query = scenario.query(5, num_q_heads)
    args = (query, fp8.k_cache, fp8.v_cache, scenario.block_tables, scenario.seq_lens)
    outs = {}
    for route in ("fp32", "bits"):
        monkeypatch.setattr(triton_fp8, "FP8_CONVERT", tl.constexpr(route))
        outs[route] = paged_decode_attention(*args, scale=0.125, num_splits=2, backend="triton", tuning=DecodeTuning(),
                                             **fp8.scales)
    assert torch.equal(outs["bits"], outs["fp32"])
    expected = reference_decode_attention(*args, scale=0.125, float64=True, **fp8.scales)
    assert_matches(outs["bits"], expected, torch.float16)


@pytest.mark.parametrize("heads_per_program, merge", [(2, "in_kernel"), (1, "launch"), (4, "in_kernel")])
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
def test_tiles_decode_matches_reference(heads_per_program, merge, cache_dtype):
    """The tiles schedule packs kv heads per program: each row must take its own head's K and V scales."""
    case = (torch.float32, (8, 4), 64, 16, cache_dtype)
    scenario, fp8, num_q_heads = _fp8_case(case, [30, 64, 0, 100, 1], seed=7)
    query = scenario.query(5, num_q_heads)
    args = (query, fp8.k_cache, fp8.v_cache, scenario.block_tables, scenario.seq_lens)
    tuning = DecodeTuning(schedule="tiles", block_n=16, min_split_tokens=16, programs_per_sm=8,
                          heads_per_program=heads_per_program, merge=merge, fp8_block_n=None)
    workspace = KernelWorkspace(32, "cpu")
    for options in ({}, {"sliding_window": 20, "soft_cap": 2.0}):
        expected = reference_decode_attention(*args, scale=0.125, float64=True, **options, **fp8.scales)
        out = paged_decode_attention(*args, scale=0.125, max_seq_len=100, backend="triton", tuning=tuning,
                                     workspace=workspace, **options, **fp8.scales)
        assert_matches(out, expected, torch.float32)
    workspace.check_integrity()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sliding_window, soft_cap", [(5, None), (None, 2.0)])
def test_decode_window_and_soft_cap(backend, sliding_window, soft_cap):
    case = (torch.float32, (6, 2), 80, 8, torch.float8_e4m3fn)
    scenario, fp8, num_q_heads = _fp8_case(case, [1, 8, 9, 50], seed=5)
    query = scenario.query(4, num_q_heads) * 3
    args = (query, fp8.k_cache, fp8.v_cache, scenario.block_tables, scenario.seq_lens)
    options = {"scale": 0.125, "sliding_window": sliding_window, "soft_cap": soft_cap, **fp8.scales}
    expected = reference_decode_attention(*args, **options, float64=True)
    for tuning in (None, DecodeTuning()):  # FP8's default (tiles), the split kernel
        assert_matches(paged_decode_attention(*args, **options, num_splits=3, backend=backend, tuning=tuning),
                       expected, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_prefill_matches_reference(backend, case):
    block_size = case[3]
    seq_lens = seq_lens_for(block_size)
    q_lens = [1, block_size, 3, block_size + 1, 2 * block_size - 1]
    scenario, fp8, num_q_heads = _fp8_case(case, seq_lens, seed=6)
    cu = cu_seqlens(q_lens)
    query = scenario.query(int(cu[-1]), num_q_heads)
    args = (query, fp8.k_cache, fp8.v_cache, scenario.block_tables, scenario.seq_lens, cu)
    expected = reference_prefill_attention(*args, scale=case[2] ** -0.5, float64=True, **fp8.scales)
    out = paged_prefill_attention(*args, scale=case[2] ** -0.5, max_seqlen_q=max(q_lens), backend=backend,
                                  **fp8.scales)
    assert_matches(out, expected, case[0])


@pytest.mark.parametrize("backend, num_splits", [("triton", 1), ("torch", 1), ("triton", 3)])
@pytest.mark.parametrize("case", CASES[:2] + CASES[3:], ids=CASE_IDS[:2] + CASE_IDS[3:])
def test_unified_mixed_step_matches_reference(backend, num_splits, case):
    """Also with the kv split 3 ways (16-key splits): each split's rows carry the V scale into the merge."""
    seq_lens, q_lens = [1, 17, 90, 9, 33], [1, 1, 12, 9, 1]
    scenario, fp8, num_q_heads = _fp8_case(case, seq_lens, seed=7)
    cu = cu_seqlens(q_lens)
    query = scenario.query(int(cu[-1]), num_q_heads)
    args = (query, fp8.k_cache, fp8.v_cache, scenario.block_tables, scenario.seq_lens, cu)
    expected = reference_paged_attention(*args, scale=0.1, float64=True, **fp8.scales)
    tuning = UnifiedTuning(block_m=16, block_n=16, num_splits=num_splits, min_split_tokens=16)
    out = paged_attention(*args, scale=0.1, max_seqlen_q=max(q_lens), max_seq_len=max(seq_lens), backend=backend,
                          tuning=tuning, **fp8.scales)
    assert_matches(out, expected, case[0])


def test_fp8_attention_tracks_model_dtype_attention():
    """The quantized cache's output stays within a few percent of the unquantized one (e4m3, calibrated scales)."""
    scenario = Scenario([300, 64], 16, 2, 64, torch.float32, seed=8)
    fp8 = Fp8Pool(scenario, torch.float8_e4m3fn)
    query = scenario.query(2, 8)
    kv = (scenario.block_tables, scenario.seq_lens)
    exact = paged_decode_attention(query, scenario.k_cache, scenario.v_cache, *kv, scale=0.125, backend="torch")
    quantized = paged_decode_attention(query, fp8.k_cache, fp8.v_cache, *kv, scale=0.125, backend="torch",
                                       **fp8.scales)
    assert float((quantized - exact).norm() / exact.norm()) < 0.05


# --------------------------------------------------------------------------- the pool and bad input
def test_fp8_pool_halves_blocks_and_moves_bytes():
    bf16 = KVPool(3, 10, 8, 2, 16, dtype=torch.float32, device="cpu")
    scales = KVScales(torch.rand(3, 2) + 0.5, torch.rand(3, 2) + 0.5, "test")
    pool = KVPool(3, 10, 8, 2, 16, dtype=torch.float32, device="cpu", kv_cache_dtype="fp8_e4m3", scales=scales)
    assert pool.dtype == torch.float8_e4m3fn and pool.model_dtype == torch.float32 and pool.is_fp8
    assert pool.bytes_per_block * 4 == bf16.bytes_per_block  # 1 byte against fp32's 4
    assert torch.equal(pool.k_scale, scales.k_scale) and pool.kv_scales(1)[1].shape == (2,)
    generator = torch.Generator().manual_seed(9)
    for layer in range(3):
        pool.k_caches[layer].copy_(torch.randn(10, 8, 2, 16, generator=generator).to(torch.float8_e4m3fn))
    snapshot = pool.kv.view(torch.uint8).clone()
    pool.copy_blocks(torch.tensor([2, 5]), torch.tensor([5, 7]))
    assert torch.equal(pool.k_caches[1][5].view(torch.uint8), snapshot[0, 1, 2])
    assert torch.equal(pool.k_caches[2][7].view(torch.uint8), snapshot[0, 2, 5])
    k, v = pool.gather_blocks(torch.tensor([7, 0]))
    assert k.dtype == torch.float8_e4m3fn
    pool.scatter_blocks(torch.tensor([1, 9]), k, v)
    assert torch.equal(pool.k_caches[0][9].view(torch.uint8), pool.k_caches[0][0].view(torch.uint8))
    with pytest.raises(KernelInputError, match="float8_e4m3fn"):
        pool.scatter_blocks(torch.tensor([1, 9]), k.float(), v.float())
    assert "fp8_e4m3" in repr(pool)


def test_kv_cache_dtype_errors_name_the_value_and_the_allowed_set():
    with pytest.raises(ConfigError, match=r"'fp8'.*auto, fp8_e4m3, fp8_e5m2"):
        resolve_kv_cache_dtype("fp8", torch.bfloat16)
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        KVPool(1, 2, 8, 1, 16, dtype=torch.float32, device="cpu", kv_cache_dtype="int8")
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    with pytest.raises(KernelInputError, match="only FP8 pools"):
        KVPool(1, 2, 8, 1, 16, dtype=torch.float32, device="cpu", scales=KVScales.unit(1, 1))
    with pytest.raises(ConfigError, match="> 0"):
        KVScales(torch.zeros(1, 1), torch.ones(1, 1), "bad")


def _fp8_bad_inputs():
    scenario = Scenario([10, 17], 8, 2, 64, torch.float32, seed=10)
    fp8 = Fp8Pool(scenario, torch.float8_e4m3fn)
    query = scenario.query(2, 4)
    args = (query, fp8.k_cache, fp8.v_cache, scenario.block_tables, scenario.seq_lens)
    key = torch.randn(3, 2, 64)
    slots = torch.tensor([0, 1, 2])
    return fp8, {
        "no scales": lambda backend: paged_decode_attention(*args, scale=0.1, backend=backend),
        "scale shape": lambda backend: paged_decode_attention(*args, scale=0.1, backend=backend,
                                                              k_scale=torch.ones(3), v_scale=fp8.v_scale),
        "scale dtype": lambda backend: paged_decode_attention(*args, scale=0.1, backend=backend,
                                                              k_scale=fp8.k_scale.double(), v_scale=fp8.v_scale),
        "write without scales": lambda backend: write_kv(key, key, fp8.k_cache, fp8.v_cache, slots, backend=backend),
        "scales on a float cache": lambda backend: paged_decode_attention(
            query, scenario.k_cache, scenario.v_cache, scenario.block_tables, scenario.seq_lens, scale=0.1,
            backend=backend, **fp8.scales),
        "prefill without scales": lambda backend: paged_prefill_attention(
            query, fp8.k_cache, fp8.v_cache, scenario.block_tables, scenario.seq_lens, cu_seqlens([1, 1]),
            scale=0.1, max_seqlen_q=1, backend=backend),
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(_fp8_bad_inputs()[1]))
def test_fp8_bad_input_raises_kernel_input_error(backend, name):
    fp8, calls = _fp8_bad_inputs()
    before = fp8.k_cache.view(torch.uint8).clone()
    with pytest.raises(KernelInputError, match="scale"):
        calls[name](backend)
    assert torch.equal(fp8.k_cache.view(torch.uint8), before)


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_rotary_write_quantizes_like_write_kv(cache_dtype, dtype):
    """The own decoder's fused q/k-norm + rotary + K/V store writes what `write_kv` would for the same K/V."""
    from pagedkv.kernels import layer_ops

    num_heads, num_kv_heads, head_dim, num_tokens = 8, 2, 32, 6
    generator = torch.Generator().manual_seed(11)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator).to(dtype)
    positions = torch.tensor([0, 5, 17, 3, 30, 1])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    emb = torch.arange(32, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat((emb, emb), -1).cos(), torch.cat((emb, emb), -1).sin()
    k_scale, v_scale = torch.tensor([0.004, 0.01]), torch.tensor([0.02, 0.003])
    nan = torch.full((8, 4, num_kv_heads, head_dim), float("nan")).to(cache_dtype)
    k_cache, v_cache, k_expected, v_expected = nan.clone(), nan.clone(), nan.clone(), nan.clone()
    slots = torch.tensor([3, 9, 10, 0, 31, 17])
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    _, rotated_k = layer_ops.qk_norm_rope_reference(q.reshape(num_tokens, num_heads, head_dim),
                                                k.reshape(num_tokens, num_kv_heads, head_dim), positions, cos, sin,
                                                None, None, 1e-6)
    reference_write_kv(rotated_k, v.reshape(num_tokens, num_kv_heads, head_dim), k_expected, v_expected, slots,
                       k_scale, v_scale)
    layer_ops.qk_norm_rope_write_kv(qkv.clone(), positions, cos, sin, None, None, 1e-6, k_cache, v_cache, slots,
                                num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(v_cache.view(torch.uint8), v_expected.view(torch.uint8))
    got = dequantize(k_cache.view(-1, num_kv_heads, head_dim)[slots], k_scale)
    want = dequantize(k_expected.view(-1, num_kv_heads, head_dim)[slots], k_scale)
    # Rotary in fp32 may differ from torch's in the last bit, which can move a value across a rounding edge.
    torch.testing.assert_close(got, want, atol=1e-6, rtol=RELATIVE_STEP[cache_dtype] * 2)
    assert k_cache.view(-1, num_kv_heads, head_dim)[slots].float().isfinite().all()


def test_fp8_decode_without_tuning_runs_the_tiles_schedule(monkeypatch):
    """A call without a tuning over an FP8 cache takes the FP8 default (tiles), not the model-dtype one (split),
    and matches the reference. (Which schedules the defaults are: test_decode_schedule_environment_picks_...)"""
    import pagedkv.kernels.ops as ops
    import pagedkv.kernels.triton_decode_tiles as tiles_module

    monkeypatch.setattr(ops, "_DEFAULT_FP8_DECODE", DecodeTuning(schedule="tiles"))  # whatever the environment set
    monkeypatch.setattr(ops, "_DEFAULT_DECODE", DecodeTuning())

    calls = []
    original = tiles_module.triton_tiles_decode
    monkeypatch.setattr(tiles_module, "triton_tiles_decode", lambda *a, **k: calls.append(1) or original(*a, **k))
    case = (torch.float16, (8, 2), 64, 16, torch.float8_e4m3fn)
    scenario, fp8, num_q_heads = _fp8_case(case, [30, 64, 0, 100, 1], seed=11)
    query = scenario.query(5, num_q_heads)
    args = (query, fp8.k_cache, fp8.v_cache, scenario.block_tables, scenario.seq_lens)
    out = paged_decode_attention(*args, scale=0.125, max_seq_len=100, backend="triton", **fp8.scales)
    assert calls
    expected = reference_decode_attention(*args, scale=0.125, float64=True, **fp8.scales)
    assert_matches(out, expected, torch.float16)


# --------------------------------------------------------------------------- on CUDA
# FP8 KV caches on CUDA: the Triton kernels compiled for the GPU against the torch reference (run on the H200).
#
# The tests above cover the same kernels under the interpreter at small shapes in fp32/fp16;
# here they run compiled, in bf16, at Llama-3-8B attention shapes, with
# the hardware FP8 conversions, CUDA graphs, and the engine's three model paths.
#: (atol, rtol) against the float64 reference: bf16 queries and outputs, as in the CUDA tests of test_kernels.py.
GPU_TOLERANCE = dict(zip(("atol", "rtol"), GPU_TOLERANCES[torch.bfloat16]))


class Fp8GpuScenario:
    """Sequences of `seq_lens` in a NaN-poisoned FP8 pool behind shuffled tables, per-head scales from the amax."""

    def __init__(self, seq_lens, block_size, num_kv_heads, head_dim, cache_dtype, seed=0):
        generator = torch.Generator().manual_seed(seed)
        num_blocks, self.block_tables, self.slots = shuffled_layout(seq_lens, block_size, generator)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        gain = torch.linspace(0.5, 8.0, num_kv_heads)[None, :, None]  # heads of different ranges
        keys = torch.randn(len(self.slots), num_kv_heads, head_dim, generator=generator) * gain
        values = torch.randn(len(self.slots), num_kv_heads, head_dim, generator=generator) / gain
        self.keys, self.values = keys.to("cuda", torch.bfloat16), values.to("cuda", torch.bfloat16)
        top = fp8_max(cache_dtype) / DEFAULT_HEADROOM
        self.k_scale = (self.keys.float().abs().amax(dim=(0, 2)) / top).contiguous()
        self.v_scale = (self.values.float().abs().amax(dim=(0, 2)) / top).contiguous()
        nan = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), device="cuda")
        self.k_cache, self.v_cache = nan.to(cache_dtype), nan.to(cache_dtype)
        write_kv(self.keys, self.values, self.k_cache, self.v_cache, self.slots, k_scale=self.k_scale,
                 v_scale=self.v_scale)

    @property
    def kv(self):
        return self.k_cache, self.v_cache, self.block_tables, self.seq_lens

    @property
    def scales(self):
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def query(self, num_tokens, num_heads, seed=1):
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(num_tokens, num_heads, self.k_cache.shape[-1], generator=generator).to("cuda",
                                                                                                  torch.bfloat16)


def _assert_close_on_cuda(out, expected):
    assert not out.isnan().any(), "NaN leaked from a poisoned slot"
    torch.testing.assert_close(out.double(), expected, **GPU_TOLERANCE)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_write_kv_bytes_equal_the_reference(cache_dtype, dtype):
    generator = torch.Generator().manual_seed(2)
    key = (torch.randn(333, 8, 128, generator=generator) * 30).to("cuda", dtype)
    value = (torch.randn(333, 8, 128, generator=generator) / 100).to("cuda", dtype)
    k_scale = torch.linspace(0.01, 0.5, 8, device="cuda")
    v_scale = torch.linspace(1e-5, 1e-3, 8, device="cuda")
    slots = torch.randperm(64 * 16, generator=generator)[:333].cuda()
    slots[::7] = -1
    nan = torch.full((64, 16, 8, 128), float("nan"), device="cuda").to(cache_dtype)
    k_cache, v_cache, k_expected, v_expected = nan.clone(), nan.clone(), nan.clone(), nan.clone()
    reference_write_kv(key, value, k_expected, v_expected, slots, k_scale, v_scale)
    write_kv(key, value, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(k_cache.view(torch.uint8), k_expected.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_expected.view(torch.uint8))
    keep = slots >= 0  # the engine's unpadded call (no checks, every slot real) stores the same bytes
    k_cache, v_cache = nan.clone(), nan.clone()
    write_kv(key[keep], value[keep], k_cache, v_cache, slots[keep], k_scale=k_scale, v_scale=v_scale,
             has_padding=False, validate=False)
    assert torch.equal(k_cache.view(torch.uint8), k_expected.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
def test_decode_llama3_matches_reference(schedule, block_size, cache_dtype):
    num_heads, num_kv_heads, head_dim = LLAMA3
    scenario = Fp8GpuScenario(LENGTHS, block_size, num_kv_heads, head_dim, cache_dtype)
    query = scenario.query(len(LENGTHS), num_heads)
    expected = reference_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5, float64=True,
                                          **scenario.scales)
    out = paged_decode_attention(query, *scenario.kv, scale=head_dim ** -0.5, max_seq_len=max(LENGTHS),
                                 tuning=SCHEDULES[schedule], workspace=KernelWorkspace(64, "cuda"), **scenario.scales)
    _assert_close_on_cuda(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
def test_prefill_and_mixed_step_match_reference(cache_dtype):
    num_heads, num_kv_heads, head_dim = LLAMA3
    seq_lens, q_lens = [1, 17, 1000, 129, 2048], [1, 1, 300, 129, 64]
    scenario = Fp8GpuScenario(seq_lens, 16, num_kv_heads, head_dim, cache_dtype, seed=3)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    query = scenario.query(int(cu[-1]), num_heads)
    args = (query, *scenario.kv, cu)
    expected = reference_prefill_attention(*args, scale=0.088, float64=True, **scenario.scales)
    _assert_close_on_cuda(paged_prefill_attention(*args, scale=0.088, max_seqlen_q=max(q_lens), **scenario.scales), expected)
    expected = reference_paged_attention(*args, scale=0.088, float64=True, **scenario.scales)
    out = paged_attention(*args, scale=0.088, max_seqlen_q=max(q_lens), max_seq_len=max(seq_lens),
                          tuning=UnifiedTuning(decode_route=False), **scenario.scales)
    _assert_close_on_cuda(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_fp8_decode_captures_in_a_cuda_graph(schedule):
    num_heads, num_kv_heads, head_dim = LLAMA3
    scenario = Fp8GpuScenario([300, 4096, 1, 77], 16, num_kv_heads, head_dim, torch.float8_e4m3fn, seed=4)
    query = scenario.query(4, num_heads)
    workspace = KernelWorkspace(64, "cuda")
    out = torch.empty_like(query)

    def step():
        paged_decode_attention(query, *scenario.kv, scale=0.088, max_seq_len=4096, out=out, validate=False,
                               tuning=SCHEDULES[schedule], workspace=workspace, **scenario.scales)

    step()
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
    workspace.check_integrity()


@pytest.mark.gpu
def test_fused_rotary_write_in_bf16_stores_what_write_kv_stores():
    from pagedkv.kernels import layer_ops

    num_heads, num_kv_heads, head_dim, num_tokens = 32, 8, 128, 40
    generator = torch.Generator().manual_seed(5)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator).to("cuda",
                                                                                                     torch.bfloat16)
    positions = torch.randint(0, 4000, (num_tokens,), generator=generator).cuda()
    inv_freq = 1.0 / (500000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    emb = torch.arange(4096, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat((emb, emb), -1).cos().cuda(), torch.cat((emb, emb), -1).sin().cuda()
    k_scale = torch.linspace(0.005, 0.05, num_kv_heads, device="cuda")
    v_scale = torch.linspace(0.002, 0.02, num_kv_heads, device="cuda")
    shape = (8, 16, num_kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(shape, device="cuda").to(torch.float8_e4m3fn), torch.zeros(shape, device="cuda").to(
        torch.float8_e4m3fn)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(128, generator=generator)[:num_tokens].cuda()
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    _, rotated = layer_ops.qk_norm_rope_reference(q.reshape(num_tokens, num_heads, head_dim),
                                              k.reshape(num_tokens, num_kv_heads, head_dim), positions, cos, sin,
                                              None, None, 1e-6)
    write_kv(rotated.contiguous(), v.reshape(num_tokens, num_kv_heads, head_dim).contiguous(), k_ref, v_ref, slots,
             k_scale=k_scale, v_scale=v_scale)
    layer_ops.qk_norm_rope_write_kv(qkv.clone(), positions, cos, sin, None, None, 1e-6, k_cache, v_cache, slots,
                                num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, k_scale=k_scale,
                                v_scale=v_scale)
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    # The FP8 K is exactly write_kv's quantization of the K the same kernel stores in a bf16 cache ...
    k_bf16, v_bf16 = torch.zeros(shape, device="cuda", dtype=torch.bfloat16), torch.zeros(shape, device="cuda",
                                                                                          dtype=torch.bfloat16)
    layer_ops.qk_norm_rope_write_kv(qkv.clone(), positions, cos, sin, None, None, 1e-6, k_bf16, v_bf16, slots,
                                num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    rotated_by_kernel = k_bf16.view(-1, num_kv_heads, head_dim)[slots].contiguous()
    k_expected = torch.zeros(shape, device="cuda").to(torch.float8_e4m3fn)
    write_kv(rotated_by_kernel, v.reshape(num_tokens, num_kv_heads, head_dim).contiguous(), k_expected,
             k_expected.clone(), slots, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(k_cache.view(torch.uint8), k_expected.view(torch.uint8))
    # ... and that bf16 K is HF's rotary up to rounding: HF rounds cos, sin, both products and the sum
    # to bf16; an intermediate an ulp apart (2**-7 relative at most) moves the result by at most
    # 2**-7 (|k_i| + |k_partner|).
    # (Compared in bf16, not FP8: where the two terms cancel, one bf16 ulp of a term is many FP8
    # steps of the small result - on the H200 a value came out -3.75 against -3.0 FP8 units.)
    k_in = k.reshape(num_tokens, num_kv_heads, head_dim).float().abs()
    pair_magnitude = k_in + torch.cat([k_in[..., head_dim // 2:], k_in[..., :head_dim // 2]], dim=-1)
    difference = (rotated_by_kernel.float() - rotated.float()).abs()
    assert (difference <= 2 ** -7 * pair_magnitude).all(), difference.max()


ENGINE_PATHS = [{}, {"enforce_eager": True}, {"model_impl": "hf"}]  # own decoder + graphs, own eager, HF modules


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_engine_fp8_paths_agree_and_preemption_is_invariant(name):
    model = random_model(name, torch.float32, "cuda")
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 500, (40,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 500, (n,), generator=gen).tolist() for n in (3, 40, 17, 64, 1, 100)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = []
    for path in ENGINE_PATHS:
        llm = LLM(hf_model=model, kv_cache_memory=64 * 2**20, max_model_len=256, max_num_batched_tokens=64,
                  max_num_seqs=16, kv_cache_dtype="fp8_e4m3", **path)
        assert llm.engine.pool.dtype == torch.float8_e4m3fn
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outputs[0] == outputs[1] == outputs[2]
    for mode in ("recompute", "swap"):
        small = LLM(hf_model=model, num_blocks=14, block_size=16, max_model_len=200, watermark=0.0, max_num_seqs=16,
                    preemption_mode=mode, swap_space=2**20, kv_cache_dtype="fp8_e4m3")
        outs = small.generate(prompts, params)
        assert small.stats()["num_preemptions"] > 0
        assert [o.outputs[0].token_ids for o in outs] == outputs[0]
