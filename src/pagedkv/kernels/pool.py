"""The KV pool: the tensors that hold every layer's K and V blocks.

One allocation of `[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]` backs
the whole pool; `k_caches[layer]` and `v_caches[layer]` are views of it, each

    [num_blocks, block_size, num_kv_heads, head_dim]

so a block id addresses the same slot in every layer, and a block-wide operation (copy-on-
write, swap out, swap in) is one indexing op over the block dimension for all layers at once.

Within a block, a token's heads and head dims are contiguous (`num_kv_heads * head_dim`
elements), so `write_kv` stores each token with one contiguous write, and decode attention
reads each token's head as one `head_dim`-long run: 16-byte vectorised loads.

An FP8 pool (`kv_cache_dtype="fp8_e4m3"` or `"fp8_e5m2"`) stores one byte per value and
carries the dequantization scales beside the blocks, `k_scale` and `v_scale`, each
`[num_layers, num_kv_heads]` float32 (see `pagedkv.kernels.fp8`). They are fixed when the pool
is made: a block's bytes mean the same thing for the pool's whole life, so block copies, swaps
and prefix sharing move bytes and nothing else.

With layer groups (`pagedkv.core.kv_groups`: a model with sliding-window layers) a block holds
`num_slots` layers, not all of them: the allocation is `[2, num_slots, num_blocks, ...]`, layer
`l` lives in slot `layer_slots[l]`, and a block id means the page of whichever group's table
holds it. Block-wide operations move all of a block's slots, which is right for any group.

The pool only stores. Which block belongs to whom is the allocator's and block tables' job
(`pagedkv.core`), which never import torch.
"""

from __future__ import annotations

import torch

