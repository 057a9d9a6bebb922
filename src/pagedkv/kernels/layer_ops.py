"""The decoder's layer ops as fused Triton kernels, each with its plain torch reference beside it.

A decode step at batch 1 is not limited by bytes or FLOPs but by the number of kernels: an
HF-style layer launches ~70 small ones (RMSNorm alone is seven: cast, square, mean, add,
rsqrt, multiply, cast), and at ~2 us per graph node, 28 layers cost ~4 ms (measured on the
H200: 3.9 ms per step at batch 1 before these kernels). Three kernels take a layer down to
about ten nodes:

- `add_rms_norm`: residual += delta, then RMSNorm of the result (one pass, one launch);
- `qk_norm_rope_write_kv`: per (token, head): the optional Qwen3 q/k RMSNorm, rotary, and for
  kv heads the store of K and V straight into their paged-pool slots (no separate write);
- `silu_mul`: silu(gate) * up of the fused gate-up projection (`gelu_tanh_mul`: Gemma's
  gelu_pytorch_tanh(gate) * up, the same kernel).

Gemma's RMSNorm scales by (1 + weight) in fp32 and rounds once (`offset=True` in the norms),
where Llama's rounds the normalised value to the model dtype before the weight.

Rounding follows HF's modules op by op (each torch op on bf16/fp16 rounds its result), so the
fused path computes the same bits HF's eager modules do wherever fp32 arithmetic inside one
torch op allows: the kernels round to the model dtype exactly where HF does.

With an FP8 pool, `qk_norm_rope_write_kv` quantizes K (after rotary, in the model dtype) and V
with their heads' scales as it stores them (`triton_fp8.quantize`): the same bytes `write_kv`
would store for the same K/V.

Every launch is bound (`pagedkv.kernels.launch`): Triton's own `kernel[grid](...)` spends ~58 us
of host time per call, four calls per layer, which is most of an eager step (prefill chunks,
mixed steps, tensor-parallel workers' eager steps); inside a CUDA graph it costs nothing either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.launch import BoundKernel
from pagedkv.kernels.triton_fp8 import fp8_format, quantize


@triton.jit
def _round(x, dtype: tl.constexpr, ROUND: tl.constexpr):
    # Round an fp32 value to the model dtype and back, where an HF op would store its result.
    if ROUND:
        x = x.to(dtype).to(tl.float32)
    return x


# ---------------------------------------------------------------------------------------- references
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """HF's RMSNorm: normalise in fp32, cast back, then scale in the input dtype.

    `offset=True` is Gemma's: scale by (1 + weight) in fp32, then cast once.
    """
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


def add_rms_norm_reference(delta: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                           eps: float, offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + delta), residual + delta); with no residual, delta is the residual."""
    residual = delta if residual is None else residual + delta
    return rms_norm_reference(residual, weight, eps, offset), residual


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def qk_norm_rope_reference(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                           eps: float, offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, Hkv, D]; cos/sin fp32 tables [max_pos, D]. HF's order: q/k norm, then rotary."""
    if q_norm is not None:
        q, k = rms_norm_reference(q, q_norm, eps, offset), rms_norm_reference(k, k_norm, eps, offset)
    c = cos.index_select(0, positions).to(q.dtype)[:, None, :]
    s = sin.index_select(0, positions).to(q.dtype)[:, None, :]
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [T, 2 I] gate-up output."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_pytorch_tanh(gate) * up of a fused [T, 2 I] gate-up output (Gemma's MLP)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


# ---------------------------------------------------------------------------------------- add + RMSNorm
@triton.jit
def _scale_normed(x, rstd, w, dtype: tl.constexpr, ROUND: tl.constexpr, OFFSET: tl.constexpr):
    # Llama: round(x * rstd) * w; Gemma (OFFSET): x * rstd * (1 + w) in fp32, rounded once by the store.
    if OFFSET:
        return x * rstd * (1.0 + w)
    return _round(x * rstd, dtype, ROUND) * w


