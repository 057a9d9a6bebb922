"""FP8 KV storage: one byte per K/V value, a float32 scale per (layer, KV head), and the math both sides share.

`kv_cache_dtype` is the one option every entry point takes:

    "auto"       the model's dtype (bf16 / fp16 / fp32): no quantization
    "fp8_e4m3"   torch.float8_e4m3fn: 3 mantissa bits, max 448 (the usual choice for K/V)
    "fp8_e5m2"   torch.float8_e5m2: 2 mantissa bits, max 57344 (more range, less precision)

Stored value and real value are tied by a dequantization scale per layer, per KV head, for K
and V separately (`KVScales`, `[num_layers, num_kv_heads]` float32 each):

    quantize     q = fp8(clamp(x / scale, -FP8_MAX, FP8_MAX))     round to nearest, ties to even
    dequantize   x ~ float(q) * scale

The clamp makes an outlier past the calibrated range saturate at +-FP8_MAX instead of becoming
NaN (e4m3fn has no infinity: torch turns anything past 464 into NaN). Every path (the Triton
write kernels, the fused rotary kernel, the torch path, the reference) quantizes with exactly
this formula: an IEEE division in fp32, the clamp, then round-to-nearest-even. They produce
the same bytes for the same input.

The attention kernels read the bytes, convert them to the compute dtype (exact: every fp8 value
is a bf16/fp16 value) and fold the scales in where that is exact arithmetic, not a second pass:
the K scale into the softmax scale (a program reads one KV head, so one scalar), the V scale into
the output (softmax weights sum to one per head, so it factors out). The reference dequantizes
explicitly; both compute the same function up to rounding.

Where the scales come from (see `pagedkv.hf.kv_scales`): the checkpoint where it carries them
(vLLM / compressed-tensors `k_scale` / `v_scale` on the attention modules), otherwise a short
calibration pass over a fixed built-in text at startup, with `DEFAULT_HEADROOM`. Either way they
are fixed for the pool's life: a preempted sequence recomputed later, or a prefix-cache hit,
reads and writes exactly the bytes the first computation did.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.core.memory import KV_CACHE_DTYPES, check_kv_cache_dtype  # noqa: F401 (the option's names, here too)
from pagedkv.errors import ConfigError, KernelInputError

#: Option name -> torch storage dtype.
FP8_DTYPES: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
#: Oldest CUDA compute capability whose Triton build converts to each format (Triton's own table:
#: fp8e4nv needs sm_89 (Ada / Hopper); fp8e5 converts everywhere Triton runs).
MIN_CUDA_CAPABILITY = {"fp8_e4m3": (8, 9), "fp8_e5m2": (8, 0)}
#: Calibrated amax maps to FP8_MAX / DEFAULT_HEADROOM: values up to twice what the calibration text
#: produced still fit, and beyond that they saturate. A floating-point format keeps its relative
#: precision across the range, so the binade given up at the top costs only one at the bottom.
#: Measured on SmolLM2-135M (e4m3, 20k tokens): headroom 1 lost 0.2-0.35 perplexity points to
#: saturation against 2; 2 to 128 were the same within noise.
DEFAULT_HEADROOM = 2.0


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether `dtype` is one of the FP8 storage dtypes."""
    return dtype in FP8_DTYPES.values()


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def kv_cache_dtype_name(dtype: torch.dtype) -> str:
    """The option name of a storage dtype: 'fp8_e4m3', 'fp8_e5m2', or the torch name ('bfloat16')."""
    for name, fp8 in FP8_DTYPES.items():
        if fp8 == dtype:
            return name
    return str(dtype).removeprefix("torch.")


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype,
                           device: str | torch.device | None = None) -> torch.dtype:
    """The storage dtype for `kv_cache_dtype` with a model in `model_dtype` on `device`.

    Raises `ConfigError` for an unknown name, or an FP8 format the device cannot convert
    (a CUDA GPU older than `MIN_CUDA_CAPABILITY`, or a Triton build without the type):
    no silent fallback to the model dtype.
    """
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        return model_dtype
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        needed = MIN_CUDA_CAPABILITY[kv_cache_dtype]
        if capability < needed:
            allowed = ["auto"] + [name for name, cap in MIN_CUDA_CAPABILITY.items() if capability >= cap]
            raise ConfigError(f"kv_cache_dtype {kv_cache_dtype!r} needs a GPU of compute capability "
                              f"{needed[0]}.{needed[1]}+, this one is {capability[0]}.{capability[1]}; choose one "
                              f"of {', '.join(allowed)}")
        try:
            import triton.language as tl
        except ImportError:
            tl = None
        triton_name = {"fp8_e4m3": "float8e4nv", "fp8_e5m2": "float8e5"}[kv_cache_dtype]
        if tl is None or not hasattr(tl, triton_name):
            raise ConfigError(f"kv_cache_dtype {kv_cache_dtype!r} needs Triton's {triton_name}, which this Triton "
                              f"build lacks; choose one of auto")
    return FP8_DTYPES[kv_cache_dtype]


