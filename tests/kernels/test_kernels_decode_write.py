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
from pagedkv.hf import PagedCache, PagePool, random_model
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


# --------------------------------------------------------------------------- on CUDA
# The fused decode + K/V write kernel on CUDA: bound launches against Triton's own, and the decode step in generate.
#
# A bound launch replays a compiled kernel's C launcher; if its key missed a specialization
# Triton makes (16-byte alignment of a pointer, an int equal to 1 or divisible by 16, a dtype),
# it would run a kernel compiled for other inputs and compute garbage without an error. So
# every bound launch here is compared bit for bit with Triton's own launch of the same inputs
# (`paged_decode_write_attention`), over shapes and over inputs that change specialization.
# Both launch the same compiled kernel, so the kernel itself is also checked against the
# float64 reference on the GPU, split and unsplit (the interpreter cannot see GPU-only
# miscompilation: a kernel can be right under the interpreter and wrong compiled).
#: dtype, (q heads, kv heads), head_dim, block_size, batch, max kv length, sliding window, soft cap
SHAPES = [
    (torch.float16, (12, 12), 64, 16, 1, 140, None, None),  # GPT-2 124M, batch 1
    (torch.float16, (12, 12), 64, 16, 32, 140, None, None),  # GPT-2 124M, batch 32
    (torch.bfloat16, (32, 8), 64, 16, 1, 140, None, None),  # Llama-3.2-1B, batch 1
    (torch.bfloat16, (32, 8), 64, 16, 32, 140, None, None),  # Llama-3.2-1B, batch 32
    (torch.bfloat16, (32, 8), 128, 32, 3, 3000, None, None),  # long: split, merged in the launch
    (torch.float16, (16, 2), 128, 16, 5, 700, 256, None),  # window
    (torch.bfloat16, (8, 1), 256, 16, 7, 300, None, 30.0),  # soft cap, head_dim 256
    (torch.float16, (28, 4), 80, 8, 2, 900, None, None),  # head_dim padded, small pages
]
SHAPE_IDS = [f"{str(d)[6:]}-h{h}:{kv}-d{hd}-bs{bs}-b{b}-len{n}-w{w}-cap{c}"
             for d, (h, kv), hd, bs, b, n, w, c in SHAPES]


