"""A step's results written into pinned host memory by a kernel, not copied by a copy engine.

Why: copies to the host run in the order they were issued, whatever their stream. A step's
sampled tokens (a few bytes) issued after a KV spill to the host tier (1.8 GB, 34 ms over
PCIe) reach the host only when the spill has crossed: on the H200, the first warm 16K turn
after a cold one got its first token 4.2 ms after its prefill ended, behind the spill
(benchmarks/results/kv_tiers_first_token_56444e9). Swap preemption's copies out hold the
tokens back the same way.

A kernel's stores need no copy engine. Pinned host memory (`torch.empty(..., pin_memory=True)`,
cudaHostAlloc) is mapped into the device's address space at the same address under unified
addressing, so a kernel can store to it over PCIe directly; the stores are visible to the
host once an event recorded after the kernel has completed. One program stores up to
`BLOCK` 8-byte words: a step's results are a few KB at most.

    dst[i] = src[i]      src contiguous on the device, dst contiguous pinned host memory,
                         same shape and dtype; 4- and 8-byte dtypes as they are, others
                         viewed as the widest integer word that fits (or bytes)

`store_to_host_reference` is the plain copy it replaces (`dst.copy_(src, non_blocking=True)`).
On CPU (and under TRITON_INTERPRET=1, which runs kernels on host tensors) the Triton path runs
the same kernel on host memory; tests use it there to check the indexing.
"""

from __future__ import annotations

import torch

from pagedkv.errors import KernelInputError
from pagedkv.kernels.block_moves import word_dtype
from pagedkv.kernels.ops import resolve_backend

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is Linux-only (pyproject): the torch reference still runs
    triton = None

#: Words one program stores. 1,024 int64 words (8 KiB) cover a greedy step of 1,024 rows in one program.
BLOCK = 1024


def store_to_host_reference(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """dst = src through the copy engine (asynchronous on CUDA): what the kernel replaces."""
    dst.copy_(src, non_blocking=True)
    return dst


if triton is not None:
    @triton.jit
    def _store_kernel(src, dst, num_words, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < num_words
        tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)


#: Dtypes the kernel moves as they are (a load and a store of 4 or 8 bytes copy the bits, NaN payloads included):
#: a step's results are int64 or float64, and need no reinterpreting views on the hot path.
DIRECT_DTYPES = (torch.int64, torch.float64, torch.int32, torch.float32)


def _as_words(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`src` and `dst` (contiguous, same dtype) as flat tensors of the widest integer word both allow."""
    if src.dtype in DIRECT_DTYPES:
        return src, dst
    word = word_dtype(src.numel() * src.element_size(), src, dst)
    return src.reshape(-1).view(torch.uint8).view(word), dst.reshape(-1).view(torch.uint8).view(word)


def _check(src: object, dst: object) -> None:
    for name, tensor in (("src", src), ("dst", dst)):
        if not isinstance(tensor, torch.Tensor):
            raise KernelInputError(f"{name} must be a tensor, got {type(tensor).__name__}")
        if not tensor.is_contiguous():
            raise KernelInputError(f"{name} must be contiguous, got strides {tensor.stride()}")
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise KernelInputError(f"dst must match src: src is {src.dtype} {tuple(src.shape)}, "
                               f"dst is {dst.dtype} {tuple(dst.shape)}")
    if dst.device.type != "cpu":
        raise KernelInputError(f"dst must be host memory, got a tensor on {dst.device}")
    if src.device.type == "cuda" and not dst.is_pinned():
        raise KernelInputError("dst must be pinned host memory (torch.empty(..., pin_memory=True)): a kernel "
                               "can only store to host memory that is mapped for the device")


def store_to_host(src: torch.Tensor, dst: torch.Tensor, *, backend: str = "auto",
                  validate: bool = True) -> torch.Tensor:
    """dst = src, stored by a kernel on the current stream (no copy engine); returns `dst`.

    src contiguous on the device; dst a contiguous pinned host tensor of src's shape and dtype.
    Asynchronous like a non-blocking copy: record an event after the call and wait for it before
    reading `dst`, and keep both tensors alive until it has completed. Backends follow
    `pagedkv.kernels.ops.resolve_backend` ("auto": Triton on CUDA, the reference on CPU).
    `validate=False` skips the checks (the sampler's own pinned tensors; `is_pinned` asks the driver).
    """
    if validate:
        _check(src, dst)
    if src.numel() == 0:
        return dst
    if resolve_backend(backend, src.device) == "torch":
        return store_to_host_reference(src, dst)
    if triton is None:
        raise KernelInputError("backend 'triton' needs Triton, which is not installed")
    from pagedkv.kernels.launch import bound

    words, out = _as_words(src, dst)
    num_words = words.numel()
    bound(_store_kernel).config(BLOCK=BLOCK, num_warps=4).launch(
        (triton.cdiv(num_words, BLOCK), 1, 1), (words, out), (num_words,))
    return dst
