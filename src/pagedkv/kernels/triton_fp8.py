"""Triton FP8 helpers: quantize on the way into the pool, dequantize on the way into registers.

`quantize` computes `pagedkv.kernels.fp8.quantize` bit for bit: an IEEE division by the head's
scale (`div_rn`: Triton's `/` is an approximate division on NVIDIA GPUs), a clamp to the
format's max, then rounding to the nearest FP8 value, ties to even, done on the fp32 bits:

    normal range     drop 23 - MANT_BITS mantissa bits, round half to even (a carry moves
                     into the exponent, which is what rounding 1.1111b up to 10.000b means)
    below 2**MIN_EXP the FP8 subnormals: multiples of 2**(MIN_EXP - MANT_BITS), same rounding

after which the cast to FP8 is exact. On a GPU the hardware conversion (cvt.rn.satfinite) would
round the same way; the explicit rounding is there because Triton's interpreter rounds an
fp32 -> fp8 cast half-up and drops the carry into the exponent (1.97 -> 1.0 in e4m3), so with
it the interpreter runs the Triton write path on CPU and matches torch exactly. It costs a few
integer operations per value in a kernel that is bound by memory.

`to_compute` converts a loaded FP8 tile to the compute dtype. Every FP8 value is exact in fp16,
bf16 and fp32, so on a GPU the conversion is direct (`FP8_CONVERT` "direct"); under the
interpreter it goes through fp32 ("fp32"), because the interpreter's direct e5m2 -> fp16
conversion loses subnormals. PAGEDKV_FP8_CONVERT=fp32|direct|bits picks a route (to compare):
"bits" builds fp16 tiles with integer operations instead of conversion instructions - e5m2 is
the top byte of an fp16, and an e4m3 byte moved into fp16's exponent and mantissa fields is its
value times 2**-8, so one exact multiply by 256 restores it (fp16 compute only; else "direct").
Exact for every finite code; e4m3's two NaN codes come out as +-480, which no pool holds
(`quantize` saturates at 448).

Byte loads: Triton stages an FP8 tile in shared memory and reads it into the `mma` operand layout
one byte per value (8-bit operands have no `ldmatrix` path). Loading int32 words and converting
four codes per word in registers removes those reads but ran 3-12% slower on the H200; that route
was removed again (docs/kernels.md, FP8 decode).

`fp8_query` picks the compute dtype of an FP8 cache's tiles. A bf16 model's query is taken
to fp16 (clamped to fp16's range; fp16 holds every bf16 value of its normal range exactly, with
3 more mantissa bits, and rounds the tiny ones below 2**-14 to its subnormals), so a K/V tile needs one
conversion (e4m3x2 -> f16x2, one instruction per two values)
instead of two (then f16 -> bf16, one per value), and the dots run in fp16 with fp32
accumulation. PAGEDKV_FP8_COMPUTE=model keeps the model's dtype (to compare).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagedkv.env import env_choice


FP8_CONVERT_ROUTES = ("fp32", "direct", "bits")


def _fp8_convert_route() -> str:
    """`to_compute`'s route: PAGEDKV_FP8_CONVERT, else fp32 under the interpreter and direct on a GPU."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return env_choice("PAGEDKV_FP8_CONVERT", FP8_CONVERT_ROUTES, "fp32" if interpreted else "direct")


#: How `to_compute` turns FP8 tiles into the compute dtype (see the module docstring).
FP8_CONVERT = tl.constexpr(_fp8_convert_route())


def _fp8_compute() -> bool:
    """PAGEDKV_FP8_COMPUTE: "f16" (the default) or "model"."""
    return env_choice("PAGEDKV_FP8_COMPUTE", ("f16", "model"), "f16") == "f16"


#: Whether an FP8 cache's tiles are computed in fp16 for a bf16 model (`fp8_query`).
FP8_F16_COMPUTE = tl.constexpr(_fp8_compute())
FP16_MAX = tl.constexpr(65504.0)


def fp8_format(dtype: torch.dtype) -> tuple[int, int, float]:
    """(MANT_BITS, MIN_EXP, MAX) of an FP8 storage dtype, the constexprs of `quantize`."""
    if dtype == torch.float8_e4m3fn:
        return 3, -6, 448.0
    if dtype == torch.float8_e5m2:
        return 2, -14, 57344.0
    return 0, 0, 0.0  # not FP8: the kernels never quantize


@triton.jit
def round_to_fp8(x, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """fp32 `x` (|x| <= the format's max) rounded to the nearest FP8 value, ties to even; still fp32."""
    bits = x.to(tl.int32, bitcast=True)
    sign = bits & -2147483648
    mag = bits & 0x7FFFFFFF
    exp = (mag >> 23) - 127
    DROP: tl.constexpr = 23 - MANT_BITS
    normal = (mag + ((1 << (DROP - 1)) - 1) + ((mag >> DROP) & 1)) & ~((1 << DROP) - 1)
    # Subnormal: |x| = significand * 2**(exp - 23); count multiples of 2**(MIN_EXP - MANT_BITS).
    significand = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(DROP + MIN_EXP - exp, 1), 31)
    count = (significand + ((1 << (shift - 1)) - 1) + ((significand >> shift) & 1)) >> shift
    small = (count.to(tl.float32) * (2.0 ** (MIN_EXP - MANT_BITS))).to(tl.int32, bitcast=True)
    out = tl.where(exp >= MIN_EXP, normal, tl.where(mag == 0, 0, small))
    return (out | sign).to(tl.float32, bitcast=True)


@triton.jit
def quantize(x, scale, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, FP8_MAX: tl.constexpr):
    """fp8(clamp(x / scale, +-FP8_MAX)) as fp32 on the FP8 grid (cast it to the cache dtype: exact)."""
    x, scale = tl.broadcast(x.to(tl.float32), scale)  # div_rn does not broadcast its operands
    y = tl.math.div_rn(x, scale)
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    return round_to_fp8(y, MANT_BITS, MIN_EXP)


@triton.jit
def fp8_bits_to_f16(tile):
    """An e4m3 or e5m2 tile as fp16, by integer operations (exact; see the module docstring)."""
    byte = tile.to(tl.uint8, bitcast=True).to(tl.uint16)
    if tile.dtype == tl.float8e5:
        return (byte << 8).to(tl.uint16).to(tl.float16, bitcast=True)
    half = (((byte & 0x80) << 8) | ((byte & 0x7F) << 7)).to(tl.uint16)
    return half.to(tl.float16, bitcast=True) * 256.0


@triton.jit
def to_compute(tile, dtype: tl.constexpr, KV_FP8: tl.constexpr):
    """A loaded K or V tile in the compute dtype (exact for FP8 on every route); anything else as loaded."""
    if KV_FP8:
        if FP8_CONVERT == "bits" and dtype == tl.float16:
            tile = fp8_bits_to_f16(tile)
        elif FP8_CONVERT == "fp32":
            tile = tile.to(tl.float32).to(dtype)
        else:
            tile = tile.to(dtype)
    return tile


@triton.jit
def fp8_query(q, KV_FP8: tl.constexpr):
    """The query in its tiles' compute dtype: fp16 for a bf16 query over an FP8 cache (see the module docstring)."""
    if KV_FP8 and FP8_F16_COMPUTE and q.dtype == tl.bfloat16:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -FP16_MAX), FP16_MAX).to(tl.float16)
    return q