class _Case:
    """Two identical pools and one decode step's inputs over them: one pool for each launch path."""

    def __init__(self, dtype, heads, head_dim, block_size, batch, max_len, seed=0, num_layers=2):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        num_heads, num_kv_heads = heads
        max_blocks = -(-max_len // block_size)
        num_blocks = batch * max_blocks + 4
        self.pools = [KVPool(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, "cuda")
                      for _ in range(2)]
        self.pools[0].kv.copy_(torch.randn(self.pools[0].kv.shape, generator=generator, device="cuda").to(dtype))
        self.pools[1].kv.copy_(self.pools[0].kv)
        lens = torch.randint(1, max_len + 1, (batch,), generator=generator, device="cuda")
        lens[0] = max_len
        self.seq_lens = lens.to(torch.int64)
        width = 1 << (max_blocks - 1).bit_length()
        order = torch.randperm(num_blocks, generator=generator, device="cuda")[:batch * max_blocks]
        self.block_tables = torch.zeros(batch, width, dtype=torch.int64, device="cuda")
        self.block_tables[:, :max_blocks] = order.view(batch, max_blocks)
        self.query = torch.randn(batch, num_heads, 1, head_dim, generator=generator, device="cuda").to(dtype)
        self.key = torch.randn(batch, num_kv_heads, 1, head_dim, generator=generator, device="cuda").to(dtype)
        self.value = torch.randn(batch, num_kv_heads, 1, head_dim, generator=generator, device="cuda").to(dtype)
        self.max_len = max_len

    def triton_launch(self, layer, query, key, value, num_splits, scale, window, soft_cap):
        """Triton's own launch (through `paged_decode_write_attention`, every check on), into pool 1."""
        pool = self.pools[1]
        return paged_decode_write_attention(query.squeeze(2), key.squeeze(2), value.squeeze(2), pool.k_caches[layer],
                                            pool.v_caches[layer], self.block_tables, self.seq_lens, scale=scale,
                                            sliding_window=window, soft_cap=soft_cap, num_splits=num_splits,
                                            max_seq_len=self.max_len, backend="triton")


def _bound(step, layer, query, key, value, scale, window, soft_cap):
    return step(layer, query, key, value, scale, window, soft_cap).squeeze(1)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("dtype, heads, head_dim, block_size, batch, max_len, window, soft_cap", SHAPES,
                         ids=SHAPE_IDS)
def test_fused_kernel_matches_the_float64_reference(dtype, heads, head_dim, block_size, batch, max_len, window,
                                                    soft_cap, num_splits):
    case = _Case(dtype, heads, head_dim, block_size, batch, max_len)
    pool = case.pools[0]
    scale = head_dim ** -0.5
    expected = reference_decode_write_attention(
        case.query.squeeze(2), case.key.squeeze(2), case.value.squeeze(2), pool.k_caches[0].clone(),
        pool.v_caches[0].clone(), case.block_tables, case.seq_lens, scale=scale, sliding_window=window,
        soft_cap=soft_cap, float64=True)
    got = case.triton_launch(0, case.query, case.key, case.value, num_splits, scale, window, soft_cap)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=tolerance)
    # The new K/V landed in their slots: the pool now equals one the reference wrote into.
    written = pool.k_caches[0].clone(), pool.v_caches[0].clone()
    reference_decode_write_attention(case.query.squeeze(2), case.key.squeeze(2), case.value.squeeze(2), *written,
                                     case.block_tables, case.seq_lens, scale=scale)
    assert torch.equal(case.pools[1].k_caches[0], written[0]) and torch.equal(case.pools[1].v_caches[0], written[1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, heads, head_dim, block_size, batch, max_len, window, soft_cap", SHAPES,
                         ids=SHAPE_IDS)
def test_bound_launch_equals_triton_launch(dtype, heads, head_dim, block_size, batch, max_len, window, soft_cap):
    case = _Case(dtype, heads, head_dim, block_size, batch, max_len)
    kernel = DecodeWriteKernel(case.pools[0])
    assert kernel.kernel.bindable
    scale = head_dim ** -0.5
    for layer in range(2):
        step = kernel.step(case.block_tables, case.seq_lens, case.max_len)
        for _ in range(2):  # the first call of a key goes through Triton and binds; the second replays
            got = _bound(step, layer, case.query, case.key, case.value, scale, window, soft_cap)
        expected = case.triton_launch(layer, case.query, case.key, case.value, step.num_splits, scale, window,
                                      soft_cap)
        assert torch.equal(got, expected), (got - expected).abs().max()
    assert torch.equal(case.pools[0].kv, case.pools[1].kv)
    bound, through_triton = kernel.kernel.launch_counts
    assert through_triton == 1 and bound == 3  # one key for both layers: bound once, replayed after


@pytest.mark.gpu
def test_bound_launch_rebinds_when_the_specialization_changes():
    """Misaligned pointers, strides that become 1 or stop being divisible by 16, a wider table: each its own key."""
    case = _Case(torch.float16, (8, 2), 64, 16, 4, 120, seed=1)
    kernel = DecodeWriteKernel(case.pools[0])
    step = kernel.step(case.block_tables, case.seq_lens, case.max_len)
    base = torch.empty(4 * 8 * 64 + 8, dtype=torch.float16, device="cuda")
    misaligned = base[1:1 + 4 * 8 * 64].view(4, 8, 1, 64)  # 2 bytes past a 16-byte boundary
    misaligned.copy_(case.query)
    spread = torch.zeros(4, 2, 1, 64, 2, dtype=torch.float16, device="cuda")
    spread[..., 0] = case.key
    strided_key = spread[..., 0]  # head_dim stride 2, no longer the constant 1
    fused_qkv = torch.zeros(4, 1, 12 * 64, dtype=torch.float16, device="cuda")
    fused_qkv[..., :512] = case.query.transpose(1, 2).reshape(4, 1, 512)
    strided_query = fused_qkv[..., :512].view(4, 1, 8, 64).transpose(1, 2)  # sequence stride 768
    variants = [(case.query, case.key), (misaligned, case.key), (case.query, strided_key),
                (strided_query, case.key), (case.query, case.key)]
    for query, key in variants:
        for _ in range(2):
            got = _bound(step, 0, query, key, case.value, 0.125, None, None)
        expected = case.triton_launch(0, query, key, case.value, step.num_splits, 0.125, None, None)
        assert torch.equal(got, expected)
    (config,) = kernel._configs.values()
    assert config.num_bindings == 4  # the last variant is the first one again
    padded_out = torch.full((4, 8, 80), float("nan"), dtype=torch.float16, device="cuda")[..., :64]  # row 80 apart
    for _ in range(2):
        step(0, case.query, case.key, case.value, 0.125, out=padded_out)
    assert torch.equal(padded_out, expected) and config.num_bindings == 5
    wide = torch.zeros(4, 2 * case.block_tables.shape[1], dtype=torch.int64, device="cuda")
    wide[:, :case.block_tables.shape[1]] = case.block_tables
    wide_step = kernel.step(wide, case.seq_lens, case.max_len)
    got = _bound(wide_step, 0, case.query, case.key, case.value, 0.125, None, None)
    case.block_tables = wide
    assert torch.equal(got, case.triton_launch(0, case.query, case.key, case.value, wide_step.num_splits, 0.125,
                                               None, None))
    assert config.num_bindings == 6


@pytest.mark.gpu
@pytest.mark.parametrize("name, dtype", [("gpt2", torch.float16), ("llama3.2-1b", torch.bfloat16)])
def test_generate_decode_steps_replay_bound_launches(name, dtype):
    """After one warm-up generate, every decode step's fused launch is bound, and the tokens do not change."""
    model = random_model(name, dtype, "cuda", num_hidden_layers=2) if name != "gpt2" else \
        random_model(name, dtype, "cuda", n_layer=2)
    ids = torch.randint(0, 1000, (3, 10), generator=torch.Generator().manual_seed(0)).cuda()
    pool = PagePool.for_model(model, num_blocks=64, block_size=16)
    pool.fused_decode = True

    def generate():
        with PagedCache(pool) as cache:
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                  past_key_values=cache, pad_token_id=0, eos_token_id=None,
                                  output_logits=True, return_dict_in_generate=True)

    first = generate()
    before = pool.decode_write_kernel().kernel.launch_counts
    second = generate()
    bound, through_triton = (after - prior for after, prior in zip(pool.decode_write_kernel().kernel.launch_counts,
                                                                    before))
    assert through_triton == 0 and bound == 2 * 39  # 2 layers x 39 decode steps, all bound
    assert torch.equal(first.sequences, second.sequences)
    # The unfused path, teacher-forced on the fused run's tokens (a greedy run of its own may take
    # another token at a near-tie, after which its logits are another sequence's): each step's logits
    # agree to a few units in the last place of the largest logit. The fused kernel folds the new
    # token in fp32 where the unfused one rounds its probability to the model dtype in a tile
    # (bf16: 410 of 384,768 logits were 1-2 ulps apart on the H200).
    tokens = second.sequences
    with PagedCache(pool) as cache, torch.no_grad():
        cache._decode_kernel = None  # write_kv, then the unfused decode kernel
        mask = torch.ones_like(ids)
        logits = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, -1]
        for step, fused_logits in enumerate(second.logits):
            ulp = torch.finfo(dtype).eps * logits.float().abs().max().item()
            torch.testing.assert_close(fused_logits.float(), logits.float(), atol=4 * ulp, rtol=0)
            if step + 1 < len(second.logits):
                next_ids = tokens[:, ids.shape[1] + step:ids.shape[1] + step + 1]
                mask = torch.cat([mask, torch.ones_like(next_ids)], dim=1)
                logits = model(next_ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, -1]
    assert pool.num_used_blocks == 0


@pytest.mark.gpu
def test_split_step_counters_stay_zero_and_long_sequences_match():
    """A split decode step merges in the launch and leaves its counters zero for the next step."""
    case = _Case(torch.bfloat16, (32, 8), 64, 16, 2, 4000, seed=3)
    kernel = DecodeWriteKernel(case.pools[0], DecodeTuning(min_split_tokens=256))
    step = kernel.step(case.block_tables, case.seq_lens, case.max_len)
    assert step.num_splits > 1
    for _ in range(3):
        got = _bound(step, 1, case.query, case.key, case.value, 0.125, None, None)
    expected = case.triton_launch(1, case.query, case.key, case.value, step.num_splits, 0.125, None, None)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    kernel._workspace.check_integrity()
