"""The decoder's fused Triton kernels against their torch references (interpreter on CPU, compiled on CUDA)."""

import pytest
import torch

from pagedkv.kernels import layer_ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# (num_heads, num_kv_heads, head_dim): GQA ratios 1, 3, 4 and a head_dim that is not a power of two
HEADS = [(4, 4, 16), (9, 3, 64), (8, 2, 32), (4, 2, 40)]


def _randn(*shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(dtype, with_residual):
    delta = _randn(5, 96, dtype=dtype, seed=1)
    residual = _randn(5, 96, dtype=dtype, seed=2) if with_residual else None
    weight = _randn(96, dtype=dtype, seed=3)
    expected, expected_residual = layer_ops.add_rms_norm_reference(delta, residual, weight, 1e-6)
    got, got_residual = layer_ops.add_rms_norm(delta.clone(), residual.clone() if with_residual else None, weight, 1e-6)
    torch.testing.assert_close(got, expected, **TOL[dtype])
    torch.testing.assert_close(got_residual, expected_residual, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_qk_norm_rope_write_kv(dtype, heads, qk_norm):
    num_heads, num_kv_heads, head_dim = heads
    num_tokens, num_blocks, block_size = 6, 8, 4
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=4)
    positions = torch.tensor([0, 5, 17, 3, 30, 1], device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(32, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(DEVICE), emb.sin().to(DEVICE)
    q_norm = _randn(head_dim, dtype=dtype, seed=5) if qk_norm else None
    k_norm = _randn(head_dim, dtype=dtype, seed=6) if qk_norm else None
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = k_cache.clone()
    slots = torch.tensor([3, 9, 10, 0, 31, 17], device=DEVICE)

    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    exp_q, exp_k = layer_ops.qk_norm_rope_reference(q.reshape(num_tokens, num_heads, head_dim),
                                                k.reshape(num_tokens, num_kv_heads, head_dim), positions, cos, sin,
                                                q_norm, k_norm, 1e-6)
    rotated = qkv.clone()
    got_q = layer_ops.qk_norm_rope_write_kv(rotated, positions, cos, sin, q_norm, k_norm, 1e-6, k_cache, v_cache,
                                        slots, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    torch.testing.assert_close(got_q, exp_q, **TOL[dtype])
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    torch.testing.assert_close(flat_k[slots], exp_k, **TOL[dtype])
    # K is rotated in place as well, to the very values stored (prefill reads a chunk's K/V from qkv); V stays.
    assert torch.equal(rotated[:, q_size:q_size + kv_size].reshape(num_tokens, num_kv_heads, head_dim), flat_k[slots])
    assert torch.equal(rotated[:, q_size + kv_size:], qkv[:, q_size + kv_size:])
    assert torch.equal(flat_v[slots], v.reshape(num_tokens, num_kv_heads, head_dim))
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    gate_up = _randn(7, 2 * 80, dtype=dtype, seed=7)
    torch.testing.assert_close(layer_ops.silu_mul(gate_up), layer_ops.silu_mul_reference(gate_up), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_offset_norms_and_gelu_tanh(dtype):
    """Gemma's (1 + weight) RMSNorm, on the residual stream and on q/k heads, and gelu_pytorch_tanh(gate) * up."""
    delta, residual = _randn(5, 96, dtype=dtype, seed=1), _randn(5, 96, dtype=dtype, seed=2)
    weight = _randn(96, dtype=dtype, seed=3) * 0.1
    expected, expected_residual = layer_ops.add_rms_norm_reference(delta, residual, weight, 1e-6, offset=True)
    assert not torch.allclose(expected, layer_ops.add_rms_norm_reference(delta, residual, weight, 1e-6)[0])
    got, got_residual = layer_ops.add_rms_norm(delta.clone(), residual.clone(), weight, 1e-6, offset=True)
    torch.testing.assert_close(got, expected, **TOL[dtype])
    torch.testing.assert_close(got_residual, expected_residual, **TOL[dtype])

    num_heads, num_kv_heads, head_dim = 4, 2, 32
    qkv = _randn(3, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=4)
    positions = torch.tensor([0, 7, 2], device=DEVICE)
    freqs = torch.arange(8, dtype=torch.float32)[:, None] / (100 ** (torch.arange(0, head_dim, 2) / head_dim))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(DEVICE), emb.sin().to(DEVICE)
    q_norm, k_norm = _randn(head_dim, dtype=dtype, seed=5), _randn(head_dim, dtype=dtype, seed=6)
    k_cache = torch.zeros((2, 4, num_kv_heads, head_dim), dtype=dtype, device=DEVICE)
    slots = torch.tensor([1, 5, 6], device=DEVICE)
    q, k, _ = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    exp_q, exp_k = layer_ops.qk_norm_rope_reference(q.reshape(3, num_heads, head_dim),
                                                    k.reshape(3, num_kv_heads, head_dim), positions, cos, sin,
                                                    q_norm, k_norm, 1e-6, offset=True)
    got_q = layer_ops.qk_norm_rope_write_kv(qkv.clone(), positions, cos, sin, q_norm, k_norm, 1e-6, k_cache,
                                            k_cache.clone(), slots, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                            head_dim=head_dim, offset=True)
    torch.testing.assert_close(got_q, exp_q, **TOL[dtype])
    torch.testing.assert_close(k_cache.view(-1, num_kv_heads, head_dim)[slots], exp_k, **TOL[dtype])

    gate_up = _randn(7, 2 * 80, dtype=dtype, seed=7) * 3
    torch.testing.assert_close(layer_ops.silu_mul(gate_up, gelu_tanh=True), layer_ops.gelu_tanh_mul_reference(gate_up),
                               **TOL[dtype])