@dataclass(frozen=True)
class KVScales:
    """Dequantization scales of an FP8 pool: real K = stored K * k_scale[layer, kv_head] (V likewise).

    `source` says where they came from ('checkpoint', 'calibration: N tokens', 'unit').
    """

    k_scale: torch.Tensor  # [num_layers, num_kv_heads] float32
    v_scale: torch.Tensor  # [num_layers, num_kv_heads] float32
    source: str

    def __post_init__(self):
        for name in ("k_scale", "v_scale"):
            scale = getattr(self, name)
            if not isinstance(scale, torch.Tensor) or scale.dim() != 2 or scale.dtype != torch.float32:
                got = f"{tuple(scale.shape)} {scale.dtype}" if isinstance(scale, torch.Tensor) else repr(scale)
                raise ConfigError(f"KVScales.{name} must be a [num_layers, num_kv_heads] float32 tensor, got {got}")
            if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
                raise ConfigError(f"KVScales.{name} must be finite and > 0, got min {float(scale.min())}")
        if self.k_scale.shape != self.v_scale.shape:
            raise ConfigError(f"k_scale {tuple(self.k_scale.shape)} and v_scale {tuple(self.v_scale.shape)} differ")

    @classmethod
    def unit(cls, num_layers: int, num_kv_heads: int) -> KVScales:
        """Scale 1 everywhere (vLLM's default when a checkpoint has none: uncalibrated)."""
        ones = torch.ones(num_layers, num_kv_heads, dtype=torch.float32)
        return cls(ones, ones.clone(), "unit")

    @classmethod
    def from_amax(cls, k_amax: torch.Tensor, v_amax: torch.Tensor, dtype: torch.dtype, source: str,
                  headroom: float = DEFAULT_HEADROOM) -> KVScales:
        """Scales that map each head's absolute maximum to FP8_MAX / headroom (a head that was all zeros gets 1)."""
        if not headroom >= 1.0:
            raise ConfigError(f"headroom must be >= 1 (a smaller one overflows the calibrated range), got {headroom}")
        top = fp8_max(dtype) / headroom

        def scale(amax: torch.Tensor) -> torch.Tensor:
            amax = amax.detach().to("cpu", torch.float32)
            return torch.where(amax > 0, amax / top, torch.ones_like(amax))

        return cls(scale(k_amax), scale(v_amax), source)

    def shard(self, rank: int, size: int) -> KVScales:
        """The KV heads of tensor-parallel rank `rank` of `size` (contiguous blocks of heads)."""
        num_heads = self.k_scale.shape[1]
        if num_heads % size:
            raise ConfigError(f"{num_heads} KV heads do not divide by tensor_parallel_size {size}")
        per_rank = num_heads // size
        heads = slice(rank * per_rank, (rank + 1) * per_rank)
        return KVScales(self.k_scale[:, heads].contiguous(), self.v_scale[:, heads].contiguous(), self.source)


# ---------------------------------------------------------------------------------------- the torch math
def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x `[..., num_kv_heads, head_dim]` -> `dtype` bytes: fp8(clamp(x / scale[head], +-max)), ties to even."""
    limit = fp8_max(dtype)
    return (x.float() / scale.float()[:, None]).clamp_(-limit, limit).to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored values `[..., num_kv_heads, head_dim]` back to `dtype`: float(q) * scale[head]."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    return (q.to(work) * scale.to(work)[:, None]).to(dtype)


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor as its uint8 bytes (a view), any other tensor as itself.

    Block copies and slot writes go through this: torch has no CPU `index_copy_` for float8,
    and moving bytes is exactly what those operations mean.
    """
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache


def check_scales(k_cache: torch.Tensor, k_scale: object, v_scale: object) -> None:
    """An FP8 cache comes with `[num_kv_heads]` float32 scales on its device; any other cache with none."""
    num_kv_heads = k_cache.shape[-2]
    if not is_fp8(k_cache.dtype):
        if k_scale is not None or v_scale is not None:
            raise KernelInputError(f"k_scale/v_scale were given for a {k_cache.dtype} KV cache; only FP8 caches "
                                   "take scales")
        return
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(scale, torch.Tensor) or scale.shape != (num_kv_heads,) or scale.dtype != torch.float32 \
                or scale.device != k_cache.device or scale.stride(0) != 1:
            got = (f"{tuple(scale.shape)} {scale.dtype} on {scale.device}" if isinstance(scale, torch.Tensor)
                   else repr(scale))
            raise KernelInputError(f"an FP8 ({k_cache.dtype}) KV cache needs {name} as a contiguous "
                                   f"[{num_kv_heads}] float32 tensor on {k_cache.device}, got {got}")
