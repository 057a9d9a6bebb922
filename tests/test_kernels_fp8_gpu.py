"""FP8 KV caches on CUDA: the Triton kernels compiled for the GPU against the torch reference (run on the H200).

The CPU run (`test_kernels_fp8.py`) covers the same kernels under the interpreter at small
shapes in fp32/fp16; here they run compiled, in bf16, at Llama-3-8B attention shapes, with
the hardware FP8 conversions, CUDA graphs, and the engine's three model paths.
"""

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.hf import random_model
from pagedkv.kernels import (
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
from pagedkv.kernels.fp8 import DEFAULT_HEADROOM, fp8_max

from test_kernels_gpu import LENGTHS, LLAMA3, SCHEDULES, TOLERANCES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
#: (atol, rtol) against the float64 reference: bf16 queries and outputs, as in test_kernels_gpu.py.
TOLERANCE = dict(zip(("atol", "rtol"), TOLERANCES[torch.bfloat16]))


class Fp8GpuScenario:
    """Sequences of `seq_lens` in a NaN-poisoned FP8 pool behind shuffled tables, per-head scales from the amax."""

    def __init__(self, seq_lens, block_size, num_kv_heads, head_dim, cache_dtype, seed=0):
        generator = torch.Generator().manual_seed(seed)
        blocks = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(blocks) + 31
        order = torch.randperm(num_blocks, generator=generator)
        table = order[sum(blocks):][torch.randint(31, (len(seq_lens), max(blocks) + 3), generator=generator)]
        slots, start = [], 0
        for b, (n, num) in enumerate(zip(seq_lens, blocks)):
            table[b, :num] = order[start:start + num]
            start += num
            positions = torch.arange(n)
            slots.append(table[b, positions // block_size] * block_size + positions % block_size)
        self.block_tables = table.to(torch.int32).cuda()
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        self.slots = torch.cat(slots).cuda()
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


def _assert_close(out, expected):
    assert not out.isnan().any(), "NaN leaked from a poisoned slot"
    torch.testing.assert_close(out.double(), expected, **TOLERANCE)


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
    _assert_close(out, expected)


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
def test_prefill_and_mixed_step_match_reference(cache_dtype):
    num_heads, num_kv_heads, head_dim = LLAMA3
    seq_lens, q_lens = [1, 17, 1000, 129, 2048], [1, 1, 300, 129, 64]
    scenario = Fp8GpuScenario(seq_lens, 16, num_kv_heads, head_dim, cache_dtype, seed=3)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    query = scenario.query(int(cu[-1]), num_heads)
    args = (query, *scenario.kv, cu)
    expected = reference_prefill_attention(*args, scale=0.088, float64=True, **scenario.scales)
    _assert_close(paged_prefill_attention(*args, scale=0.088, max_seqlen_q=max(q_lens), **scenario.scales), expected)
    expected = reference_paged_attention(*args, scale=0.088, float64=True, **scenario.scales)
    out = paged_attention(*args, scale=0.088, max_seqlen_q=max(q_lens), max_seq_len=max(seq_lens),
                          tuning=UnifiedTuning(decode_route=False), **scenario.scales)
    _assert_close(out, expected)


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


PATHS = [{}, {"enforce_eager": True}, {"model_impl": "hf"}]  # own decoder + graphs, own eager, HF modules


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_engine_fp8_paths_agree_and_preemption_is_invariant(name):
    model = random_model(name, torch.float32, "cuda")
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 500, (40,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 500, (n,), generator=gen).tolist() for n in (3, 40, 17, 64, 1, 100)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = []
    for path in PATHS:
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
