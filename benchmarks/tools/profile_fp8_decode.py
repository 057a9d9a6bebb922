"""Nsight Compute view of FP8 against bf16 decode at B=64 x 4096 (Llama-3-8B attention): where the FP8 kernel's time goes.

Run under `ncu --profile-from-start off`: each variant runs twice (compile, warm), then once inside
cudaProfilerStart/Stop. Variants: the bf16 split default, FP8 split (128 tokens, 2 warps: the FP8
default when profiled at 960ace1), FP8 tiles (64 tokens, 2 warps: the sweep's best, FP8's default since).
The profile at 960ace1 also had FP8 split with word loads (PAGEDKV_FP8_LOAD=words, removed since).
"""

from __future__ import annotations

import os

import torch

from pagedkv.bench.kernel_common import HEAD_DIM, make_paged
from pagedkv.bench.kernel_fp8 import quantized_caches
from pagedkv.kernels import DecodeTuning, paged_decode_attention


def main() -> None:
    device = torch.device("cuda")
    query, k_cache, v_cache, table, lens = make_paged(64, 4096, 16, True, device, torch.bfloat16, seed=5)
    k8, v8, k_scale, v_scale = quantized_caches(k_cache, v_cache, torch.float8_e4m3fn)
    base = dict(scale=HEAD_DIM ** -0.5, max_seq_len=4096, validate=False, backend="triton")
    fp8 = dict(k_scale=k_scale, v_scale=v_scale)
    variants = {
        "bf16 split": lambda: paged_decode_attention(query, k_cache, v_cache, table, lens, **base),
        "fp8 split": lambda: paged_decode_attention(query, k8, v8, table, lens, **base, **fp8, tuning=DecodeTuning()),
        "fp8 tiles n64 w2": lambda: paged_decode_attention(
            query, k8, v8, table, lens, **base, **fp8,
            tuning=DecodeTuning(schedule="tiles", block_n=64, num_warps=2, fp8_block_n=None, fp8_num_warps=None)),
    }
    for name, call in variants.items():
        call(), call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        torch.cuda.nvtx.range_push(name)
        call()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print("profiled", name, flush=True)


if __name__ == "__main__":
    main()