@triton.jit
def _add_rms_norm_kernel(delta_ptr, residual_ptr, weight_ptr, out_ptr, n_cols, eps,
                         stride_delta, stride_residual, stride_out,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, ROUND: tl.constexpr,
                         OFFSET: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    x = tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
        x = _round(x + r, dtype, ROUND)
        tl.store(residual_ptr + row * stride_residual + cols, x.to(dtype), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = _scale_normed(x, rstd, w, dtype, ROUND, OFFSET)
    tl.store(out_ptr + row * stride_out + cols, y.to(dtype), mask=mask)


_ADD_RMS_NORM = BoundKernel(_add_rms_norm_kernel)


def add_rms_norm(delta: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused `add_rms_norm_reference`. `residual` is updated in place (returned); with None, `delta` is it."""
    num_rows, n_cols = delta.shape
    out = torch.empty_like(delta)
    if num_rows:
        config = _ADD_RMS_NORM.config(HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n_cols),
                                      ROUND=delta.dtype != torch.float32, OFFSET=offset,
                                      num_warps=4 if n_cols <= 2048 else 8)
        config.launch((num_rows, 1, 1), (delta, residual if residual is not None else delta, weight, out),
                      (n_cols, float(eps), delta.stride(0), residual.stride(0) if residual is not None else 0,
                       out.stride(0)))
    return out, (residual if residual is not None else delta)


# ---------------------------------------------------------------------------------------- q/k norm + rotary + K/V write
@triton.jit
def _rope_half(x1, x2, c, s, dtype: tl.constexpr, ROUND: tl.constexpr):
    # HF: q * cos + rotate_half(q) * sin, each product and the sum rounded to the model dtype;
    # rotate_half(q) = cat(-x2, x1), and cos/sin repeat their first half in the second.
    o1 = _round(_round(x1 * c, dtype, ROUND) + _round(-x2 * s, dtype, ROUND), dtype, ROUND)
    o2 = _round(_round(x2 * c, dtype, ROUND) + _round(x1 * s, dtype, ROUND), dtype, ROUND)
    return o1, o2


@triton.jit
def _head_norm(x1, x2, w_ptr, half, halves, mask, eps, HEAD_DIM: tl.constexpr, dtype: tl.constexpr,
               ROUND: tl.constexpr, OFFSET: tl.constexpr):
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_DIM + eps)
    w1 = tl.load(w_ptr + halves, mask=mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + half + halves, mask=mask, other=0.0).to(tl.float32)
    x1 = _round(_scale_normed(x1, rstd, w1, dtype, ROUND, OFFSET), dtype, ROUND)
    x2 = _round(_scale_normed(x2, rstd, w2, dtype, ROUND, OFFSET), dtype, ROUND)
    return x1, x2


@triton.jit
def _qk_norm_rope_write_kernel(
    qkv_ptr, positions_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    k_scale_ptr, v_scale_ptr, eps, stride_qkv, stride_table, stride_cache_slot, stride_cache_head,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr,
    QK_NORM: tl.constexpr, ROUND: tl.constexpr, OFFSET: tl.constexpr,
    KV_FP8: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = HEAD_DIM // 2
    halves = tl.arange(0, HALF_PAD)
    mask = halves < half
    dtype = qkv_ptr.dtype.element_ty
    pos = tl.load(positions_ptr + token).to(tl.int64)
    c = _round(tl.load(cos_ptr + pos * stride_table + halves, mask=mask, other=0.0), dtype, ROUND)
    s = _round(tl.load(sin_ptr + pos * stride_table + halves, mask=mask, other=0.0), dtype, ROUND)
    row = qkv_ptr + token * stride_qkv
    if head < NUM_HEADS:  # a query head: rotated in place
        base = row + head * HEAD_DIM
        x1 = tl.load(base + halves, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + half + halves, mask=mask, other=0.0).to(tl.float32)
        if QK_NORM:
            x1, x2 = _head_norm(x1, x2, q_norm_ptr, half, halves, mask, eps, HEAD_DIM, dtype, ROUND, OFFSET)
        o1, o2 = _rope_half(x1, x2, c, s, dtype, ROUND)
        tl.store(base + halves, o1.to(dtype), mask=mask)
        tl.store(base + half + halves, o2.to(dtype), mask=mask)
    else:  # a kv head: K rotated, then K and V stored at the token's pool slot
        kv_head = head - NUM_HEADS
        k_base = row + (NUM_HEADS + kv_head) * HEAD_DIM
        v_base = row + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM
        x1 = tl.load(k_base + halves, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(k_base + half + halves, mask=mask, other=0.0).to(tl.float32)
        if QK_NORM:
            x1, x2 = _head_norm(x1, x2, k_norm_ptr, half, halves, mask, eps, HEAD_DIM, dtype, ROUND, OFFSET)
        o1, o2 = _rope_half(x1, x2, c, s, dtype, ROUND)
        # The rotated K back in place too: prefill reads a chunk's K/V from qkv (`triton_prefill_split`).
        tl.store(k_base + halves, o1.to(dtype), mask=mask)
        tl.store(k_base + half + halves, o2.to(dtype), mask=mask)
        slot = tl.load(slots_ptr + token).to(tl.int64)
        dst = slot * stride_cache_slot + kv_head * stride_cache_head
        v1 = tl.load(v_base + halves, mask=mask, other=0.0)
        v2 = tl.load(v_base + half + halves, mask=mask, other=0.0)
        if KV_FP8:  # K as the model dtype holds it, then quantized: what write_kv stores for that K
            k_scale = tl.load(k_scale_ptr + kv_head)
            v_scale = tl.load(v_scale_ptr + kv_head)
            o1 = quantize(o1.to(dtype), k_scale, MANT_BITS, MIN_EXP, FP8_MAX)
            o2 = quantize(o2.to(dtype), k_scale, MANT_BITS, MIN_EXP, FP8_MAX)
            v1 = quantize(v1, v_scale, MANT_BITS, MIN_EXP, FP8_MAX)
            v2 = quantize(v2, v_scale, MANT_BITS, MIN_EXP, FP8_MAX)
        cache_dtype = k_cache_ptr.dtype.element_ty
        tl.store(k_cache_ptr + dst + halves, o1.to(cache_dtype), mask=mask)
        tl.store(k_cache_ptr + dst + half + halves, o2.to(cache_dtype), mask=mask)
        tl.store(v_cache_ptr + dst + halves, v1.to(cache_dtype), mask=mask)
        tl.store(v_cache_ptr + dst + half + halves, v2.to(cache_dtype), mask=mask)


_QK_NORM_ROPE_WRITE = BoundKernel(_qk_norm_rope_write_kernel)


def qk_norm_rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                          num_heads: int, num_kv_heads: int, head_dim: int, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None, offset: bool = False) -> torch.Tensor:
    """Rotate q and k in place in `qkv` [T, (H + 2 Hkv) D], store rotated K and V at their slots; returns q [T, H, D].

    k_cache/v_cache [num_blocks, block_size, Hkv, D] (contiguous per slot); slot_mapping [T] int64, all >= 0.
    An FP8 cache takes its layer's `k_scale`/`v_scale` ([Hkv] float32) and stores quantized K/V.
    `offset=True`: the q/k norms are Gemma's (1 + weight).
    """
    num_tokens = qkv.shape[0]
    if num_tokens:
        mant_bits, min_exp, fp8_max = fp8_format(k_cache.dtype)
        kv_fp8 = k_scale is not None
        config = _QK_NORM_ROPE_WRITE.config(
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            HALF_PAD=triton.next_power_of_2(head_dim // 2), QK_NORM=q_norm is not None,
            ROUND=qkv.dtype != torch.float32, OFFSET=offset, KV_FP8=kv_fp8, MANT_BITS=mant_bits, MIN_EXP=min_exp,
            FP8_MAX=fp8_max, num_warps=1)
        config.launch((num_tokens, num_heads + num_kv_heads, 1),
                      (qkv, positions, cos, sin, q_norm if q_norm is not None else qkv,
                       k_norm if k_norm is not None else qkv, k_cache, v_cache, slot_mapping,
                       k_scale if kv_fp8 else qkv, v_scale if kv_fp8 else qkv),
                      (float(eps), qkv.stride(0), cos.stride(0), k_cache.stride(1), k_cache.stride(2)))
    return qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)


# ---------------------------------------------------------------------------------------- silu(gate) * up
@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, n_cols, stride_in, stride_out, BLOCK: tl.constexpr, ROUND: tl.constexpr,
                     GELU_TANH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + row * stride_in + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:  # 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), in fp32 as torch computes it
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = _round(0.5 * g * (1.0 + (1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))), dtype, ROUND)
    else:
        act = _round(g / (1.0 + tl.exp(-g)), dtype, ROUND)
    tl.store(out_ptr + row * stride_out + cols, (act * u).to(dtype), mask=mask)


_SILU_MUL = BoundKernel(_silu_mul_kernel)


def silu_mul(gate_up: torch.Tensor, gelu_tanh: bool = False) -> torch.Tensor:
    """Fused `silu_mul_reference` (`gelu_tanh_mul_reference` with `gelu_tanh`): [T, 2 I] -> [T, I]."""
    num_rows, width = gate_up.shape
    n_cols = width // 2
    out = torch.empty(num_rows, n_cols, dtype=gate_up.dtype, device=gate_up.device)
    if num_rows:
        block = min(1024, triton.next_power_of_2(n_cols))
        config = _SILU_MUL.config(BLOCK=block, ROUND=gate_up.dtype != torch.float32, GELU_TANH=gelu_tanh,
                                  num_warps=4)
        config.launch((num_rows, triton.cdiv(n_cols, block), 1), (gate_up, out),
                      (n_cols, gate_up.stride(0), out.stride(0)))
    return out
