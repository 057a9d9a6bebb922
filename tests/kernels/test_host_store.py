"""Storing a step's results into pinned host memory from a kernel (`pagedkv.kernels.host_store`).

The kernel copies words, so comparisons are bit-exact. On CPU the Triton path runs under
TRITON_INTERPRET=1 (tests/conftest.py) on host tensors: that checks the indexing and the word
widths. The `gpu` cases store into pinned memory from the device, against a copy, and check
the reason the kernel exists: its results reach the host while a large copy to the host
issued before it is still crossing.
"""

import pytest
import torch

from pagedkv.engine.sampler import Sampler, SamplingRow
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.errors import KernelInputError
from pagedkv.kernels.host_store import BLOCK, store_to_host, store_to_host_reference

BACKENDS = ["triton", "torch"]
#: (shape, dtype): a step's greedy tokens, its float64 results with logprobs, a tensor over one program,
#: and sizes whose bytes allow only int32 words or bytes.
CASES = [
    ((5, 1), torch.int64),
    ((3, 9), torch.float64),
    ((BLOCK + 7,), torch.int64),
    ((2, 3), torch.int32),
    ((7,), torch.uint8),
    ((4,), torch.float16),
]
CASE_IDS = ["greedy-tokens", "logprobs", "two-programs", "int32", "bytes", "fp16-as-int64"]


def random_bytes(shape, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    size = (*shape[:-1], shape[-1] * dtype.itemsize)
    return torch.randint(0, 256, size, dtype=torch.uint8, generator=generator).view(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape,dtype", CASES, ids=CASE_IDS)
def test_store_equals_source_bytes(shape, dtype, backend):
    src = random_bytes(shape, dtype)
    dst = torch.zeros_like(src)
    assert store_to_host(src, dst, backend=backend) is dst
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))


def test_store_of_nothing_leaves_dst():
    dst = torch.empty(0, dtype=torch.int64)
    assert store_to_host(torch.empty(0, dtype=torch.int64), dst, backend="triton") is dst


@pytest.mark.parametrize("src,dst,match", [
    (torch.zeros(4, dtype=torch.int64), torch.zeros(5, dtype=torch.int64), "dst must match src"),
    (torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.float64), "dst must match src"),
    (torch.zeros(4, 2, dtype=torch.int64).t(), torch.zeros(2, 4, dtype=torch.int64), "src must be contiguous"),
    ([1, 2], torch.zeros(2, dtype=torch.int64), "src must be a tensor"),
], ids=["shape", "dtype", "strided", "not-a-tensor"])
def test_bad_input_is_a_typed_error(src, dst, match):
    before = dst.clone()
    with pytest.raises(KernelInputError, match=match):
        store_to_host(src, dst, backend="triton")
    assert torch.equal(dst, before)


@pytest.mark.gpu
def test_device_store_needs_pinned_host_memory():
    src = torch.arange(4, device="cuda")
    with pytest.raises(KernelInputError, match="pinned"):
        store_to_host(src, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(KernelInputError, match="host memory"):
        store_to_host(src, torch.zeros(4, dtype=torch.int64, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", CASES, ids=CASE_IDS)
def test_device_store_equals_copy(shape, dtype):
    src = random_bytes(shape, dtype).cuda()
    stored = torch.zeros(src.shape, dtype=dtype, pin_memory=True)
    copied = torch.zeros(src.shape, dtype=dtype, pin_memory=True)
    store_to_host(src, stored)
    store_to_host_reference(src, copied)
    torch.cuda.synchronize()
    assert torch.equal(stored.view(torch.uint8), copied.view(torch.uint8))


@pytest.mark.gpu
def test_device_store_does_not_wait_for_copies_to_the_host_issued_before_it():
    """A 2 GiB copy to the host on another stream (~40 ms over PCIe), then a few bytes stored on the main
    stream: the store is on the host while the copy still crosses. A copy in its place would wait for it."""
    side = torch.cuda.Stream()
    big = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    big_host = torch.empty(big.shape, dtype=torch.uint8, pin_memory=True)
    tokens = torch.arange(64, device="cuda")
    host = torch.zeros(64, dtype=torch.int64, pin_memory=True)
    store_to_host(tokens.flip(0), host)  # compiles the kernel first: a compile outlasts the copy
    torch.cuda.synchronize()
    assert host.tolist() == list(range(63, -1, -1))
    with torch.cuda.stream(side):
        big_host.copy_(big, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(side)
    store_to_host(tokens, host)
    stored = torch.cuda.Event()
    stored.record()
    stored.synchronize()
    copy_still_running = not copied.query()
    torch.cuda.synchronize()
    assert host.tolist() == list(range(64))
    assert copy_still_running


@pytest.mark.gpu
@pytest.mark.parametrize("params", [SamplingParams(max_tokens=4),
                                    SamplingParams(max_tokens=4, temperature=0.8, seed=3, logprobs=2)],
                         ids=["greedy", "seeded-logprobs"])
def test_sampler_results_equal_by_kernel_and_by_copy(params, monkeypatch):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)).cuda()
    rows = [SamplingRow(params, seed=7, sample_indices=(0,), num_output_tokens=i) for i in range(6)]
    outputs = {}
    for route in ("kernel", "copy"):
        monkeypatch.setenv("PAGEDKV_RESULTS_TO_HOST", route)
        sampler = Sampler(50, "cuda")
        result = sampler.sample(logits, rows)
        outputs[route] = (result.token_ids(), result.logprobs())
        assert sampler.results_to_host == route  # the kernel route did not fall back to copying
    assert outputs["kernel"] == outputs["copy"]