from pagedkv.core.memory import ModelSpec
from pagedkv.errors import KernelInputError, require_positive_int
from pagedkv.kernels.checks import SUPPORTED_DTYPES
from pagedkv.kernels.fp8 import KVScales, as_bytes, is_fp8, kv_cache_dtype_name, resolve_kv_cache_dtype


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class KVPool:
    """Every layer's K and V blocks for one model, in one device allocation.

    `dtype` is the model's (the dtype of the K/V handed to `write_kv`, and of attention's
    output); `kv_cache_dtype` says what the blocks store: "auto" (that same dtype) or an FP8
    format, whose `scales` (a `KVScales`; default: 1 everywhere, uncalibrated) are kept as
    `k_scale` / `v_scale`. After construction `self.dtype` is the storage dtype and
    `self.model_dtype` the model's.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float16, device: str | torch.device = "cuda", *,
                 kv_cache_dtype: str = "auto", scales: KVScales | None = None,
                 layer_slots: tuple[int, ...] | None = None):
        for name, value in (("num_layers", num_layers), ("num_blocks", num_blocks), ("block_size", block_size),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            require_positive_int(name, value)
        if dtype not in SUPPORTED_DTYPES:
            raise KernelInputError(f"KVPool dtype {dtype} is not one of {SUPPORTED_DTYPES}")
        device = torch.device(device)
        storage = resolve_kv_cache_dtype(kv_cache_dtype, dtype, device)
        if scales is not None:
            if not is_fp8(storage):
                raise KernelInputError(f"scales were given for a kv_cache_dtype={kv_cache_dtype!r} pool; only FP8 "
                                       "pools take scales")
            if tuple(scales.k_scale.shape) != (num_layers, num_kv_heads):
                raise KernelInputError(f"scales are {tuple(scales.k_scale.shape)}, expected [num_layers, "
                                       f"num_kv_heads] = [{num_layers}, {num_kv_heads}]")
        elif is_fp8(storage):
            scales = KVScales.unit(num_layers, num_kv_heads)
        if layer_slots is not None and (len(layer_slots) != num_layers or min(layer_slots) < 0):
            raise KernelInputError(f"layer_slots must give {num_layers} slots >= 0, got {layer_slots}")
        self.layer_slots = tuple(layer_slots) if layer_slots is not None else tuple(range(num_layers))
        self.num_slots = max(self.layer_slots) + 1  # layers one block holds
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.model_dtype = dtype
        self.dtype = storage
        self.kv_cache_dtype = kv_cache_dtype
        self.device = device
        self.scales_source = scales.source if scales is not None else None
        # [L, Hkv] float32 on the device; row `layer` is the `[Hkv]` scale vector the kernels take. None unless FP8.
        self.k_scale = scales.k_scale.to(device) if scales is not None else None
        self.v_scale = scales.v_scale.to(device) if scales is not None else None
        # Zeroed, not empty: a slot no sequence wrote is never read unmasked, but zeros keep
        # debugging dumps and swap-outs of fresh blocks deterministic.
        self.kv = torch.zeros(2, self.num_slots, num_blocks, block_size, num_kv_heads, head_dim,
                              dtype=storage, device=self.device)  # [2, S, N, B, Hkv, D] (S = L without groups)
        self._bytes = as_bytes(self.kv)  # what block copies move (torch has no CPU index_copy_ for float8)
        # Indexed views, not unbind(): unbind views may not be written in place when grad mode is on.
        self.k_caches: list[torch.Tensor] = [self.kv[0, slot] for slot in self.layer_slots]  # [N, B, Hkv, D]
        self.v_caches: list[torch.Tensor] = [self.kv[1, slot] for slot in self.layer_slots]

    @property
    def is_fp8(self) -> bool:
        """Whether the blocks store FP8 (then `k_scale` / `v_scale` are set)."""
        return is_fp8(self.dtype)

    def kv_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(k_scale, v_scale) of one layer, each `[num_kv_heads]` float32 (None, None for a non-FP8 pool)."""
        if self.k_scale is None:
            return None, None
        return self.k_scale[layer], self.v_scale[layer]

    @property
    def kv_storage(self) -> torch.Tensor:
        """`kv` as what block copies move: itself, or its uint8 bytes for FP8."""
        return self._bytes

    # ------------------------------------------------------------------ construction helpers
    @staticmethod
    def bytes_per_block_for(spec, block_size: int, dtype: torch.dtype) -> int:
        """K+V bytes of one block across all layers of a model described by `spec`."""
        return ModelSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, _dtype_bytes(dtype)).page_size_bytes(block_size)

    @staticmethod
    def num_blocks_for_budget(spec, budget_bytes: int, block_size: int, dtype: torch.dtype) -> int:
        """How many whole blocks of `block_size` tokens fit in `budget_bytes` (0 if not even one)."""
        require_positive_int("budget_bytes", budget_bytes, allow_zero=True)
        return budget_bytes // KVPool.bytes_per_block_for(spec, block_size, dtype)

    @classmethod
    def from_spec(cls, spec, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float16,
                  device: str | torch.device = "cuda", *, kv_cache_dtype: str = "auto",
                  scales: KVScales | None = None) -> KVPool:
        """A pool for a model described by `spec` (anything with num_layers, num_kv_heads, head_dim)."""
        return cls(spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, dtype, device,
                   kv_cache_dtype=kv_cache_dtype, scales=scales)

    # ------------------------------------------------------------------ sizes
    @property
    def bytes_per_block(self) -> int:
        """K+V bytes of one block across its layer slots (all layers without groups)."""
        return ModelSpec(self.num_slots, self.num_kv_heads, self.head_dim,
                         _dtype_bytes(self.dtype)).page_size_bytes(self.block_size)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool."""
        return self.num_blocks * self.bytes_per_block

    # ------------------------------------------------------------------ block-wide operations
    def _check_ids(self, name: str, block_ids: object) -> torch.Tensor:
        if not isinstance(block_ids, torch.Tensor) or block_ids.dim() != 1 or block_ids.dtype != torch.int64:
            got = f"{tuple(block_ids.shape)} {block_ids.dtype}" if isinstance(block_ids, torch.Tensor) else block_ids
            raise KernelInputError(f"{name} must be a 1-D int64 tensor of block ids, got {got}")
        if block_ids.numel():
            low, high = int(block_ids.min()), int(block_ids.max())
            if low < 0 or high >= self.num_blocks:
                bad = low if low < 0 else high
                raise KernelInputError(f"{name} has block id {bad}, outside the pool of {self.num_blocks} blocks")
        return block_ids.to(self.device)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks `src[i]` -> `dst[i]` in every layer, K and V (copy-on-write)."""
        src, dst = self._check_ids("src", src), self._check_ids("dst", dst)
        if src.shape != dst.shape:
            raise KernelInputError(f"src has {src.numel()} block ids but dst has {dst.numel()}")
        if dst.numel() and torch.unique(dst).numel() != dst.numel():
            raise KernelInputError("dst lists a block more than once; the copy result would be undefined")
        # The sources are gathered into a temporary first, so a dst that is also a src is safe.
        self._bytes.index_copy_(2, dst, self._bytes.index_select(2, src))

    def gather_blocks(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `block_ids`, each `[num_slots, n, block_size, num_kv_heads, head_dim]` (swap-out)."""
        block_ids = self._check_ids("block_ids", block_ids)
        blocks = self.kv.index_select(2, block_ids)  # [2, L, n, B, Hkv, D], a copy
        return blocks[0], blocks[1]

    def scatter_blocks(self, block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write `k` and `v` (as returned by `gather_blocks`) into `block_ids` in every layer (swap-in)."""
        block_ids = self._check_ids("block_ids", block_ids)
        expected = (self.num_slots, block_ids.numel(), self.block_size, self.num_kv_heads, self.head_dim)
        for name, tensor in (("k", k), ("v", v)):
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != expected or tensor.dtype != self.dtype:
                got = f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else tensor
                raise KernelInputError(f"{name} must be {expected} {self.dtype}, got {got}")
        if block_ids.numel() and torch.unique(block_ids).numel() != block_ids.numel():
            raise KernelInputError("block_ids lists a block more than once")
        self._bytes[0].index_copy_(1, block_ids, as_bytes(k).to(self.device, non_blocking=True))
        self._bytes[1].index_copy_(1, block_ids, as_bytes(v).to(self.device, non_blocking=True))

    def __repr__(self) -> str:
        return (f"KVPool(num_layers={self.num_layers}, num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"dtype={kv_cache_dtype_name(self.dtype)}, "
                f"device={self.device}, {self.nbytes / 2**30:.2f} GiB)")
